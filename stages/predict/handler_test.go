package predict

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
)

type downWorldModel struct{}

func (downWorldModel) Name() string { return "down" }
func (downWorldModel) Predict(context.Context, []schemas.Trajectory) ([]Score, error) {
	return nil, errors.New("connection refused")
}

type recorder struct{ msgs []*message.Message }

func (r *recorder) Publish(_ string, msgs ...*message.Message) error {
	r.msgs = append(r.msgs, msgs...)
	return nil
}
func (r *recorder) Close() error { return nil }

// A failing world model is retried (nothing published) until the last
// attempt, which records the group as ungraded with the reason and still
// reports the error; a shutdown records nothing.
func TestLastAttemptRecordsTheGroupAsUngraded(t *testing.T) {
	g := schemas.Group{Schema: schemas.Version, Run: "r", Step: 2, GroupID: "g", TaskID: "t", Anchor: true,
		Trajectories: []schemas.Trajectory{{TrajID: "a"}, {TrajID: "b"}}}
	payload, _ := json.Marshal(g)
	last := false
	pub := &recorder{}
	h := &Handler{Run: "r", Out: "pred", Pub: pub, WM: downWorldModel{}, LastAttempt: func(*message.Message) bool { return last }}
	msg := func(ctx context.Context) *message.Message {
		m := message.NewMessage("id", payload)
		m.SetContext(ctx)
		return m
	}

	if err := h.Handle(msg(context.Background())); err == nil || len(pub.msgs) != 0 {
		t.Fatalf("not the last attempt: %v, %d published; want the error and nothing", err, len(pub.msgs))
	}
	last = true
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	if err := h.Handle(msg(cancelled)); err == nil || len(pub.msgs) != 0 {
		t.Fatalf("shutting down: %v, %d published; want the error and nothing", err, len(pub.msgs))
	}
	err := h.Handle(msg(context.Background()))
	if err == nil || !strings.Contains(err.Error(), "recorded the group as ungraded") || len(pub.msgs) != 1 {
		t.Fatalf("last attempt: %v, %d published; want the error and one prediction", err, len(pub.msgs))
	}
	var p schemas.Prediction
	if err := json.Unmarshal(pub.msgs[0].Payload, &p); err != nil {
		t.Fatal(err)
	}
	if p.GroupID != "g" || !p.Anchor || len(p.Items) != 2 {
		t.Fatalf("prediction %+v", p)
	}
	for _, it := range p.Items {
		if it.Score != nil || it.Status != schemas.PredUngraded || !strings.Contains(it.Reason, "connection refused") {
			t.Fatalf("item %+v: want ungraded with the world model's error", it)
		}
	}
}
