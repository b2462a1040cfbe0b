package pair

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
)

// recorder is a fake publisher that keeps what it is given.
type recorder struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (r *recorder) Publish(_ string, msgs ...*message.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.msgs = append(r.msgs, msgs...)
	return nil
}

func (r *recorder) Close() error { return nil }

func (r *recorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.msgs)
}

func msgOf(t *testing.T, v any) *message.Message {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	m := message.NewMessage("id", b)
	m.SetContext(context.Background())
	return m
}

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
	pub := &recorder{}
	h := NewHandler("r", "pairs", pub)
	h.Wait = 50 * time.Millisecond

	pred, exec := sides("g1")
	err := h.HandlePred(msgOf(t, pred))
	if !errors.Is(err, schemas.ErrUnusable) || !strings.Contains(err.Error(), "3/g1: no execution within 50ms") {
		t.Fatalf("lone prediction: %v; want ErrUnusable naming the missing execution", err)
	}
	err = h.HandleExecution(msgOf(t, exec))
	if !errors.Is(err, schemas.ErrUnusable) || !strings.Contains(err.Error(), "no prediction") {
		t.Fatalf("execution after its prediction gave up: %v; want it to wait afresh and give up too", err)
	}
	if len(h.slots) != 0 || pub.count() != 0 {
		t.Fatalf("%d slots held, %d pairs published after both gave up", len(h.slots), pub.count())
	}

	pred, exec = sides("g2")
	done := make(chan error, 1)
	go func() { done <- h.HandlePred(msgOf(t, pred)) }()
	if err := h.HandleExecution(msgOf(t, exec)); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if len(h.slots) != 0 || pub.count() != 1 {
		t.Fatalf("%d slots held, %d pairs published; want 0 and 1", len(h.slots), pub.count())
	}
}
