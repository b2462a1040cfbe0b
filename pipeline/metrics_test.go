package pipeline

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/pipeline/offline"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/fuse"
)

// A step's losses are counted by kind, in the metrics and in its line: an
// ungraded world-model score, an anchor whose sandbox failed, a skipped
// group, a late anchor group and a failed one each once, and nothing for
// a graded item, an anchor scored 0 because its code crashed, or a late
// anchor's items the world model scored.
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
		Skipped:       []schemas.SkippedGroup{{GroupID: "g9", Reason: fuse.SkipTooFewGraded}},
		LateAnchors:   []string{"late"},
		FailedAnchors: []string{"failed"},
	}
	m := NewMetrics()
	for _, l := range stepLosses(schemas.Update{}) {
		if got := testutil.ToFloat64(m.Lost.WithLabelValues(l.kind)); got != 0 {
			t.Errorf("%s starts at %v", l.kind, got)
		}
	}
	m.ObserveUpdate(u)
	m.ObserveUpdate(u)
	for _, kind := range []string{"wm_ungraded", "sandbox_error", "skipped_group", "late_anchor", "failed_anchor"} {
		if got := testutil.ToFloat64(m.Lost.WithLabelValues(kind)); got != 2 {
			t.Errorf("%s: %v after two steps that lost one each", kind, got)
		}
	}
	if got := testutil.ToFloat64(m.TrajectoriesFused); got != float64(2*len(u.Items)) {
		t.Errorf("trajectories fused %v after two steps of %d", got, len(u.Items))
	}
	want := "  late anchors 1  failed anchors 1  wm ungraded 1  sandbox errors 1  skipped groups 1"
	if got := healthOf(u); got != want {
		t.Errorf("step line ends %q, want %q", got, want)
	}
	if got := healthOf(schemas.Update{Items: u.Items[:1]}); got != "" {
		t.Errorf("a step that lost nothing says %q", got)
	}
}

// finished runs cfg's pipeline to its end (cfg.Steps) and returns it, for
// its metrics.
func finished(t *testing.T, cfg Config) *Pipeline {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	return p
}

// The live rank-correlation histogram says what an audit of the run's
// archive says afterwards: the same number of anchor groups, the same mean
// within-group Spearman.
func TestLiveRankCorrelationIsTheAudits(t *testing.T) {
	cfg := testConfig(t)
	cfg.Steps = 8
	cfg.Anchors.Fraction = 0.5
	p := finished(t, cfg)
	for _, u := range decodeUpdates(t, readStored(t, cfg.DataDir, "wmrl.default.update")) {
		if len(u.LateAnchors) > 0 {
			t.Fatalf("step %d has late anchors, which only the audit sees: the comparison would not hold", u.Step)
		}
	}
	fams, err := p.Metrics().Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var count uint64
	var sum float64
	for _, f := range fams {
		if f.GetName() == "wmrl_wm_within_group_spearman" {
			h := f.GetMetric()[0].GetHistogram()
			count, sum = h.GetSampleCount(), h.GetSampleSum()
		}
	}
	rows, err := archive.ReadAll(cfg.ArchiveRoot(), cfg.Run)
	if err != nil {
		t.Fatal(err)
	}
	a, err := offline.RunAudit(rows, offline.AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	r := a.Overall.Ranks
	if count < 32 || count != uint64(r.Groups) {
		t.Fatalf("live: %d anchor groups ranked; audit: %d (want the same, at least 32)", count, r.Groups)
	}
	if live := sum / float64(count); math.Abs(live-float64(r.WithinSpearman)) > 1e-9 {
		t.Fatalf("live mean within-group Spearman %.6f, audit %.6f", live, float64(r.WithinSpearman))
	}
	t.Logf("%d anchor groups, mean within-group Spearman %.3f", count, sum/float64(count))
}
