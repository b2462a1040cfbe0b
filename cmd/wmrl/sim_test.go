package main

import (
	"strings"
	"testing"

	"github.com/wmrl/wmrl/connectors/sim/rl"
	"github.com/wmrl/wmrl/stages/calibrate"
)

func TestPickMethods(t *testing.T) {
	names := func(ms []rl.Method) string {
		var out []string
		for _, m := range ms {
			out = append(out, m.Name)
		}
		return strings.Join(out, ",")
	}
	// grpo and wmrl always run, in the order of rl.Methods, once each.
	ms, err := pickMethods("wmrl-ratio, denoise,denoise")
	if err != nil {
		t.Fatal(err)
	}
	if got := names(ms); got != "grpo,denoise,wmrl,wmrl-ratio" {
		t.Errorf("--methods wmrl-ratio,denoise,denoise runs %s", got)
	}
	if ms, _ := pickMethods("all"); len(ms) != len(rl.Methods) {
		t.Errorf("--methods all runs %d methods, want %d", len(ms), len(rl.Methods))
	}
	if _, err := pickMethods("wmrl,grop"); err == nil || !strings.Contains(err.Error(), `"grop"`) || !strings.Contains(err.Error(), "grpo") {
		t.Errorf("a misspelt method gives %v; want the name and the list", err)
	}
}

// The header names the calibration cadence in force, defaults filled in,
// and the first fit where the cadence puts it (not at --min-pairs alone).
func TestCalibrationLine(t *testing.T) {
	cfg := rl.DefaultConfig()
	if got, want := calibrationLine(cfg), "first isotonic fit at 200 anchor pairs, then every 64; until then the map is flat at the anchors' mean true score"; got != want {
		t.Errorf("default: %q, want %q", got, want)
	}
	cfg.Debiaser.MinPairs, cfg.Debiaser.RefitEvery, cfg.Debiaser.BeforeFit = 32, 0, calibrate.BeforeFitIdentity
	if got, want := calibrationLine(cfg), "first isotonic fit at 64 anchor pairs, then every 64; until then the map is the identity (raw world-model scores)"; got != want {
		t.Errorf("--min-pairs 32 --refit-every 0 --before-fit identity: %q, want %q", got, want)
	}
}
