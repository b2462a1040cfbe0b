package rl

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/route"
)

// run trains the named methods on 8 fixed seeds of one scenario.
func run(t *testing.T, scenario string, methods ...string) ScenarioResult {
	t.Helper()
	return runWith(t, DefaultConfig(), scenario, methods...)
}

func runWith(t *testing.T, cfg Config, scenario string, methods ...string) ScenarioResult {
	t.Helper()
	sc, err := ScenarioByName(scenario)
	if err != nil {
		t.Fatal(err)
	}
	var ms []Method
	for _, n := range methods {
		ms = append(ms, Methods[index(Methods, n)])
	}
	res, err := Run(Options{Config: cfg, Seeds: 8, Scenarios: []Scenario{sc}, Methods: ms})
	if err != nil {
		t.Fatal(err)
	}
	return res[0]
}

func TestMonotoneScenario(t *testing.T) {
	r := run(t, "monotone", "grpo", "wm", "wmrl")
	g, w, wm := r.Methods["grpo"], r.Methods["wmrl"], r.Methods["wm"]
	t.Logf("grpo %.4f, wmrl %.4f (%+.4f ± %.4f at equal steps, %+.4f ± %.4f at equal cost), wm %.4f; cost ratio %.2f",
		g.FinalReward, w.FinalReward, w.DiffGRPO.Mean, w.DiffGRPO.CI95, w.EqualCostDiff.Mean, w.EqualCostDiff.CI95, wm.FinalReward, g.Cost/w.Cost)
	if w.EqualCostDiff.Mean-w.EqualCostDiff.CI95 <= 0 {
		t.Errorf("at equal cost wmrl does not clearly beat grpo: %+.4f ± %.4f", w.EqualCostDiff.Mean, w.EqualCostDiff.CI95)
	}
	// On these 8 seeds, the fixed seeds, wmrl ends 0.009 below grpo.
	// They are the favourable block: on seeds 1000-1031 the gap is 0.013 ±
	// 0.002 (README, "How far 8 seeds go"), so this guards against a
	// regression and is not evidence that the claim holds in general.
	if math.Abs(w.DiffGRPO.Mean) > 0.01 {
		t.Errorf("at equal steps wmrl is %+.4f from grpo; want within 0.01", w.DiffGRPO.Mean)
	}
	if wm.DiffGRPO.Mean+wm.DiffGRPO.CI95 >= 0 {
		t.Errorf("the uncorrected world model is not below grpo: %+.4f ± %.4f", wm.DiffGRPO.Mean, wm.DiffGRPO.CI95)
	}
	// The cost accounting itself: per step 128 generations and world-model
	// calls and 2 anchor groups of 8 executions (round_half_even(1.6) = 2).
	cfg := DefaultConfig()
	perStep := 128*(cfg.Costs.Generate+cfg.Costs.WorldModel) + 2*8*cfg.Costs.Execute
	if want := float64(cfg.Steps) * perStep; w.Cost != want || w.Executions != float64(cfg.Steps*16) {
		t.Errorf("wmrl cost %v and %v executions; the cost model gives %v and %d", w.Cost, w.Executions, want, cfg.Steps*16)
	}
}

// A world model without information, or an anti-correlated one: wmrl falls
// back on the anchors and stays far above the uncorrected world model.
func TestUselessAndAdversarialWorldModels(t *testing.T) {
	mono := run(t, "monotone", "wmrl").Methods["wmrl"].Rho
	for _, sc := range []string{"useless", "adversarial"} {
		r := run(t, sc, "wm", "wmrl", "denoise")
		w, wm, dn := r.Methods["wmrl"], r.Methods["wm"], r.Methods["denoise"]
		t.Logf("%s: wmrl %.4f (rho %.2f; monotone %.2f), denoise rho %.2f, wm %.4f", sc, w.FinalReward, w.Rho, mono, dn.Rho, wm.FinalReward)
		if w.FinalReward-wm.FinalReward < 0.1 {
			t.Errorf("%s: wmrl %.4f is not far above wm %.4f", sc, w.FinalReward, wm.FinalReward)
		}
		if dn.Rho <= mono {
			t.Errorf("%s: rho on the raw scores %.2f did not rise above monotone's %.2f", sc, dn.Rho, mono)
		}
		// In adversarial the isotonic map is flat: the calibrated world
		// model cannot rank a group, which the estimator reads as r = 0.
		if w.Rho <= mono {
			t.Errorf("%s: rho %.2f did not rise above monotone's %.2f", sc, w.Rho, mono)
		}
	}
}

// The evidence for the default estimator: the advantage gap beats the
// reference where the world model is weak.
func TestAdvantageEstimatorBeatsReference(t *testing.T) {
	for _, sc := range []string{"noisy", "useless"} {
		r := run(t, sc, "grpo", "wmrl-advantage", "wmrl-reference")
		a, ref := r.Methods["wmrl-advantage"], r.Methods["wmrl-reference"]
		t.Logf("%s: advantage %.4f, reference %.4f", sc, a.FinalReward, ref.FinalReward)
		if a.DiffGRPO.Mean <= ref.DiffGRPO.Mean {
			t.Errorf("%s: advantage %.4f does not beat reference %.4f", sc, a.FinalReward, ref.FinalReward)
		}
	}
}

func TestRewardAtCost(t *testing.T) {
	c := []Point{{Cost: 10, Reward: 0.1}, {Cost: 20, Reward: 0.3}, {Cost: 30, Reward: 0.4}}
	for _, tc := range []struct{ cost, want float64 }{{5, 0.1}, {15, 0.2}, {30, 0.4}, {99, 0.4}} {
		if got := RewardAtCost(c, tc.cost); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("RewardAtCost(%v) = %v, want %v", tc.cost, got, tc.want)
		}
	}
}

func TestCostToReach(t *testing.T) {
	c := []Point{{Cost: 10, Reward: 0.5}, {Cost: 20, Reward: 0.7}, {Cost: 30, Reward: 0.6}, {Cost: 40, Reward: 0.9}}
	for _, tc := range []struct {
		start, target float64
		want          float64 // -1: never
	}{
		{0.4, 0.45, 5},                          // between the start (cost 0) and the first point
		{0.4, 0.6, 15},                          // between points
		{0.4, 0.7, 20},                          // on a point
		{0.4, 0.8, 30 + 10*(0.8-0.6)/(0.9-0.6)}, // after a dip: the first crossing
		{0.4, 0.95, -1},                         // never
		{0.6, 0.55, 0},                          // the start is already there
	} {
		got, gotS := CostToReach(c, tc.start, tc.target), "never"
		if got != nil {
			gotS = fmt.Sprint(*got)
		}
		if (tc.want < 0) != (got == nil) || (got != nil && math.Abs(*got-tc.want) > 1e-12) {
			t.Errorf("target %v from %v: reached at %s, want %v (-1: never)", tc.target, tc.start, gotS, tc.want)
		}
	}
}

func TestSpearmanHandlesTies(t *testing.T) {
	if got := spearman([]float64{1, 2, 3, 4}, []float64{10, 20, 30, 40}); math.Abs(got-1) > 1e-12 {
		t.Fatalf("perfect order: %v", got)
	}
	if got := spearman([]float64{1, 2, 3, 4}, []float64{4, 3, 2, 1}); math.Abs(got+1) > 1e-12 {
		t.Fatalf("reversed: %v", got)
	}
	if got := spearman([]float64{1, 1, 1}, []float64{1, 2, 3}); got != 0 {
		t.Fatalf("constant side: %v", got)
	}
}

func TestAnchorGroupsRoundsHalfToEvenOrSpreads(t *testing.T) {
	for _, tc := range []struct {
		groups   int
		fraction float64
		rounding string
		want     float64
	}{
		{16, 0.10, "", 2},                  // 1.6
		{20, 0.10, "", 2},                  // 2.0: the fraction realised exactly
		{25, 0.10, route.RoundEven, 2},     // 2.5 rounds to even
		{35, 0.10, "", 4},                  // 3.5 rounds to even
		{4, 0.10, "", 1},                   // 0.4, raised to the minimum of one
		{16, 0.10, route.RoundSpread, 1.6}, // 1 or 2 a step: 480 in 300 steps
		{25, 0.10, route.RoundSpread, 2.5},
		{4, 0.10, route.RoundSpread, 1}, // the minimum still holds
	} {
		cfg := DefaultConfig()
		cfg.Groups, cfg.AnchorFraction, cfg.AnchorRounding = tc.groups, tc.fraction, tc.rounding
		got, err := cfg.AnchorGroups()
		if err != nil || got != tc.want {
			t.Errorf("%d groups at %v, rounding %q: %v anchor groups a step (err %v), want %v", tc.groups, tc.fraction, tc.rounding, got, err, tc.want)
		}
	}
	cfg := DefaultConfig()
	cfg.AnchorRounding = "up"
	if _, err := cfg.AnchorGroups(); err == nil || !strings.Contains(err.Error(), `rounding "up"`) {
		t.Errorf("rounding \"up\": %v", err)
	}
}

// Every method's curve costs what StepCost says its steps cost, and
// grpo-anchors draws and executes as many groups a step as wmrl executes,
// with either rounding.
func TestStepCostIsWhatTrainingSpends(t *testing.T) {
	for _, rounding := range route.Roundings {
		cfg := DefaultConfig()
		cfg.Steps, cfg.Seed, cfg.AnchorRounding = 6, 1000, rounding
		sc, _ := ScenarioByName("monotone")
		anchorsSeen := map[int]bool{}
		for _, m := range Methods {
			curve, err := Train(cfg, sc, m)
			if err != nil {
				t.Fatal(err)
			}
			cost, execs := 0.0, 0
			for i, p := range curve {
				per, err := StepCost(cfg, m, i)
				if err != nil {
					t.Fatal(err)
				}
				groups, executed, _ := StepShape(cfg, m, i)
				cost, execs = cost+per, execs+executed*cfg.GroupSize
				if p.Cost != cost || p.Executions != execs {
					t.Fatalf("%s, %s step %d: cost %v and %d executions; StepCost gives %v, StepShape %d", rounding, m.Name, p.Step, p.Cost, p.Executions, cost, execs)
				}
				if m.Name == "grpo-anchors" {
					_, wmrlExecuted, _ := StepShape(cfg, Methods[index(Methods, "wmrl")], i)
					if groups != wmrlExecuted || executed != groups {
						t.Fatalf("%s step %d: grpo-anchors draws %d groups and executes %d; wmrl executes %d", rounding, i, groups, executed, wmrlExecuted)
					}
					anchorsSeen[groups] = true
				}
			}
		}
		if want := map[string]int{route.RoundEven: 1, route.RoundSpread: 2}[rounding]; len(anchorsSeen) != want {
			t.Errorf("%s: grpo-anchors drew %v groups a step; want %d different counts", rounding, anchorsSeen, want)
		}
	}
	cfg := DefaultConfig()
	ga, _ := StepCost(cfg, Methods[index(Methods, "grpo-anchors")], 0)
	if want := float64(2*8) * (cfg.Costs.Generate + cfg.Costs.Execute); ga != want {
		t.Errorf("grpo-anchors: %v a step, want two groups of 8 generated and executed (%v)", ga, want)
	}
}

// Methods cheaper per step than wmrl train until they have spent what
// wmrl spends, so the reward they reach at wmrl's cost is measured inside
// their curve; at equal steps they are still read at cfg.Steps.
func TestCheaperMethodsTrainToWmrlsCost(t *testing.T) {
	for _, rounding := range route.Roundings {
		t.Run(rounding, func(t *testing.T) { testCheaperMethodsTrainToWmrlsCost(t, rounding) })
	}
}

func testCheaperMethodsTrainToWmrlsCost(t *testing.T, rounding string) {
	cfg := DefaultConfig()
	cfg.Steps, cfg.AnchorRounding = 40, rounding
	sc, _ := ScenarioByName("monotone")
	ms := []Method{Methods[index(Methods, "grpo")], Methods[index(Methods, "grpo-anchors")], Methods[index(Methods, "wm")], Methods[index(Methods, "wmrl")]}
	res, err := Run(Options{Config: cfg, Seeds: 2, Scenarios: []Scenario{sc}, Methods: ms})
	if err != nil {
		t.Fatal(err)
	}
	r := res[0]
	budget := r.Methods["wmrl"].Cost
	for _, name := range []string{"grpo-anchors", "wm"} {
		m := r.Methods[name]
		atSteps := 0.0
		for step := range cfg.Steps {
			c, _ := StepCost(cfg, Methods[index(Methods, name)], step)
			atSteps += c
		}
		if m.Cost != atSteps {
			t.Errorf("%s: cost at equal steps %v, want %v", name, m.Cost, atSteps)
		}
		end := m.Curve[len(m.Curve)-1]
		last, _ := StepCost(cfg, Methods[index(Methods, name)], len(m.Curve)-1)
		if end.Cost < budget || end.Cost-last >= budget {
			t.Errorf("%s trained to cost %v; want the first step at or past wmrl's %v", name, end.Cost, budget)
		}
		if m.EqualCostReward.Mean == m.FinalReward {
			t.Errorf("%s: reward at wmrl's cost %v is its reward at equal steps", name, m.EqualCostReward.Mean)
		}
	}
	if n := len(r.Methods["grpo"].Curve); n != cfg.Steps || r.Methods["grpo"].TrainedSteps != n {
		t.Errorf("grpo, dearer than wmrl, trained %d steps (says %d), want %d", n, r.Methods["grpo"].TrainedSteps, cfg.Steps)
	}
	var table strings.Builder
	WriteTable(&table, r, ms)
	ga, wm := r.Methods["grpo-anchors"].TrainedSteps, r.Methods["wm"].TrainedSteps
	if want := fmt.Sprintf("grpo-anchors to step %d, wm to step %d; their other columns are at step %d", ga, wm, cfg.Steps); ga <= cfg.Steps || !strings.Contains(table.String(), want) {
		t.Errorf("the table does not say which methods trained longer (%q):\n%s", want, table.String())
	}
}

// The tabular policy learns per step almost as fast from two groups as from
// sixteen (its mean gradient gives each task the same expected move per
// step whatever the batch; only the noise differs), so GRPO on the anchor
// groups alone stays close to GRPO at equal steps: the README explains what
// that means for WMRL here.
func TestAnchorGroupsAloneKeepUpWithGRPOPerStep(t *testing.T) {
	r := run(t, "monotone", "grpo", "grpo-anchors", "wmrl")
	g, ga, w := r.Methods["grpo"], r.Methods["grpo-anchors"], r.Methods["wmrl"]
	t.Logf("grpo %.4f; grpo-anchors %.4f (%+.4f ± %.4f) at %.2f of the cost; at wmrl's cost grpo-anchors %.4f, wmrl %.4f",
		g.FinalReward, ga.FinalReward, ga.DiffGRPO.Mean, ga.DiffGRPO.CI95, ga.CostRatio, ga.EqualCostReward.Mean, w.EqualCostReward.Mean)
	if math.Abs(ga.DiffGRPO.Mean) > 0.01 {
		t.Errorf("grpo-anchors is %+.4f from grpo at equal steps", ga.DiffGRPO.Mean)
	}
}

// Before the map's first fit (200 pairs: 13 steps here) the reference uses
// raw world-model scores. Under Adam, which moves every parameter by about
// the learning rate whatever the gradient's size, 13 steps of an
// anti-correlated world model push the policy onto bad styles it does not
// climb back from; the flat map before the fit (the default) gives those
// groups no signal, and WMRL falls back on its anchors completely.
func TestFlatMapBeforeTheFitSavesAdversarialRunsUnderAdam(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Optimizer = Adam
	flat := runWith(t, cfg, "adversarial", "grpo-anchors", "wmrl")
	cfg.Debiaser.BeforeFit = calibrate.BeforeFitIdentity
	ident := runWith(t, cfg, "adversarial", "wmrl")
	ga, wf, wi := flat.Methods["grpo-anchors"], flat.Methods["wmrl"], ident.Methods["wmrl"]
	t.Logf("adam, adversarial: grpo-anchors %.4f; wmrl %.4f with the flat map before the fit, %.4f with the identity", ga.FinalReward, wf.FinalReward, wi.FinalReward)
	if ga.FinalReward-wi.FinalReward < 0.1 {
		t.Errorf("with the identity before the fit wmrl %.4f is not far below grpo-anchors %.4f: nothing to fix", wi.FinalReward, ga.FinalReward)
	}
	if math.Abs(wf.FinalReward-ga.FinalReward) > 0.02 {
		t.Errorf("with the flat map before the fit wmrl %.4f is not level with grpo-anchors %.4f", wf.FinalReward, ga.FinalReward)
	}
}

// The shared policy is the learner where the batch matters: at the same
// learning rate, GRPO on two groups a step falls clearly behind GRPO on
// sixteen (the tabular policy under SGD barely notices, above), so that
// what WMRL's world-model groups add can show.
func TestSharedPolicyNeedsTheBatch(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Policy, cfg.Tasks, cfg.Optimizer = Shared, DefaultSharedTasks, Adam
	r := runWith(t, cfg, "monotone", "grpo", "grpo-anchors", "wmrl")
	g, ga, w := r.Methods["grpo"], r.Methods["grpo-anchors"], r.Methods["wmrl"]
	t.Logf("shared, adam: grpo %.4f; grpo-anchors %+.4f ± %.4f, wmrl %+.4f ± %.4f at equal steps; at wmrl's cost grpo-anchors %.4f, wmrl %.4f, grpo %.4f",
		g.FinalReward, ga.DiffGRPO.Mean, ga.DiffGRPO.CI95, w.DiffGRPO.Mean, w.DiffGRPO.CI95, ga.EqualCostReward.Mean, w.EqualCostReward.Mean, g.EqualCostReward.Mean)
	if ga.DiffGRPO.Mean+ga.DiffGRPO.CI95 >= 0 {
		t.Errorf("grpo-anchors %+.4f ± %.4f is not clearly below grpo at equal steps: the batch does not matter", ga.DiffGRPO.Mean, ga.DiffGRPO.CI95)
	}
	if w.DiffGRPO.Mean <= ga.DiffGRPO.Mean {
		t.Errorf("wmrl (%+.4f) is no closer to grpo than grpo-anchors (%+.4f) at equal steps: the world-model groups add nothing", w.DiffGRPO.Mean, ga.DiffGRPO.Mean)
	}
}

// ExecNoise sets how far an executed score strays from the true quality,
// and leaves the world model's scores as they were.
func TestExecNoiseSetsTheSpreadOfExecutions(t *testing.T) {
	sc, err := ScenarioByName("monotone")
	if err != nil {
		t.Fatal(err)
	}
	spread := func(noise float64) (execSD float64, predictions []float64) {
		cfg := DefaultConfig()
		cfg.ExecNoise = noise
		e := cfg.newEnv(1000, sc)
		var sum, n float64
		for i := range 4000 {
			task, style := i%cfg.Tasks, (i/cfg.Tasks)%cfg.Styles
			tr := Traj{Task: task, Style: style}
			if q := e.Quality(task, style); q > 0.4 && q < 0.6 { // far from the clip at 0 and 1
				d := e.ExecuteAt(0, i, 0, tr) - q
				sum, n = sum+d*d, n+1
			}
			predictions = append(predictions, e.PredictAt(0, i, 0, tr))
		}
		return math.Sqrt(sum / n), predictions
	}
	def, defPred := spread(0)
	noisy, noisyPred := spread(0.15)
	if math.Abs(def-DefaultExecNoise) > 0.005 || math.Abs(noisy-0.15) > 0.015 {
		t.Errorf("executed scores spread %.3f by default and %.3f at 0.15; want about %g and 0.15", def, noisy, DefaultExecNoise)
	}
	for i := range defPred {
		if defPred[i] != noisyPred[i] {
			t.Fatalf("prediction %d is %v with the default execution noise and %v with 0.15", i, defPred[i], noisyPred[i])
		}
	}
}

// fixedRewarder gives every step the same advantages (a trajectory's
// style, centred in its group), anchors and rho.
type fixedRewarder struct {
	anchor []bool
	rho    float64
}

func (f fixedRewarder) Reward(_ int, groups [][]Traj) (StepRewards, error) {
	out := StepRewards{Anchor: f.anchor[:len(groups)], Rho: f.rho, Fused: make([][]float64, len(groups))}
	for g, trajs := range groups {
		out.Fused[g] = make([]float64, len(trajs))
		for i, tr := range trajs {
			out.Fused[g][i] = float64(tr.Style) - 3.5
		}
	}
	return out, nil
}

func (fixedRewarder) Close() error { return nil }

// The reference's scale is the exact gradient's direction with a step
// (rho|A|+|W|)/(|A|+|W|) times as long: under SGD, training with it is
// training at that much higher a learning rate, and with rho 1 (GRPO,
// the world model alone) it changes nothing.
func TestReferenceScaleIsALongerStep(t *testing.T) {
	sc, err := ScenarioByName("monotone")
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.Steps, cfg.Seed = 40, 1000
	anchor := make([]bool, cfg.Groups)
	anchor[3], anchor[9] = true, true
	train := func(scale Scale, lr, rho float64) []Point {
		c := cfg
		c.Scale, c.LR = scale, lr
		curve, err := TrainWith(c, sc, Methods[index(Methods, "wmrl")], func(Config, *Env, Method) (Rewarder, error) {
			return fixedRewarder{anchor: anchor, rho: rho}, nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return curve
	}
	const rho = 3.0
	length := (2*rho + 14) / 16
	ref, exact, longer := train(ScaleReference, 2, rho), train(ScaleExact, 2, rho), train(ScaleExact, 2*length, rho)
	for k := range ref {
		if math.Abs(ref[k].Reward-longer[k].Reward) > 1e-12 {
			t.Fatalf("step %d: reference scale at lr 2 reaches %.15f, the exact one at lr %g %.15f", k+1, ref[k].Reward, 2*length, longer[k].Reward)
		}
	}
	if last := len(ref) - 1; ref[last].Reward == exact[last].Reward {
		t.Errorf("the reference scale changed nothing at rho %g", rho)
	}
	one, exactOne := train(ScaleReference, 2, 1), train(ScaleExact, 2, 1)
	for k := range one {
		if one[k].Reward != exactOne[k].Reward {
			t.Fatalf("step %d at rho 1: reference %v, exact %v", k+1, one[k].Reward, exactOne[k].Reward)
		}
	}
}

// A configuration that cannot make a training run is refused, naming what
// is wrong, by Train and Run alike: `wmrl sim --steps 0` and `--tasks 0`
// panicked (an index of -1, rand.IntN(0)).
func TestAConfigThatCannotTrainIsRefused(t *testing.T) {
	sc, err := ScenarioByName("monotone")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		set  func(*Config)
		want string
	}{
		{func(c *Config) { c.Steps = 0 }, "--steps 0: want at least 1"},
		{func(c *Config) { c.Tasks = 0 }, "--tasks 0: want at least 1"},
		{func(c *Config) { c.Styles = 0 }, "styles 0: want at least 1"},
		{func(c *Config) { c.Groups = -1 }, "--groups -1: want at least 1"},
		{func(c *Config) { c.GroupSize = 1 }, "--group-size 1: want at least 2"},
		{func(c *Config) { c.AnchorFraction = math.NaN() }, "--anchor-fraction NaN: want [0, 1]"},
		{func(c *Config) { c.Costs.Execute = math.Inf(1) }, "--cost-exec +Inf: want a finite number, 0 or more"},
		{func(c *Config) { c.ExecNoise = -0.1 }, "--exec-noise -0.1: want a finite number, 0 or more"},
		{func(c *Config) { c.AdvantageNorm = "zscore" }, `--advantage-norm "zscore": want "std" or "center"`},
	} {
		cfg := DefaultConfig()
		cfg.Steps = 5
		c.set(&cfg)
		if _, err := Train(cfg, sc, Methods[0]); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Train: %v, want %q", err, c.want)
		}
		if _, err := Run(Options{Config: cfg, Seeds: 2, Scenarios: []Scenario{sc}, Methods: Methods[:1]}); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Run: %v, want %q", err, c.want)
		}
	}
	if err := DefaultConfig().Check(); err != nil {
		t.Errorf("the default configuration: %v", err)
	}
}
