package rl

import (
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/wmrl/wmrl/stages/fuse"
)

// TestExpectPlacesTheWorldModel: a rank correlation read off the sweep's
// table lands on that row's noise, so an audit's expectation and the
// sweep agree; correlations the scenario cannot reach are placed at its
// nearest and say so; a negative one is an anti-correlated world model.
func TestExpectPlacesTheWorldModel(t *testing.T) {
	cfg := DefaultConfig()
	mono, _ := ScenarioByName("monotone")
	for _, fresh := range SweepNoise {
		sc := mono
		sc.Fresh = fresh
		corr := RankCorrelation(cfg.newEnv(1000, sc), cfg.GroupSize, 1)
		e := &Expectation{RankCorr: corr}
		got := e.place(cfg)
		if math.Abs(got.Fresh-fresh) > 0.002 || got.Persistent != mono.Persistent || e.Note != "" || e.Reversed {
			t.Errorf("rank corr %.3f (the sweep's noise %.2f): placed at fresh %.4f, persistent %.3f, note %q", corr, fresh, got.Fresh, got.Persistent, e.Note)
		}
		if math.Abs(e.SimRankCorr-corr) > 0.002 {
			t.Errorf("rank corr %.3f: the simulated world model ranks at %.3f", corr, e.SimRankCorr)
		}
	}

	better := &Expectation{RankCorr: 0.8} // above the scenario's 0.60: less persistent error
	if sc := better.place(cfg); sc.Fresh != 0 || sc.Persistent >= mono.Persistent || math.Abs(better.SimRankCorr-0.8) > 0.005 {
		t.Errorf("rank corr 0.8: fresh %.4f, persistent %.4f, simulated %.3f", sc.Fresh, sc.Persistent, better.SimRankCorr)
	}
	perfect := &Expectation{RankCorr: 0.999}
	if sc := perfect.place(cfg); sc.Fresh != 0 || sc.Persistent != 0 || perfect.SimRankCorr >= 0.99 || !strings.Contains(perfect.Note, "execution noise") {
		t.Errorf("rank corr 0.999: fresh %.4f, persistent %.4f, simulated %.3f, note %q", sc.Fresh, sc.Persistent, perfect.SimRankCorr, perfect.Note)
	}
	none := &Expectation{RankCorr: 0}
	if none.place(cfg); !strings.Contains(none.Note, "no information") || math.Abs(none.SimRankCorr) > 0.05 {
		t.Errorf("rank corr 0: simulated %.3f, note %q", none.SimRankCorr, none.Note)
	}
	anti := &Expectation{RankCorr: -0.4}
	if anti.place(cfg); !anti.Reversed || math.Abs(anti.SimRankCorr+0.4) > 0.005 {
		t.Errorf("rank corr -0.4: reversed %v, simulated %.3f", anti.Reversed, anti.SimRankCorr)
	}
}

// TestExpectFollowsTheWorldModel: the methods that use the world model do
// worse the worse it ranks, GRPO does not move, and WMRL's fallback on its
// anchors holds more of the reward the worse it ranks; the run's rho
// estimator is the one trained with.
func TestExpectFollowsTheWorldModel(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Steps, cfg.Groups, cfg.GroupSize, cfg.AnchorFraction = 120, 8, 4, 0.25
	expect := func(corr float64, est fuse.Estimator) *Expectation {
		t.Helper()
		e, err := Expect(ExpectConfig{Config: cfg, RankCorr: corr, Debias: true, Estimator: est, Seeds: 4})
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, m := range e.Methods {
			names = append(names, m.Name)
		}
		if !slices.Equal(names, []string{"grpo", "grpo-anchors", "wm", "wmrl"}) || len(e.Result.Methods) != 4 {
			t.Fatalf("methods %v", names)
		}
		if e.Groups != 8 || e.GroupSize != 4 || e.AnchorFraction != 0.25 || e.Steps != 120 {
			t.Errorf("the expectation records %d groups of %d, fraction %v, %d steps", e.Groups, e.GroupSize, e.AnchorFraction, e.Steps)
		}
		return e
	}
	good, poor := expect(0.6, fuse.DefaultEstimator), expect(0.1, fuse.DefaultEstimator)
	g, p := good.Result.Methods, poor.Result.Methods
	if g["grpo"].FinalReward != p["grpo"].FinalReward {
		t.Errorf("grpo's reward depends on the world model: %.4f against %.4f", g["grpo"].FinalReward, p["grpo"].FinalReward)
	}
	if g["wm"].FinalReward <= p["wm"].FinalReward || g["wmrl"].FinalReward <= p["wmrl"].FinalReward {
		t.Errorf("a better-ranking world model did not train better: wm %.4f vs %.4f, wmrl %.4f vs %.4f",
			g["wm"].FinalReward, p["wm"].FinalReward, g["wmrl"].FinalReward, p["wmrl"].FinalReward)
	}
	if lift := p["wmrl"].FinalReward - p["wm"].FinalReward; lift <= g["wmrl"].FinalReward-g["wm"].FinalReward || lift <= 0 {
		t.Errorf("wmrl over wm: %.4f with a poor world model, %.4f with a good one", lift, g["wmrl"].FinalReward-g["wm"].FinalReward)
	}
	if p["wmrl"].Rho <= g["wmrl"].Rho {
		t.Errorf("rho %.3f with a poor world model, %.3f with a good one", p["wmrl"].Rho, g["wmrl"].Rho)
	}
	if off := expect(0.1, fuse.EstimatorOff); off.Result.Methods["wmrl"].Rho != 1 {
		t.Errorf("with the run's rho off, wmrl trained at rho %.3f", off.Result.Methods["wmrl"].Rho)
	}
}

func TestExpectRejectsWhatItCannotPlace(t *testing.T) {
	for _, c := range []ExpectConfig{
		{Config: DefaultConfig(), RankCorr: 1.5, Seeds: 4},
		{Config: DefaultConfig(), RankCorr: math.NaN(), Seeds: 4},
		{Config: DefaultConfig(), RankCorr: 0.5, Seeds: 1},
	} {
		if _, err := Expect(c); err == nil || !strings.Contains(err.Error(), "rl: expect:") {
			t.Errorf("Expect(rank corr %v, %d seeds): %v", c.RankCorr, c.Seeds, err)
		}
	}
}

// TestAnAuditOfATrainingRunMeasuresLess: the within-group rank correlation
// over a run's anchor groups, as wmrl audit measures it, is below the
// world model's over uniformly drawn solutions where the policy learns
// enough for its groups to grow alike (monotone), and not above it where
// it learns little (noisy); it is still the world model's (positive, and
// lower for the noisier one).
func TestAnAuditOfATrainingRunMeasuresLess(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Seed = 1000
	wmrl := Methods[index(Methods, "wmrl")]
	var audited, uniform []float64
	for _, name := range []string{"monotone", "noisy"} {
		sc, _ := ScenarioByName(name)
		_, a, err := TrainAudited(cfg, sc, wmrl, nil)
		if err != nil {
			t.Fatal(err)
		}
		audited, uniform = append(audited, a), append(uniform, RankCorrelation(cfg.newEnv(1000, sc), cfg.GroupSize, 1))
	}
	if audited[0] <= 0 || audited[0] >= uniform[0]-0.05 || audited[1] > uniform[1]+0.01 {
		t.Errorf("the runs' anchor groups rank at %.3f (monotone) and %.3f (noisy); uniformly drawn solutions at %.3f and %.3f",
			audited[0], audited[1], uniform[0], uniform[1])
	}
	if audited[1] >= audited[0] {
		t.Errorf("the noisy world model's run audits at %.3f, the monotone one's at %.3f", audited[1], audited[0])
	}
}
