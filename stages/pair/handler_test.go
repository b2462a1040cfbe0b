package pair

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

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
