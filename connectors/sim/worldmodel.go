package sim

import (
	"context"
	"math"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/predict"
)

// WorldModel predicts a score as a monotone distortion of the true quality
// plus noise: clip(Offset + Scale*q^Power + Noise*N(0,1), 0, 1). The default
// (0.25 + 0.5 q^2, noise 0.05) is compressed and over-confident at the low
// end. The noise is a deterministic function of the trajectory.
type WorldModel struct {
	Offset, Scale, Power, Noise float64
	// UngradedEvery > 0 makes every n-th trajectory (by content) ungraded,
	// as an unparseable reply would be.
	UngradedEvery int
}

var _ predict.WorldModel = (*WorldModel)(nil)

// DefaultWorldModel is the default bias and noise.
func DefaultWorldModel() *WorldModel {
	return &WorldModel{Offset: 0.25, Scale: 0.5, Power: 2, Noise: 0.05}
}

// Name identifies the model in predictions.
func (w *WorldModel) Name() string { return "sim" }

// Bias is the noiseless prediction for quality q.
func (w *WorldModel) Bias(q float64) float64 { return w.Offset + w.Scale*math.Pow(q, w.Power) }

// Predict scores each trajectory.
func (w *WorldModel) Predict(_ context.Context, trajs []schemas.Trajectory) ([]predict.Score, error) {
	out := make([]predict.Score, len(trajs))
	for i, t := range trajs {
		r := rng(t.TrajID, t.Response, "wm")
		if w.UngradedEvery > 0 && r.IntN(w.UngradedEvery) == 0 {
			out[i] = predict.Score{Reason: "simulated unparseable reply"}
			continue
		}
		out[i] = predict.Score{Value: clip01(w.Bias(Quality(t)) + w.Noise*r.NormFloat64()), Graded: true}
	}
	return out, nil
}
