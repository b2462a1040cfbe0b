package archive

import "testing"

// The keys of a run's archived updates are kept as the ranges of steps
// they name, not a string each; every other key, and a key only like an
// update's, by name.
func TestKeySetKeepsUpdatesAsRanges(t *testing.T) {
	var k keySet
	for n := range int64(10_000) {
		k.add(UpdateKey(n))
	}
	k.add(LateKey(3, "g1"))
	k.add("update/010001")
	k.add("update/x")
	if k.updates.Ranges() != 1 || len(k.other) != 3 {
		t.Fatalf("%d ranges of updates and %d other keys; want 1 and 3", k.updates.Ranges(), len(k.other))
	}
	for _, c := range []struct {
		key  string
		want bool
	}{
		{UpdateKey(0), true}, {UpdateKey(9_999), true}, {UpdateKey(10_000), false}, {UpdateKey(-1), false},
		{LateKey(3, "g1"), true}, {LateKey(3, "g2"), false},
		{"update/010001", true}, {UpdateKey(10_001), false}, {"update/x", true}, {"update/", false},
	} {
		if k.has(c.key) != c.want {
			t.Errorf("has(%q) = %v, want %v", c.key, k.has(c.key), c.want)
		}
	}
}
