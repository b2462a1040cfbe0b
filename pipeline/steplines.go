package pipeline

import (
	"context"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/wmrl/wmrl/schemas"
)

// stepLine prints what a step this process fused gave: its line, or, with
// Config.StepSummary, its share of the next summary line.
func (p *Pipeline) stepLine(u schemas.Update, latency time.Duration) {
	switch {
	case p.cfg.Quiet || p.cfg.NoStepLines:
	case p.cfg.StepSummary > 0:
		p.summary.add(u, latency)
	default:
		fmt.Fprintf(p.cfg.Out, "step %5d  groups %3d  anchors %2d  pairs %7d  calibration v%-4d  rho %.3f  D %.3f  latency %s%s\n",
			u.Step, u.Groups, u.Anchors, u.PairsTotal, u.CalibrationVersion, u.Rho, u.D, latency.Round(time.Millisecond), healthOf(u))
	}
}

// summarize prints the summary line every StepSummary until ctx is done,
// when there were steps fused since the last.
func (p *Pipeline) summarize(ctx context.Context) {
	t := time.NewTicker(p.cfg.StepSummary)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			p.flushSummary()
		case <-ctx.Done():
			return
		}
	}
}

// flushSummary prints the summary of the steps fused since the last one,
// if any were: before a closing line, so that it sums up every step.
func (p *Pipeline) flushSummary() { p.summary.flush(p.cfg.Out, time.Now()) }

// stepSummary sums up the steps fused since its last line: which, how
// many and how fast, the state the newest left (anchor groups, pairs,
// calibration, rho, D), the latencies, and what was lost.
type stepSummary struct {
	mu        sync.Mutex
	since     time.Time // of the last line, or the start
	n         int
	lo, hi    int64
	newest    schemas.Update
	latencies []float64 // seconds
	lost      []int     // by stepLosses' order
}

func newStepSummary(now time.Time) *stepSummary { return &stepSummary{since: now} }

func (s *stepSummary) add(u schemas.Update, latency time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.n == 0 || u.Step < s.lo {
		s.lo = u.Step
	}
	if s.n == 0 || u.Step >= s.hi {
		s.hi, s.newest = u.Step, u
		s.newest.Items = nil
	}
	s.n++
	s.latencies = append(s.latencies, latency.Seconds())
	losses := stepLosses(u)
	if s.lost == nil {
		s.lost = make([]int, len(losses))
	}
	for i, l := range losses {
		s.lost[i] += l.n
	}
}

// flush writes the line of the steps added since the last to w, if any
// were, and starts anew. The line is written under the lock, so that a
// closing line written after a flush comes after it.
func (s *stepSummary) flush(w io.Writer, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.n == 0 {
		s.since = now
		return
	}
	d := now.Sub(s.since)
	q := timeQuantiles(s.latencies)
	seconds := func(x float64) time.Duration { return time.Duration(x * float64(time.Second)).Round(time.Millisecond) }
	u := s.newest
	var b strings.Builder
	fmt.Fprintf(&b, "steps %d-%d  fused %d in %s (%.1f a second)  groups %d  anchors %d  pairs %d  calibration v%d  rho %.3f  D %.3f  latency median %s, max %s",
		s.lo, s.hi, s.n, d.Round(100*time.Millisecond), float64(s.n)/max(d.Seconds(), 1e-3), u.Groups, u.Anchors, u.PairsTotal, u.CalibrationVersion, u.Rho, u.D,
		seconds(q.Median), seconds(q.Max))
	for i, l := range stepLosses(schemas.Update{}) {
		if s.lost[i] > 0 {
			fmt.Fprintf(&b, "  %s %d", l.label, s.lost[i])
		}
	}
	fmt.Fprintln(w, b.String())
	s.since, s.n, s.latencies, s.lost = now, 0, s.latencies[:0], nil
}
