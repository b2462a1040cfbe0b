// Package predict scores every trajectory with the world model. It is
// stateless: several processes of it share the work of one run.
package predict

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/breaker"
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
	// Verdict is the outcome the model predicted (one of the execution
	// statuses but sandbox_error; the most frequent over its samples), and
	// Rationale why, as it said: for audits of its misses. Empty when the
	// model says neither (the simulated one).
	Verdict, Rationale string
}

// MaxRationale bounds a rationale as it travels (prediction, update,
// archive): a sentence is asked for, and a model may write pages.
const MaxRationale = 500

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
	// LastAttempt reports whether msg is on its last delivery before it is
	// dead-lettered (nil: never). A world model still failing then gets the
	// group recorded as ungraded, with the reason, so that its step is
	// fused without it rather than waiting for a prediction that will never
	// come; the error is still returned, for the dead letters.
	LastAttempt func(*message.Message) bool
	// Breaker, if set, stops asking a world model that keeps failing.
	Breaker *breaker.Breaker
	// Predicted, if set, is told of the scores of every group the world
	// model answered, graded or not (not of a group given up on).
	Predicted func([]Score)
}

// Handle predicts one group. Invalid input wraps schemas.ErrInvalid; a
// group the breaker does not let through, schemas.ErrDown.
func (h *Handler) Handle(msg *message.Message) error {
	var g schemas.Group
	if err := schemas.Decode(msg.Payload, h.Run, &g); err != nil {
		return fmt.Errorf("predict: %w", err)
	}
	call, err := h.Breaker.Ask()
	if err != nil {
		err = fmt.Errorf("predict: world model on group %s: not asked: %w", g.GroupID, err)
		return h.giveUp(g, err, err.Error())
	}
	ctx, cancel := call.Context(msg.Context())
	scores, err := h.WM.Predict(ctx, g.Trajectories)
	cancel()
	if err == nil && len(scores) != len(g.Trajectories) {
		err = fmt.Errorf("returned %d scores for %d trajectories", len(scores), len(g.Trajectories))
	}
	if down := call.End(msg.Context(), err); down != nil {
		err = fmt.Errorf("predict: world model on group %s: %w", g.GroupID, down)
		return h.giveUp(g, err, err.Error())
	}
	if err != nil {
		err = fmt.Errorf("predict: world model on group %s: %w", g.GroupID, err)
		if h.LastAttempt == nil || !h.LastAttempt(msg) || msg.Context().Err() != nil {
			return err
		}
		return h.giveUp(g, err, "world model failed on every attempt: "+err.Error())
	}
	if h.Predicted != nil {
		h.Predicted(scores)
	}
	return h.publish(g, scores)
}

// giveUp records every trajectory of g as ungraded, with reason, so that
// its step is fused without it, and returns why, for the dead letters. If
// the record cannot be stored, the message is kept (an outage) rather than
// dead-lettered: its step would wait for good for the group.
func (h *Handler) giveUp(g schemas.Group, why error, reason string) error {
	scores := make([]Score, len(g.Trajectories))
	for i := range scores {
		scores[i].Reason = reason
	}
	if err := h.publish(g, scores); err != nil {
		return fmt.Errorf("%v (and recording the group as ungraded failed: %w: %w)", why, schemas.ErrOutage, err)
	}
	return fmt.Errorf("%w (recorded the group as ungraded)", why)
}

func (h *Handler) publish(g schemas.Group, scores []Score) error {
	p := schemas.Prediction{
		Schema: schemas.Version, Run: g.Run, Step: g.Step, GroupID: g.GroupID, Anchor: g.Anchor,
		Model: h.WM.Name(), Items: make([]schemas.PredItem, len(scores)),
	}
	for i, s := range scores {
		it := schemas.PredItem{TrajID: g.Trajectories[i].TrajID, Status: schemas.PredOK, Spread: s.Spread,
			ResponseChars: len(g.Trajectories[i].Response)}
		switch {
		case s.Graded && !schemas.ScoreInRange(s.Value):
			it.Status, it.Reason = schemas.PredUngraded, fmt.Sprintf("the world model's score %g is beyond ±%g, the largest the pipeline takes", s.Value, schemas.MaxScore)
		case s.Graded:
			v := s.Value
			it.Score = &v
			it.Verdict, it.Rationale = s.Verdict, schemas.Clip(s.Rationale, MaxRationale)
		default:
			it.Status, it.Reason = schemas.PredUngraded, s.Reason
		}
		if !schemas.ScoreInRange(it.Spread) {
			it.Spread = 0
		}
		p.Items[i] = it
	}
	out, err := schemas.NewMessage(fmt.Sprintf("%s/pred/%d/%s", g.Run, g.Step, g.GroupID), p)
	if err != nil {
		return err
	}
	return h.Pub.Publish(h.Out, out)
}
