package main

import (
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/stages/calibrate"
)

// The calibration flags of run and stage land in the debiaser's config, and
// left alone they keep the project's defaults.
func TestCalibrationFlagsReachTheDebiaser(t *testing.T) {
	parse := func(args ...string) pipeline.Config {
		cfg := pipeline.DefaultConfig()
		var estimator string
		fs := pflag.NewFlagSet("run", pflag.ContinueOnError)
		pipelineFlags(fs, &cfg, &estimator)
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	def := parse().Debiaser
	if def != calibrate.DefaultDebiaserConfig() {
		t.Errorf("no flags: debiaser %+v, want the defaults %+v", def, calibrate.DefaultDebiaserConfig())
	}
	got := parse("--before-fit", "identity", "--min-pairs", "32", "--refit-every", "16", "--bins", "0", "--buffer", "900").Debiaser
	want := calibrate.DebiaserConfig{BeforeFit: calibrate.BeforeFitIdentity, MinPairs: 32, RefitEvery: 16, Bins: 0, BufferSize: 900}
	if got != want {
		t.Errorf("debiaser %+v, want %+v", got, want)
	}
	if n := parse("--checkpoint-every", "8").CheckpointEvery; n != 8 {
		t.Errorf("--checkpoint-every 8 gives %d", n)
	}
	if c := parse(); c.WMRetries != 5 || c.WMTimeout != 120*time.Second {
		t.Errorf("no flags: world-model retries %d, timeout %v; want 5, 2m0s", c.WMRetries, c.WMTimeout)
	}
	if c := parse("--wm-retries", "0", "--wm-timeout", "20s"); c.WMRetries != 0 || c.WMTimeout != 20*time.Second {
		t.Errorf("--wm-retries 0 --wm-timeout 20s gives %d, %v", c.WMRetries, c.WMTimeout)
	}
}
