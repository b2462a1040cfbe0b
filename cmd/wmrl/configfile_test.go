package main

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/wmrl/wmrl/pipeline"
)

// writeConfig writes a config file and returns its path.
func writeConfig(t *testing.T, text string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "wmrl.yaml")
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// A config file sets run's and stage's flags as the command line would,
// a list for a flag given once per value, snake_case names too; the
// command line wins over it.
func TestAConfigFileSetsTheFlags(t *testing.T) {
	path := writeConfig(t, `
# the job's settings
run: mle-9b
anchor_fraction: 0.25
bins: 0
anchor-deadline: 20m
debias: false
exec-env: [OMP_NUM_THREADS=4, HF_HUB_OFFLINE=1]
rho: reference
`)
	cfg := pipeline.DefaultConfig()
	var estimator string
	fs := pflag.NewFlagSet("run", pflag.ContinueOnError)
	pipelineFlags(fs, &cfg, &estimator)
	if err := fs.Parse([]string{"--bins", "5", "--exec-env", "A=1"}); err != nil {
		t.Fatal(err)
	}
	if err := applyConfigFile(fs, "wmrl run", path); err != nil {
		t.Fatal(err)
	}
	switch {
	case cfg.Run != "mle-9b" || cfg.Anchors.Fraction != 0.25 || cfg.AnchorDeadline != 20*time.Minute || cfg.Debias || estimator != "reference":
		t.Errorf("from the file: run %q, anchor fraction %v, deadline %v, debias %v, rho %q", cfg.Run, cfg.Anchors.Fraction, cfg.AnchorDeadline, cfg.Debias, estimator)
	case cfg.Debiaser.Bins != 5:
		t.Errorf("--bins 5 on the command line gave %d: the file's 0 won", cfg.Debiaser.Bins)
	case !slices.Equal(cfg.ExecEnv, []string{"A=1"}):
		t.Errorf("exec-env %q; the command line's A=1 should win over the file's list", cfg.ExecEnv)
	}
	// Without the command line's, the file's list is taken whole.
	cfg2 := pipeline.DefaultConfig()
	fs2 := pflag.NewFlagSet("run", pflag.ContinueOnError)
	pipelineFlags(fs2, &cfg2, &estimator)
	if err := applyConfigFile(fs2, "wmrl run", path); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cfg2.ExecEnv, []string{"OMP_NUM_THREADS=4", "HF_HUB_OFFLINE=1"}) || cfg2.Debiaser.Bins != 0 {
		t.Errorf("exec-env %q, bins %d from the file alone", cfg2.ExecEnv, cfg2.Debiaser.Bins)
	}
}

// What a config file gets wrong is named: file, line, setting and why.
func TestAConfigFileSaysWhatIsWrong(t *testing.T) {
	for text, want := range map[string]string{
		"anchor-fraction: 0.1\nanchor-fractoin: 0.2\n": `wmrl.yaml:2: wmrl run has no setting "anchor-fractoin" (did you mean "anchor-fraction"?)`,
		"bins: [1, 2]\n":         `wmrl.yaml:1: bins: takes one value, not a list`,
		"bins: ten\n":            `wmrl.yaml:1: bins: invalid argument "ten" for "--bins" flag`,
		"bins:\n":                `wmrl.yaml:1: bins: no value`,
		"- bins\n":               `wmrl.yaml:1: want a mapping of settings (name: value), got a list`,
		"bins: 1\nbins: 2\n":     `wmrl.yaml:2: "bins" is set already on line 1`,
		"config: other.yaml\n":   `has no setting "config"`,
		"exec-env: [{A: 1}]\n":   `exec-env: line 1: want a list of values, got a mapping in it`,
		"bins: 1\n  nested: 2\n": `wmrl.yaml: yaml:`,
	} {
		cfg := pipeline.DefaultConfig()
		var estimator string
		fs := pflag.NewFlagSet("run", pflag.ContinueOnError)
		pipelineFlags(fs, &cfg, &estimator)
		err := applyConfigFile(fs, "wmrl run", writeConfig(t, text))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v; want %q", text, err, want)
		}
	}
	cfg := pipeline.DefaultConfig()
	var estimator string
	fs := pflag.NewFlagSet("run", pflag.ContinueOnError)
	pipelineFlags(fs, &cfg, &estimator)
	if err := applyConfigFile(fs, "wmrl run", writeConfig(t, "# nothing set yet\n")); err != nil {
		t.Errorf("a file of comments only: %v", err)
	}
}

// wmrl run --config runs the job the file describes, the command line
// overriding it.
func TestRunReadsItsConfigFile(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	path := writeConfig(t, "steps: 5\nlisten: 127.0.0.1:0\nanchor-fraction: 0.25\ndata: "+t.TempDir()+"\n")
	out, err := wmrl(ctx, "run", "--config", path, "--steps", "3")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if !strings.Contains(out, "done: steps 0-2 fused") || !strings.Contains(out, "anchors  4") {
		t.Fatalf("want 3 steps (the command line's) of 4 anchors (the file's 0.25 of 16 groups):\n%s", out)
	}
	if out, err := wmrl(ctx, "run", "--config", writeConfig(t, "stepz: 3\n")); err == nil || !strings.Contains(err.Error(), `wmrl run has no setting "stepz" (did you mean "steps"?)`) {
		t.Fatalf("a misspelt setting: %v\n%s", err, out)
	}
}
