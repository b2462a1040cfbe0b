package main

import (
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"slices"
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

// TestSimAtARankCorrelation: --rank-corr trains grpo, grpo-anchors, wm and
// wmrl on a world model placed at that within-group rank correlation, with
// the shape the flags give, and says where it placed it; it refuses what
// it cannot place and the flags it replaces.
func TestSimAtARankCorrelation(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	out, err := wmrl(ctx, "sim", "--rank-corr", "0.4", "--seeds", "2", "--steps", "40", "--groups", "4", "--group-size", "4", "--out", dir, "--json")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	var doc struct {
		GroupSize int `json:"group_size"`
		Scenarios map[string]map[string]struct {
			FinalReward float64 `json:"final_reward"`
		}
		RankCorr *struct {
			Sim float64 `json:"sim_rank_corr"`
		} `json:"rank_corr"`
	}
	if err := json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &doc); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	methods := doc.Scenarios["rank-corr"]
	if doc.GroupSize != 4 || doc.RankCorr == nil || math.Abs(doc.RankCorr.Sim-0.4) > 0.01 || len(doc.Scenarios) != 1 || len(methods) != 4 || methods["grpo-anchors"].FinalReward == 0 {
		t.Errorf("sim --rank-corr 0.4 --group-size 4: %+v, placed %+v", doc, doc.RankCorr)
	}
	if _, err := os.Stat(filepath.Join(dir, "curves-rank-corr.png")); err != nil {
		t.Error(err)
	}
	for args, want := range map[string]string{
		"--rank-corr 1.5":                  "--rank-corr 1.5: a correlation is in [-1, 1]",
		"--rank-corr 0.4 --scenario noisy": "drop --scenario and --methods",
		"--rank-corr 0.4 --methods wm":     "drop --scenario and --methods",
	} {
		if _, err := wmrl(ctx, append([]string{"sim", "--out", dir}, strings.Fields(args)...)...); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("sim %s: %v; want %q", args, err, want)
		}
	}
}

// TestSimRefusesASettingByItsName: a share of anchors outside [0, 1] was
// refused by the anchor scheduler, as "route: invalid config: fraction
// 3", before the benchmark's own check could name it.
func TestSimRefusesASettingByItsName(t *testing.T) {
	out, err := wmrl(context.Background(), "sim", "--out", t.TempDir(), "--anchor-fraction", "3")
	if want := "sim: rl: --anchor-fraction 3: want [0, 1]"; err == nil || err.Error() != want {
		t.Errorf("sim --anchor-fraction 3: %v; want %q\n%s", err, want, out)
	}
	for _, c := range []struct{ args, want []string }{
		{[]string{"--group-size", "1", "--cost-exec", "-1"}, []string{"sim: rl: --group-size 1: want at least 2\n--cost-exec -1: want a finite number, 0 or more"}},
		{[]string{"--scenario", "monotone,mono"}, []string{"sim: --scenario: ", `unknown scenario "mono"`}},
		{[]string{"--methods", "grpo,wmlr"}, []string{"sim: --methods: ", `unknown method "wmlr"`}},
	} {
		out, err := wmrl(context.Background(), append([]string{"sim", "--out", t.TempDir()}, c.args...)...)
		for _, w := range c.want {
			if err == nil || !strings.Contains(err.Error(), w) {
				t.Errorf("sim %s: %v; want it to say %q\n%s", strings.Join(c.args, " "), err, w, out)
			}
		}
	}
}

// --advantage-norm center trains every method on centred advantages (the
// same seeds end elsewhere), says so, and says once that SGD at its
// default learning rate leaves them short; the JSON names them.
func TestSimOnCentredAdvantages(t *testing.T) {
	ctx := context.Background()
	args := []string{"sim", "--scenario", "monotone", "--methods", "grpo,wmrl", "--seeds", "2", "--steps", "20", "--no-sweep", "--out", t.TempDir()}
	final := func(more ...string) (float64, string) {
		t.Helper()
		out, err := wmrl(ctx, append(append(slices.Clone(args), more...), "--json")...)
		if err != nil {
			t.Fatalf("wmrl sim %v: %v\n%s", more, err, out)
		}
		var doc struct {
			Norm      string `json:"advantage_norm"`
			Scenarios map[string]map[string]struct {
				Final float64 `json:"final_reward"`
			} `json:"scenarios"`
		}
		if err := json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &doc); err != nil { // after the progress bar's lines
			t.Fatalf("wmrl sim %v --json: %v\n%s", more, err, out)
		}
		return doc.Scenarios["monotone"]["grpo"].Final, doc.Norm
	}
	std, norm := final()
	if norm != "std" {
		t.Errorf("the default run's JSON says advantage_norm %q, want std", norm)
	}
	centred, norm := final("--advantage-norm", "center")
	if norm != "center" || centred == std {
		t.Errorf("--advantage-norm center: advantage_norm %q, grpo's final reward %v (standardised: %v); want center, and another reward", norm, centred, std)
	}
	const short = "leaves every learner short"
	for _, tc := range []struct {
		more []string
		said bool
	}{{[]string{"--advantage-norm", "center"}, true}, {[]string{"--advantage-norm", "center", "--optimizer", "adam"}, false}, {[]string{"--advantage-norm", "center", "--lr", "20"}, false}} {
		out, err := wmrl(ctx, append(slices.Clone(args), tc.more...)...)
		if err != nil || !strings.Contains(out, "advantages: centred only (r - mean within the group, Dr. GRPO), for every method") || strings.Contains(out, short) != tc.said {
			t.Errorf("wmrl sim %v (%v): want the advantages named, and %q said: %v\n%s", tc.more, err, short, tc.said, out)
		}
	}
}
