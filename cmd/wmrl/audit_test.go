package main

import (
	"context"
	"encoding/json"
	"html"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/openai/openaitest"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/pipeline/offline"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/stagetest"
)

// A run of centred advantages is expected with them, and with Adam unless
// told otherwise: SGD at the benchmark's learning rate leaves every
// learner short of its steps there.
func TestAuditExpectsARunsAdvantages(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := finishedRun(ctx, t, 30, func(cfg *pipeline.Config) {
		cfg.Groups, cfg.GroupSize, cfg.Anchors.Fraction, cfg.AdvantageNorm = 4, 4, 0.5, fuse.CenterOnly
	})
	for _, tc := range []struct {
		flags []string
		want  string
	}{
		{nil, "rho advantage, advantages center; 300 steps of a adam learner;"},
		{[]string{"--expect-optimizer", "sgd"}, "rho advantage, advantages center; 300 steps of a sgd learner;"},
	} {
		report := filepath.Join(t.TempDir(), "report")
		out, err := wmrl(ctx, append([]string{"audit", "--archive", cfg.ArchiveRoot(), "--out", report, "--expect-seeds", "2"}, tc.flags...)...)
		if err != nil || !strings.Contains(out, tc.want) {
			t.Errorf("wmrl audit %v of a run of centred advantages (%v) lacks %q:\n%s", tc.flags, err, tc.want, out)
		}
		var sum struct {
			Expect struct {
				Norm string `json:"advantage_norm"`
			}
		}
		b, _ := os.ReadFile(filepath.Join(report, "summary.json"))
		if err := json.Unmarshal(b, &sum); err != nil || sum.Expect.Norm != "center" {
			t.Errorf("summary.json's expectation: advantage_norm %q (%v), want center", sum.Expect.Norm, err)
		}
	}
}

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
		"this run's shape and settings: 4 groups of 4 a step, anchor fraction 0.50 (even), debias true, rho advantage, advantages std; 300 steps of a sgd learner;", "execution 50\n", "\ngrpo-anchors ", "\nwmrl ",
		"reading 100% ", "auditing 100% "} { // each read of the archive shows its progress
		if !strings.Contains(out, want) {
			t.Errorf("wmrl audit's output lacks %q:\n%s", want, out)
		}
	}
	var sum struct {
		Builds []string `json:"wmrl_builds"`
		Drift  []struct {
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

	// It names the world model it audited, and --wm-model audits one's
	// rows alone.
	if !strings.Contains(out, "\nworld model: sim\n") {
		t.Errorf("wmrl audit does not name the world model it audited:\n%s", out)
	}
	// And the build of wmrl that wrote the archive: this test's.
	if build := pipeline.ReadBuild().String(); !strings.Contains(out, "\nwritten by wmrl "+build+"\n") || !slices.Equal(sum.Builds, []string{build}) {
		t.Errorf("wmrl audit does not name the build that wrote the archive (%s); summary.json's %q:\n%s", build, sum.Builds, out)
	} else if b, _ := os.ReadFile(filepath.Join(report, "index.html")); !strings.Contains(string(b), "Written by wmrl <code>"+html.EscapeString(build)+"</code>.") {
		t.Error("the report does not name the build that wrote the archive")
	}
	if b, _ := os.ReadFile(filepath.Join(report, "index.html")); !strings.Contains(string(b), "World model: <code>sim</code>.") {
		t.Error("the report does not name the world model it audited")
	}
	picked := filepath.Join(t.TempDir(), "picked")
	if out, err := wmrl(ctx, "audit", "--archive", root, "--out", picked, "--expect-seeds", "0", "--wm-model", "sim"); err != nil ||
		!regexp.MustCompile(`audited run default, world model "sim": \d+ rows`).MatchString(out) {
		t.Errorf("--wm-model sim (%v):\n%s", err, out)
	}
	if _, err := wmrl(ctx, "audit", "--archive", root, "--out", picked, "--wm-model", "qwen"); err == nil ||
		!strings.Contains(err.Error(), `no rows of world model "qwen": the rows' world models are "sim"`) {
		t.Errorf("--wm-model qwen, of a run scored by sim alone: %v", err)
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

	// --steps audits a range alone, and says so in the report.
	ranged := filepath.Join(t.TempDir(), "ranged")
	out, err = wmrl(ctx, "audit", "--archive", root, "--out", ranged, "--expect-seeds", "0", "--steps", "4-")
	if err != nil || !regexp.MustCompile(`audited run default, steps 4 and after: \d+ rows`).MatchString(out) {
		t.Errorf("--steps 4- (%v):\n%s", err, out)
	}
	if b, _ := os.ReadFile(filepath.Join(ranged, "index.html")); !regexp.MustCompile(`rows over \d+ steps \(steps 4 and after of the run alone\)`).Match(b) {
		t.Error("the report of --steps 4- does not say which steps it covers")
	}
	if _, err := wmrl(ctx, "audit", "--archive", root, "--out", ranged, "--steps", "9-4"); err == nil || !strings.Contains(err.Error(), `--steps "9-4": the last step is before the first`) {
		t.Errorf("--steps 9-4: %v", err)
	}
	out, err = wmrl(ctx, "audit", "--archive", root, "--out", ranged, "--expect-seeds", "0", "--last", "1h")
	if err != nil || !strings.Contains(out, "audited run default, steps 0 and after (fused in the last 1h0m0s of the run): ") {
		t.Errorf("--last 1h, over a run of seconds (%v):\n%s", err, out)
	}
}

// TestAuditSetsTheExecutionTimesAgainstTheDeadline: wmrl audit reads the
// run's --anchor-deadline from the archive and sets the anchors' execution
// times against it, the late groups' times included (from their late
// rows); --anchor-deadline replaces the recorded one.
func TestAuditSetsTheExecutionTimesAgainstTheDeadline(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := finishedRun(ctx, t, 12, func(cfg *pipeline.Config) {
		cfg.ExecLatency, cfg.AnchorDeadline, cfg.ArchiveMaxAge = 60*time.Millisecond, 40*time.Millisecond, 50*time.Millisecond
	})
	report := filepath.Join(t.TempDir(), "report")
	out, err := wmrl(ctx, "audit", "--archive", cfg.ArchiveRoot(), "--out", report, "--expect-seeds", "0")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	var sum struct {
		Exec *struct {
			Executions int     `json:"executions"`
			Anchor     int     `json:"anchor_groups"`
			Late       int     `json:"late_groups"`
			Timed      int     `json:"groups_timed"`
			Deadline   float64 `json:"anchor_deadline_seconds"`
			Within     float64 `json:"groups_within_deadline"`
			LateTimed  int     `json:"late_groups_timed"`
			LateAfter  *struct {
				Median, P90, Max float64
			} `json:"late_after_fused_seconds"`
			Slowest struct {
				Median float64 `json:"median"`
			} `json:"group_slowest_seconds"`
		} `json:"execution_times"`
	}
	b, err := os.ReadFile(filepath.Join(report, "summary.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &sum); err != nil || sum.Exec == nil {
		t.Fatalf("summary.json: %v, execution times %v", err, sum.Exec)
	}
	e := sum.Exec
	// Every execution takes at least ExecLatency, past the deadline: the
	// anchor groups are late (nearly all: the deadline runs from when fuse
	// has the plan, which a loaded machine can deliver after the
	// executions), and a late group's times come from its late rows alone.
	if e.Anchor != 12*2 /* 2 of 16 groups a step */ || e.Late < e.Anchor/2 || e.Late > e.Anchor || e.Timed != e.Anchor || e.Executions != e.Anchor*cfg.GroupSize ||
		e.Deadline != 0.04 || e.Within != 0 || e.Slowest.Median < 0.06 {
		t.Errorf("execution times %+v; want most of the 24 anchor groups late, every one timed, the deadline 0.04 s, none within it, the slowest 0.06 s or more", *e)
	}
	want := "execution times: " + strconv.Itoa(e.Executions) + " anchor executions, median "
	if !strings.Contains(out, want) || !strings.Contains(out, "; "+strconv.Itoa(e.Late)+" of "+strconv.Itoa(e.Anchor)+" anchor groups ("+strconv.FormatFloat(100*float64(e.Late)/float64(e.Anchor), 'f', 1, 64)+"%) late for the deadline of 40ms, and 100.0% of the groups' slowest executions ran past it (exec-times.png)") {
		t.Errorf("wmrl audit's output lacks the execution times:\n%s", out)
	}
	// Each late group was calibrated after its step's update, once its
	// executions (60 ms, past the 40 ms deadline) had ended.
	if a := e.LateAfter; a == nil || e.LateTimed != e.Late || a.Max <= 0 || a.Median > a.P90 || a.P90 > a.Max {
		t.Errorf("late groups calibrated after their steps' updates: %+v over %d groups; want all %d late groups, after", a, e.LateTimed, e.Late)
	} else if want := "; the late groups were calibrated median " + seconds(a.Median) + ", p90 " + seconds(a.P90) + ", max " + seconds(a.Max) +
		" after their step was fused: a deadline longer by " + seconds(a.P90) + " would have let 90% of them in"; !strings.Contains(out, want) {
		t.Errorf("wmrl audit's output lacks %q:\n%s", want, out)
	}
	if _, err := os.Stat(filepath.Join(report, "exec-times.png")); err != nil {
		t.Error(err)
	}
	out, err = wmrl(ctx, "audit", "--archive", cfg.ArchiveRoot(), "--out", report, "--expect-seeds", "0", "--anchor-deadline", "1m")
	if err != nil || !strings.Contains(out, "late for the deadline of 1m0s, and 0.0% of the groups' slowest executions ran past it (exec-times.png): more groups were late than executions ran past it") {
		t.Errorf("--anchor-deadline 1m (%v):\n%s", err, out)
	}
}

// Several world models are named with the steps they scored, and said to
// be measured together; rows from before the archive kept the name are
// said to be so.
func TestTheAuditNamesEachWorldModel(t *testing.T) {
	var b strings.Builder
	printWorldModels(&b, []offline.WorldModelUse{{Model: "", Rows: 10, Pairs: 2, FirstStep: 0, LastStep: 3}, {Model: "qwen", Rows: 40, Pairs: 8, FirstStep: 4, LastStep: 9}})
	want := "world models: not recorded (rows from before the archive kept it) (steps 0-3: 10 rows, 2 anchor pairs), qwen (steps 4-9: 40 rows, 8 anchor pairs); " +
		"this audit measures them together, as if one: --wm-model NAME audits one alone\n"
	if b.String() != want {
		t.Errorf("printed %q, want %q", b.String(), want)
	}
	b.Reset()
	printWorldModels(&b, nil)
	if b.Len() != 0 {
		t.Errorf("no world model: printed %q", b.String())
	}
}

// A run restarted onto another world model archives each one's rows under
// its name: status names the one scoring now, the audit names both with
// their steps, and --wm-model audits the new one's rows alone.
func TestARestartOntoAnotherWorldModelIsAuditedApart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := finishedRun(ctx, t, 4, func(*pipeline.Config) {})
	hashed := openaitest.Judge(t, func(code string) (float64, bool) {
		return float64(len(code)%10) / 10, true
	})
	cfg.Steps = 8
	cfg.WorldModel, cfg.WMURL, cfg.WMModel = "openai", hashed.URL+"/v1", "judge"
	var said stagetest.Output
	cfg.Quiet, cfg.Out = false, &said
	if err := pipeline.Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	// The restarted run says, once, that the world model changed.
	note := regexp.MustCompile(`(?m)^fuse: step [4-7] was scored by judge, the step fused before it by sim: .*; sim is the simulated world model, which a predict process started without --world-model openai scores with$`)
	if n := len(note.FindAllString(said.String(), -1)); n != 1 {
		t.Errorf("the run restarted onto another world model said %d times that it changed, want once:\n%s", n, said.String())
	}
	if out, err := wmrl(ctx, "status", "--data", cfg.DataDir); err != nil ||
		!regexp.MustCompile(`(?m)^steps fused:     up to 7 .*, world model judge$`).MatchString(out) {
		t.Errorf("status after the restart (%v):\n%s", err, out)
	}
	report := filepath.Join(t.TempDir(), "report")
	out, err := wmrl(ctx, "audit", "--archive", cfg.ArchiveRoot(), "--out", report, "--expect-seeds", "0")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	both := regexp.MustCompile(`(?m)^world models: sim \(steps 0-3: (\d+) rows, \d+ anchor pairs\), judge \(steps 4-7: (\d+) rows, \d+ anchor pairs\); this audit measures them together`)
	m := both.FindStringSubmatch(out)
	if m == nil || m[1] != "512" || m[2] != "512" {
		t.Fatalf("the audit of a run scored by two world models, 4 steps of 128 trajectories each, says:\n%s", out)
	}
	out, err = wmrl(ctx, "audit", "--archive", cfg.ArchiveRoot(), "--out", report, "--expect-seeds", "0", "--wm-model", "judge")
	if err != nil || !strings.Contains(out, `audited run default, world model "judge": 512 rows`) || !strings.Contains(out, "\nworld model: judge\n") {
		t.Errorf("--wm-model judge (%v):\n%s", err, out)
	}
}
