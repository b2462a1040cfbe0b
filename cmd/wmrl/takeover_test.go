package main

import (
	"context"
	"encoding/json"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/pipeline"
)

// A one-per-run stage killed (SIGKILL: the OOM killer, a supervisor's
// last resort) and started again on its machine is taken over at once by
// the new process, which says whose it was, instead of standing by for
// the lease's TTL (30 s) as though the killed process still ran; and
// what the killed one held (route holds a step's trajectories until its
// watermark) is given to it again at once, not after the consumers'
// AckWait (30 s). Between the two, status says the holder is gone.
func TestAStageKilledIsTakenOverAtOnceOnItsMachine(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	bin := buildBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	args := []string{"stage", "route", "--nats", srv.URL(), "--run", "r", "--listen", freePort(t)}
	ready := func(p *proc) {
		t.Helper()
		waitUntil(t, time.Minute, func() bool {
			select {
			case <-p.done:
				t.Fatalf("the process ended (%v); its output:\n%s", p.err, p.out.String())
			default:
			}
			return strings.Contains(p.out.String(), "ready: ")
		})
	}
	first := exec.Command(bin, args...)
	p1 := started(t, first)
	ready(p1)

	nc, err := srv.Connect("trainer")
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	trajs, _ := (&sim.Policy{Run: "r", Tasks: 2, Groups: 2, GroupSize: 4}).Step(0)
	for _, tr := range trajs { // no watermark: route holds them all
		b, _ := json.Marshal(tr)
		if _, err := js.Publish(ctx, "wmrl.r.traj", b); err != nil {
			t.Fatal(err)
		}
	}
	route, err := js.Consumer(ctx, pipeline.StreamName("wmrl"), natsjs.SafeName("route_r_traj"))
	if err != nil {
		t.Fatal(err)
	}
	consumer := func() *jetstream.ConsumerInfo {
		info, err := route.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return info
	}
	waitUntil(t, 30*time.Second, func() bool { return consumer().NumAckPending == len(trajs) })
	if err := first.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-p1.done
	// Meanwhile, status on this machine says route's holder is gone.
	js2, err := wmrl(ctx, "status", "--nats", srv.URL(), "--run", "r", "--json")
	if err != nil {
		t.Fatal(err)
	}
	var st statusDoc
	if err := json.Unmarshal([]byte(js2), &st); err != nil {
		t.Fatal(err)
	}
	if len(st.Runners) == 0 || st.Runners[0].Stage != "route" || st.Runners[0].Holder == nil || !st.Runners[0].Holder.NoLongerRuns {
		t.Errorf("status, route's holder killed: %s; want it said to run no longer", js2)
	}

	p2 := started(t, exec.Command(bin, args...))
	ready(p2)
	out := p2.out.String()
	if strings.Contains(out, "another process runs this stage") ||
		!strings.Contains(out, "route: the process that ran this stage for run r (") ||
		!strings.Contains(out, "no longer runs on this machine: this one takes it over now") {
		t.Errorf("the process started after the holder was killed did not take over at once, saying so:\n%s", out)
	}
	// Delivered again within 10 s of the start, where the AckWait would
	// have them wait 30 s after the killed process took them.
	deadline := time.Now().Add(10 * time.Second)
	for info := consumer(); info.NumRedelivered < len(trajs); info = consumer() {
		if time.Now().After(deadline) {
			t.Fatalf("the killed process's trajectories: %d of %d delivered again 10 s after the start (%d in flight); want all, at once",
				info.NumRedelivered, len(trajs), info.NumAckPending)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
