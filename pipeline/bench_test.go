package pipeline

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
)

// rawBaseline is plain nats.go publish+consume on an embedded file store,
// measured in the same run as the pipeline.
func rawBaseline(b *testing.B) float64 {
	srv, err := natsjs.StartServer(context.Background(), natsjs.ServerConfig{StoreDir: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	defer srv.Shutdown()
	nc, err := srv.Connect("raw")
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	raw, err := natsjs.RawThroughput(context.Background(), nc, 50000, 200)
	if err != nil {
		b.Fatal(err)
	}
	return raw
}

// runSteps runs the whole pipeline in-process on at least 20 steps of 1024
// trajectories (128 groups of 8). It returns the steady-state rate (the
// steps after the first, from the first update to the last, so start-up is
// not counted) and each step's latency from its last input to its update.
func runSteps(b *testing.B, inFlight int, stages ...string) (trajPerSec float64, lat []time.Duration) {
	return runStepsOf(b, DefaultConfig(), inFlight, stages...)
}

func runStepsOf(b *testing.B, cfg Config, inFlight int, stages ...string) (trajPerSec float64, lat []time.Duration) {
	if stages != nil {
		cfg.Stages = stages
	}
	cfg.DataDir, cfg.Listen, cfg.Quiet = b.TempDir(), "127.0.0.1:0", true
	steps := max(b.N, 20)
	cfg.Groups, cfg.GroupSize, cfg.Steps, cfg.InFlightSteps = 128, 8, int64(steps), inFlight
	cfg.ExecLatency = time.Millisecond
	var mu sync.Mutex
	var first, last time.Time
	cfg.OnUpdate = func(_ schemas.Update, d time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		if first.IsZero() {
			first = time.Now()
		}
		last = time.Now()
		lat = append(lat, d)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	b.ResetTimer()
	if err := Run(ctx, cfg); err != nil {
		b.Fatal(err)
	}
	return float64((steps-1)*1024) / last.Sub(first).Seconds(), lat
}

// BenchmarkEndToEnd: trajectories per second through every stage with
// simulated connectors and the embedded file store, a group of
// trajectories a message (trajs), beside raw nats.go
// publish+consume (msgs/s) measured in the same run. Target: 20,000/s.
func BenchmarkEndToEnd(b *testing.B) {
	raw := rawBaseline(b)
	rate, _ := runSteps(b, 4)
	b.ReportMetric(rate, "traj/s")
	b.ReportMetric(raw, "raw_msgs/s")
	b.ReportMetric(rate/raw, "x_raw")
}

// BenchmarkEndToEndOneByOne: the same with every trajectory in a message
// of its own (the traj subject) rather than a group a message (trajs), as
// BenchmarkEndToEnd's simulated trainer sends them.
func BenchmarkEndToEndOneByOne(b *testing.B) {
	raw := rawBaseline(b)
	cfg := DefaultConfig()
	cfg.trajsAlone = true
	rate, _ := runStepsOf(b, cfg, 4)
	b.ReportMetric(rate, "traj/s")
	b.ReportMetric(raw, "raw_msgs/s")
	b.ReportMetric(rate/raw, "x_raw")
}

// BenchmarkEndToEndNoArchive: the same without the archive stage, to show
// what archiving every record costs.
func BenchmarkEndToEndNoArchive(b *testing.B) {
	raw := rawBaseline(b)
	rate, _ := runSteps(b, 4, slices.DeleteFunc(slices.Clone(AllStages), func(s string) bool { return s == StageArchive })...)
	b.ReportMetric(rate, "traj/s")
	b.ReportMetric(raw, "raw_msgs/s")
	b.ReportMetric(rate/raw, "x_raw")
}

// BenchmarkStepLatency: from a step's last input (its watermark stored) to
// its update, one step at a time, at 1,024 trajectories per step.
func BenchmarkStepLatency(b *testing.B) {
	_, lat := runSteps(b, 1)
	slices.Sort(lat)
	q := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))]) / 1e6 }
	b.ReportMetric(q(0.5), "p50_ms")
	b.ReportMetric(q(0.99), "p99_ms")
}

// BenchmarkGateway: trajectories per second from an HTTP trainer through
// the gateway and every stage, 1,024 a step (128 groups of 8) in one
// request, at most 4 steps in flight (the trainer closes a step, then
// waits for the update of the step 4 before it). The gateway stores a
// group a message.
func BenchmarkGateway(b *testing.B) { benchGateway(b, false) }

// BenchmarkGatewayOneByOne: the same, the gateway storing each trajectory
// alone, as it did before trajs messages.
func BenchmarkGatewayOneByOne(b *testing.B) { benchGateway(b, true) }

func benchGateway(b *testing.B, alone bool) {
	cfg := DefaultConfig()
	cfg.DataDir, cfg.Listen, cfg.Quiet = b.TempDir(), "127.0.0.1:0", true
	cfg.Source, cfg.HTTPAddr, cfg.ExecLatency, cfg.trajsAlone = SourceExternal, "127.0.0.1:0", time.Millisecond, alone
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	p, err := Start(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer p.Stop()
	base := p.HTTPURL() + "/v1/runs/default"
	post := func(path string, body []byte) []byte {
		resp, err := http.Post(base+path, "application/json", bytes.NewReader(body))
		if err != nil {
			b.Fatal(err)
		}
		defer resp.Body.Close()
		out, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusAccepted {
			b.Fatalf("POST %s: %s %s", path, resp.Status, out)
		}
		return out
	}
	waitUpdate := func(step int64) {
		resp, err := http.Get(fmt.Sprintf("%s/steps/%d/update?wait=60", base, step))
		if err != nil {
			b.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b.Fatalf("update of step %d: %s", step, resp.Status)
		}
	}
	pol := sim.Policy{Run: cfg.Run, Seed: 1, Tasks: cfg.Tasks, Groups: 128, GroupSize: 8}
	steps := int64(max(b.N, 20))
	const inFlight = 4
	var first time.Time
	b.ResetTimer()
	for step := range steps {
		if step >= inFlight {
			waitUpdate(step - inFlight)
			if step == inFlight {
				first = time.Now() // the first update: start-up not counted
			}
		}
		trajs, wm := pol.Step(step)
		body, _ := json.Marshal(trajs)
		post("/trajectories", body)
		post(fmt.Sprintf("/steps/%d/close", step), []byte(fmt.Sprintf(`{"groups": %d}`, wm.Groups)))
	}
	for step := steps - inFlight; step < steps; step++ {
		waitUpdate(step)
	}
	b.ReportMetric(float64((steps-1)*1024)/time.Since(first).Seconds(), "traj/s")
}
