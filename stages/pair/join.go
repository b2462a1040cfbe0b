// Package pair joins an anchor group's world-model predictions with its
// real execution into (predicted, true) pairs for calibration.
package pair

import "github.com/wmrl/wmrl/schemas"

// Pairs builds the pairs of one anchor group: trajectories graded on both
// sides, in the prediction's order. Trajectories missing on either side, or
// ungraded there, are left out.
func Pairs(p schemas.Prediction, e schemas.Execution) schemas.PairGroup {
	truth := make(map[string]float64, len(e.Items))
	for _, it := range e.Items {
		if it.Score != nil {
			truth[it.TrajID] = *it.Score
		}
	}
	out := schemas.PairGroup{Schema: schemas.Version, Run: p.Run, Step: p.Step, GroupID: p.GroupID, Pairs: []schemas.PairItem{}}
	for _, it := range p.Items {
		s, ok := truth[it.TrajID]
		if it.Score == nil || !ok {
			continue
		}
		out.Pairs = append(out.Pairs, schemas.PairItem{TrajID: it.TrajID, Predicted: *it.Score, True: s})
	}
	return out
}
