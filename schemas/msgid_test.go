package schemas

import "testing"

// The step and what follows it, read from the de-duplication IDs the
// stages make; an ID of another shape gives no step rather than a wrong one.
func TestSplitMsgID(t *testing.T) {
	for _, c := range []struct {
		id   string
		step int64
		rest string
		ok   bool
	}{
		{"run/plan/12", 12, "", true},
		{"run/exec/7/g7-1", 7, "g7-1", true},
		{"run/group/0/a/b", 0, "a/b", true}, // a group ID with a slash stays whole
		{"run/plan", 0, "", false},
		{"run/plan/x/g", 0, "", false},
		{"dlq/route/33/2", 33, "2", true},
		{"", 0, "", false},
	} {
		step, rest, ok := SplitMsgID(c.id)
		if step != c.step || rest != c.rest || ok != c.ok {
			t.Errorf("SplitMsgID(%q) = %d, %q, %v; want %d, %q, %v", c.id, step, rest, ok, c.step, c.rest, c.ok)
		}
		if s, sok := StepOfMsgID(c.id); s != c.step || sok != c.ok {
			t.Errorf("StepOfMsgID(%q) = %d, %v; want %d, %v", c.id, s, sok, c.step, c.ok)
		}
	}
}
