package pipeline

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
	"github.com/wmrl/wmrl/stages/stagetest"
)

// countingExecutor counts the runs of each trajectory and fails the ones
// in fail.
type countingExecutor struct {
	mu   sync.Mutex
	runs map[string]int
	fail map[string]bool
}

func (e *countingExecutor) Execute(_ context.Context, t schemas.Trajectory) (execute.Result, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.runs[t.TrajID]++
	if e.fail[t.TrajID] {
		return execute.Result{}, errors.New("sandbox node lost")
	}
	return execute.Result{Status: schemas.ExecScored, Score: 0.5, Seconds: 60}, nil
}

// An anchor group whose execution a process left unfinished (one
// trajectory's executor failed, then the process was gone) is finished by a
// fresh process of the stage, which finds the outcomes already paid for in
// the bucket and runs only the one that has none. The bucket ages outcomes
// out with the stream's retention.
func TestExecutionsOutliveTheExecuteProcess(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, closeIt := openStopped(t, ctx, t.TempDir())
	defer closeIt()
	cfg := testConfig(t)
	cfg.MaxAge = 3 * time.Hour
	store, err := openOutcomes(ctx, js, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	g := schemas.Group{Schema: schemas.Version, Run: cfg.Run, Step: 4, GroupID: "g/7 ü", TaskID: "t", Anchor: true}
	for _, id := range []string{"a", "b", "c", "d"} {
		g.Trajectories = append(g.Trajectories, schemas.Trajectory{TrajID: id, GroupID: g.GroupID})
	}
	exe := &countingExecutor{runs: map[string]int{}, fail: map[string]bool{"c": true}}

	first := execute.NewHandler(cfg.Run, "execution", &stagetest.Recorder{}, exe, 4)
	first.Store = store
	if err := first.Handle(stagetest.Message(t, ctx, g)); err == nil {
		t.Fatal("the first process's executor failed on c, and the group was not handed back")
	}
	exe.fail["c"] = false
	pub := &stagetest.Recorder{}
	second := execute.NewHandler(cfg.Run, "execution", pub, exe, 4) // a fresh process: nothing in memory
	var mu sync.Mutex
	var storeErrs []error
	second.Store, second.OnStoreError = store, func(err error) { mu.Lock(); storeErrs = append(storeErrs, err); mu.Unlock() }
	if err := second.Handle(stagetest.Message(t, ctx, g)); err != nil || pub.Count() != 1 {
		t.Fatalf("the second process: %v, %d executions published", err, pub.Count())
	}
	for id, n := range exe.runs {
		if want := map[bool]int{true: 2, false: 1}[id == "c"]; n != want {
			t.Errorf("%s executed %d times, want %d", id, n, want)
		}
	}
	var e schemas.Execution
	pub.Decode(t, 0, &e)
	for _, it := range e.Items {
		if it.Score == nil || *it.Score != 0.5 || it.Seconds != 60 {
			t.Errorf("published %+v; want every outcome as executed", it)
		}
	}
	if len(storeErrs) > 0 {
		t.Errorf("store errors: %v", storeErrs)
	}
	// Another run's store shares nothing.
	if _, ok, err := (outcomeStore{st: store.st, run: "other"}).Load(ctx, "4/g/7 ü/a"); ok || err != nil {
		t.Errorf("run other sees run %s's outcome (%v)", cfg.Run, err)
	}
	kv, err := js.KeyValue(ctx, OutcomeBucket(cfg.Prefix))
	if err != nil {
		t.Fatal(err)
	}
	st, err := kv.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.TTL() != cfg.MaxAge || st.Values() != 4 {
		t.Errorf("bucket TTL %v with %d values; want the retention %v and 4", st.TTL(), st.Values(), cfg.MaxAge)
	}
}

// The pipeline's execute stage keeps every anchor trajectory's outcome in
// the bucket.
func TestPipelineStoresEveryExecution(t *testing.T) {
	cfg, ctx := runToEnd(t, 4)
	anchors := 0
	for _, u := range decodeUpdates(t, readStored(t, cfg.DataDir, "wmrl.default.update")) {
		for _, it := range u.Items {
			if it.ExecStatus != "" {
				anchors++
			}
		}
	}
	js, closeIt := openStopped(t, ctx, cfg.DataDir) // after readStored: one server on a store at a time
	defer closeIt()
	kv, err := js.KeyValue(ctx, OutcomeBucket(cfg.Prefix))
	if err != nil {
		t.Fatal(err)
	}
	keys, err := kv.ListKeys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for range keys.Keys() {
		n++
	}
	if anchors == 0 || n != anchors {
		t.Fatalf("%d outcomes in the bucket for %d executed anchor trajectories", n, anchors)
	}
}

// A server where the outcome bucket cannot be made (here a stream of its
// name with another retention policy is in the way) costs the outcomes'
// durability, said once at start, not the run.
func TestExecuteRunsWithoutTheOutcomeBucket(t *testing.T) {
	cfg := testConfig(t)
	cfg.Steps = 3
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, closeIt := openStopped(t, ctx, cfg.DataDir) // the pipeline's own store, before it starts
	bucket := OutcomeBucket(cfg.Prefix)
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "KV_" + bucket, Subjects: []string{"$KV." + bucket + ".>"},
		Retention: jetstream.WorkQueuePolicy})
	closeIt()
	if err != nil {
		t.Fatal(err)
	}
	// The stop hands back what it held (connectors/natsjs
	// TestHandedBackMessagesOutliveTheServer), so the group comes back at
	// once, or, rarely, after AckWait (30 s) for a message that was on its
	// way to the stopping process (README, Known limits).
	var out syncBuffer
	cfg.Quiet, cfg.Out = false, &out
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "running without it: outcomes are kept in this process only") {
		t.Errorf("no word of the missing bucket:\n%s", out.String())
	}
	if ups := decodeUpdates(t, readStored(t, cfg.DataDir, "wmrl.default.update")); len(ups) != 3 {
		t.Errorf("%d updates, want 3", len(ups))
	}
}

// stallingExecutor executes with the simulated executor, counts what it
// finished by trajectory, and from its stallAt-th call on hangs until its
// context ends, having said so on stalled.
type stallingExecutor struct {
	inner    execute.Executor
	stallAt  int
	stalled  chan struct{}
	mu       sync.Mutex
	calls    int
	finished map[string]int
}

func (e *stallingExecutor) Execute(ctx context.Context, t schemas.Trajectory) (execute.Result, error) {
	e.mu.Lock()
	e.calls++
	stall := e.stallAt > 0 && e.calls >= e.stallAt
	if stall && e.calls == e.stallAt {
		close(e.stalled)
	}
	e.mu.Unlock()
	if stall {
		<-ctx.Done()
		return execute.Result{}, ctx.Err()
	}
	r, err := e.inner.Execute(ctx, t)
	if err == nil {
		e.mu.Lock()
		e.finished[t.TrajID]++
		e.mu.Unlock()
	}
	return r, err
}

// A pipeline stopped while an anchor group is half executed, and started
// again on its data, runs only the half that had not finished: the rest
// comes from the outcome bucket, on the restarted server.
func TestRestartRunsOnlyTheUnfinishedExecutions(t *testing.T) {
	cfg := testConfig(t)
	cfg.Steps, cfg.Groups, cfg.GroupSize, cfg.ExecSlots = 1, 4, 4, 1
	cfg.Anchors.Fraction = 0.25 // one anchor group of 4, executed one at a time
	first := &stallingExecutor{inner: &sim.Executor{Noise: 0.02}, stallAt: 3, stalled: make(chan struct{}), finished: map[string]int{}}
	cfg.ExecutorImpl = first
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-first.stalled:
	case <-ctx.Done():
		t.Fatal("the anchor group's third execution never started")
	}
	if err := p.Stop(); err != nil {
		t.Fatal(err)
	}
	if len(first.finished) != 2 {
		t.Fatalf("finished before the stop: %v, want 2 trajectories", first.finished)
	}

	again := &stallingExecutor{inner: &sim.Executor{Noise: 0.02}, finished: map[string]int{}}
	cfg.ExecutorImpl = again
	// The stop hands back what it held (connectors/natsjs
	// TestHandedBackMessagesOutliveTheServer), so the group comes back at
	// once, or, rarely, after AckWait (30 s) for a message that was on its
	// way to the stopping process (README, Known limits).
	var out syncBuffer
	cfg.Quiet, cfg.Out = false, &out
	defer func() {
		if t.Failed() {
			t.Logf("the restarted run said:\n%s", out.String())
		}
	}()
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if len(again.finished) != 2 {
		t.Errorf("after the restart executed %v; want only the 2 not finished before it", again.finished)
	}
	for id := range again.finished {
		if first.finished[id] > 0 {
			t.Errorf("%s was executed again after the restart", id)
		}
	}
	ups := decodeUpdates(t, readStored(t, cfg.DataDir, "wmrl.default.update"))
	scored := 0
	for _, it := range ups[0].Items {
		if it.Source == "anchor" && it.Reward != nil {
			scored++
		}
	}
	if scored != 4 {
		t.Errorf("step 0 has %d anchor rewards, want 4", scored)
	}
}
