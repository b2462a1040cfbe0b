package pipeline

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/fuse"
)

// A step's losses are counted by kind, in the metrics and in its line: an
// ungraded world-model score, an anchor whose sandbox failed, a skipped
// group and a late anchor group each once, and nothing for a graded item,
// an anchor scored 0 because its code crashed, or a late anchor's items
// the world model scored.
func TestStepLossesAreCountedByKind(t *testing.T) {
	score := 0.5
	u := schemas.Update{
		Items: []schemas.UpdateItem{
			{Source: fuse.SourceWorldModel, Reward: &score},
			{Source: fuse.SourceWorldModel, WMStatus: schemas.PredUngraded},
			{Source: fuse.SourceAnchor, Reward: &score, ExecStatus: schemas.ExecScored},
			{Source: fuse.SourceAnchor, ExecStatus: schemas.ExecSandboxError},
			{Source: fuse.SourceAnchor, Reward: new(float64), ExecStatus: schemas.ExecCrashed},
			{Source: fuse.SourceWorldModel, Reward: &score, GroupID: "late"},
		},
		Skipped:     []schemas.SkippedGroup{{GroupID: "g9", Reason: fuse.SkipTooFewGraded}},
		LateAnchors: []string{"late"},
	}
	m := NewMetrics()
	for _, l := range stepLosses(schemas.Update{}) {
		if got := testutil.ToFloat64(m.Lost.WithLabelValues(l.kind)); got != 0 {
			t.Errorf("%s starts at %v", l.kind, got)
		}
	}
	m.ObserveUpdate(u)
	m.ObserveUpdate(u)
	for _, kind := range []string{"wm_ungraded", "sandbox_error", "skipped_group", "late_anchor"} {
		if got := testutil.ToFloat64(m.Lost.WithLabelValues(kind)); got != 2 {
			t.Errorf("%s: %v after two steps that lost one each", kind, got)
		}
	}
	want := "  late anchors 1  wm ungraded 1  sandbox errors 1  skipped groups 1"
	if got := healthOf(u); got != want {
		t.Errorf("step line ends %q, want %q", got, want)
	}
	if got := healthOf(schemas.Update{Items: u.Items[:1]}); got != "" {
		t.Errorf("a step that lost nothing says %q", got)
	}
}
