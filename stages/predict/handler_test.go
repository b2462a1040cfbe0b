package predict

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
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
