package stepset

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// A Set holds exactly the steps added, in any order, kept as sorted,
// disjoint ranges with a gap between any two.
func TestStepSetHoldsWhatWasAdded(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := range 200 {
		var s Set
		want := map[int64]bool{}
		for range rng.IntN(300) {
			n := rng.Int64N(120) - 10
			s.Add(n)
			want[n] = true
		}
		for n := int64(-20); n < 130; n++ {
			if s.Has(n) != want[n] {
				t.Fatalf("trial %d: Has(%d) = %v, want %v (ranges %v)", trial, n, s.Has(n), want[n], s.r)
			}
		}
		all := slices.Collect(s.All())
		if !slices.IsSorted(all) || len(all) != len(want) {
			t.Fatalf("trial %d: All gave %v, not the %d steps in order", trial, all, len(want))
		}
		if s.Len() != int64(len(want)) {
			t.Fatalf("trial %d: Len %d, want %d", trial, s.Len(), len(want))
		}
		for i, r := range s.r {
			if r.lo > r.hi || (i > 0 && s.r[i-1].hi+1 >= r.lo) {
				t.Fatalf("trial %d: ranges %v are not sorted, disjoint and apart", trial, s.r)
			}
		}
	}
}

// A run's steps published nearly in order (here every 50th fused after
// the next) are one range, however long the run: the set does not grow
// with the run as a map of steps did.
func TestStepSetOfALongRunIsOneRange(t *testing.T) {
	var s Set
	for n := int64(0); n < 100_000; n++ {
		switch {
		case n%50 == 0:
			continue // held up: fused after the next
		case n%50 == 1:
			s.Add(n)
			s.Add(n - 1)
		default:
			s.Add(n)
		}
		if s.Ranges() > 2 {
			t.Fatalf("after step %d the set is %d ranges", n, s.Ranges())
		}
	}
	if s.Ranges() != 1 || s.Len() != 100_000 {
		t.Fatalf("%d ranges holding %d steps, want 1 holding 100000", s.Ranges(), s.Len())
	}
}

// Steps added newest first, and steps that fill the gap between two
// ranges, join them.
func TestStepSetJoinsRangesAtBothEnds(t *testing.T) {
	var s Set
	s.Add(12_000)
	for n := int64(9_999); n >= 0; n-- {
		s.Add(n)
	}
	if want := []stepRange{{0, 9_999}, {12_000, 12_000}}; !slices.Equal(s.r, want) {
		t.Fatalf("added newest first: %v; want %v", s.r, want)
	}
	s.Add(10_000)
	s.Add(11_999)
	s.Add(11_998)
	if want := []stepRange{{0, 10_000}, {11_998, 12_000}}; !slices.Equal(s.r, want) {
		t.Fatalf("joined at both ends: %v; want %v", s.r, want)
	}
	s.Add(10_001)
	for n := int64(11_997); n > 10_001; n-- {
		s.Add(n)
	}
	if want := []stepRange{{0, 12_000}}; !slices.Equal(s.r, want) {
		t.Fatalf("the gap filled: %v; want %v", s.r, want)
	}
}
