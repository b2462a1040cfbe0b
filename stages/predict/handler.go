// Package predict scores every trajectory with the world model. It is
// stateless: several processes of it share the work of one run.
package predict

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
)

// Score is the world model's verdict on one trajectory.
type Score struct {
	Value float64
	// Graded is false when the reply could not be used; Reason says why.
	// An ungraded trajectory is dropped downstream, never scored as 0.
	Graded bool
	Reason string
	// Spread is the standard deviation over the model's samples, if several.
	Spread float64
}

// WorldModel predicts execution outcomes. An error means the whole call
// failed (it is retried); a per-trajectory failure is an ungraded Score.
type WorldModel interface {
	Predict(ctx context.Context, trajs []schemas.Trajectory) ([]Score, error)
	Name() string
}

// Handler is the predict stage: a Group in, a Prediction out.
type Handler struct {
	Run string
	Out string // prediction subject
	Pub message.Publisher
	WM  WorldModel
}

// Handle predicts one group. Invalid input wraps schemas.ErrInvalid.
func (h *Handler) Handle(msg *message.Message) error {
	var g schemas.Group
	if err := schemas.Decode(msg.Payload, h.Run, &g); err != nil {
		return fmt.Errorf("predict: %w", err)
	}
	scores, err := h.WM.Predict(msg.Context(), g.Trajectories)
	if err != nil {
		return fmt.Errorf("predict: world model on group %s: %w", g.GroupID, err)
	}
	if len(scores) != len(g.Trajectories) {
		return fmt.Errorf("predict: world model returned %d scores for %d trajectories", len(scores), len(g.Trajectories))
	}
	p := schemas.Prediction{
		Schema: schemas.Version, Run: g.Run, Step: g.Step, GroupID: g.GroupID, Anchor: g.Anchor,
		Model: h.WM.Name(), Items: make([]schemas.PredItem, len(scores)),
	}
	for i, s := range scores {
		it := schemas.PredItem{TrajID: g.Trajectories[i].TrajID, Status: schemas.PredOK, Spread: s.Spread,
			ResponseChars: len(g.Trajectories[i].Response)}
		if s.Graded {
			v := s.Value
			it.Score = &v
		} else {
			it.Status, it.Reason = schemas.PredUngraded, s.Reason
		}
		p.Items[i] = it
	}
	out, err := schemas.NewMessage(fmt.Sprintf("%s/pred/%d/%s", g.Run, g.Step, g.GroupID), p)
	if err != nil {
		return err
	}
	return h.Pub.Publish(h.Out, out)
}
