package pipeline

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/stepset"
)

// progress counts the steps of [0, target) whose update is stored.
type progress struct {
	mu     sync.Mutex
	target int64
	seen   stepset.Set
}

func newProgress(target int64, published []int64) *progress {
	p := &progress{target: target}
	for _, s := range published {
		p.add(s)
	}
	return p
}

func (p *progress) add(step int64) (complete bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if step >= 0 && step < p.target {
		p.seen.Add(step)
	}
	return p.seen.Len() == p.target
}

func (p *progress) complete() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.seen.Len() == p.target
}

// missing lists the steps of [0, target) not seen, in order.
func (p *progress) missing() []int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []int64
	for s := range p.target {
		if !p.seen.Has(s) {
			out = append(out, s)
		}
	}
	return out
}

// onUpdate runs for every update this process's fuse stage stores.
func (p *Pipeline) onUpdate(u schemas.Update) {
	p.metrics.ObserveUpdate(u)
	if u.CalibrationVersion == 0 && p.cfg.Debias && !p.cfg.Quiet {
		p.beforeFitOnce.Do(func() { p.sayBeforeFit(u) })
	}
	if den := p.cfg.Denoiser.Effective(); u.Rho == 1 && u.CalibrationSeq < int64(den.Warmup) && den.Estimator != fuse.EstimatorOff && !p.cfg.Quiet {
		p.warmUpOnce.Do(func() { p.sayWarmingUp(u, den) })
	}
	if then, ok := p.models.changed(u); ok {
		p.sayWorldModels(u, then)
	}
	latency := u.PublishedAt.Sub(u.ClosedAt)
	if p.source != nil {
		if d := p.source.updated(u.Step); d > 0 {
			latency = d
		}
	}
	if p.cfg.OnUpdate != nil {
		p.cfg.OnUpdate(u, latency)
	}
	p.stepLine(u, latency)
	if p.progress != nil && p.progress.add(u.Step) {
		p.finishIfComplete()
	}
}

// worldModels follows the world models the steps this process fuses were
// scored by. Safe for concurrent use.
type worldModels struct {
	mu   sync.Mutex
	last []string        // of the step fused last
	said map[string]bool // the sets said, each once
}

// seed makes models those of the step fused last: before this process
// fused any, the newest update stored.
func (w *worldModels) seed(models []string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.last, w.said = models, map[string]bool{}
}

// changed says whether u was scored by world models other than the step
// fused before it (or by more than one, at the first), with those, the
// first time for this set of them.
func (w *worldModels) changed(u schemas.Update) (then []string, ok bool) {
	now := u.Models()
	if len(now) == 0 { // no group of it was scored
		return nil, false
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	then, w.last = w.last, now
	if w.said == nil {
		w.said = map[string]bool{}
	}
	key := strings.Join(now, "\x00")
	switch {
	case len(then) == 0: // the first step
		w.said[key] = true
		return nil, len(now) > 1
	case slices.Equal(now, then) || w.said[key]:
		return nil, false
	}
	w.said[key] = true
	return then, true
}

// sayWorldModels says that step u was scored by other world models than
// the step before (then; nil at this process's first), which the
// calibration and rho, fitted on the anchor pairs of both, mix. A predict
// process started without the run's world-model flags scores with the
// simulated world model.
func (p *Pipeline) sayWorldModels(u schemas.Update, then []string) {
	names := func(ms []string) string {
		out := make([]string, len(ms))
		for i, m := range ms {
			out[i] = cmp.Or(m, "(a world model its predictions did not name)")
		}
		return strings.Join(out, " and ")
	}
	before := ""
	if then != nil {
		before = fmt.Sprintf(", the step fused before it by %s", names(then))
	}
	sim := ""
	if all := append(slices.Clone(then), u.Models()...); slices.Contains(all, "sim") && slices.ContainsFunc(all, func(m string) bool { return m != "sim" }) {
		sim = "; sim is the simulated world model, which a predict process started without --world-model openai scores with"
	}
	p.notef("fuse: step %d was scored by %s%s: the calibration's map, fitted on a buffer of anchor pairs, and rho, a running average over anchor groups, "+
		"mix them until the old one's pairs age out (wmrl audit --wm-model audits each alone; wmrl status names the newest step's)%s", u.Step, names(u.Models()), before, sim)
}

// sayBeforeFit says, at the first update fused before the calibration's
// first fit, what the map does until then and about when the fit comes:
// the step lines' "calibration v0" is a phase of its own, in which (with
// the default flat map) only the anchor groups move the policy.
func (p *Pipeline) sayBeforeFit(u schemas.Update) {
	pairs := 0
	for _, it := range u.Items {
		if it.Source == fuse.SourceAnchor && it.Reward != nil {
			pairs++
		}
	}
	first := p.cfg.Debiaser.FirstFit()
	when := ""
	if left := int64(first) - u.PairsTotal; pairs > 0 && left > 0 {
		when = fmt.Sprintf("; at %d a step, %s", pairs, stepsFromNow(left, int64(pairs)))
	}
	what := "scores every world-model trajectory of a group alike (at the anchors' mean score), so only the anchor groups move the policy"
	if p.cfg.Debiaser.BeforeFit == calibrate.BeforeFitIdentity {
		what = "passes the world model's raw scores through, unchecked by the anchors"
	}
	p.notef("calibration: until its first isotonic fit, after %d anchor pairs (%d so far%s), the map %s (--before-fit, --min-pairs, --refit-every)",
		first, u.PairsTotal, when, what)
}

// sayWarmingUp says, at the first update fused at rho 1 in the denoiser's
// warm-up, that the anchors' weight waits for its anchor groups to be
// measured, and about when that is.
func (p *Pipeline) sayWarmingUp(u schemas.Update, den fuse.DenoiserConfig) {
	when := ""
	if left := int64(den.Warmup) - u.CalibrationSeq; u.Anchors > 0 && left > 0 {
		when = fmt.Sprintf("; at %d a step, %s", u.Anchors, stepsFromNow(left, int64(u.Anchors)))
	}
	p.notef("rho: the anchor groups' weight is 1, as in plain GRPO, until %d anchor groups have measured the world model's disagreement "+
		"(%d absorbed so far%s); then it follows that disagreement, within [%g, %g] (--rho)", den.Warmup, u.CalibrationSeq, when, den.RhoMin, den.RhoMax)
}

// stepsFromNow says about when left more come, at perStep a step.
func stepsFromNow(left, perStep int64) string {
	if n := (left + perStep - 1) / perStep; n != 1 {
		return fmt.Sprintf("about %d steps from now", n)
	}
	return "about a step from now"
}

// finishIfComplete stops a run of a fixed number of steps once every step
// is fused and, when this process archives, archived with the pairs of
// its late anchor groups (which come after their steps), but for those a
// dead letter holds up.
func (p *Pipeline) finishIfComplete() {
	if p.progress == nil && p.archived == nil {
		return
	}
	fused := p.progress == nil || p.progress.complete()
	if fused && p.archiveWriter != nil {
		p.archiveWriter.SetMaxAge(0) // the last steps' rows: close the file at once
	}
	if !fused || p.archived != nil && !p.archived.complete() {
		return
	}
	if p.archived != nil {
		if coming, _, _ := p.lateWaits(); len(coming) > 0 {
			return
		}
	}
	p.doneOnce.Do(p.sayDone)
	p.cancel()
}

// sayDone closes a run of a fixed number of steps with what this process
// saw of it: the world model's ranking on the anchors and what was lost.
func (p *Pipeline) sayDone() {
	if p.cfg.Quiet || p.progress == nil {
		return
	}
	p.flushSummary()
	archived := ""
	if p.archived != nil {
		archived = " and archived"
	}
	steps := fmt.Sprintf("steps 0-%d", p.progress.target-1)
	if p.progress.target == 1 {
		steps = "step 0"
	}
	fused, seen := p.seen()
	fmt.Fprintf(p.cfg.Out, "done: %s fused%s, %d of them by this process in %s, %s\n",
		steps, archived, fused, time.Since(p.started).Round(100*time.Millisecond), seen)
	if p.archived == nil {
		return
	}
	if _, held, why := p.lateWaits(); len(held) > 0 {
		fmt.Fprintf(p.cfg.Out, "not archived: the pairs of late anchor groups %s, whose messages were dead-lettered (the first, %s); "+
			"wmrl dlq lists them, and --resend sends back those given up for an outage or a bug, whose pairs a run on the same --data then archives\n",
			Few(held, 3, lateName), why[0])
	}
}

func lateName(g archive.LateGroup) string { return fmt.Sprintf("%s of step %d", g.GroupID, g.Step) }

// sayStopped closes a run stopped from outside (Ctrl-C, SIGTERM) with
// where it is and how to go on, so that a stop is not mistaken for a loss.
func (p *Pipeline) sayStopped() {
	p.errMu.Lock()
	failed := p.err != nil // said by the caller
	p.errMu.Unlock()
	if p.cfg.Quiet || failed {
		return
	}
	p.flushSummary()
	line := "stopped after " + time.Since(p.started).Round(100*time.Millisecond).String()
	if p.fuse != nil {
		fused, seen := p.seen()
		if fused > 0 {
			var newest dto.Metric
			_ = p.metrics.Steps.Write(&newest)
			line += fmt.Sprintf(": the newest step fused %d, %d steps fused by this process, %s", int64(newest.GetGauge().GetValue()), fused, seen)
		} else {
			line += ": no step fused by this process"
		}
	}
	if w := p.archiveWaits(); w != "" {
		line += "; " + w
	}
	again := "on the same --data"
	if p.tr.srv == nil {
		again = "with the same --nats and --run"
	}
	fmt.Fprintf(p.cfg.Out, "%s. What it held is handed back; start it again %s to go on where it stopped\n", line, again)
}

// archiveWaits says, of a run of a fixed number of steps stopped with
// every step fused, what the archive had not written: the updates of
// steps, and late anchor groups' pairs (whose calibrations come after
// their steps). Empty when it had them all or steps remain to fuse.
func (p *Pipeline) archiveWaits() string {
	if p.progress == nil || p.archived == nil || !p.progress.complete() {
		return ""
	}
	var waits []string
	if steps := p.archived.missing(); len(steps) > 0 {
		waits = append(waits, "the updates of steps "+Few(steps, 3, func(s int64) string { return fmt.Sprint(s) }))
	}
	if late := p.archiveWriter.PendingLate(); len(late) > 0 {
		waits = append(waits, "the pairs of late anchor groups "+Few(late, 3, lateName))
	}
	if waits == nil {
		return ""
	}
	return fmt.Sprintf("all %d steps fused, the archive waited for %s", p.progress.target, strings.Join(waits, " and "))
}

// Few names the first show of xs, then says how many more there are:
// "3, 5, 8 and 12 more".
func Few[T any](xs []T, show int, name func(T) string) string {
	var names []string
	for _, x := range xs[:min(len(xs), show)] {
		names = append(names, name(x))
	}
	out := strings.Join(names, ", ")
	if len(xs) > show {
		out += fmt.Sprintf(" and %d more", len(xs)-show)
	}
	return out
}

// seen is how many steps this process fused, and what it saw of them:
// the world model's ranking on the anchors and what was lost.
func (p *Pipeline) seen() (fused uint64, seen string) {
	var h dto.Metric
	_ = p.metrics.WithinSpearman.Write(&h)
	ranked := "no anchor group ranked"
	if n := h.GetHistogram().GetSampleCount(); n > 0 {
		ranked = fmt.Sprintf("%d anchor groups, the world model's within-group Spearman on them %.3f", n, h.GetHistogram().GetSampleSum()/float64(n))
	}
	var lost []string
	for _, l := range stepLosses(schemas.Update{}) {
		var c dto.Metric
		_ = p.metrics.Lost.WithLabelValues(l.kind).Write(&c)
		if n := c.GetCounter().GetValue(); n > 0 {
			lost = append(lost, fmt.Sprintf("%s %d", l.label, int(n)))
		}
	}
	if lost == nil {
		lost = []string{"nothing"}
	}
	var steps dto.Metric
	_ = p.metrics.StepLatency.Write(&steps)
	return steps.GetHistogram().GetSampleCount(), fmt.Sprintf("which saw %s; lost %s", ranked, strings.Join(lost, ", "))
}

// loss is one kind of what a step did not get to the gradient as
// planned: trajectories the world model could not score (wm_ungraded),
// anchor trajectories whose execution gave no score (sandbox_error), both
// dropped and never scored as 0; groups that did not contribute
// (skipped_group); anchor groups that missed the deadline (late_anchor),
// or were executed with fewer than two scores (failed_anchor), and used
// world-model rewards.
type loss struct {
	kind, label string // the metric's label; the step line's words
	n           int
}

func stepLosses(u schemas.Update) []loss {
	wm, sandbox := 0, 0
	for _, it := range u.Items {
		switch {
		case it.Source == fuse.SourceWorldModel && it.Reward == nil && it.WMStatus != schemas.PredNotSent:
			wm++ // not those of a group never sent to it (a skipped group)
		case it.ExecStatus == schemas.ExecSandboxError:
			sandbox++
		}
	}
	return []loss{
		{"late_anchor", "late anchors", len(u.LateAnchors)},
		{"failed_anchor", "failed anchors", len(u.FailedAnchors)},
		{"wm_ungraded", "wm ungraded", wm},
		{"sandbox_error", "sandbox errors", sandbox},
		{"skipped_group", "skipped groups", len(u.Skipped)},
	}
}

// healthOf is the step line's tail: what of the step was lost, when
// anything was, so that a world model answering garbage or a sandbox
// failing shows in the run's output and not only in the archive.
func healthOf(u schemas.Update) string {
	var b strings.Builder
	for _, l := range stepLosses(u) {
		if l.n > 0 {
			fmt.Fprintf(&b, "  %s %d", l.label, l.n)
		}
	}
	return b.String()
}
