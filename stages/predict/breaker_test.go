package predict

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/stagetest"
)

// clock is a time that moves only when told.
type clock struct{ t time.Time }

func (c *clock) now() time.Time             { return c.t }
func (c *clock) add(d time.Duration)        { c.t = c.t.Add(d) }
func newClock() *clock                      { return &clock{t: time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)} }
func refused(t *testing.T, b *Breaker) bool { t.Helper(); _, err := b.Ask(); return err != nil }

// The breaker opens after After calls in a row have failed, not after as
// many failures with a success between them; while open it lets one probe
// through per Probe, and the first success closes it.
func TestBreakerOpensOnFailuresInARowAndProbes(t *testing.T) {
	clk := newClock()
	var changes []BreakerState
	b := &Breaker{After: 3, Probe: 30 * time.Second, Now: clk.now, OnChange: func(s BreakerState) { changes = append(changes, s) }}
	down := errors.New("connection refused")
	fail := func() *DownError {
		t.Helper()
		c, err := b.Ask()
		if err != nil {
			t.Fatalf("refused while closed: %v", err)
		}
		return c.Failed(down)
	}

	fail()
	fail()
	c, _ := b.Ask()
	c.Succeeded() // two failures, then an answer: not in a row
	fail()
	if fail() != nil || refused(t, b) || len(changes) != 0 {
		t.Fatalf("open after 2 failures in a row (After 3); changes %+v", changes)
	}
	if fail() == nil {
		t.Fatal("the failure that opened it was not told so")
	}
	if len(changes) != 1 || !changes[0].Open || changes[0].Failures != 3 || changes[0].Last != down || !changes[0].Since.Equal(clk.t) {
		t.Fatalf("changes after 3 failures in a row: %+v; want one, open", changes)
	}
	_, err := b.Ask()
	var de *DownError
	if !errors.As(err, &de) || !errors.Is(err, schemas.ErrDown) || !strings.Contains(err.Error(), "down since 2026-12-03T10:00:00Z") ||
		!strings.Contains(err.Error(), "connection refused") ||
		!strings.Contains(err.Error(), "3 calls in a row failed") || !strings.Contains(err.Error(), "one group every 30s") {
		t.Fatalf("open: %v; want a DownError naming the failures, the last error and the probe", err)
	}

	// A call let through before it opened still counts.
	clk.add(29 * time.Second)
	if !refused(t, b) {
		t.Fatal("a probe before Probe has passed")
	}
	clk.add(time.Second)
	probe, err := b.Ask()
	if err != nil || !probe.probe {
		t.Fatalf("no probe after Probe: %v", err)
	}
	if !refused(t, b) {
		t.Fatal("a second call let through while the probe is out")
	}
	if probe.Failed(down) == nil { // still down: the next probe a Probe later
		t.Fatal("a failed probe was not told that the world model is down")
	}
	clk.add(29 * time.Second)
	if !refused(t, b) {
		t.Fatal("a probe sooner than Probe after a failed one")
	}
	clk.add(time.Second)
	probe, _ = b.Ask()
	probe.Abandoned() // the process stopped: says nothing, frees the probe
	probe, err = b.Ask()
	if err != nil || !probe.probe {
		t.Fatalf("no probe after an abandoned one: %v", err)
	}
	clk.add(5 * time.Second)
	probe.Succeeded()
	if len(changes) != 2 || changes[1].Open || changes[1].Refused != 4 || changes[1].At.Sub(changes[1].Since) != 65*time.Second {
		t.Fatalf("changes after the probe succeeded: %+v; want closed after 65s with 4 groups refused", changes)
	}
	if refused(t, b) {
		t.Fatal("refused after it closed")
	}
	fail()
	if fail() != nil || refused(t, b) {
		t.Fatal("closed but still counting the failures from before")
	}
}

// A nil breaker, or one with After 0, lets everything through.
func TestBreakerOff(t *testing.T) {
	var nilB *Breaker
	off := &Breaker{}
	for _, b := range []*Breaker{nilB, off} {
		for range 10 {
			c, err := b.Ask()
			if err != nil {
				t.Fatalf("%+v refused: %v", b, err)
			}
			c.Failed(errors.New("down"))
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
	clk := newClock()
	wm := &countingWorldModel{}
	wm.down.Store(true)
	pub := &stagetest.Recorder{}
	h := &Handler{Run: "r", Out: "pred", Pub: pub, WM: wm, Breaker: &Breaker{After: 2, Probe: time.Minute, Now: clk.now}}
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
	clk.add(time.Minute)
	err = h.Handle(stagetest.Message(t, context.Background(), group("g4")))
	if !errors.Is(err, schemas.ErrDown) || wm.calls.Load() != 3 || pub.Count() != 3 {
		t.Fatalf("failed probe: %v, %d calls, %d published; want the world model asked, ErrDown and g4 recorded", err, wm.calls.Load(), pub.Count())
	}
	clk.add(time.Minute)
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
	h := &Handler{Run: "r", Out: "pred", Pub: pub, WM: wm, Breaker: &Breaker{After: 2, Probe: time.Minute}}
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
