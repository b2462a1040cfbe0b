package pipeline

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
)

// A group delivered to a route that did not acknowledge it (lost on its
// way at a server's failover, or held by a process that ended) comes
// again only after the consumer's AckWait. A step whose --step-timeout
// comes first waits for it, and is planned whole once it comes; before,
// the step was planned without the group and its trajectories were
// dead-lettered as late (a rehearsal on a cluster lost 7 groups so).
// Here the test takes the group's delivery itself, on route's consumer,
// and never acknowledges it; a route started after that has a step
// timeout of 1 s and an AckWait of 6 s.
func TestAStepWaitsForAGroupDeliveredAgain(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv, _, js := startServer(t, ctx, natsjs.ServerConfig{})
	cfg := testConfig(t)
	cfg.NATSURL, cfg.Source, cfg.StepTimeout, cfg.ackWait = srv.URL(), SourceExternal, time.Second, 6*time.Second
	first, err := Start(ctx, cfg) // makes route's consumers
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Stop(); err != nil {
		t.Fatal(err)
	}

	pol := &sim.Policy{Run: cfg.Run, Tasks: 4, Groups: 3, GroupSize: 4}
	trajs, wm := pol.Step(0)
	prefix := "wmrl." + cfg.Run + "."
	for _, group := range schemas.ByGroup(trajs) {
		b, _ := json.Marshal(group)
		if _, err := js.Publish(ctx, prefix+"trajs", b); err != nil {
			t.Fatal(err)
		}
	}
	cons, err := js.Consumer(ctx, StreamName(cfg.Prefix), consumerName(StageRoute, cfg.Run, schemas.KindTrajs))
	if err != nil {
		t.Fatal(err)
	}
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var taken []schemas.Trajectory
	for m := range batch.Messages() {
		if err := json.Unmarshal(m.Data(), &taken); err != nil {
			t.Fatal(err)
		}
	}
	if len(taken) == 0 {
		t.Fatal("took no group's delivery off route's consumer")
	}
	b, _ := json.Marshal(wm)
	if _, err := js.Publish(ctx, prefix+"step", b); err != nil {
		t.Fatal(err)
	}

	var out syncBuffer
	cfg.Quiet, cfg.Out = false, &out
	updates := make(chan schemas.Update, 1)
	cfg.OnUpdate = func(u schemas.Update, _ time.Duration) { updates <- u }
	p := started(t, ctx, cfg)
	select {
	case u := <-updates:
		if u.Groups != wm.Groups || len(u.Items) != len(trajs) {
			t.Errorf("step 0 fused with %d groups and %d trajectories; want all %d and %d, %s's taken back:\n%s",
				u.Groups, len(u.Items), wm.Groups, len(trajs), taken[0].GroupID, out.String())
		}
	case <-ctx.Done():
		t.Fatalf("no update of step 0:\n%s", out.String())
	}
	if !strings.Contains(out.String(), "route: step 0's --step-timeout came while it lacks groups, and 1 of route's inputs were delivered and not acknowledged outside this process") {
		t.Errorf("the wait was not said:\n%s", out.String())
	}
	if n := testutil.ToFloat64(p.Metrics().AstraySteps); n != 1 {
		t.Errorf("wmrl_steps_waited_for_astray_total %v, want 1", n)
	}
}
