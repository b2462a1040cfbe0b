package pair

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/stagetest"
)

func sides(group string) (schemas.Prediction, schemas.Execution) {
	score := 0.4
	p := schemas.Prediction{Schema: schemas.Version, Run: "r", Step: 3, GroupID: group, Anchor: true, Model: "m",
		Items: []schemas.PredItem{{TrajID: group + "-0", Score: &score, Status: schemas.PredOK}}}
	e := schemas.Execution{Schema: schemas.Version, Run: "r", Step: 3, GroupID: group,
		Items: []schemas.ExecItem{{TrajID: group + "-0", Score: &score, Status: schemas.ExecScored}}}
	return p, e
}

// A side alone past Wait fails as unusable, naming what it waited for, and
// leaves nothing behind; the two sides together within Wait pair once.
func TestWaitBoundsALoneSide(t *testing.T) {
	pub := &stagetest.Recorder{}
	h := NewHandler("r", "pairs", pub)
	h.Wait = 50 * time.Millisecond
	ctx := context.Background()

	pred, exec := sides("g1")
	err := h.HandlePred(stagetest.Message(t, ctx, pred))
	if !errors.Is(err, schemas.ErrUnusable) || !strings.Contains(err.Error(), "3/g1: no execution within 50ms") {
		t.Fatalf("lone prediction: %v; want ErrUnusable naming the missing execution", err)
	}
	err = h.HandleExecution(stagetest.Message(t, ctx, exec))
	if !errors.Is(err, schemas.ErrUnusable) || !strings.Contains(err.Error(), "no prediction") {
		t.Fatalf("execution after its prediction gave up: %v; want it to wait afresh and give up too", err)
	}
	if len(h.slots) != 0 || pub.Count() != 0 {
		t.Fatalf("%d slots held, %d pairs published after both gave up", len(h.slots), pub.Count())
	}

	pred, exec = sides("g2")
	done := make(chan error, 1)
	go func() { done <- h.HandlePred(stagetest.Message(t, ctx, pred)) }()
	if err := h.HandleExecution(stagetest.Message(t, ctx, exec)); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if len(h.slots) != 0 || pub.Count() != 1 {
		t.Fatalf("%d slots held, %d pairs published; want 0 and 1", len(h.slots), pub.Count())
	}
}

// storedPairs answers Stored for the IDs in ids, or with err, counting
// what it was asked, and what LetGo was told.
type storedPairs struct {
	ids   map[string]bool
	err   error
	mu    sync.Mutex
	asked []string
	let   []string
}

func (s *storedPairs) letGo(step int64, group, side string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.let = append(s.let, fmt.Sprintf("%d/%s %s", step, group, side))
}

func (s *storedPairs) letOf() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.let)
}

func (s *storedPairs) stored(_ context.Context, _ *message.Message, id string) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.asked = append(s.asked, id)
	return s.ids[id], s.err
}

func (s *storedPairs) askedOf() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.asked)
}

// again is a message of v delivered before.
func again(t *testing.T, ctx context.Context, v any) *message.Message {
	m := stagetest.Message(t, ctx, v)
	m.Metadata.Set("again", "1")
	return m
}

// A side delivered again after its group's pairs were stored (the process
// that paired them stopped before its acknowledgement of this side reached
// the server) is let go at once: its other side was acknowledged and will
// not come, and waiting for it ended in the dead letters with "no
// execution within".
func TestASideDeliveredAgainAfterItsPairsIsLetGo(t *testing.T) {
	ctx := context.Background()
	pub := &stagetest.Recorder{}
	h := NewHandler("r", "pairs", pub)
	h.Wait = time.Hour
	h.Redelivered = func(m *message.Message) bool { return m.Metadata.Get("again") == "1" }
	s := &storedPairs{ids: map[string]bool{"r/pairs/3/g1": true}}
	h.Stored, h.LetGo = s.stored, s.letGo

	_, exec := sides("g1")
	done := make(chan error, 1)
	go func() { done <- h.HandleExecution(again(t, ctx, exec)) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("a side whose pairs were stored: %v; want it let go", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a side whose pairs were stored is still waiting for its other side")
	}
	if len(h.slots) != 0 || pub.Count() != 0 || !slices.Equal(s.askedOf(), []string{"r/pairs/3/g1"}) {
		t.Errorf("%d slots held, %d pairs published, asked %v; want none, none, the group's pairs", len(h.slots), pub.Count(), s.askedOf())
	}
	if !slices.Equal(s.letOf(), []string{"3/g1 execution"}) {
		t.Errorf("LetGo told %v; want the execution of 3/g1", s.letOf())
	}

	// Delivered again but not paired yet (both sides come again after a
	// restart): the side waits, and the other pairs it.
	pred, exec := sides("g2")
	go func() { done <- h.HandlePred(again(t, ctx, pred)) }()
	for deadline := time.Now().Add(10 * time.Second); len(s.askedOf()) < 2; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("a side delivered again was not asked about")
		}
	}
	// The first delivery of its other side is not asked about.
	if err := h.HandleExecution(stagetest.Message(t, ctx, exec)); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil || pub.Count() != 1 || !slices.Equal(s.askedOf(), []string{"r/pairs/3/g1", "r/pairs/3/g2"}) {
		t.Errorf("pairing after a redelivery: %v, %d pairs published, asked %v; want the pairs once, g2 asked once", err, pub.Count(), s.askedOf())
	}
	if len(s.letOf()) != 1 {
		t.Errorf("LetGo told %v; want nothing of g2, which was paired", s.letOf())
	}
}

// A side alone until Wait is dead-lettered only when its group's pairs
// were not stored; when that cannot be told, it is handed back (to be asked
// again), not dead-lettered.
func TestASideAloneIsAskedAboutBeforeTheDeadLetters(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name   string
		stored bool
		err    error
		want   func(error) bool
		let    int // sides LetGo is told of
	}{
		{"stored", true, nil, func(err error) bool { return err == nil }, 1},
		{"not stored", false, nil, func(err error) bool {
			return errors.Is(err, schemas.ErrUnusable) && strings.Contains(err.Error(), "3/g1: no execution within 50ms")
		}, 0},
		{"cannot tell", false, errors.New("nats: timeout"), func(err error) bool {
			return err != nil && !errors.Is(err, schemas.ErrUnusable) && strings.Contains(err.Error(), "cannot be told: nats: timeout")
		}, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := NewHandler("r", "pairs", &stagetest.Recorder{})
			h.Wait = 50 * time.Millisecond
			s := &storedPairs{ids: map[string]bool{"r/pairs/3/g1": c.stored}, err: c.err}
			h.Stored, h.LetGo = s.stored, s.letGo
			pred, _ := sides("g1")
			if err := h.HandlePred(stagetest.Message(t, ctx, pred)); !c.want(err) {
				t.Errorf("a side alone past Wait: %v", err)
			}
			if len(h.slots) != 0 || !slices.Equal(s.askedOf(), []string{"r/pairs/3/g1"}) {
				t.Errorf("%d slots held, asked %v; want none, the group's pairs once", len(h.slots), s.askedOf())
			}
			if len(s.letOf()) != c.let {
				t.Errorf("LetGo told %v; want %d side(s)", s.letOf(), c.let)
			}
		})
	}
}
