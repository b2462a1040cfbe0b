package rl

import (
	"math"

	"github.com/wmrl/wmrl/stages/fuse"
)

// auditing records, for every anchor group a rewarder executes, the world
// model's within-group Spearman correlation with the executed scores: what
// wmrl audit measures over a run's archive (groups where a side is constant
// are skipped, as the audit does). The draws are keyed by the trajectory's
// place, so recomputing them here gives the scores the rewarder used.
type auditing struct {
	Rewarder
	env *Env
	sum float64
	n   int
}

func (a *auditing) Reward(step int, groups [][]Traj) (StepRewards, error) {
	out, err := a.Rewarder.Reward(step, groups)
	if err != nil {
		return out, err
	}
	for g, trajs := range groups {
		if !out.Anchor[g] {
			continue
		}
		pred, truth := make([]float64, len(trajs)), make([]float64, len(trajs))
		for i, tr := range trajs {
			pred[i], truth[i] = a.env.PredictAt(step, g, i, tr), a.env.ExecuteAt(step, g, i, tr)
		}
		if c := fuse.Spearman(pred, truth); !math.IsNaN(c) {
			a.sum += c
			a.n++
		}
	}
	return out, nil
}

// mean is the mean within-group Spearman over the anchor groups seen (NaN:
// none).
func (a *auditing) mean() float64 {
	if a.n == 0 {
		return math.NaN()
	}
	return a.sum / float64(a.n)
}

// TrainAudited trains like TrainWith and also returns the within-group
// rank correlation an audit of the run's archive would report: the mean
// over its anchor groups. It is lower than RankCorrelation's over styles
// drawn uniformly where the policy learns enough for its groups to grow
// alike.
func TrainAudited(cfg Config, sc Scenario, m Method, newRewarder NewRewarder) ([]Point, float64, error) {
	if newRewarder == nil {
		newRewarder = NewCoreRewarder
	}
	var a *auditing
	curve, err := TrainWith(cfg, sc, m, func(cfg Config, env *Env, m Method) (Rewarder, error) {
		r, err := newRewarder(cfg, env, m)
		if err != nil {
			return nil, err
		}
		a = &auditing{Rewarder: r, env: env}
		return a, nil
	})
	if err != nil {
		return nil, 0, err
	}
	return curve, a.mean(), nil
}
