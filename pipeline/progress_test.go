package pipeline

import (
	"context"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
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
