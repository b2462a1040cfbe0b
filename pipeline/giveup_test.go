package pipeline

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
	"github.com/wmrl/wmrl/stages/pair"
	"github.com/wmrl/wmrl/stages/predict"
	"github.com/wmrl/wmrl/stages/route"
)

// oneBrokenGroup is a policy of groups groups of 4 a step, the ID of step
// 0's first group (the one a test breaks), and a pipeline that waits for
// trajectories from outside.
func oneBrokenGroup(t *testing.T, groups int) (sim.Policy, string, Config) {
	pol := sim.Policy{Run: "default", Tasks: 4, Groups: groups, GroupSize: 4}
	trajs, _ := pol.Step(0)
	cfg := testConfig(t)
	cfg.Source = SourceExternal
	return pol, trajs[0].GroupID, cfg
}

// firstUpdate starts cfg's pipeline, publishes pol's step 0 and returns
// the pipeline, a client of its server and the step's update.
func firstUpdate(t *testing.T, ctx context.Context, cfg Config, pol sim.Policy) (*Pipeline, *nats.Conn, schemas.Update) {
	t.Helper()
	p, nc, js := startClient(t, ctx, cfg)
	publishStep(t, ctx, js, pol, 0)
	var raw [][]byte
	waitFor(t, 60*time.Second, func() bool { raw = scanAll(t, nc, "wmrl.default.update"); return len(raw) == 1 })
	return p, nc, decodeUpdates(t, raw)[0]
}

// downUntilStep2 runs cfg to its end with a service that is down until
// step 2's update, when back brings it back; gauge (wmrl_wm_down or
// wmrl_executor_down) must read 1 then and 0 at the end. It returns the
// run's updates and what the run printed.
func downUntilStep2(t *testing.T, cfg Config, gauge func(*Metrics) prometheus.Gauge, back func(*Pipeline)) (map[int64]schemas.Update, string) {
	t.Helper()
	var p atomic.Pointer[Pipeline]
	var wasDown atomic.Bool
	cfg.OnUpdate = func(u schemas.Update, _ time.Duration) {
		if u.Step == 2 {
			for p.Load() == nil { // Start has not returned yet
				time.Sleep(time.Millisecond)
			}
			wasDown.Store(testutil.ToFloat64(gauge(p.Load().Metrics())) == 1)
			back(p.Load())
			// Hold this update until a probe has found the service back,
			// or for a second: longer than the tests' probe interval
			// (100 ms) and a hung call's timeout (200 ms), so that the
			// next call is a probe. Without the race detector the 9 steps
			// left took 130 ms, and sometimes went by before any probe
			// was due, leaving the service down to the end.
			for deadline := time.Now().Add(time.Second); testutil.ToFloat64(gauge(p.Load().Metrics())) == 1 && time.Now().Before(deadline); {
				time.Sleep(5 * time.Millisecond)
			}
		}
	}
	var out syncBuffer
	cfg.Quiet, cfg.Out = false, &out
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p.Store(started(t, ctx, cfg))
	if err := p.Load().Wait(); err != nil {
		t.Fatal(err)
	}
	if end := testutil.ToFloat64(gauge(p.Load().Metrics())); !wasDown.Load() || end != 0 {
		t.Errorf("down gauge: 1 at step 2 is %v, %v at the end; want 1 then 0", wasDown.Load(), end)
	}
	p.Load().Stop()
	return decodeUpdates(t, readStored(t, cfg.DataDir, "wmrl.default.update")), out.String()
}

// givenUpAtOnce counts stage's dead letters given up at once because
// service is down, naming cause as its last failure.
func givenUpAtOnce(t *testing.T, dataDir, stage, service, cause string) int {
	t.Helper()
	n := 0
	for _, b := range readStored(t, dataDir, "wmrl.default.dlq") {
		var dl schemas.DeadLetter
		json.Unmarshal(b, &dl)
		if dl.Stage == stage && strings.HasPrefix(dl.Reason, "gave up at once: ") &&
			strings.Contains(dl.Reason, service+" is down since") && strings.Contains(dl.Reason, cause) {
			n++
		}
	}
	return n
}

// brokenExecutor fails every trajectory of one group, as a sandbox service
// that is down fails a request, and scores the rest.
type brokenExecutor struct{ group string }

func (e brokenExecutor) Execute(_ context.Context, t schemas.Trajectory) (execute.Result, error) {
	if t.GroupID == e.group {
		return execute.Result{}, errors.New("sandbox service unreachable")
	}
	return execute.Result{Status: schemas.ExecScored, Score: 0.5}, nil
}

// An anchor group whose execution never comes (an outside executor that
// is gone; here, no execute stage at all) leaves its prediction in the
// pair stage with nothing to join. It goes to the dead letters after
// --pair-wait, saying what it waited for, instead of being held (and
// redelivered after every restart) for good; the step is fused at its
// anchor deadline on the world model.
func TestOrphanedAnchorSideIsDeadLetteredAfterPairWait(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	pol, _, cfg := oneBrokenGroup(t, 2)
	cfg.Stages = slices.DeleteFunc(slices.Clone(AllStages), func(s string) bool { return s == StageExecute })
	cfg.Anchors = route.SchedulerConfig{Fraction: 1, MinPerStep: 1}
	cfg.AnchorDeadline = 500 * time.Millisecond
	cfg.PairWait = 2 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, nc, js := startClient(t, ctx, cfg)
	letters := make(chan *nats.Msg, 16)
	sub, err := nc.ChanSubscribe("wmrl.default.dlq", letters)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	publishStep(t, ctx, js, pol, 0)

	orphans := map[string]schemas.DeadLetter{}
	timeout := time.After(60 * time.Second)
	for len(orphans) < 2 {
		select {
		case m := <-letters:
			d, pred := predictionLetter(m)
			if d.Stage != StagePair || d.Subject != "wmrl.default.pred" || !strings.Contains(d.Reason, "no execution within 2s") {
				t.Fatalf("dead letter %+v; want the pair stage's, for a prediction without an execution", d)
			}
			orphans[pred.GroupID] = d
		case <-timeout:
			t.Fatalf("%d dead letters after 60s; want one from pair for each anchor group", len(orphans))
		}
	}

	// Nothing is held any more; the step is fused on the world model.
	waitEmpty(t, ctx, js, StagePair, schemas.KindPred)
	var raw [][]byte
	waitFor(t, 30*time.Second, func() bool { raw = scanAll(t, nc, "wmrl.default.update"); return len(raw) == 1 })
	if u := decodeUpdates(t, raw)[0]; len(u.LateAnchors) != 2 || u.Anchors != 0 {
		t.Errorf("update: late anchors %v, anchors %d; want both groups late", u.LateAnchors, u.Anchors)
	}
	if err := p.Stop(); err != nil {
		t.Fatalf("pipeline: %v", err)
	}
}

// predictionLetter is a dead letter and the prediction it holds.
func predictionLetter(m *nats.Msg) (d schemas.DeadLetter, p schemas.Prediction) {
	json.Unmarshal(m.Data, &d)
	json.Unmarshal([]byte(d.Payload), &p)
	return d, p
}

// A pair process that stopped after storing a group's pairs and
// acknowledging its execution, but before its acknowledgement of the
// prediction reached the server, leaves the prediction to come again to
// the next, alone: its execution will not. It is let go, not held for
// --pair-wait and dead-lettered as "no execution within"; a prediction
// whose pairs were never stored still waits, and is.
func TestAPredictionDeliveredAgainAfterItsPairsIsLetGo(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	pol, _, cfg := oneBrokenGroup(t, 2)
	cfg.Stages = slices.DeleteFunc(slices.Clone(AllStages), func(s string) bool { return s == StagePair })
	cfg.Anchors = route.SchedulerConfig{Fraction: 1, MinPerStep: 1}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	a, nc, js := startClient(t, ctx, cfg)
	publishStep(t, ctx, js, pol, 0)
	waitFor(t, 60*time.Second, func() bool {
		return len(scanAll(t, nc, "wmrl.default.pred")) == 2 && len(scanAll(t, nc, "wmrl.default.execution")) == 2
	})

	// The pair process that stopped: it paired the first group only.
	var gone []*natsjs.Subscriber
	read := func(kind schemas.Kind) <-chan *message.Message {
		sub, err := natsjs.NewSubscriber(natsjs.SubscriberConfig{Conn: nc, ConsumerGroup: consumerName(StagePair, "default", kind),
			Stream: func(string) jetstream.StreamConfig { return StreamConfig(&cfg) }})
		if err != nil {
			t.Fatal(err)
		}
		msgs, err := sub.Subscribe(ctx, "wmrl.default."+string(kind))
		if err != nil {
			t.Fatal(err)
		}
		gone = append(gone, sub)
		return msgs
	}
	preds, execs := read(schemas.KindPred), read(schemas.KindExecution)
	byGroup := map[string]schemas.Prediction{}
	for len(byGroup) < 2 { // a prediction handed back may come again first
		m := <-preds
		var p schemas.Prediction
		if err := json.Unmarshal(m.Payload, &p); err != nil {
			t.Fatal(err)
		}
		byGroup[p.GroupID] = p
		m.Nack()
	}
	groups := slices.Sorted(maps.Keys(byGroup))
	paired, alone := groups[0], groups[1]
	for range 2 {
		m := <-execs
		var e schemas.Execution
		if err := json.Unmarshal(m.Payload, &e); err != nil {
			t.Fatal(err)
		}
		if e.GroupID == paired {
			b, _ := json.Marshal(pair.Pairs(byGroup[paired], e))
			if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: "wmrl.default.pairs", Data: b,
				Header: nats.Header{jetstream.MsgIDHeader: {"default/pairs/0/" + paired}}}); err != nil {
				t.Fatal(err)
			}
		}
		m.Ack()
	}
	for _, sub := range gone {
		sub.Close()
	}

	letters := make(chan *nats.Msg, 16)
	sub, err := nc.ChanSubscribe("wmrl.default.dlq", letters)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	next := testConfig(t)
	next.NATSURL, next.Source, next.Stages, next.PairWait = a.URL(), SourceExternal, []string{StagePair}, 3*time.Second
	p := started(t, ctx, next)

	select {
	case m := <-letters:
		d, p := predictionLetter(m)
		if d.Stage != StagePair || p.GroupID != alone || !strings.Contains(d.Reason, "no execution within 3s") {
			t.Fatalf("dead letter of %s: %+v; want only %s's prediction, for want of its execution", p.GroupID, d, alone)
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("no dead letter after 60s; want %s's prediction, never paired, after --pair-wait", alone)
	}
	waitEmpty(t, ctx, js, StagePair, schemas.KindPred)
	nc.Flush()
	select {
	case m := <-letters:
		t.Errorf("a second dead letter: %s; want none for %s, whose pairs were stored", m.Data, paired)
	default:
	}
	if n := len(scanAll(t, nc, "wmrl.default.pairs")); n != 1 {
		t.Errorf("%d pair groups stored; want the one the stopped process stored", n)
	}
	let := p.Metrics().PairSidesLetGo
	if pred, exec := testutil.ToFloat64(let.WithLabelValues("prediction")), testutil.ToFloat64(let.WithLabelValues("execution")); pred != 1 || exec != 0 {
		t.Errorf("wmrl_pair_sides_let_go_total: prediction %v, execution %v; want 1 (%s's), 0", pred, exec, paired)
	}
}

// An anchor group whose executor fails on every attempt is published with
// its trajectories ungraded and dead-lettered, and its step is fused at
// once on the world model for that group (a failed anchor), not held for
// its anchor deadline (an hour here); the other anchor group is used.
func TestStepIsFusedAtOnceWhenAnAnchorGroupFails(t *testing.T) {
	pol, broken, cfg := oneBrokenGroup(t, 2)
	cfg.Anchors = route.SchedulerConfig{Fraction: 1, MinPerStep: 1}
	cfg.ExecutorImpl = brokenExecutor{group: broken}
	cfg.MaxAttempts = 2
	cfg.AnchorDeadline = time.Hour
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, nc, u := firstUpdate(t, ctx, cfg, pol)
	if len(u.FailedAnchors) != 1 || u.FailedAnchors[0] != broken || len(u.LateAnchors) != 0 || u.Anchors != 1 || u.Groups != 2 {
		t.Fatalf("update: failed anchors %v, late %v, anchors %d, groups %d; want %s failed, the other an anchor",
			u.FailedAnchors, u.LateAnchors, u.Anchors, u.Groups, broken)
	}
	for _, it := range u.Items {
		if it.GroupID == broken && (it.Source != "world_model" || it.Reward == nil || it.ExecStatus != schemas.ExecSandboxError) {
			t.Errorf("item %s of the failed group: %+v; want a world-model reward and its sandbox error", it.TrajID, it)
		}
	}
	var letters [][]byte
	waitFor(t, 30*time.Second, func() bool { letters = scanAll(t, nc, "wmrl.default.dlq"); return len(letters) > 0 })
	for _, b := range letters {
		var dl schemas.DeadLetter
		json.Unmarshal(b, &dl)
		if dl.Stage != StageExecute || !strings.Contains(dl.Reason, "sandbox service unreachable") {
			t.Errorf("dead letter %+v; want only execute's, for the broken group", dl)
		}
	}
	checkFusion(t, u)
	if err := p.Stop(); err != nil {
		t.Fatalf("pipeline: %v", err)
	}
}

// brokenWorldModel fails on every call for one group, as a world-model
// server that is down for longer than the retries last.
type brokenWorldModel struct{ group string }

func (w brokenWorldModel) Name() string { return "sim" }

func (w brokenWorldModel) Predict(ctx context.Context, trajs []schemas.Trajectory) ([]predict.Score, error) {
	if trajs[0].GroupID == w.group {
		return nil, errors.New("connection refused")
	}
	return sim.DefaultWorldModel().Predict(ctx, trajs)
}

// A group the world model fails on at every attempt is dead-lettered and
// recorded as ungraded, so that its step is still fused (without that
// group's world-model signal) instead of waiting for good for a prediction.
func TestStepIsFusedWhenTheWorldModelGivesUpOnAGroup(t *testing.T) {
	pol, broken, cfg := oneBrokenGroup(t, 3)
	cfg.WorldModelImpl = brokenWorldModel{group: broken}
	cfg.MaxAttempts = 2
	var out syncBuffer
	cfg.Out, cfg.Quiet = &out, false
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, nc, u := firstUpdate(t, ctx, cfg, pol)
	n := 0
	for _, it := range u.Items {
		if it.GroupID != broken {
			continue
		}
		n++
		if it.WMStatus != schemas.PredUngraded || it.Predicted != nil || (it.Source != "anchor" && it.Reward != nil) {
			t.Errorf("item %s of the failed group: %+v; want ungraded, no prediction, no world-model reward", it.TrajID, it)
		}
	}
	if n != 4 {
		t.Errorf("%d items of group %s in the update, want 4", n, broken)
	}
	var pred schemas.Prediction
	for _, b := range scanAll(t, nc, "wmrl.default.pred") {
		if json.Unmarshal(b, &pred); pred.GroupID == broken {
			break
		}
	}
	if pred.GroupID != broken || !strings.Contains(pred.Items[0].Reason, "world model failed on every attempt") || !strings.Contains(pred.Items[0].Reason, "connection refused") {
		t.Errorf("prediction of the failed group: %+v", pred)
	}
	var dl schemas.DeadLetter
	waitFor(t, 30*time.Second, func() bool {
		for _, b := range scanAll(t, nc, "wmrl.default.dlq") {
			json.Unmarshal(b, &dl)
		}
		return dl.Stage == StagePredict
	})
	if !strings.Contains(dl.Reason, "gave up after 2 deliveries") || !strings.Contains(dl.Reason, "recorded the group as ungraded") {
		t.Errorf("dead letter: %q", dl.Reason)
	}
	// The run's output says what happened, once each.
	for _, want := range []string{
		"predict: world model on group " + broken + ": connection refused (delivery 1 of 2; retrying)",
		"predict: dead-lettered to wmrl.default.dlq: gave up after 2 deliveries",
	} {
		if strings.Count(out.String(), want) != 1 {
			t.Errorf("output has %q %d times, want once:\n%s", want, strings.Count(out.String(), want), out.String())
		}
	}
	if err := p.Stop(); err != nil {
		t.Fatalf("pipeline: %v", err)
	}
}

// switchedExecutor fails every execution while down, as a sandbox service
// that is unreachable, and scores 0.5 otherwise.
type switchedExecutor struct{ down atomic.Bool }

func (e *switchedExecutor) Execute(context.Context, schemas.Trajectory) (execute.Result, error) {
	if e.down.Load() {
		return execute.Result{}, errors.New("sandbox service unreachable")
	}
	return execute.Result{Status: schemas.ExecScored, Score: 0.5}, nil
}

// An executor that goes down is given up at once after --exec-down-after
// executions in a row failed: anchor groups are published with their
// executions ungraded and their steps fused on the world model at once,
// instead of each group waiting out its retries (and, with an anchor
// deadline set for real executions, an hour here, its step waiting for
// it). Once the executor is back, a probe finds it and anchors return.
func TestPipelineGivesUpOnADownExecutorUntilItIsBack(t *testing.T) {
	exe := &switchedExecutor{}
	exe.down.Store(true)
	cfg := testConfig(t)
	cfg.Steps = 20
	cfg.ExecutorImpl = exe
	cfg.ExecDownAfter, cfg.ExecProbeEvery = 3, 100*time.Millisecond
	cfg.AnchorDeadline = time.Hour
	ups, out := downUntilStep2(t, cfg, func(m *Metrics) prometheus.Gauge { return m.ExecutorDown }, func(*Pipeline) { exe.down.Store(false) })
	allFailed := 0
	for _, u := range ups {
		if len(u.FailedAnchors) == 2 && u.Anchors == 0 && len(u.LateAnchors) == 0 {
			allFailed++
		}
	}
	if len(ups) != 20 || allFailed == 0 {
		t.Fatalf("%d updates, %d of them with both anchor groups failed; want 20, some", len(ups), allFailed)
	}
	if u := ups[19]; u.Anchors != 2 || len(u.FailedAnchors) != 0 {
		t.Fatalf("step 19: %d anchors, failed %v; want both anchors used once the executor is back", u.Anchors, u.FailedAnchors)
	}
	atOnce := givenUpAtOnce(t, cfg.DataDir, StageExecute, "the executor", "sandbox service unreachable")
	if atOnce == 0 {
		t.Error("no anchor group given up at once in the dead letters")
	}
	for _, want := range []string{"execute: the executor is down: 3 calls in a row failed", "execute: the executor is back after "} {
		if strings.Count(out, want) != 1 {
			t.Errorf("output has %q %d times, want once:\n%s", want, strings.Count(out, want), out)
		}
	}
	t.Logf("%d steps with both anchor groups failed, %d groups given up at once", allFailed, atOnce)
}

// A run of a fixed number of steps whose late anchor groups' pairs are in
// the dead letters (here pair gave up on executions that never came) ends
// once every step is fused and archived, naming those groups, instead of
// waiting for their pairs, in silence, until stopped (it waited out its
// 20 s context before).
func TestARunOfStepsEndsWhenItsLateGroupsPairsAreDeadLettered(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	cfg := testConfig(t)
	cfg.Steps = 2
	cfg.Stages = slices.DeleteFunc(slices.Clone(AllStages), func(s string) bool { return s == StageExecute })
	cfg.Anchors = route.SchedulerConfig{Fraction: 0.25, MinPerStep: 1}
	cfg.AnchorDeadline = 500 * time.Millisecond
	cfg.PairWait = 2 * time.Second
	var out syncBuffer
	cfg.Out, cfg.Quiet = &out, false
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := Run(ctx, cfg); err != nil || ctx.Err() != nil {
		t.Fatalf("run: %v, its context %v; want it ended by itself\n%s", err, ctx.Err(), out.String())
	}
	var late []string
	for _, u := range decodeUpdates(t, readStored(t, cfg.DataDir, "wmrl.default.update")) {
		for _, g := range u.LateAnchors {
			late = append(late, fmt.Sprintf("%s of step %d", g, u.Step))
		}
	}
	slices.Sort(late)
	if len(late) < 4 {
		t.Fatalf("late anchor groups %v; want 4 or more", late)
	}
	want := fmt.Sprintf("not archived: the pairs of late anchor groups %s, %s, %s and %d more, whose messages were dead-lettered (the first, pair's: pair: unusable message: anchor group ",
		late[0], late[1], late[2], len(late)-3)
	if !strings.Contains(out.String(), "done: steps 0-1 fused and archived") || !strings.Contains(out.String(), want) {
		t.Fatalf("the run did not end saying %q:\n%s", want, out.String())
	}
}

// Which dead letters hold up an anchor group's pairs: those of the stages
// from pairing on, and of outside stages, whose message names a step and
// a group; route's and predict's hold up the step itself, and execute
// sends a group it gives up on ungraded.
func TestWhichDeadLettersHoldUpAGroupsPairs(t *testing.T) {
	named := `{"schema":1,"run":"default","step":7,"group_id":"g3","items":[]}`
	for _, c := range []struct {
		stage, payload string
		held           bool
	}{
		{StagePair, named, true},
		{StageCalibrate, named, true},
		{StageFuse, named, true},
		{StageArchive, named, true},
		{"length-penalty", named, true},
		{StageRoute, named, false},
		{StagePredict, named, false},
		{StageExecute, named, false},
		{StagePair, named[:40], false},                                   // cut to fit the server: no group to name
		{StagePair, `{"schema":1,"group_id":"g3"}`, false},               // no step
		{StageCalibrate, `{"schema":1,"run":"default","step":7}`, false}, // no group
	} {
		step, group, held := noPairsFor(schemas.DeadLetter{Stage: c.stage, Payload: c.payload})
		if held != c.held || held && (step != 7 || group != "g3") {
			t.Errorf("%s's letter of %s: holds %v (step %d, group %q); want %v", c.stage, c.payload, held, step, group, c.held)
		}
	}
}
