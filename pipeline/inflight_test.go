package pipeline

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
	"github.com/wmrl/wmrl/stages/route"
)

// heldExecutor executes nothing until released.
type heldExecutor struct{ release chan struct{} }

func (e heldExecutor) Execute(ctx context.Context, t schemas.Trajectory) (execute.Result, error) {
	select {
	case <-e.release:
		return execute.Result{Status: schemas.ExecScored, Score: 0.5}, nil
	case <-ctx.Done():
		return execute.Result{}, ctx.Err()
	}
}

// With a cap on executions in flight, a step planned while earlier anchors
// still run gets fewer anchors, and full ones again once they finish.
func TestInFlightCapHoldsBackAnchors(t *testing.T) {
	cfg := testConfig(t)
	cfg.Source = SourceExternal
	cfg.Anchors = route.SchedulerConfig{Fraction: 0.5, MinPerStep: 1, MaxInFlight: 2}
	cfg.AnchorDeadline = 100 * time.Millisecond // steps fuse while anchors are held
	exe := heldExecutor{release: make(chan struct{})}
	cfg.ExecutorImpl = exe
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, nc, js := startClient(t, ctx, cfg)
	pol := sim.Policy{Run: "default", Tasks: 8, Groups: 4, GroupSize: 2}
	plan := func(n int) schemas.Plan {
		var plans [][]byte
		waitFor(t, 30*time.Second, func() bool { plans = scanAll(t, nc, "wmrl.default.plan"); return len(plans) > n })
		var pl schemas.Plan
		if err := json.Unmarshal(plans[n], &pl); err != nil {
			t.Fatal(err)
		}
		return pl
	}
	capped := func(pl schemas.Plan) (n int) {
		for _, d := range pl.Decisions {
			if d.Reason == route.ReasonCapped {
				n++
			}
		}
		return n
	}

	publishStep(t, ctx, js, pol, 0)
	if pl := plan(0); pl.Anchors != 2 || capped(pl) != 0 {
		t.Fatalf("step 0: %d anchors, %d capped; want 2 and none (nothing in flight)", pl.Anchors, capped(pl))
	}
	waitFor(t, 30*time.Second, func() bool { n, err := p.execInFlight(ctx); return err == nil && n == 2 })
	publishStep(t, ctx, js, pol, 1)
	if pl := plan(1); pl.Anchors != 0 || capped(pl) != 2 {
		t.Fatalf("step 1, two groups executing under a cap of 2: %d anchors, %d capped; want 0 and 2", pl.Anchors, capped(pl))
	}
	close(exe.release)
	waitFor(t, 30*time.Second, func() bool { n, err := p.execInFlight(ctx); return err == nil && n == 0 })
	publishStep(t, ctx, js, pol, 2)
	if pl := plan(2); pl.Anchors != 2 || capped(pl) != 0 {
		t.Fatalf("step 2, executions done: %d anchors, %d capped; want 2 and none", pl.Anchors, capped(pl))
	}
	// What a restarted route reads back: the groups sent to execution, by step.
	sent, err := p.tr.groupsByMsgID(ctx, "wmrl.default.exec")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int64{0, 2} {
		var want []string
		for _, g := range plan(int(n)).Groups {
			if g.Anchor {
				want = append(want, g.GroupID)
			}
		}
		got := slices.Sorted(slices.Values(sent[n]))
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("step %d: exec subject holds %v, the plan's anchors are %v", n, got, want)
		}
	}
	if len(sent[1]) != 0 || len(sent) != 2 {
		t.Errorf("exec subject by step: %v; want steps 0 and 2 only", sent)
	}
}

// A route that stored a step's anchors and died before its plan re-plans
// that step with exactly those anchors, whatever the count says now.
func TestRestartedRouteKeepsTheAnchorsItSent(t *testing.T) {
	cfg := testConfig(t)
	cfg.Source = SourceExternal
	cfg.Anchors = route.SchedulerConfig{Fraction: 0.5, MinPerStep: 1, MaxInFlight: 2}
	cfg.AnchorDeadline = 100 * time.Millisecond
	cfg.ExecutorImpl = heldExecutor{release: make(chan struct{})}
	pol := sim.Policy{Run: "default", Tasks: 8, Groups: 4, GroupSize: 2}
	trajs, _ := pol.Step(0)
	sched, err := route.NewScheduler(cfg.Anchors)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	byGroup := map[string][]schemas.Trajectory{}
	for _, tr := range trajs {
		if byGroup[tr.GroupID] == nil {
			ids = append(ids, tr.GroupID)
		}
		byGroup[tr.GroupID] = append(byGroup[tr.GroupID], tr)
	}
	drawn := sched.Select("default", 0, ids, 0).Anchors()
	// The group sent before the crash is one the draw does not pick, so
	// only the resume can make it an anchor.
	sent := slices.DeleteFunc(slices.Clone(ids), func(id string) bool { return slices.Contains(drawn, id) })[0]

	// The crashed process: the stream holds step 0's one exec message, no plan.
	none := cfg
	none.Stages = []string{}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p0, nc, js := startClient(t, ctx, none)
	g := schemas.Group{Schema: 1, Run: "default", Step: 0, GroupID: sent, TaskID: byGroup[sent][0].TaskID, Anchor: true, Trajectories: byGroup[sent]}
	b, _ := json.Marshal(g)
	if _, err := js.Publish(ctx, "wmrl.default.exec", b, jetstream.WithMsgID("default/exec/0/"+sent)); err != nil {
		t.Fatal(err)
	}
	nc.Close()
	p0.Stop()

	_, nc, js = startClient(t, ctx, cfg)
	publishStep(t, ctx, js, pol, 0)
	var plans [][]byte
	waitFor(t, 30*time.Second, func() bool { plans = scanAll(t, nc, "wmrl.default.plan"); return len(plans) == 1 })
	var pl schemas.Plan
	if err := json.Unmarshal(plans[0], &pl); err != nil {
		t.Fatal(err)
	}
	var anchors []string
	for _, d := range pl.Decisions {
		if d.Anchor {
			anchors = append(anchors, d.GroupID)
			if d.Reason != route.ReasonResent {
				t.Errorf("%s: reason %q, want %q", d.GroupID, d.Reason, route.ReasonResent)
			}
		}
	}
	if fmt.Sprint(anchors) != fmt.Sprint([]string{sent}) || pl.Anchors != 1 {
		t.Fatalf("re-planned step 0 with anchors %v (%d); the exec subject holds [%s] (the draw: %v)", anchors, pl.Anchors, sent, drawn)
	}
}

// Before any execute stage has made its consumer, nothing counts as in
// flight: route plans full anchors rather than waiting on an executor that
// does not exist yet (when one starts, it reads every exec message).
func TestNoExecuteConsumerMeansNothingInFlight(t *testing.T) {
	cfg := testConfig(t)
	cfg.Source, cfg.Stages = SourceExternal, []string{StageRoute}
	cfg.Anchors = route.SchedulerConfig{Fraction: 0.5, MinPerStep: 1, MaxInFlight: 2}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, nc, js := startClient(t, ctx, cfg)
	pol := sim.Policy{Run: "default", Tasks: 8, Groups: 4, GroupSize: 2}
	for n := range int64(3) {
		publishStep(t, ctx, js, pol, n)
	}
	var plans [][]byte
	waitFor(t, 30*time.Second, func() bool { plans = scanAll(t, nc, "wmrl.default.plan"); return len(plans) == 3 })
	for i, b := range plans {
		var pl schemas.Plan
		if err := json.Unmarshal(b, &pl); err != nil {
			t.Fatal(err)
		}
		if pl.Anchors != 2 {
			t.Errorf("plan %d: %d anchors, want 2 (no execute consumer, nothing in flight)", i, pl.Anchors)
		}
	}
	if n, err := p.execInFlight(ctx); err != nil || n != 0 {
		t.Errorf("in flight with no execute consumer: %d, %v", n, err)
	}
	if got := len(scanAll(t, nc, "wmrl.default.exec")); got != 6 {
		t.Errorf("%d exec messages stored, want 6 for an executor to read when it starts", got)
	}
}
