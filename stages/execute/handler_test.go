package execute

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
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

type recorder struct{ msgs []*message.Message }

func (r *recorder) Publish(_ string, msgs ...*message.Message) error {
	r.msgs = append(r.msgs, msgs...)
	return nil
}
func (r *recorder) Close() error { return nil }

// A group redelivered because one trajectory's executor failed runs that
// one again and reuses the others' outcomes.
func TestRedeliveryRunsOnlyWhatHasNoOutcome(t *testing.T) {
	g := schemas.Group{Schema: schemas.Version, Run: "r", Step: 1, GroupID: "g", TaskID: "t", Anchor: true}
	for _, id := range []string{"a", "bb", "ccc", "dddd"} {
		g.Trajectories = append(g.Trajectories, schemas.Trajectory{TrajID: id, GroupID: "g"})
	}
	payload, _ := json.Marshal(g)
	deliver := func(h *Handler) error {
		m := message.NewMessage("id", payload)
		m.SetContext(context.Background())
		return h.Handle(m)
	}
	exe := &flakyExecutor{runs: map[string]int{}, flaky: "ccc"}
	pub := &recorder{}
	h := NewHandler("r", "execution", pub, exe, 2)

	if err := deliver(h); err == nil || len(pub.msgs) != 0 {
		t.Fatalf("first delivery: %v, %d published; want the executor's error and nothing", err, len(pub.msgs))
	}
	if err := deliver(h); err != nil || len(pub.msgs) != 1 {
		t.Fatalf("redelivery: %v, %d published", err, len(pub.msgs))
	}
	for id, n := range exe.runs {
		if want := map[bool]int{true: 2, false: 1}[id == "ccc"]; n != want {
			t.Errorf("%s executed %d times, want %d", id, n, want)
		}
	}
	var e schemas.Execution
	if err := json.Unmarshal(pub.msgs[0].Payload, &e); err != nil {
		t.Fatal(err)
	}
	for i, it := range e.Items {
		if id := g.Trajectories[i].TrajID; it.TrajID != id || it.Score == nil || *it.Score != 0.25*float64(len(id)) {
			t.Errorf("item %d: %+v, want %s scored %v", i, it, id, 0.25*float64(len(id)))
		}
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

// On the last attempt a group with at least two scored trajectories is
// published with the failing ones ungraded, and the error still returned
// for the dead letters; with fewer, nothing is published.
func TestLastAttemptPublishesWhatWasExecuted(t *testing.T) {
	g := schemas.Group{Schema: schemas.Version, Run: "r", Step: 1, GroupID: "g", TaskID: "t", Anchor: true}
	for _, id := range []string{"a", "b", "c"} {
		g.Trajectories = append(g.Trajectories, schemas.Trajectory{TrajID: id, GroupID: "g"})
	}
	payload, _ := json.Marshal(g)
	deliver := func(h *Handler) error {
		m := message.NewMessage("id", payload)
		m.SetContext(context.Background())
		return h.Handle(m)
	}
	last := false
	for _, tc := range []struct {
		broken    brokenFor
		published bool
	}{{brokenFor{"b": true}, true}, {brokenFor{"a": true, "c": true}, false}} {
		pub := &recorder{}
		h := NewHandler("r", "execution", pub, tc.broken, 2)
		h.LastAttempt = func(*message.Message) bool { return last }
		last = false
		if err := deliver(h); err == nil || len(pub.msgs) != 0 {
			t.Fatalf("%v, not the last attempt: %v, %d published", tc.broken, err, len(pub.msgs))
		}
		last = true
		err := deliver(h)
		if err == nil || (len(pub.msgs) == 1) != tc.published {
			t.Fatalf("%v, last attempt: %v, %d published; want an error and published %v", tc.broken, err, len(pub.msgs), tc.published)
		}
		if !tc.published {
			continue
		}
		var e schemas.Execution
		json.Unmarshal(pub.msgs[0].Payload, &e)
		for _, it := range e.Items {
			if tc.broken[it.TrajID] != (it.Score == nil) || (it.Score == nil && (it.Status != schemas.ExecSandboxError || it.Detail == "")) {
				t.Errorf("%v: item %+v", tc.broken, it)
			}
		}
	}
}
