package archive

import (
	"reflect"
	"testing"
)

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

// Detached copies what every pointer field of a row points to, so that a
// row kept does not hold its row group's columns: a field added to Row
// and left out of Detached fails here.
func TestDetachedLeavesNothingShared(t *testing.T) {
	var r Row
	v := reflect.ValueOf(&r).Elem()
	pointers := 0
	for i := range v.NumField() {
		f := v.Field(i)
		if f.Kind() != reflect.Pointer {
			continue
		}
		pointers++
		f.Set(reflect.New(f.Type().Elem()))
	}
	d := r.Detached()
	dv := reflect.ValueOf(d)
	for i := range v.NumField() {
		f := v.Field(i)
		if f.Kind() != reflect.Pointer {
			continue
		}
		if g := dv.Field(i); g.IsNil() || g.Pointer() == f.Pointer() || !reflect.DeepEqual(g.Elem().Interface(), f.Elem().Interface()) {
			t.Errorf("Row.%s: detached points to %v, the row to %v", v.Type().Field(i).Name, g, f)
		}
	}
	if pointers < 15 {
		t.Fatalf("%d pointer fields: the test looks at the wrong type", pointers)
	}
	var empty Row
	if e := empty.Detached(); !reflect.DeepEqual(e, empty) {
		t.Errorf("a row of nil fields detached: %+v", e)
	}
}
