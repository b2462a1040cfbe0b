package schemas

import "testing"

// Parts that run together alike (a task "ab" with prompt "c", a task "a"
// with prompt "bc") are told apart; the same parts give the same digest.
func TestDigestKeepsItsPartsApart(t *testing.T) {
	if Digest("ab", "c", "x") == Digest("a", "bc", "x") || Digest("a", "", "b") == Digest("a", "b", "") {
		t.Error("parts that run together alike have the same digest")
	}
	if Digest("t", "p", "print(1)") != Digest("t", "p", "print(1)") {
		t.Error("the same parts have another digest")
	}
}
