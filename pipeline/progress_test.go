package pipeline

import (
	"context"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
)

// A run stopped from outside says where it is and that starting it again
// goes on; a run of --steps that finished says only that it is done.
func TestAStoppedRunSaysWhereItIs(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := testConfig(t)
	cfg.Quiet = false
	out := &syncBuffer{}
	cfg.Out = out
	var newest atomic.Int64
	cfg.OnUpdate = func(u schemas.Update, _ time.Duration) { newest.Store(u.Step) }
	p := started(t, ctx, cfg)
	waitFor(t, 30*time.Second, func() bool { return newest.Load() >= 3 })
	if err := p.Stop(); err != nil {
		t.Fatal(err)
	}
	line := regexp.MustCompile(`(?m)^stopped after [0-9.]+m?s: the newest step fused (\d+), (\d+) steps fused by this process, which saw (\d+) anchor groups, .*; lost nothing\. ` +
		`What it held is handed back; start it again on the same --data to go on where it stopped$`)
	m := line.FindStringSubmatch(out.String())
	if m == nil {
		t.Fatalf("no closing line saying where the run stopped:\n%s", out.String())
	}
	steps := len(regexp.MustCompile(`(?m)^step `).FindAllString(out.String(), -1))
	if got, _ := strconv.ParseInt(m[1], 10, 64); got != newest.Load() {
		t.Errorf("says the newest step fused is %d; the last update was of step %d", got, newest.Load())
	}
	if got, _ := strconv.Atoi(m[2]); got != steps {
		t.Errorf("says %d steps fused by this process; it printed %d step lines", got, steps)
	}
	// The phase before the first fit is said once, with the fit's cadence
	// (testConfig: 32 pairs, refit every 16), if a step was fused in it:
	// with steps in flight, the first fit can come before step 0 is fused.
	want := 0
	if regexp.MustCompile(`(?m)^step .* calibration v0 `).MatchString(out.String()) {
		want = 1
	}
	if n := strings.Count(out.String(), "calibration: until its first isotonic fit, after 32 anchor pairs ("); n != want {
		t.Errorf("the phase before the first fit was said %d times, want %d:\n%s", n, want, out.String())
	}
	// So is rho's warm-up (testConfig: 4 anchor groups), if a step was
	// fused at rho 1.
	want = 0
	if regexp.MustCompile(`(?m)^step .* rho 1\.000 `).MatchString(out.String()) {
		want = 1
	}
	if n := strings.Count(out.String(), "rho: the anchor groups' weight is 1, as in plain GRPO, until 4 anchor groups have measured"); n != want {
		t.Errorf("rho's warm-up was said %d times, want %d:\n%s", n, want, out.String())
	}
	if strings.Contains(out.String(), "done:") {
		t.Errorf("a stopped run said it was done:\n%s", out.String())
	}

	// Started again on the same data with --steps beyond where it is, it
	// ends with the done line alone.
	cfg.Steps = newest.Load() + 3
	out2 := &syncBuffer{}
	cfg.Out = out2
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out2.String(), "done: steps 0-") || strings.Contains(out2.String(), "stopped after") {
		t.Errorf("a finished run's output:\n%s", out2.String())
	}
	if strings.Contains(out2.String(), "rho: the anchor groups' weight is 1") {
		t.Errorf("a run resumed past rho's warm-up said it was in it:\n%s", out2.String())
	}
}

// A run of --steps stopped with every step fused but not everything
// archived says what the archive waited for: a run that does not end has
// a reason to give.
func TestAStoppedRunSaysWhatTheArchiveWaitedFor(t *testing.T) {
	w, err := archive.OpenWriter(archive.WriterConfig{Dir: t.TempDir(), Run: "r"})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	late := []archive.LateGroup{{Step: 2, GroupID: "s2-g5"}, {Step: 2, GroupID: "s2-g1"}}
	if _, err := w.Add(archive.UpdateKey(2), nil, late); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Add(archive.LateKey(2, "s2-g5"), nil, nil); err != nil {
		t.Fatal(err)
	}
	p := &Pipeline{progress: newProgress(6, []int64{0, 1, 2, 3, 4}), archived: newProgress(6, []int64{2}), archiveWriter: w}
	if got := p.archiveWaits(); got != "" {
		t.Errorf("with a step left to fuse, it says %q", got)
	}
	p.progress.add(5)
	want := "all 6 steps fused, the archive waited for the updates of steps 0, 1, 3 and 2 more and the pairs of late anchor groups s2-g1 of step 2"
	if got := p.archiveWaits(); got != want {
		t.Errorf("says %q\nwant %q", got, want)
	}
	for _, s := range []int64{0, 1, 3, 4, 5} {
		p.archived.add(s)
	}
	if _, err := w.Add(archive.LateKey(2, "s2-g1"), nil, nil); err != nil {
		t.Fatal(err)
	}
	if got := p.archiveWaits(); got != "" {
		t.Errorf("with everything archived, it says %q", got)
	}
}

// With --step-summary, a run prints a line an interval instead of a line a
// step, and its lines add up to every step fused, before the closing line.
func TestAStepSummaryAddsUpEveryStep(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := testConfig(t)
	cfg.Quiet, cfg.Steps, cfg.StepSummary = false, 40, 50*time.Millisecond
	out := &syncBuffer{}
	cfg.Out = out
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if regexp.MustCompile(`(?m)^step `).MatchString(out.String()) {
		t.Errorf("a line a step with --step-summary:\n%s", out.String())
	}
	line := regexp.MustCompile(`(?m)^steps (\d+)-(\d+)  fused (\d+) in [0-9.]+m?s \([0-9.]+ a second\)  groups 16  anchors 2  pairs \d+  calibration v\d+  rho [0-9.]+  D [0-9.]+  latency median [0-9.]+m?s, max [0-9.]+m?s$`)
	lines := line.FindAllStringSubmatch(out.String(), -1)
	if len(lines) == 0 {
		t.Fatalf("no summary line:\n%s", out.String())
	}
	fused, hi := 0, int64(-1)
	for _, m := range lines {
		lo, _ := strconv.ParseInt(m[1], 10, 64)
		top, _ := strconv.ParseInt(m[2], 10, 64)
		n, _ := strconv.Atoi(m[3])
		if lo > top || int64(n) > top-lo+1 || n < 1 {
			t.Errorf("%q: %d steps fused cannot be steps %d-%d", m[0], n, lo, top)
		}
		fused, hi = fused+n, max(hi, top)
	}
	if fused != 40 || hi != 39 {
		t.Errorf("the summary lines count %d steps fused, up to step %d; want 40, up to 39:\n%s", fused, hi, out.String())
	}
	done := strings.Index(out.String(), "done: steps 0-39")
	if last := strings.LastIndex(out.String(), lines[len(lines)-1][0]); done < last {
		t.Errorf("the closing line does not come after every summary line:\n%s", out.String())
	}
}

// A summary line names the steps fused since the last, however they came,
// the newest's state, the median and longest latency, and the losses of
// all of them.
func TestAStepSummaryLine(t *testing.T) {
	start := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	s := newStepSummary(start)
	var b strings.Builder
	s.flush(&b, start.Add(time.Second))
	if b.Len() != 0 {
		t.Fatalf("a summary of no steps: %q", b.String())
	}
	ungraded := schemas.UpdateItem{Source: "world_model", WMStatus: schemas.PredUngraded}
	s.add(schemas.Update{Step: 7, Groups: 16, Anchors: 2, PairsTotal: 900, CalibrationVersion: 12, Rho: 2.5, D: 1.5, LateAnchors: []string{"g1"}}, 30*time.Millisecond)
	s.add(schemas.Update{Step: 3, Groups: 16, Anchors: 2, PairsTotal: 800, CalibrationVersion: 11, Rho: 2, D: 1, Items: []schemas.UpdateItem{ungraded, ungraded}}, 90*time.Millisecond)
	s.add(schemas.Update{Step: 5, Groups: 16, Anchors: 2, PairsTotal: 850, CalibrationVersion: 11, Rho: 2.2, D: 1.2, LateAnchors: []string{"g0", "g4"}}, 10*time.Millisecond)
	s.flush(&b, start.Add(3*time.Second))
	want := "steps 3-7  fused 3 in 2s (1.5 a second)  groups 16  anchors 2  pairs 900  calibration v12  rho 2.500  D 1.500  latency median 30ms, max 90ms  late anchors 3  wm ungraded 2\n"
	if b.String() != want {
		t.Errorf("summary line\n%q\nwant\n%q", b.String(), want)
	}
	b.Reset()
	s.add(schemas.Update{Step: 8, Groups: 16, Anchors: 2, PairsTotal: 950, CalibrationVersion: 12, Rho: 2.4, D: 1.4}, 20*time.Millisecond)
	s.flush(&b, start.Add(4*time.Second))
	if want := "steps 8-8  fused 1 in 1s (1.0 a second)  groups 16  anchors 2  pairs 950  calibration v12  rho 2.400  D 1.400  latency median 20ms, max 20ms\n"; b.String() != want {
		t.Errorf("the next line, which owes nothing to the one before:\n%q\nwant\n%q", b.String(), want)
	}
}

// A run of one step closes on "step 0", not on a range of one.
func TestARunOfOneStepSaysSo(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := testConfig(t)
	cfg.Quiet, cfg.Steps = false, 1
	out := &syncBuffer{}
	cfg.Out = out
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "done: step 0 fused and archived, 1 of them by this process in ") {
		t.Errorf("a run of one step closed with:\n%s\nwant \"done: step 0 fused and archived, 1 of them ...\"", out.String())
	}
}

// The note about the world models is said when the set of them changes
// from the step fused before (seeded with the newest update stored), each
// set once, so that two predict processes taking turns do not say it a
// step; at a first step with nothing before, only when it has more than
// one.
func TestTheWorldModelsAreSaidWhenTheyChange(t *testing.T) {
	// An update scored by models: by one, named once for the step; by
	// several, an item each.
	update := func(models ...string) schemas.Update {
		if len(models) == 1 {
			return schemas.Update{WMModel: models[0], Items: []schemas.UpdateItem{{WMStatus: schemas.PredOK}}}
		}
		u := schemas.Update{}
		for _, m := range models {
			u.Items = append(u.Items, schemas.UpdateItem{WMModel: m, WMStatus: schemas.PredOK})
		}
		return u
	}
	var w worldModels
	w.seed([]string{"sim"})
	for i, tc := range []struct {
		models []string
		said   bool
		then   []string
	}{
		{[]string{"sim"}, false, nil},
		{[]string{"judge"}, true, []string{"sim"}},
		{[]string{"judge"}, false, nil},
		{[]string{"sim", "judge"}, true, []string{"judge"}},
		{[]string{"judge"}, false, nil}, // said before
		{[]string{"sim"}, true, []string{"judge"}},
		{[]string{"judge"}, false, nil}, // said before
		{[]string{"sim"}, false, nil},   // said before
	} {
		then, said := w.changed(update(tc.models...))
		if said != tc.said || !slices.Equal(then, tc.then) {
			t.Errorf("update %d, scored by %v: said %v after %v; want %v after %v", i, tc.models, said, then, tc.said, tc.then)
		}
	}
	if then, said := w.changed(schemas.Update{}); said || then != nil {
		t.Errorf("a step no world model scored: said %v after %v", said, then)
	}
	if _, said := w.changed(update("sim")); said {
		t.Error("after a step no world model scored, the same as before it was said")
	}
	var fresh worldModels
	fresh.seed(nil) // the newest update stored had no group scored
	if _, said := fresh.changed(update("judge")); said {
		t.Error("the first step, by one world model, was said")
	}
	var two worldModels
	if then, said := two.changed(update("sim", "judge")); !said || then != nil {
		t.Errorf("the first step, by two world models: said %v after %v", said, then)
	}
}
