package predict

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/breaker"
	"github.com/wmrl/wmrl/stages/stagetest"
)

type downWorldModel struct{}

func (downWorldModel) Name() string { return "down" }
func (downWorldModel) Predict(context.Context, []schemas.Trajectory) ([]Score, error) {
	return nil, errors.New("connection refused")
}

// A failing world model is retried (nothing published) until the last
// attempt, which records the group as ungraded with the reason and still
// reports the error; a shutdown records nothing.
func TestLastAttemptRecordsTheGroupAsUngraded(t *testing.T) {
	g := schemas.Group{Schema: schemas.Version, Run: "r", Step: 2, GroupID: "g", TaskID: "t", Anchor: true,
		Trajectories: []schemas.Trajectory{{TrajID: "a"}, {TrajID: "b"}}}
	last := false
	pub := &stagetest.Recorder{}
	h := &Handler{Run: "r", Out: "pred", Pub: pub, WM: downWorldModel{}, LastAttempt: func(*message.Message) bool { return last }}

	if err := h.Handle(stagetest.Message(t, context.Background(), g)); err == nil || pub.Count() != 0 {
		t.Fatalf("not the last attempt: %v, %d published; want the error and nothing", err, pub.Count())
	}
	last = true
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	if err := h.Handle(stagetest.Message(t, cancelled, g)); err == nil || pub.Count() != 0 {
		t.Fatalf("shutting down: %v, %d published; want the error and nothing", err, pub.Count())
	}
	err := h.Handle(stagetest.Message(t, context.Background(), g))
	if err == nil || !strings.Contains(err.Error(), "recorded the group as ungraded") || pub.Count() != 1 {
		t.Fatalf("last attempt: %v, %d published; want the error and one prediction", err, pub.Count())
	}
	var p schemas.Prediction
	pub.Decode(t, 0, &p)
	if p.GroupID != "g" || !p.Anchor || len(p.Items) != 2 {
		t.Fatalf("prediction %+v", p)
	}
	for _, it := range p.Items {
		if it.Score != nil || it.Status != schemas.PredUngraded || !strings.Contains(it.Reason, "connection refused") {
			t.Fatalf("item %+v: want ungraded with the world model's error", it)
		}
	}
}

// countingWorldModel fails while down and counts its calls.
type countingWorldModel struct {
	down  atomic.Bool
	calls atomic.Int32
}

func (*countingWorldModel) Name() string { return "counting" }
func (w *countingWorldModel) Predict(_ context.Context, trajs []schemas.Trajectory) ([]Score, error) {
	w.calls.Add(1)
	if w.down.Load() {
		return nil, errors.New("connection refused")
	}
	out := make([]Score, len(trajs))
	for i := range out {
		out[i] = Score{Value: 0.5, Graded: true}
	}
	return out, nil
}

// Once the breaker is open the handler gives groups up without calling the
// world model: each recorded as ungraded with the reason, the error
// marked schemas.ErrDown for the dead letters. A probe that succeeds
// brings the predictions back.
func TestHandlerGivesUpAtOnceWhileTheWorldModelIsDown(t *testing.T) {
	now := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)
	clk := struct{ now func() time.Time }{func() time.Time { return now }}
	wm := &countingWorldModel{}
	wm.down.Store(true)
	pub := &stagetest.Recorder{}
	h := &Handler{Run: "r", Out: "pred", Pub: pub, WM: wm, Breaker: &breaker.Breaker{Name: "the world model", After: 2, Probe: time.Minute, Now: clk.now}}
	group := func(id string) schemas.Group {
		return schemas.Group{Schema: schemas.Version, Run: "r", Step: 1, GroupID: id, TaskID: "t",
			Trajectories: []schemas.Trajectory{{TrajID: id + "-a"}, {TrajID: id + "-b"}}}
	}
	err := h.Handle(stagetest.Message(t, context.Background(), group("g0")))
	if err == nil || errors.Is(err, schemas.ErrDown) || pub.Count() != 0 {
		t.Fatalf("g0, world model failing, breaker closed: %v, %d published; want a plain error to retry", err, pub.Count())
	}
	// The failure that opens it gives its group up too.
	err = h.Handle(stagetest.Message(t, context.Background(), group("g1")))
	if !errors.Is(err, schemas.ErrDown) || !strings.Contains(err.Error(), "connection refused") || pub.Count() != 1 {
		t.Fatalf("g1, the second failure: %v, %d published; want ErrDown with the world model's error, and g1 recorded", err, pub.Count())
	}
	err = h.Handle(stagetest.Message(t, context.Background(), group("g2")))
	if !errors.Is(err, schemas.ErrDown) || !strings.Contains(err.Error(), "recorded the group as ungraded") || wm.calls.Load() != 2 || pub.Count() != 2 {
		t.Fatalf("open: %v, %d calls, %d published; want ErrDown, 2 calls and g2 recorded", err, wm.calls.Load(), pub.Count())
	}
	var p schemas.Prediction
	pub.Decode(t, 1, &p)
	for _, it := range p.Items {
		if p.GroupID != "g2" || it.Score != nil || it.Status != schemas.PredUngraded || !strings.Contains(it.Reason, "not asked: the world model is down") {
			t.Fatalf("prediction %+v: want g2's items ungraded, saying why", p)
		}
	}

	// The record cannot be stored: an outage, retried, not dead-lettered.
	pub.Err = errors.New("nats: no responders")
	err = h.Handle(stagetest.Message(t, context.Background(), group("g3")))
	if !errors.Is(err, schemas.ErrOutage) || errors.Is(err, schemas.ErrDown) {
		t.Fatalf("record not stored: %v; want an outage, not ErrDown", err)
	}
	pub.Err = nil

	// A probe that fails gives its group up at once, as the others.
	now = now.Add(time.Minute)
	err = h.Handle(stagetest.Message(t, context.Background(), group("g4")))
	if !errors.Is(err, schemas.ErrDown) || wm.calls.Load() != 3 || pub.Count() != 3 {
		t.Fatalf("failed probe: %v, %d calls, %d published; want the world model asked, ErrDown and g4 recorded", err, wm.calls.Load(), pub.Count())
	}
	now = now.Add(time.Minute)
	wm.down.Store(false)
	if err := h.Handle(stagetest.Message(t, context.Background(), group("g5"))); err != nil || wm.calls.Load() != 4 {
		t.Fatalf("probe: %v, %d calls; want the world model asked and an answer", err, wm.calls.Load())
	}
	if err := h.Handle(stagetest.Message(t, context.Background(), group("g6"))); err != nil || wm.calls.Load() != 5 || pub.Count() != 5 {
		t.Fatalf("after the probe: %v, %d calls, %d published; want the world model asked again", err, wm.calls.Load(), pub.Count())
	}
	pub.Decode(t, 4, &p)
	if p.GroupID != "g6" || p.Items[0].Score == nil {
		t.Fatalf("prediction after the probe: %+v", p)
	}
}

// hangingWorldModel never answers a group whose first trajectory is
// "hang" (a server that accepts and says nothing), and refuses the rest.
type hangingWorldModel struct{ hanging chan struct{} }

func (hangingWorldModel) Name() string { return "hanging" }
func (w hangingWorldModel) Predict(ctx context.Context, trajs []schemas.Trajectory) ([]Score, error) {
	if trajs[0].TrajID != "hang" {
		return nil, errors.New("connection refused")
	}
	close(w.hanging)
	<-ctx.Done()
	return nil, ctx.Err()
}

// A call under way when the breaker opens (a server that does not answer,
// requests queued behind the connector's limit) is cut short, and its
// group given up with the failures that opened it, not its cancellation.
func TestCallsUnderWayAreCutShortWhenItOpens(t *testing.T) {
	wm := hangingWorldModel{hanging: make(chan struct{})}
	pub := &stagetest.Recorder{}
	h := &Handler{Run: "r", Out: "pred", Pub: pub, WM: wm, Breaker: &breaker.Breaker{Name: "the world model", After: 2, Probe: time.Minute}}
	group := func(first string) schemas.Group {
		return schemas.Group{Schema: schemas.Version, Run: "r", Step: 1, GroupID: "g-" + first, TaskID: "t",
			Trajectories: []schemas.Trajectory{{TrajID: first}, {TrajID: first + "-b"}}}
	}
	hung := make(chan error, 1)
	go func() { hung <- h.Handle(stagetest.Message(t, context.Background(), group("hang"))) }()
	<-wm.hanging
	for _, first := range []string{"a", "b"} {
		h.Handle(stagetest.Message(t, context.Background(), group(first)))
	}
	select {
	case err := <-hung:
		if !errors.Is(err, schemas.ErrDown) || !strings.Contains(err.Error(), "2 calls in a row failed, the last: connection refused") {
			t.Fatalf("the call under way: %v; want it given up, saying the world model is down with the error that opened it", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the call under way is still waiting for a world model taken for down")
	}
	if n := pub.Count(); n != 2 { // b's group, which opened it, and the hung one
		t.Fatalf("%d predictions recorded; want 2", n)
	}
}

// fixedWorldModel gives its scores, in order, to a group's trajectories.
type fixedWorldModel []Score

func (fixedWorldModel) Name() string { return "fixed" }
func (w fixedWorldModel) Predict(_ context.Context, trajs []schemas.Trajectory) ([]Score, error) {
	return w[:len(trajs)], nil
}

// A world model's score beyond schemas.MaxScore (or not a number) is
// recorded as ungraded, saying why, and the group's prediction is one its
// readers take: published as it was, the whole group's would be refused.
func TestAScoreOutOfRangeIsUngraded(t *testing.T) {
	wm := fixedWorldModel{{Value: 0.5, Graded: true}, {Value: 1e300, Graded: true}, {Value: math.Inf(-1), Graded: true, Spread: math.NaN()}}
	pub := &stagetest.Recorder{}
	h := &Handler{Run: "r", Out: "pred", Pub: pub, WM: wm}
	g := schemas.Group{Schema: schemas.Version, Run: "r", Step: 1, GroupID: "g", Trajectories: []schemas.Trajectory{{TrajID: "a"}, {TrajID: "b"}, {TrajID: "c"}}}
	if err := h.Handle(stagetest.Message(t, context.Background(), g)); err != nil {
		t.Fatal(err)
	}
	var p schemas.Prediction
	if err := schemas.Decode(pub.Payload(0), "r", &p); err != nil {
		t.Fatalf("the prediction is refused by its readers: %v", err)
	}
	if it := p.Items[0]; it.Score == nil || *it.Score != 0.5 || it.Status != schemas.PredOK {
		t.Errorf("in range: %+v", it)
	}
	for i, v := range []string{"1e+300", "-Inf"} {
		it := p.Items[i+1]
		if it.Score != nil || it.Status != schemas.PredUngraded || !strings.Contains(it.Reason, "the world model's score "+v+" is beyond ±1e+100") {
			t.Errorf("score %s: %+v, want it ungraded saying why", v, it)
		}
	}
}
