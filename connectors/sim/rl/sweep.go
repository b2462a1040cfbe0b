package rl

import (
	"math"
	"math/rand/v2"

	"github.com/wmrl/wmrl/stages/fuse"
)

// SweepCell is the wmrl-grpo gap at equal steps for one world-model noise
// level and anchor fraction.
type SweepCell struct {
	Fresh          float64 `json:"fresh_noise"`
	RankCorr       float64 `json:"within_group_rank_corr"`
	AnchorFraction float64 `json:"anchor_fraction"`
	Gap            Stat    `json:"gap_wmrl_minus_grpo"`
	CostRatio      float64 `json:"cost_ratio_to_grpo"`
}

// SweepNoise and SweepFractions span the sweep.
var (
	SweepNoise     = []float64{0.02, 0.05, 0.1, 0.2, 0.4}
	SweepFractions = []float64{0.05, 0.1, 0.25, 0.5}
)

// RankCorrelation is the world model's mean within-group Spearman
// correlation with executed scores, for groups of g styles drawn uniformly,
// as an untrained policy draws them: a property of the world model alone.
// An audit of a training run measures less (TrainAudited) once the
// policy's groups grow alike.
func RankCorrelation(env *Env, g int, seed uint64) float64 {
	r := rand.New(rand.NewPCG(seed, 9))
	var sum float64
	const groups = 2000
	pred, truth := make([]float64, g), make([]float64, g)
	for i := 0; i < groups; i++ {
		t := r.IntN(env.Tasks)
		for j := range pred {
			s := r.IntN(env.Styles)
			pred[j], truth[j] = env.Predict(r, t, s), env.Execute(r, t, s)
		}
		sum += spearman(pred, truth)
	}
	return sum / groups
}

// spearman is the audit's within-group rank correlation (fuse.Spearman,
// average ranks for ties), with 0 where a side is constant.
func spearman(a, b []float64) float64 {
	if c := fuse.Spearman(a, b); !math.IsNaN(c) {
		return c
	}
	return 0
}

// Sweep measures the gap between wmrl and grpo at equal steps over world-model
// noise (reported as within-group rank correlation) and anchor fraction, in
// the monotone scenario, with newRewarder (nil: the core packages).
func Sweep(cfg Config, seeds int, newRewarder NewRewarder, progress func(done, total int)) ([]SweepCell, error) {
	if newRewarder == nil {
		newRewarder = NewCoreRewarder
	}
	base, _ := ScenarioByName("monotone")
	grpo := make([]float64, seeds)
	total := seeds * (1 + len(SweepNoise)*len(SweepFractions))
	done := 0
	tick := func() {
		done++
		if progress != nil {
			progress(done, total)
		}
	}
	for s := range grpo {
		c := cfg
		c.Seed = uint64(1000 + s)
		curve, err := TrainWith(c, base, Methods[0], newRewarder)
		if err != nil {
			return nil, err
		}
		grpo[s] = curve[len(curve)-1].Reward
		tick()
	}
	wmrl := Methods[index(Methods, "wmrl")]
	var cells []SweepCell
	for _, fresh := range SweepNoise {
		sc := base
		sc.Fresh = fresh
		corr := RankCorrelation(cfg.newEnv(1000, sc), cfg.GroupSize, 1)
		for _, f := range SweepFractions {
			c := cfg
			c.AnchorFraction = f
			gaps := make([]float64, seeds)
			var cost float64
			for s := range gaps {
				c.Seed = uint64(1000 + s)
				curve, err := TrainWith(c, sc, wmrl, newRewarder)
				if err != nil {
					return nil, err
				}
				last := curve[len(curve)-1]
				gaps[s], cost = last.Reward-grpo[s], last.Cost
				tick()
			}
			grpoCost := float64(cfg.Steps*cfg.Groups*cfg.GroupSize) * (cfg.Costs.Generate + cfg.Costs.Execute)
			cells = append(cells, SweepCell{Fresh: fresh, RankCorr: corr, AnchorFraction: f, Gap: statOf(gaps), CostRatio: cost / grpoCost})
		}
	}
	return cells, nil
}
