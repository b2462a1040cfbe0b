package sandbox

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/sandbox/fusiontest"
	"github.com/wmrl/wmrl/schemas"
)

func TestSandboxFusionExecutor(t *testing.T) {
	task := housing(t)
	srv, calls := fusiontest.Server(t, 1) // the first request gets a 503
	// Room for four executions at once on a loaded machine of 2 cores:
	// at 2 s, one of them was killed at its limit there.
	f := &Fusion{URL: srv.URL, Task: task, Limits: Limits{Timeout: 20 * time.Second}}
	local := exe(task)
	for _, tc := range []struct{ file, status string }{
		{"03_interactions.py", schemas.ExecScored},
		{"01_mean.py", schemas.ExecScored},
		{"04_wrong_format.py", schemas.ExecInvalid},
		{"05_crash.py", schemas.ExecCrashed},
	} {
		code := solution(t, tc.file)
		r, err := f.Execute(context.Background(), schemas.Trajectory{Response: code})
		if err != nil || r.Status != tc.status {
			t.Fatalf("%s: %+v %v", tc.file, r, err)
		}
		want, _ := local.Execute(context.Background(), schemas.Trajectory{Response: code})
		if r.Score != want.Score {
			t.Fatalf("%s: reward %v through Sandbox Fusion, %v locally", tc.file, r.Score, want.Score)
		}
	}
	if calls.Load() != 5 {
		t.Fatalf("%d calls: the 503 was not retried once", calls.Load())
	}
	// Executions at once share the encoded public data.
	want, _ := local.Execute(context.Background(), schemas.Trajectory{Response: solution(t, "02_one_feature.py")})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			r, err := f.Execute(context.Background(), schemas.Trajectory{Response: solution(t, "02_one_feature.py")})
			if err != nil || r.Status != schemas.ExecScored || r.Score != want.Score {
				t.Errorf("at once: %+v %v; want %v", r, err, want.Score)
			}
		})
	}
	wg.Wait()
	short := &Fusion{URL: srv.URL, Task: task, Limits: Limits{Timeout: 2 * time.Second}}
	if r, _ := short.Execute(context.Background(), schemas.Trajectory{Response: "while True:\n    pass\n"}); r.Status != schemas.ExecTimedOut {
		t.Fatalf("infinite loop: %+v", r)
	}
}

func TestSandboxFusionFailures(t *testing.T) {
	task := housing(t)
	broken := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"status":"SandboxError","message":"container failed to start","run_result":null}`))
	}))
	defer broken.Close()
	r, err := (&Fusion{URL: broken.URL, Task: task}).Execute(context.Background(), schemas.Trajectory{Response: "print(1)"})
	if err != nil || r.Status != schemas.ExecSandboxError {
		t.Fatalf("sandbox error: %+v %v; want ungraded, not a score", r, err)
	}
	// A server that takes requests and never answers is asked once: each
	// retry would wait as long again.
	var asked atomic.Int64
	hung := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked.Add(1)
		io.Copy(io.Discard, r.Body) // then the server sees the client hang up
		<-r.Context().Done()
	}))
	defer hung.Close()
	_, err = (&Fusion{URL: hung.URL, Task: task, Limits: Limits{Timeout: 200 * time.Millisecond}, Slack: 300 * time.Millisecond}).
		Execute(context.Background(), schemas.Trajectory{Response: "print(1)"})
	if err == nil || !strings.Contains(err.Error(), "no answer within 500ms") || asked.Load() != 1 {
		t.Fatalf("a hung sandbox: %v after %d requests; want an error after one", err, asked.Load())
	}
	down := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	down.Close()
	// A password in the URL (sent as basic auth) stays out of the error,
	// which goes to the dead letters and the run's output.
	withPassword := strings.Replace(down.URL, "://", "://ops:s3cret@", 1)
	_, err = (&Fusion{URL: withPassword, Task: task, Retries: 1}).Execute(context.Background(), schemas.Trajectory{Response: "print(1)"})
	if err == nil {
		t.Fatal("an unreachable sandbox gave a result; want an error so the group is retried")
	}
	if strings.Contains(err.Error(), "s3cret") || !strings.Contains(err.Error(), "ops:xxxxx@") {
		t.Errorf("an unreachable sandbox: %v; want its URL's password hidden", err)
	}
}

// TestSandboxFusionBoundsTheSubmission: a submission over the limit is
// invalid, as with the subprocess executor; one whose answer outgrew what
// was read of it (64 MiB) came back as "not run_code JSON", retried as a
// server's failure, and its group with it, for as long as the run lasted.
func TestSandboxFusionBoundsTheSubmission(t *testing.T) {
	task := housing(t)
	srv, calls := fusiontest.Server(t, 0)
	f := &Fusion{URL: srv.URL, Task: task, Limits: Limits{Timeout: 10 * time.Second, SubmissionBytes: 1 << 20}}
	for _, c := range []struct {
		mib  int
		want string
	}{
		{3, "submission.csv is 3 MiB, over the 1 MiB a submission may be"},
		{20, "Sandbox Fusion's answer is over 17 MiB: submission.csv is over the 1 MiB a submission may be"},
	} {
		calls.Store(0)
		r, err := f.Execute(context.Background(), schemas.Trajectory{Response: fmt.Sprintf("open('submission.csv', 'w').write('x' * (%d << 20))\n", c.mib)})
		if err != nil || r.Status != schemas.ExecInvalid || r.Detail != c.want || calls.Load() != 1 {
			t.Errorf("a submission of %d MiB: %s %q, %v, after %d calls; want invalid, %q, after 1", c.mib, r.Status, r.Detail, err, calls.Load(), c.want)
		}
	}
}

func TestSandboxFusionIsSentTheLimits(t *testing.T) {
	task := housing(t)
	task.TimeLimitSeconds, task.MemoryMB = 1200, 8192
	var got fusionRequest
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = fusionRequest{}
		json.NewDecoder(r.Body).Decode(&got)
		w.Write([]byte(`{"status":"Failed","run_result":{"status":"TimeLimitExceeded","execution_time":1200.2,"return_code":null}}`))
	}))
	defer srv.Close()
	for _, tc := range []struct {
		limits  Limits
		timeout float64
		mb      int
		detail  string
	}{
		{Limits{}, 1200, 8192, "killed after 20m0s, its wall-clock limit"},
		{Limits{Timeout: 90 * time.Second}, 90, 8192, "killed after 1m30s, its wall-clock limit"},
		{Limits{MemoryBytes: 2 << 30}, 1200, 2048, "killed after 20m0s, its wall-clock limit"},
		{Limits{MemoryBytes: -1}, 1200, -1, "killed after 20m0s, its wall-clock limit"},
	} {
		r, err := (&Fusion{URL: srv.URL, Task: task, Limits: tc.limits}).Execute(context.Background(), schemas.Trajectory{Response: "print(1)"})
		if err != nil || got.RunTimeout != tc.timeout || got.MemoryLimitMB != tc.mb || r.Status != schemas.ExecTimedOut || r.Detail != tc.detail {
			t.Errorf("limits %v: sent run_timeout %v, memory_limit_MB %d, got %+v %v; want %v, %d, timed out: %s",
				tc.limits, got.RunTimeout, got.MemoryLimitMB, r, err, tc.timeout, tc.mb, tc.detail)
		}
	}
}
