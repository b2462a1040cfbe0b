package rl

import (
	"fmt"
	"math"

	"github.com/wmrl/wmrl/stages/fuse"
)

// ExpectConfig places a real run's world model in the benchmark: the
// within-group rank correlation an audit measured on its anchors, with
// the run's shape and correction settings in Config (groups per step,
// group size, anchor fraction and rounding, calibration).
type ExpectConfig struct {
	Config Config
	// RankCorr is the world model's mean within-group Spearman correlation
	// with the executed scores, in [-1, 1], best measured on the run's
	// earliest groups: the simulated world model is placed by its
	// correlation over solutions drawn uniformly (RankCorrelation), as an
	// untrained policy draws them.
	RankCorr float64
	// Measured says over what RankCorr was measured, for the report.
	Measured string
	// Debias and Estimator are the run's corrections: the isotonic map on
	// or off, and its rho estimator ("" or "off": rho 1).
	Debias    bool
	Estimator fuse.Estimator
	Seeds     int
	// Name is the scenario's in the table and the plot's file name
	// (default "audited").
	Name string
	// Progress, if set, is called after each training run. NewRewarder
	// scores the steps (default NewCoreRewarder).
	Progress    func(done, total int)
	NewRewarder NewRewarder
}

// Expectation is what the benchmark says of a world model that ranks as a
// run's did: the methods a user weighs (grpo, grpo on the anchors alone,
// the world model alone, wmrl with the run's corrections), on a simulated
// world model with the same within-group rank correlation.
type Expectation struct {
	// RankCorr is the run's; SimRankCorr the simulated world model's, the
	// nearest the scenario reaches (Note says why when they differ).
	RankCorr    float64 `json:"within_group_rank_corr"`
	SimRankCorr float64 `json:"sim_rank_corr"`
	// Measured says over what RankCorr was measured (ExpectConfig.Measured).
	Measured string `json:"measured,omitempty"`
	// SimAuditedRankCorr is what an audit of a simulated wmrl run at this
	// world model (seed 1000) measures over all its anchor groups. It is
	// lower than SimRankCorr where the world model trains the policy well:
	// the simulated policy's groups converge on copies of one solution,
	// whose scores differ by execution noise alone.
	SimAuditedRankCorr float64 `json:"sim_audited_rank_corr"`
	// Scenario is the placed world model: its fresh noise per call and
	// error per (task, style), and Reversed for the adversarial
	// distortion. Note says why it is not at RankCorr, if it is not.
	Scenario   Scenario `json:"-"`
	Fresh      float64  `json:"fresh_noise"`
	Persistent float64  `json:"persistent_noise"`
	Reversed   bool     `json:"reversed"`
	Note       string   `json:"note,omitempty"`
	// Seeds is how many seeds each method trained on (paired).
	Seeds int `json:"seeds"`
	// Config is the benchmark's: the run's shape and settings.
	Config         Config             `json:"-"`
	Groups         int                `json:"groups"`
	GroupSize      int                `json:"group_size"`
	AnchorFraction float64            `json:"anchor_fraction"`
	AnchorRounding string             `json:"anchor_rounding,omitempty"`
	Optimizer      Optimizer          `json:"optimizer"`
	AdvantageNorm  fuse.Normalization `json:"advantage_norm"`
	Steps          int                `json:"steps"`
	Costs          Costs              `json:"cost_model"`
	// Debias and Estimator are wmrl's corrections (ExpectConfig).
	Debias    bool           `json:"debias"`
	Estimator fuse.Estimator `json:"rho_estimator"`
	// Methods are those run, in Result's table order.
	Methods []Method       `json:"-"`
	Result  ScenarioResult `json:"result"`
}

// maxExpectNoise bounds the noise level place searches: far past where the
// simulated world model's ranking is lost in it.
const maxExpectNoise = 4.0

// Expect trains grpo, grpo-anchors, wm and wmrl (with the run's
// corrections) on the monotone scenario with its error set so that the
// simulated world model's within-group rank correlation is the run's: past
// the scenario's own, fresh noise is added to its persistent error per
// (task, style); above it, the persistent error shrinks (an audit cannot
// tell the two kinds apart without repeated predictions, so the split is
// the scenario's). A negative correlation uses the adversarial distortion
// (better solutions scored lower).
func Expect(c ExpectConfig) (*Expectation, error) {
	if math.IsNaN(c.RankCorr) || c.RankCorr < -1 || c.RankCorr > 1 {
		return nil, fmt.Errorf("rl: expect: rank correlation %v is not in [-1, 1]", c.RankCorr)
	}
	if c.Seeds < 2 {
		return nil, fmt.Errorf("rl: expect: %d seeds: intervals need at least 2", c.Seeds)
	}
	cfg := c.Config
	e := &Expectation{RankCorr: c.RankCorr, Measured: c.Measured, Seeds: c.Seeds, Config: cfg, Groups: cfg.Groups, GroupSize: cfg.GroupSize,
		AnchorFraction: cfg.AnchorFraction, AnchorRounding: cfg.AnchorRounding, Optimizer: cfg.Optimizer, AdvantageNorm: cfg.AdvantageNorm.Effective(), Steps: cfg.Steps, Costs: cfg.Costs,
		Debias: c.Debias, Estimator: c.Estimator}
	sc := e.place(cfg)
	wmrl := Method{Name: "wmrl", Debias: c.Debias, Estimator: c.Estimator}
	audited := cfg
	audited.Seed = 1000
	_, simAudited, err := TrainAudited(audited, sc, wmrl, c.NewRewarder)
	if err != nil {
		return nil, fmt.Errorf("rl: expect: %w", err)
	}
	e.SimAuditedRankCorr = simAudited
	sc.Name = c.Name
	if sc.Name == "" {
		sc.Name = "audited"
	}
	reversed := ""
	if e.Reversed {
		reversed = ", better solutions scored lower"
	}
	sc.Doc = fmt.Sprintf("a world model ranking at %.3f within groups (fresh noise %.3f, persistent %.3f%s)",
		e.SimRankCorr, e.Fresh, e.Persistent, reversed)
	e.Scenario = sc
	e.Methods = []Method{Methods[index(Methods, "grpo")], Methods[index(Methods, "grpo-anchors")], Methods[index(Methods, "wm")], wmrl}
	res, err := Run(Options{Config: c.Config, Seeds: c.Seeds, Scenarios: []Scenario{sc}, Methods: e.Methods, Progress: c.Progress, NewRewarder: c.NewRewarder})
	if err != nil {
		return nil, fmt.Errorf("rl: expect: %w", err)
	}
	e.Result = res[0]
	return e, nil
}

// place sets the monotone scenario's error (or the adversarial one's, for
// a negative correlation) so that its within-group rank correlation in
// groups of cfg.GroupSize is e.RankCorr, or as near as it comes, and
// records where it landed in e.
func (e *Expectation) place(cfg Config) Scenario {
	sc, _ := ScenarioByName("monotone")
	want, sign := e.RankCorr, 1.0
	if want < 0 {
		adv, _ := ScenarioByName("adversarial")
		sc.Distort, want, sign, e.Reversed = adv.Distort, -want, -1, true
	}
	// One noise level spans the range: up to the scenario's persistent
	// error it is persistent error alone (a world model better than the
	// scenario's), past it the scenario's persistent error plus fresh noise.
	persistent := sc.Persistent
	at := func(level float64) Scenario {
		s := sc
		s.Persistent, s.Fresh = min(level, persistent), max(level-persistent, 0)
		return s
	}
	corr := func(level float64) float64 {
		return sign * RankCorrelation(cfg.newEnv(1000, at(level)), cfg.GroupSize, 1)
	}
	var level float64
	best, worst := corr(0), corr(maxExpectNoise)
	switch {
	case want >= best:
		e.Note = fmt.Sprintf("the nearest the simulated world model comes is %.3f, with no error of its own (what is left is the execution noise); placed there", sign*best)
	case want <= worst:
		level = maxExpectNoise
		e.Note = fmt.Sprintf("a rank correlation this close to 0 is no information: placed at the simulated world model's %.3f", sign*worst)
	default:
		lo, hi := 0.0, maxExpectNoise // corr(lo) > want > corr(hi)
		for range 40 {
			mid := (lo + hi) / 2
			if corr(mid) > want {
				lo = mid
			} else {
				hi = mid
			}
		}
		level = (lo + hi) / 2
	}
	sc = at(level)
	e.Fresh, e.Persistent, e.SimRankCorr = sc.Fresh, sc.Persistent, sign*corr(level)
	return sc
}
