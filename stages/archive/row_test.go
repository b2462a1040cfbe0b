package archive

import (
	"reflect"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
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

// Each row names the world model whose prediction it holds: the update's
// when one scored the step, the item's own when two did, none for a group
// never sent to be scored; a late anchor's rows, made when its group's
// calibration comes, name the model its step's update gave the group.
func TestRowsNameTheirWorldModel(t *testing.T) {
	str := func(p *string) string {
		if p == nil {
			return "<null>"
		}
		return *p
	}
	item := func(group, traj, model, status string) schemas.UpdateItem {
		return schemas.UpdateItem{TrajID: traj, GroupID: group, Source: SourceWorldModel, WMStatus: status, WMModel: model, Predicted: f64(0.5)}
	}
	one := schemas.Update{Run: "r", Step: 4, WMModel: "qwen", LateAnchors: []string{"a"}, Items: []schemas.UpdateItem{
		item("a", "a0", "", schemas.PredOK), item("b", "b0", "", schemas.PredUngraded), item("c", "c0", "", schemas.PredNotSent),
	}}
	two := schemas.Update{Run: "r", Step: 5, LateAnchors: []string{"a"}, Items: []schemas.UpdateItem{
		item("a", "a0", "llama", schemas.PredOK), item("b", "b0", "qwen", schemas.PredOK), item("c", "c0", "", schemas.PredNotSent),
	}}
	for _, tc := range []struct {
		u    schemas.Update
		want map[string]string // group to its rows' wm_model
	}{
		{one, map[string]string{"a": "qwen", "b": "qwen", "c": "<null>"}},
		{two, map[string]string{"a": "llama", "b": "qwen", "c": "<null>"}},
	} {
		rows, late := FromUpdate(tc.u)
		for _, r := range rows {
			if got := str(r.WMModel); got != tc.want[r.GroupID] {
				t.Errorf("step %d, group %s: wm_model %s, want %s", r.Step, r.GroupID, got, tc.want[r.GroupID])
			}
		}
		if len(late) != 1 {
			t.Fatalf("step %d: %d late groups, want a", tc.u.Step, len(late))
		}
		c := schemas.Calibration{Run: "r", Step: tc.u.Step, GroupID: "a", Seq: 9, Pairs: []schemas.CalibratedPair{{TrajID: "a0", Predicted: 0.5, True: 0.7}}}
		for _, r := range FromLate(c, late[0], nil, time.Unix(0, 0)) {
			if got := str(r.WMModel); got != tc.want["a"] {
				t.Errorf("step %d, late anchor %s: wm_model %s, want %s", r.Step, r.TrajID, got, tc.want["a"])
			}
		}
	}
}
