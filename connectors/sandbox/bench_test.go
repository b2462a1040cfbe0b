package sandbox

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
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

// BenchmarkLargePublicData runs a solution on a task whose public data is
// 256 MiB, as an ML task's can be: what an execution costs the executor in
// time and memory (B/op: bytes the wmrl process allocates) before the code
// even starts, beside copying the file once with io.Copy in the same run.
func BenchmarkLargePublicData(b *testing.B) {
	task := housing(b)
	big := filepath.Join(task.PublicDir(), "large.bin")
	f, err := os.Create(big)
	if err != nil {
		b.Fatal(err)
	}
	chunk := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
	for range 256 {
		f.Write(chunk)
	}
	f.Close()
	defer os.Remove(big)
	copyOnce := func() time.Duration { // the median of 3 copies
		var took []time.Duration
		for range 3 {
			start := time.Now()
			src, _ := os.Open(big)
			dst, _ := os.Create(filepath.Join(b.TempDir(), "copy.bin"))
			io.Copy(dst, src)
			src.Close()
			dst.Close()
			took = append(took, time.Since(start))
		}
		slices.Sort(took)
		return took[1]
	}
	code := "import os\nprint(os.path.getsize('data/large.bin'))\n"
	traj := schemas.Trajectory{TrajID: "t", Response: code}
	for _, ex := range []struct {
		name string
		exe  execute.Executor
	}{
		{"subprocess", exe(task)},
		{"sandbox-fusion", &Fusion{URL: discardingFusion(b).URL, Task: task}},
	} {
		b.Run(ex.name, func(b *testing.B) {
			base := copyOnce()
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if _, err := ex.exe.Execute(context.Background(), traj); err != nil {
					b.Fatal(err)
				}
			}
			per := b.Elapsed() / time.Duration(b.N)
			b.ReportMetric(float64(per.Milliseconds()), "ms/execution")
			b.ReportMetric(per.Seconds()/base.Seconds(), "x_one_copy")
		})
	}
}

// discardingFusion reads a run_code request whole and answers that the
// code ran and wrote nothing.
func discardingFusion(b *testing.B) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Write([]byte(`{"status":"Success","run_result":{"status":"Finished","execution_time":0.1,"return_code":0},"files":{}}`))
	}))
	b.Cleanup(srv.Close)
	return srv
}
