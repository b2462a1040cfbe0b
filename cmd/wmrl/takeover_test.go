package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
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
	killedAndTakenOver(t, false)
}

// Started again on another machine (or in a container of its own: a pid
// namespace apart), the new process cannot look the killed one's pid up;
// the killed one no longer answers requests, and once it has neither
// answered nor renewed its lease for a third of the TTL, the new process
// takes over, still before the lease would lapse, and what the killed one
// held is given again at once. Status, from another machine, says the
// holder answers no request.
func TestAStageKilledIsTakenOverOnAnotherMachineOnceSilent(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	killedAndTakenOver(t, true)
}

func killedAndTakenOver(t *testing.T, elsewhere bool) {
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
	args := []string{"stage", "route", "--nats", srv.URL(), "--run", "r"}
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
	// Elsewhere, each process is of a machine of its own, and this one of
	// neither.
	on := func(cmd *exec.Cmd, machine string) *exec.Cmd {
		if elsewhere {
			cmd.Env = append(os.Environ(), natsjs.MachineEnv+"="+machine)
		}
		return cmd
	}
	first := on(exec.Command(bin, args...), "first")
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
	killed := time.Now()
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
	if len(st.Runners) == 0 || st.Runners[0].Stage != "route" || st.Runners[0].Holder == nil {
		t.Fatalf("status, route's holder killed: %s; want it named", js2)
	}
	if h := st.Runners[0].Holder; h.NoLongerRuns == elsewhere || h.Silent != elsewhere {
		t.Errorf("status, route's holder killed: %s; want it said to run no longer on this machine, or elsewhere to answer no request", js2)
	}

	how := "no longer runs on this machine: this one takes it over now"
	if elsewhere {
		how = fmt.Sprintf("has neither answered nor renewed its lease for %v: this one takes it over now", natsjs.SilentAfter(pipeline.LeaseTTL))
	}
	p2 := started(t, on(exec.Command(bin, args...), "second"))
	ready(p2)
	t.Logf("taken over %v after the kill", time.Since(killed).Round(100*time.Millisecond))
	out := p2.out.String()
	if !strings.Contains(out, "route: the process that ran this stage for run r (") || !strings.Contains(out, how) {
		t.Errorf("the process started after the holder was killed did not take over, saying %q:\n%s", how, out)
	}
	if waited := strings.Contains(out, "another process runs this stage"); waited != elsewhere {
		t.Errorf("the process started after the holder was killed waited for it: %v; want %v:\n%s", waited, elsewhere, out)
	}
	// Delivered again within 10 s of the takeover, where the AckWait would
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
