package sandbox

import (
	"context"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
)

// BenchmarkRealExecution runs the best housing solution for real (a fresh
// directory, limits, a python3 process, grading) and reports it beside one
// simulated world-model call measured in the same run.
func BenchmarkRealExecution(b *testing.B) {
	task := housing(b)
	code := solution(b, "03_interactions.py")
	s := exe(task)
	traj := schemas.Trajectory{TrajID: "t", TaskID: "housing", Response: code}
	wm := sim.DefaultWorldModel()
	const calls = 20000
	start := time.Now()
	for range calls {
		wm.Predict(context.Background(), []schemas.Trajectory{traj})
	}
	perWM := time.Since(start).Seconds() / calls
	b.ResetTimer()
	for b.Loop() {
		r, err := s.Execute(context.Background(), traj)
		if err != nil || r.Status != schemas.ExecScored {
			b.Fatalf("%+v %v", r, err)
		}
	}
	perExec := b.Elapsed().Seconds() / float64(b.N)
	b.ReportMetric(perExec*1e3, "ms/execution")
	b.ReportMetric(perWM*1e6, "µs/sim_wm_call")
	b.ReportMetric(perExec/perWM, "x_sim_wm")
}
