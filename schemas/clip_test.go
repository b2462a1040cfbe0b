package schemas

import (
	"math/rand/v2"
	"strings"
	"testing"
	"unicode/utf8"
)

// Clip keeps within its bound, keeps both ends of what it cuts, and never
// splits a character.
func TestClipKeepsBothEndsWithinTheBound(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	alphabet := []rune("ab \n|é€😀")
	for range 5000 {
		rs := make([]rune, rng.IntN(300))
		for i := range rs {
			rs[i] = alphabet[rng.IntN(len(alphabet))]
		}
		s, n := string(rs), rng.IntN(200)
		got := Clip(s, n)
		if len(s) <= n {
			if got != s {
				t.Fatalf("Clip(%q, %d) = %q: changed what fits", s, n, got)
			}
			continue
		}
		if len(got) > n || !utf8.ValidString(got) {
			t.Fatalf("Clip(%q, %d) = %q: %d bytes, valid UTF-8 %v", s, n, got, len(got), utf8.ValidString(got))
		}
		head, tail, cut := strings.Cut(got, " … ")
		if n <= len(" … ") {
			head, tail = got, ""
		} else if !cut {
			t.Fatalf("Clip(%q, %d) = %q: no mark where it cut", s, n, got)
		}
		if !strings.HasPrefix(s, head) || !strings.HasSuffix(s, tail) {
			t.Fatalf("Clip(%q, %d) = %q: not s's start and end", s, n, got)
		}
		// Nothing left out that fitted: at most a character's worth short
		// at each end.
		if n > len(" … ") && len(got) < n-2*(utf8.UTFMax-1) {
			t.Fatalf("Clip(%q, %d) = %q: only %d bytes", s, n, got, len(got))
		}
	}
}

func TestPrefixNeverCutsACharacter(t *testing.T) {
	for _, tc := range []struct {
		s    string
		n    int
		want string
	}{{"abc", 2, "ab"}, {"aé", 2, "a"}, {"aé", 3, "aé"}, {"abc", 0, ""}, {"abc", -7, ""}} {
		if got := Prefix(tc.s, tc.n); got != tc.want {
			t.Errorf("Prefix(%q, %d) = %q, want %q", tc.s, tc.n, got, tc.want)
		}
	}
}
