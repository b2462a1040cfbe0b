package execute

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/stagetest"
)

// solutions is an anchor group of step's group id, one trajectory a
// solution: id=response pairs, all of task "t" unless the id says
// "task:id".
func solutions(step int64, id string, trajs ...[2]string) schemas.Group {
	g := schemas.Group{Schema: schemas.Version, Run: "r", Step: step, GroupID: id, TaskID: "t", Anchor: true}
	for _, tr := range trajs {
		task, traj, ok := strings.Cut(tr[0], ":")
		if !ok {
			task, traj = "t", tr[0]
		}
		g.Trajectories = append(g.Trajectories, schemas.Trajectory{TrajID: traj, GroupID: id, TaskID: task, Prompt: "p", Response: tr[1]})
	}
	return g
}

// memStore is an Outcomes in memory, shared by handlers as the bucket is
// by processes.
type memStore struct {
	mu sync.Mutex
	m  map[string]schemas.ExecItem
}

func (s *memStore) Load(_ context.Context, key string) (schemas.ExecItem, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	it, ok := s.m[key]
	return it, ok, nil
}

func (s *memStore) Save(_ context.Context, key string, it schemas.ExecItem) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.m[key] = it
	return nil
}

// handled handles g and returns its published Execution.
func handled(t *testing.T, h *Handler, g schemas.Group) schemas.Execution {
	t.Helper()
	pub := &stagetest.Recorder{}
	h.Pub = pub
	if err := h.Handle(stagetest.Message(t, context.Background(), g)); err != nil {
		t.Fatal(err)
	}
	var e schemas.Execution
	pub.Decode(t, 0, &e)
	return e
}

// With CopiesOnce a solution runs once in the run, not once a group: a
// copy in a later anchor group takes the outcome, naming the trajectory
// that ran with its step and group, as do that copy's own copies in its
// group. The same code for another task runs. A process that starts
// later (a restart, another process of the stage) takes the outcomes
// from the store.
func TestACopyInALaterGroupTakesTheOutcome(t *testing.T) {
	exe := &byResponse{runs: map[string]int{}}
	store := &memStore{m: map[string]schemas.ExecItem{}}
	h := NewHandler("r", "execution", nil, exe, 4)
	var shared []string
	h.CopiesOnce, h.Store, h.Shared = true, store, func(it schemas.ExecItem) { shared = append(shared, it.TrajID) }

	handled(t, h, solutions(1, "g", [2]string{"a", "print(1)"}, [2]string{"b", "print(22)"}))
	e := handled(t, h, solutions(2, "h", [2]string{"x", "print(1)"}, [2]string{"y", "print(1)"}, [2]string{"z", "print(333)"}, [2]string{"u:w", "print(22)"}))
	if want := map[string]int{"print(1)": 1, "print(22)": 2, "print(333)": 1}; !maps.Equal(exe.runs, want) {
		t.Errorf("runs by response %v, want %v", exe.runs, want)
	}
	one := int64(1)
	want := map[string]schemas.ExecItem{
		"x": {CopyOf: "a", CopyStep: &one, CopyGroup: "g"},
		"y": {CopyOf: "a", CopyStep: &one, CopyGroup: "g"}, // a copy of x, which ran nothing: a ran
		"z": {}, "w": {},
	}
	for _, it := range e.Items {
		w := want[it.TrajID]
		resp := map[string]string{"x": "print(1)", "y": "print(1)", "z": "print(333)", "w": "print(22)"}[it.TrajID]
		if it.CopyOf != w.CopyOf || it.CopyGroup != w.CopyGroup || (it.CopyStep == nil) != (w.CopyStep == nil) || (it.CopyStep != nil && *it.CopyStep != *w.CopyStep) {
			t.Errorf("%s: a copy of %q (step %s, group %q), want of %q (step %s, group %q)", it.TrajID, it.CopyOf, stepOf(it.CopyStep), it.CopyGroup, w.CopyOf, stepOf(w.CopyStep), w.CopyGroup)
		}
		if it.Score == nil || *it.Score != float64(len(resp))/100 || it.Detail != "ran "+resp || (it.CopyOf != "") != (it.Seconds == 0) {
			t.Errorf("%s: %+v, want the outcome of %s", it.TrajID, it, resp)
		}
	}
	if !slices.Equal(shared, []string{"x", "y"}) {
		t.Errorf("told of copies %v, want x, y", shared)
	}

	// Redelivered, the group runs nothing and tells of no copy again.
	handled(t, h, solutions(2, "h", [2]string{"x", "print(1)"}, [2]string{"y", "print(1)"}, [2]string{"z", "print(333)"}, [2]string{"u:w", "print(22)"}))
	if exe.runs["print(1)"] != 1 || exe.runs["print(333)"] != 1 || len(shared) != 2 {
		t.Errorf("the redelivery ran %v, told of copies %v", exe.runs, shared)
	}

	// Another process, on the same store.
	h2 := NewHandler("r", "execution", nil, exe, 4)
	h2.CopiesOnce, h2.Store = true, store
	e = handled(t, h2, solutions(3, "k", [2]string{"q", "print(333)"}))
	if it := e.Items[0]; exe.runs["print(333)"] != 1 || it.CopyOf != "z" || it.CopyGroup != "h" || it.CopyStep == nil || *it.CopyStep != 2 {
		t.Errorf("another process: %d runs of print(333), item %+v; want none, a copy of z of group h of step 2", exe.runs["print(333)"], it)
	}

	// Without CopiesOnce each group runs its own.
	h3 := NewHandler("r", "execution", nil, exe, 4)
	h3.Store = store
	handled(t, h3, solutions(4, "m", [2]string{"q", "print(333)"}))
	if exe.runs["print(333)"] != 2 {
		t.Errorf("without CopiesOnce: %d runs of print(333), want 2", exe.runs["print(333)"])
	}
}

func stepOf(p *int64) string {
	if p == nil {
		return "none"
	}
	return strconv.FormatInt(*p, 10)
}

// gatedExecutor holds each run of the response held until it is let go,
// failing it if fail says so, and scores others at once; entered hears of
// every run as it starts.
type gatedExecutor struct {
	held    string
	fail    bool
	gate    chan struct{}
	entered chan string
	mu      sync.Mutex
	runs    map[string]int
}

func (x *gatedExecutor) Execute(ctx context.Context, t schemas.Trajectory) (Result, error) {
	x.mu.Lock()
	x.runs[t.Response]++
	first := x.runs[t.Response] == 1
	x.mu.Unlock()
	x.entered <- t.Response
	if t.Response == x.held && first {
		<-x.gate
		if x.fail {
			return Result{}, errors.New("sandbox pool busy")
		}
	}
	return Result{Status: schemas.ExecScored, Score: float64(len(t.Response)) / 100, Seconds: 3}, nil
}

// A copy of a solution that another group is executing at the same time
// waits for that execution and takes its outcome, rather than running it
// twice; if that execution gives none (its executor failed), the copy
// runs.
func TestACopyWaitsForTheExecutionUnderWay(t *testing.T) {
	for _, fail := range []bool{false, true} {
		exe := &gatedExecutor{held: "slow()", fail: fail, gate: make(chan struct{}), entered: make(chan string, 8), runs: map[string]int{}}
		pub := &stagetest.Recorder{}
		h := NewHandler("r", "execution", pub, exe, 4)
		h.CopiesOnce = true
		first := make(chan error, 1)
		go func() {
			first <- h.Handle(stagetest.Message(t, context.Background(), solutions(1, "g", [2]string{"a", "slow()"})))
		}()
		if r := <-exe.entered; r != "slow()" {
			t.Fatalf("ran %q first", r)
		}
		// The second group's copy claims before its other solution runs.
		second := make(chan error, 1)
		go func() {
			second <- h.Handle(stagetest.Message(t, context.Background(), solutions(2, "h", [2]string{"x", "slow()"}, [2]string{"y", "other()"})))
		}()
		if r := <-exe.entered; r != "other()" {
			t.Fatalf("fail %v: the second group ran %q; want only other()", fail, r)
		}
		close(exe.gate)
		err1, err2 := <-first, <-second
		if err2 != nil {
			t.Fatalf("fail %v: the second group: %v", fail, err2)
		}
		var e schemas.Execution
		for i := range pub.Count() {
			if pub.Decode(t, i, &e); e.GroupID == "h" {
				break
			}
		}
		x := e.Items[0]
		if !fail {
			if err1 != nil || exe.runs["slow()"] != 1 || x.CopyOf != "a" || x.CopyGroup != "g" || x.Score == nil {
				t.Errorf("%v, %d runs of slow(), x %+v; want one run, x a copy of a of group g", err1, exe.runs["slow()"], x)
			}
			continue
		}
		if err1 == nil || exe.runs["slow()"] != 2 || x.CopyOf != "" || x.Score == nil || x.Seconds != 3 {
			t.Errorf("the first failing (%v): %d runs of slow(), x %+v; want x run by itself", err1, exe.runs["slow()"], x)
		}
	}
}
