package offline

import (
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/wmrl/wmrl/connectors/sim/rl"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/fuse"
)

// ErrNoRanking is returned by Expect for a run without an anchor group
// whose true and predicted scores both vary: nothing measures how well its
// world model ranks.
var ErrNoRanking = errors.New("no anchor group with varying scores: the world model's within-group ranking is unmeasured")

// ExpectOptions set the benchmark an audit runs at the audited world model.
type ExpectOptions struct {
	// Seeds (default 8), Optimizer and Costs (default rl.DefaultCosts)
	// are wmrl sim's --seeds, --optimizer, --cost-wm and --cost-exec. The
	// default optimizer is the benchmark's, SGD, for a run of standardised
	// advantages, and Adam for one of centred advantages, which SGD at the
	// benchmark's learning rate leaves short (steps five or more times
	// shorter; the README's "Under Dr. GRPO's advantages").
	Seeds     int
	Optimizer rl.Optimizer
	Costs     rl.Costs
	// Progress, if set, is called after each training run.
	Progress func(done, total int)
}

// Expect runs wmrl sim's methods on a simulated world model that ranks
// within groups as the audited one did on its anchors, with the run's
// shape (the median groups per step and group size of its updates) and
// its recorded correction settings (anchor fraction and rounding,
// calibration, rho estimator, advantages): what the sweep of wmrl sim tells a user to
// expect, at their own point. The
// within-group Spearman is the first quarter of the steps' (RankTrend; all
// anchor groups' for a run of fewer than 8 steps that have one): the
// simulated world model is placed by its ranking of uniformly drawn
// solutions, and a run's earliest groups are its most varied, while a
// learning policy's groups grow alike, which lowers the correlation an
// audit measures however good the world model (rl.TrainAudited).
func Expect(a *Audit, s archive.Settings, o ExpectOptions) (*rl.Expectation, error) {
	corr, measured := float64(a.Overall.Ranks.WithinSpearman), "all anchor groups"
	if math.IsNaN(corr) || a.Overall.Ranks.Groups == 0 {
		return nil, fmt.Errorf("expect: run %s: %w", a.Run, ErrNoRanking)
	}
	if first, _, _, ok := a.RankTrend(); ok {
		corr, measured = first, "the first quarter of the steps"
	}
	groups, size := a.groups, a.size
	if groups == 0 || size < 2 {
		return nil, fmt.Errorf("expect: run %s: no step with a group of 2 or more trajectories", a.Run)
	}
	cfg := rl.DefaultConfig()
	cfg.Groups, cfg.GroupSize = groups, size
	cfg.AnchorFraction, cfg.AnchorRounding, cfg.Debiaser = s.AnchorFraction, s.AnchorRounding, s.Debiaser
	cfg.AdvantageNorm = s.AdvantageNorm.Effective()
	switch {
	case o.Optimizer != "":
		cfg.Optimizer = o.Optimizer
	case cfg.AdvantageNorm == fuse.CenterOnly:
		cfg.Optimizer = rl.Adam
	}
	if o.Costs != (rl.Costs{}) {
		cfg.Costs = o.Costs
	}
	if o.Seeds == 0 {
		o.Seeds = 8
	}
	est := s.Denoiser.Estimator
	if est == "" { // the pipeline's default, recorded as unset; the benchmark reads "" as off
		est = fuse.DefaultEstimator
	}
	e, err := rl.Expect(rl.ExpectConfig{Config: cfg, RankCorr: corr, Measured: measured, Debias: s.Debias, Estimator: est,
		Seeds: o.Seeds, Progress: o.Progress})
	if err != nil {
		return nil, fmt.Errorf("expect: run %s: %w", a.Run, err)
	}
	return e, nil
}

// shapeAcc gathers a run's shape: its median groups per step and median
// group size, over its updates' rows (late anchor pairs repeat groups
// already counted).
type shapeAcc struct {
	perGroup map[groupKey]int // trajectories
}

func (sh *shapeAcc) add(r archive.Row) {
	if r.Source == archive.SourceLateAnchor {
		return
	}
	if sh.perGroup == nil {
		sh.perGroup = map[groupKey]int{}
	}
	sh.perGroup[groupKey{r.Step, r.GroupID}]++
}

func (sh *shapeAcc) result() (groups, size int) {
	perStep := map[int64]int{}
	var ss []int
	for g, n := range sh.perGroup {
		perStep[g.step]++
		ss = append(ss, n)
	}
	var gs []int
	for _, n := range perStep {
		gs = append(gs, n)
	}
	return median(gs), median(ss)
}

func median(xs []int) int {
	if len(xs) == 0 {
		return 0
	}
	slices.Sort(xs)
	return xs[len(xs)/2]
}
