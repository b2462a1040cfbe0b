package execute

import (
	"context"
	"errors"
	"maps"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/breaker"
	"github.com/wmrl/wmrl/stages/stagetest"
)

// flakyExecutor fails one trajectory on its first run and counts the runs
// of each.
type flakyExecutor struct {
	mu    sync.Mutex
	runs  map[string]int
	flaky string
}

func (e *flakyExecutor) Execute(_ context.Context, t schemas.Trajectory) (Result, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.runs[t.TrajID]++
	if t.TrajID == e.flaky && e.runs[t.TrajID] == 1 {
		return Result{}, errors.New("sandbox pool busy")
	}
	return Result{Status: schemas.ExecScored, Score: 0.25 * float64(len(t.TrajID)), Seconds: 1}, nil
}

// anchorGroup is step 1's anchor group "g" of trajectories ids.
func anchorGroup(ids ...string) schemas.Group {
	g := schemas.Group{Schema: schemas.Version, Run: "r", Step: 1, GroupID: "g", TaskID: "t", Anchor: true}
	for _, id := range ids {
		g.Trajectories = append(g.Trajectories, schemas.Trajectory{TrajID: id, GroupID: "g"})
	}
	return g
}

// A group redelivered because one trajectory's executor failed runs that
// one again and reuses the others' outcomes.
func TestRedeliveryRunsOnlyWhatHasNoOutcome(t *testing.T) {
	g := anchorGroup("a", "bb", "ccc", "dddd")
	exe := &flakyExecutor{runs: map[string]int{}, flaky: "ccc"}
	pub := &stagetest.Recorder{}
	h := NewHandler("r", "execution", pub, exe, 2)

	if err := h.Handle(stagetest.Message(t, context.Background(), g)); err == nil || pub.Count() != 0 {
		t.Fatalf("first delivery: %v, %d published; want the executor's error and nothing", err, pub.Count())
	}
	if err := h.Handle(stagetest.Message(t, context.Background(), g)); err != nil || pub.Count() != 1 {
		t.Fatalf("redelivery: %v, %d published", err, pub.Count())
	}
	for id, n := range exe.runs {
		if want := map[bool]int{true: 2, false: 1}[id == "ccc"]; n != want {
			t.Errorf("%s executed %d times, want %d", id, n, want)
		}
	}
	var e schemas.Execution
	pub.Decode(t, 0, &e)
	for i, it := range e.Items {
		if id := g.Trajectories[i].TrajID; it.TrajID != id || it.Score == nil || *it.Score != 0.25*float64(len(id)) {
			t.Errorf("item %d: %+v, want %s scored %v", i, it, id, 0.25*float64(len(id)))
		}
	}
}

// sandboxThenScore answers "s" with a sandbox error (no score) on its
// first run, fails "e" with an executor error on its first run, and scores
// everything else; it counts the runs.
type sandboxThenScore struct {
	mu   sync.Mutex
	runs map[string]int
}

func (x *sandboxThenScore) Execute(_ context.Context, t schemas.Trajectory) (Result, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.runs[t.TrajID]++
	switch {
	case t.TrajID == "s" && x.runs["s"] == 1:
		return Result{Status: schemas.ExecSandboxError, Detail: "container evicted"}, nil
	case t.TrajID == "e" && x.runs["e"] == 1:
		return Result{}, errors.New("sandbox pool busy")
	}
	return Result{Status: schemas.ExecScored, Score: 0.5}, nil
}

// A sandbox error is not an outcome worth keeping: a redelivered group runs
// that trajectory again, and may get a score for it.
func TestSandboxErrorsAreRunAgain(t *testing.T) {
	exe := &sandboxThenScore{runs: map[string]int{}}
	pub := &stagetest.Recorder{}
	h := NewHandler("r", "execution", pub, exe, 3)
	g := anchorGroup("s", "e", "ok")
	if err := h.Handle(stagetest.Message(t, context.Background(), g)); err == nil {
		t.Fatal("e's executor error did not hand the group back")
	}
	if err := h.Handle(stagetest.Message(t, context.Background(), g)); err != nil {
		t.Fatal(err)
	}
	if want := map[string]int{"s": 2, "e": 2, "ok": 1}; !maps.Equal(exe.runs, want) {
		t.Errorf("runs %v, want %v", exe.runs, want)
	}
	var e schemas.Execution
	pub.Decode(t, 0, &e)
	for _, it := range e.Items {
		if it.Score == nil {
			t.Errorf("%s published without a score: %+v", it.TrajID, it)
		}
	}
}

// A sandbox error is kept in the store, as how the execution ended (a
// late anchor group's archive rows read it back), but never taken as an
// outcome: the group, redelivered to another process, runs it again, and
// the score replaces it.
func TestASandboxErrorIsKeptButRunAgain(t *testing.T) {
	ctx := context.Background()
	store := &memStore{m: map[string]schemas.ExecItem{}}
	exe := &sandboxThenScore{runs: map[string]int{}}
	g := anchorGroup("s", "e", "ok")
	first := NewHandler("r", "execution", &stagetest.Recorder{}, exe, 3)
	first.Store = store
	if err := first.Handle(stagetest.Message(t, ctx, g)); err == nil {
		t.Fatal("e's executor error did not hand the group back")
	}
	kept, ok, _ := store.Load(ctx, OutcomeKey(1, "g", "s"))
	if !ok || kept.Score != nil || kept.Status != schemas.ExecSandboxError || kept.Detail != "container evicted" {
		t.Fatalf("kept for s: %+v (%v); want its sandbox error", kept, ok)
	}
	if _, ok, _ := store.Load(ctx, OutcomeKey(1, "g", "e")); ok {
		t.Error("e's executor error was kept: it is no execution")
	}
	second := NewHandler("r", "execution", &stagetest.Recorder{}, exe, 3)
	second.Store = store
	if err := second.Handle(stagetest.Message(t, ctx, g)); err != nil {
		t.Fatal(err)
	}
	if want := map[string]int{"s": 2, "e": 2, "ok": 1}; !maps.Equal(exe.runs, want) {
		t.Errorf("runs %v, want %v", exe.runs, want)
	}
	if kept, _, _ = store.Load(ctx, OutcomeKey(1, "g", "s")); kept.Score == nil || kept.Status != schemas.ExecScored {
		t.Errorf("kept for s after its rerun: %+v; want the score", kept)
	}
}

// brokenFor fails the trajectories it names on every run.
type brokenFor map[string]bool

func (b brokenFor) Execute(_ context.Context, t schemas.Trajectory) (Result, error) {
	if b[t.TrajID] {
		return Result{}, errors.New("executor protocol error")
	}
	return Result{Status: schemas.ExecScored, Score: 0.5}, nil
}

// On the last attempt a group is published with the failing trajectories
// ungraded, and the error still returned for the dead letters, however few
// were scored: its step need not wait for the anchor deadline.
func TestLastAttemptPublishesWhatWasExecuted(t *testing.T) {
	g := anchorGroup("a", "b", "c")
	last := false
	for _, broken := range []brokenFor{{"b": true}, {"a": true, "c": true}, {"a": true, "b": true, "c": true}} {
		pub := &stagetest.Recorder{}
		h := NewHandler("r", "execution", pub, broken, 2)
		h.LastAttempt = func(*message.Message) bool { return last }
		store := &memStore{m: map[string]schemas.ExecItem{}}
		h.Store = store
		last = false
		if err := h.Handle(stagetest.Message(t, context.Background(), g)); err == nil || pub.Count() != 0 {
			t.Fatalf("%v, not the last attempt: %v, %d published", broken, err, pub.Count())
		}
		last = true
		err := h.Handle(stagetest.Message(t, context.Background(), g))
		if err == nil || pub.Count() != 1 {
			t.Fatalf("%v, last attempt: %v, %d published; want an error and the group published", broken, err, pub.Count())
		}
		var e schemas.Execution
		pub.Decode(t, 0, &e)
		for _, it := range e.Items {
			if broken[it.TrajID] != (it.Score == nil) || (it.Score == nil && (it.Status != schemas.ExecSandboxError || it.Detail == "")) {
				t.Errorf("%v: item %+v", broken, it)
			}
			// How each ended is kept, the given-up ones too.
			if kept, ok, _ := store.Load(context.Background(), OutcomeKey(1, "g", it.TrajID)); !ok || !reflect.DeepEqual(kept, it) {
				t.Errorf("%v: kept for %s: %+v (%v); want %+v", broken, it.TrajID, kept, ok, it)
			}
		}
	}
}

// failingStore refuses every read and write.
type failingStore struct{}

func (failingStore) Load(context.Context, string) (schemas.ExecItem, bool, error) {
	return schemas.ExecItem{}, false, errors.New("bucket unreachable")
}

func (failingStore) Save(context.Context, string, schemas.ExecItem) error {
	return errors.New("bucket unreachable")
}

// A store that fails costs nothing but its own use: every trajectory is
// executed and published, and each failure is reported.
func TestAFailingStoreIsReportedNotFatal(t *testing.T) {
	exe := &flakyExecutor{runs: map[string]int{}}
	pub := &stagetest.Recorder{}
	h := NewHandler("r", "execution", pub, exe, 2)
	var mu sync.Mutex
	var reported []string
	h.Store, h.OnStoreError = failingStore{}, func(err error) { mu.Lock(); reported = append(reported, err.Error()); mu.Unlock() }
	if err := h.Handle(stagetest.Message(t, context.Background(), anchorGroup("a", "b"))); err != nil || pub.Count() != 1 {
		t.Fatalf("%v, %d published", err, pub.Count())
	}
	reads, writes := 0, 0
	for _, r := range reported {
		switch {
		case strings.HasPrefix(r, "execute: reading the outcome of 1/g/"):
			reads++
		case strings.HasPrefix(r, "execute: storing the outcome of 1/g/"):
			writes++
		}
	}
	if reads != 2 || writes != 2 {
		t.Errorf("reported %q; want a read and a write failure for each of 2 trajectories", reported)
	}
}

// switchedExecutor fails while down and counts its runs.
type switchedExecutor struct {
	down atomic.Bool
	runs atomic.Int32
	hold chan struct{} // if set, an execution waits until it is closed
}

func (e *switchedExecutor) Execute(context.Context, schemas.Trajectory) (Result, error) {
	e.runs.Add(1)
	if e.hold != nil {
		<-e.hold
	}
	if e.down.Load() {
		return Result{}, errors.New("sandbox service unreachable")
	}
	return Result{Status: schemas.ExecScored, Score: 0.5}, nil
}

// holdUntil holds e's executions until cond holds (or 10 s have passed),
// so that a test orders them against the breaker's calls.
func (e *switchedExecutor) holdUntil(cond func() bool) {
	hold := make(chan struct{})
	e.hold = hold
	go func() {
		defer close(hold)
		for deadline := time.Now().Add(10 * time.Second); !cond() && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
	}()
}

// Once executions have failed After times in a row the group is published
// at once with them ungraded (its step uses the world model for it) and
// given up with schemas.ErrDown, not retried; later groups are not run at
// all until a probe finds the executor back.
func TestExecutorDownGivesGroupsUpAtOnce(t *testing.T) {
	now := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)
	exe := &switchedExecutor{}
	exe.down.Store(true)
	pub := &stagetest.Recorder{}
	h := NewHandler("r", "execution", pub, exe, 4)
	h.Breaker = &breaker.Breaker{Name: "the executor", After: 2, Probe: time.Minute, Now: func() time.Time { return now }}
	handle := func(ids ...string) (schemas.Execution, error) {
		t.Helper()
		n := pub.Count()
		err := h.Handle(stagetest.Message(t, context.Background(), anchorGroup(ids...)))
		var e schemas.Execution
		if pub.Count() == n+1 {
			pub.Decode(t, n, &e)
		} else if pub.Count() != n {
			t.Fatalf("%d published for one group", pub.Count()-n)
		}
		return e, err
	}

	// All three are let through before the first fails.
	exe.holdUntil(func() bool { return exe.runs.Load() == 3 })
	e, err := handle("a", "b", "c")
	exe.hold = nil
	if !errors.Is(err, schemas.ErrDown) || len(e.Items) != 3 || exe.runs.Load() != 3 {
		t.Fatalf("the group that opened it: %v, published %+v, %d runs; want ErrDown and all three published", err, e, exe.runs.Load())
	}
	for _, it := range e.Items {
		if it.Score != nil || it.Status != schemas.ExecSandboxError || !strings.Contains(it.Detail, "sandbox service unreachable") {
			t.Fatalf("item %+v: want a sandbox error naming the executor's failure", it)
		}
	}
	e, err = handle("d", "e")
	if !errors.Is(err, schemas.ErrDown) || len(e.Items) != 2 || exe.runs.Load() != 3 ||
		!strings.HasPrefix(e.Items[0].Detail, "not run: the executor is down since 2026-12-03T10:00:00Z") {
		t.Fatalf("while down: %v, published %+v, %d runs; want ErrDown, both published as not run, none run", err, e, exe.runs.Load())
	}

	now = now.Add(time.Minute)
	exe.down.Store(false)
	// f probes, and its execution waits until g has been refused: the
	// probe is out while g asks.
	refusedBefore := h.Breaker.State().Refused
	exe.holdUntil(func() bool { return h.Breaker.State().Refused > refusedBefore })
	e, err = handle("f", "g")
	exe.hold = nil
	if !errors.Is(err, schemas.ErrDown) || exe.runs.Load() != 4 || e.Items[0].Score == nil || e.Items[1].Score != nil {
		t.Fatalf("probe: %v, published %+v, %d runs; want f scored and g not run", err, e, exe.runs.Load())
	}
	e, err = handle("h", "i")
	if err != nil || exe.runs.Load() != 6 || e.Items[0].Score == nil || e.Items[1].Score == nil {
		t.Fatalf("back: %v, published %+v, %d runs; want both run and scored", err, e, exe.runs.Load())
	}
}

// byResponse scores a trajectory by its response, counting the runs of
// each response; "fails once" makes the executor fail on its first run.
type byResponse struct {
	mu   sync.Mutex
	runs map[string]int
}

func (x *byResponse) Execute(_ context.Context, t schemas.Trajectory) (Result, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.runs[t.Response]++
	if t.Response == "fails once" && x.runs[t.Response] == 1 {
		return Result{}, errors.New("sandbox pool busy")
	}
	return Result{Status: schemas.ExecScored, Score: float64(len(t.Response)) / 100, Seconds: 3, Detail: "ran " + t.Response}, nil
}

// With CopiesOnce a group's copies of a solution (prompt and response) run
// once: each copy takes that outcome, names the trajectory it shares, and
// counts no seconds; a solution that differs only in its prompt runs. A
// copy of a solution whose executor failed is handed back with it, and
// the redelivery runs it once. Without CopiesOnce every copy runs.
func TestCopiesOfASolutionAreExecutedOnce(t *testing.T) {
	g := anchorGroup("a", "b", "c", "d", "e", "f")
	for i, r := range []string{"print(1)", "print(1)", "print(1)", "print(1)", "fails once", "fails once"} {
		g.Trajectories[i].Prompt, g.Trajectories[i].Response = "p", r
	}
	g.Trajectories[2].Prompt = "q" // c: the same response to another prompt

	exe := &byResponse{runs: map[string]int{}}
	pub := &stagetest.Recorder{}
	h := NewHandler("r", "execution", pub, exe, 4)
	var shared []string
	h.CopiesOnce, h.Shared = true, func(it schemas.ExecItem) { shared = append(shared, it.TrajID) }
	if err := h.Handle(stagetest.Message(t, context.Background(), g)); err == nil || !strings.Contains(err.Error(), "sandbox pool busy") {
		t.Fatalf("first delivery: %v; want the executor's error", err)
	}
	if err := h.Handle(stagetest.Message(t, context.Background(), g)); err != nil {
		t.Fatal(err)
	}
	// a and c ran print(1) (another prompt), d shared a's; e ran twice
	// (failed, then scored), f shared e's.
	if want := map[string]int{"print(1)": 2, "fails once": 2}; !maps.Equal(exe.runs, want) {
		t.Errorf("runs by response %v, want %v", exe.runs, want)
	}
	var e schemas.Execution
	pub.Decode(t, 0, &e)
	want := map[string]string{"b": "a", "d": "a", "f": "e"}
	for i, it := range e.Items {
		id := g.Trajectories[i].TrajID
		wantScore := float64(len(g.Trajectories[i].Response)) / 100
		if it.TrajID != id || it.Score == nil || *it.Score != wantScore || it.CopyOf != want[id] || it.Detail != "ran "+g.Trajectories[i].Response {
			t.Errorf("item %d: %+v, want %s scored %v, a copy of %q", i, it, id, wantScore, want[id])
		}
		if (it.CopyOf != "") != (it.Seconds == 0) {
			t.Errorf("%s: %v seconds as a copy of %q", id, it.Seconds, it.CopyOf)
		}
	}
	// b and d shared on the first delivery, and were remembered there; f
	// shared on the second.
	if !slices.Equal(shared, []string{"b", "d", "f"}) {
		t.Errorf("told of copies %v, want b, d, f", shared)
	}

	exe.runs = map[string]int{}
	h = NewHandler("r", "execution", &stagetest.Recorder{}, exe, 4)
	h.Handle(stagetest.Message(t, context.Background(), g))
	if err := h.Handle(stagetest.Message(t, context.Background(), g)); err != nil {
		t.Fatal(err)
	}
	if want := map[string]int{"print(1)": 4, "fails once": 3}; !maps.Equal(exe.runs, want) {
		t.Errorf("without CopiesOnce, runs by response %v, want %v", exe.runs, want)
	}
}

// scoresOf scores each trajectory with its entry, by id.
type scoresOf map[string]float64

func (s scoresOf) Execute(_ context.Context, t schemas.Trajectory) (Result, error) {
	return Result{Status: schemas.ExecScored, Score: s[t.TrajID], Seconds: 2}, nil
}

// An executor's score beyond schemas.MaxScore is recorded as a sandbox
// error (not a score), saying why; the group's other scores are used, in a
// message its readers take.
func TestAScoreOutOfRangeIsASandboxError(t *testing.T) {
	pub := &stagetest.Recorder{}
	h := NewHandler("r", "execution", pub, scoresOf{"a": 0.5, "b": -1e300, "c": 1}, 2)
	if err := h.Handle(stagetest.Message(t, context.Background(), anchorGroup("a", "b", "c"))); err != nil {
		t.Fatal(err)
	}
	var e schemas.Execution
	if err := schemas.Decode(pub.Payload(0), "r", &e); err != nil {
		t.Fatalf("the execution is refused by its readers: %v", err)
	}
	for i, want := range []float64{0.5, 0, 1} {
		it := e.Items[i]
		if i == 1 {
			if it.Score != nil || it.Status != schemas.ExecSandboxError || !strings.Contains(it.Detail, "the executor's score -1e+300 is beyond ±1e+100") {
				t.Errorf("out of range: %+v, want a sandbox error saying why", it)
			}
			continue
		}
		if it.Score == nil || *it.Score != want || it.Status != schemas.ExecScored {
			t.Errorf("%s: %+v, want scored %v", it.TrajID, it, want)
		}
	}
}

// TestWaitsForASlotAreTold: with every slot busy, an execution waits, and
// the handler says so (the metric that tells --exec-slots is too few),
// and how many slots are taken.
func TestWaitsForASlotAreTold(t *testing.T) {
	exe := &switchedExecutor{}
	h := NewHandler("r", "execution", &stagetest.Recorder{}, exe, 2)
	var waiting, busy, mostWaiting, mostBusy atomic.Int32
	h.Waiting = func(d int) { mostWaiting.Store(max(mostWaiting.Load(), waiting.Add(int32(d)))) }
	h.Busy = func(d int) { mostBusy.Store(max(mostBusy.Load(), busy.Add(int32(d)))) }
	// The first two hold their slots until the third waits (the group's
	// trajectories take their slots in turn).
	exe.holdUntil(func() bool { return waiting.Load() == 1 })
	if err := h.Handle(stagetest.Message(t, context.Background(), anchorGroup("a", "b", "c", "d", "e"))); err != nil {
		t.Fatal(err)
	}
	if exe.runs.Load() != 5 || mostWaiting.Load() != 1 || mostBusy.Load() != 2 || waiting.Load() != 0 || busy.Load() != 0 {
		t.Errorf("%d runs; at most %d waiting and %d busy, %d and %d at the end; want 5 runs, 1 waiting, 2 busy, 0 and 0",
			exe.runs.Load(), mostWaiting.Load(), mostBusy.Load(), waiting.Load(), busy.Load())
	}
}
