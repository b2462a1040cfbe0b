package main

import (
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/pipeline"
)

// TestAuditSaysWhatToExpect: wmrl audit runs wmrl sim at the audited run's
// world model (its ranking over the first quarter of the steps), shape and
// settings, prints its table, and puts it in the
// report; --expect-seeds 0 leaves it out, and 1 is refused.
func TestAuditSaysWhatToExpect(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := finishedRun(ctx, t, 30, func(cfg *pipeline.Config) {
		cfg.Groups, cfg.GroupSize, cfg.Anchors.Fraction = 4, 4, 0.5
	})
	root, report := cfg.ArchiveRoot(), filepath.Join(t.TempDir(), "report")
	out, err := wmrl(ctx, "audit", "--archive", root, "--out", report, "--expect-seeds", "2", "--cost-exec", "50")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, want := range []string{"what to expect (wmrl sim at this world model: within-group Spearman ", " over the first quarter of the steps, ",
		"this run's shape and settings: 4 groups of 4 a step, anchor fraction 0.50 (even), debias true, rho advantage;", "execution 50\n", "\ngrpo-anchors ", "\nwmrl "} {
		if !strings.Contains(out, want) {
			t.Errorf("wmrl audit's output lacks %q:\n%s", want, out)
		}
	}
	var sum struct {
		Drift []struct {
			Within *float64 `json:"within_group_spearman"`
		}
		Expect *struct {
			RankCorr  float64 `json:"within_group_rank_corr"`
			Sim       float64 `json:"sim_rank_corr"`
			Groups    int     `json:"groups"`
			GroupSize int     `json:"group_size"`
		}
	}
	b, err := os.ReadFile(filepath.Join(report, "summary.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &sum); err != nil || sum.Expect == nil {
		t.Fatalf("summary.json: %v, expect %v", err, sum.Expect)
	}
	var ranks []float64 // the steps' within-group Spearman, where defined
	for _, d := range sum.Drift {
		if d.Within != nil {
			ranks = append(ranks, *d.Within)
		}
	}
	first := 0.0
	for _, r := range ranks[:len(ranks)/4] {
		first += r / float64(len(ranks)/4)
	}
	if e := sum.Expect; math.Abs(e.RankCorr-first) > 1e-12 || math.Abs(e.Sim-e.RankCorr) > 0.01 || e.Groups != 4 || e.GroupSize != 4 {
		t.Errorf("expect %+v; the audit measured within-group Spearman %.4f over the first quarter of the steps", *e, first)
	}

	again := filepath.Join(t.TempDir(), "report")
	if out, err := wmrl(ctx, "audit", "--archive", root, "--out", again, "--expect-seeds", "0"); err != nil || strings.Contains(out, "what to expect") {
		t.Errorf("--expect-seeds 0 (%v):\n%s", err, out)
	}
	if b, _ := os.ReadFile(filepath.Join(again, "summary.json")); strings.Contains(string(b), `"expect"`) {
		t.Error("--expect-seeds 0 still wrote an expectation into summary.json")
	}
	if _, err := wmrl(ctx, "audit", "--archive", root, "--out", again, "--expect-seeds", "1"); err == nil || !strings.Contains(err.Error(), "--expect-seeds 1") {
		t.Errorf("--expect-seeds 1: %v", err)
	}
}
