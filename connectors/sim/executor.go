package sim

import (
	"context"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
)

// Executor "runs" a trajectory: it waits Latency and returns the true
// quality plus execution noise, clipped to [0, 1].
type Executor struct {
	Latency time.Duration
	Noise   float64
}

var _ execute.Executor = (*Executor)(nil)

// Execute scores one trajectory.
func (e *Executor) Execute(ctx context.Context, t schemas.Trajectory) (execute.Result, error) {
	start := time.Now()
	if e.Latency > 0 {
		select {
		case <-time.After(e.Latency):
		case <-ctx.Done():
			return execute.Result{}, ctx.Err()
		}
	}
	s := clip01(Quality(t) + e.Noise*rng(t.TrajID, t.Response, "exec").NormFloat64())
	return execute.Result{Status: schemas.ExecScored, Score: s, Seconds: time.Since(start).Seconds()}, nil
}
