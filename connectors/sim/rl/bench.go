package rl

import (
	"math"
	"runtime"
	"sync"

	"gonum.org/v1/gonum/stat"
	"gonum.org/v1/gonum/stat/distuv"
)

// Stat is a mean over seeds with its 95% interval half-width (Student t).
type Stat struct {
	Mean float64 `json:"mean"`
	CI95 float64 `json:"ci95"`
}

func statOf(xs []float64) Stat {
	m, sd := stat.MeanStdDev(xs, nil)
	if len(xs) < 2 {
		return Stat{Mean: m}
	}
	t := distuv.StudentsT{Mu: 0, Sigma: 1, Nu: float64(len(xs) - 1)}.Quantile(0.975)
	return Stat{Mean: m, CI95: t * sd / math.Sqrt(float64(len(xs)))}
}

// MethodResult is one method in one scenario, over seeds. Differences to
// grpo are paired: the same seed's environment and sampling streams.
type MethodResult struct {
	FinalReward     float64 `json:"final_reward"`
	CI95            float64 `json:"ci95"`
	Cost            float64 `json:"cost"`
	CostRatio       float64 `json:"cost_ratio_to_grpo"`
	Executions      float64 `json:"executions"`
	Rho             float64 `json:"rho"`
	DiffGRPO        Stat    `json:"diff_to_grpo"`
	EqualCostReward Stat    `json:"equal_cost_reward"` // at wmrl's total cost
	EqualCostDiff   Stat    `json:"equal_cost_diff_to_grpo"`
	// TrainedSteps is how far the method trained: the benchmark's steps, or
	// more for a method whose steps cost less than wmrl's (to reach its cost).
	TrainedSteps int `json:"trained_steps"`
	// CostToTarget is the total cost at which the method's mean curve first
	// reaches Target, interpolated; nil if it does not within TrainedSteps.
	// CostToTargetRatio is that over grpo's: the share of GRPO's spend
	// needed for the same reward.
	CostToTarget      *float64 `json:"cost_to_target"`
	CostToTargetRatio *float64 `json:"cost_to_target_ratio_to_grpo"`
	Curve             []Point  `json:"-"` // mean over seeds
}

// ScenarioResult holds every method of one scenario.
type ScenarioResult struct {
	Scenario string                   `json:"scenario"`
	Doc      string                   `json:"doc"`
	Methods  map[string]*MethodResult `json:"methods"`
	// Start is the untrained policy's expected reward (mean over seeds);
	// Target is Start plus TargetShare of grpo's gain at equal steps, the
	// reward every method's CostToTarget is measured at.
	Start  float64 `json:"start_reward"`
	Target float64 `json:"target_reward"`
}

// TargetShare of GRPO's gain over the untrained policy defines the target
// reward of CostToTarget: "what does it cost to get 90% of what GRPO gets".
const TargetShare = 0.9

// Options sets a benchmark run.
type Options struct {
	Config    Config
	Seeds     int
	Scenarios []Scenario
	Methods   []Method
	// Progress, if set, is called after each training run.
	Progress func(done, total int)
	// NewRewarder scores the steps (default NewCoreRewarder); Parallel
	// caps the training runs at once (default GOMAXPROCS).
	NewRewarder NewRewarder
	Parallel    int
}

type job struct {
	sc   int
	m    int
	seed int
}

// Run trains every method on every scenario and seed (both cores) and
// summarises them.
func Run(o Options) ([]ScenarioResult, error) {
	if err := o.Config.Check(); err != nil {
		return nil, err
	}
	curves := make([][][][]Point, len(o.Scenarios)) // scenario, method, seed
	for i := range curves {
		curves[i] = make([][][]Point, len(o.Methods))
		for j := range curves[i] {
			curves[i][j] = make([][]Point, o.Seeds)
		}
	}
	jobs := make(chan job)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	done, total := 0, len(o.Scenarios)*len(o.Methods)*o.Seeds
	if o.NewRewarder == nil {
		o.NewRewarder = NewCoreRewarder
	}
	if o.Parallel <= 0 {
		o.Parallel = runtime.GOMAXPROCS(0)
	}
	steps, err := horizons(o.Config, o.Methods)
	if err != nil {
		return nil, err
	}
	for range o.Parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				cfg := o.Config
				cfg.Seed = uint64(1000 + j.seed)
				cfg.Steps = steps[j.m]
				c, err := TrainWith(cfg, o.Scenarios[j.sc], o.Methods[j.m], o.NewRewarder)
				mu.Lock()
				if err != nil && firstErr == nil {
					firstErr = err
				}
				curves[j.sc][j.m][j.seed] = c
				done++
				if o.Progress != nil {
					o.Progress(done, total)
				}
				mu.Unlock()
			}
		}()
	}
	for s := range o.Scenarios {
		for m := range o.Methods {
			for seed := 0; seed < o.Seeds; seed++ {
				jobs <- job{s, m, seed}
			}
		}
	}
	close(jobs)
	wg.Wait()
	if firstErr != nil {
		return nil, firstErr
	}
	out := make([]ScenarioResult, len(o.Scenarios))
	for s, sc := range o.Scenarios {
		start := make([]float64, o.Seeds)
		for seed := range start {
			env := o.Config.newEnv(uint64(1000+seed), sc)
			start[seed] = newPolicy(env, o.Config.Policy).expected()
		}
		out[s] = summarise(sc, o.Methods, curves[s], o.Config.Steps, start)
	}
	return out, nil
}

// horizons are the steps each method trains: cfg.Steps, and for a method
// whose steps cost less than wmrl's, as many more as reach wmrl's total
// cost, so that the reward it reaches at that cost is measured rather than
// read off the end of a shorter run. Its numbers at equal steps are still
// read at cfg.Steps.
func horizons(cfg Config, ms []Method) ([]int, error) {
	spent := func(m Method, steps int) (float64, error) {
		total := 0.0
		for step := range steps {
			c, err := StepCost(cfg, m, step)
			if err != nil {
				return 0, err
			}
			total += c
		}
		return total, nil
	}
	budget, err := spent(Methods[index(Methods, "wmrl")], cfg.Steps)
	if err != nil {
		return nil, err
	}
	out := make([]int, len(ms))
	for i, m := range ms {
		total, err := spent(m, cfg.Steps)
		if err != nil {
			return nil, err
		}
		steps := cfg.Steps
		for ; total < budget; steps++ {
			c, err := StepCost(cfg, m, steps)
			if err != nil {
				return nil, err
			}
			if c <= 0 {
				break
			}
			total += c
		}
		out[i] = steps
	}
	return out, nil
}

func index(ms []Method, name string) int {
	for i, m := range ms {
		if m.Name == name {
			return i
		}
	}
	return -1
}

// summarise reads every method at equal steps (the curves' step `steps`),
// at wmrl's total cost, and where it reaches the target reward; start is
// each seed's untrained reward.
func summarise(sc Scenario, ms []Method, curves [][][]Point, steps int, start []float64) ScenarioResult {
	res := ScenarioResult{Scenario: sc.Name, Doc: sc.Doc, Methods: map[string]*MethodResult{}, Start: stat.Mean(start, nil)}
	g, w := index(ms, "grpo"), index(ms, "wmrl")
	seeds := len(curves[0])
	for mi, m := range ms {
		final, cost, execs, rho, diff, eq, eqDiff := []float64{}, 0.0, 0.0, 0.0, []float64{}, []float64{}, []float64{}
		for s := 0; s < seeds; s++ {
			c := curves[mi][s]
			last := c[steps-1]
			final = append(final, last.Reward)
			cost += last.Cost / float64(seeds)
			execs += float64(last.Executions) / float64(seeds)
			rho += last.Rho / float64(seeds)
			if g >= 0 {
				diff = append(diff, last.Reward-curves[g][s][steps-1].Reward)
			}
			if w >= 0 {
				budget := curves[w][s][steps-1].Cost
				r := RewardAtCost(c, budget)
				eq = append(eq, r)
				if g >= 0 {
					eqDiff = append(eqDiff, r-RewardAtCost(curves[g][s], budget))
				}
			}
		}
		fs := statOf(final)
		mr := &MethodResult{FinalReward: fs.Mean, CI95: fs.CI95, Cost: cost, Executions: execs, Rho: rho,
			DiffGRPO: statOf(diff), EqualCostReward: statOf(eq), EqualCostDiff: statOf(eqDiff),
			TrainedSteps: len(curves[mi][0]), Curve: meanCurve(curves[mi])}
		res.Methods[m.Name] = mr
	}
	if gr := res.Methods["grpo"]; gr != nil {
		res.Target = res.Start + TargetShare*(gr.FinalReward-res.Start)
		for _, mr := range res.Methods {
			mr.CostRatio = mr.Cost / gr.Cost
			mr.CostToTarget = CostToReach(mr.Curve, res.Start, res.Target)
		}
		for _, mr := range res.Methods {
			if mr.CostToTarget != nil && gr.CostToTarget != nil {
				r := *mr.CostToTarget / *gr.CostToTarget
				mr.CostToTargetRatio = &r
			}
		}
	}
	return res
}

// CostToReach is the cost at which a learning curve starting from reward
// start at cost 0 first reaches target, interpolated linearly between
// points; nil if it never does.
func CostToReach(curve []Point, start, target float64) *float64 {
	prevC, prevR := 0.0, start
	if start >= target {
		return &prevC
	}
	for _, p := range curve {
		if p.Reward >= target {
			c := prevC + (p.Cost-prevC)*(target-prevR)/(p.Reward-prevR)
			return &c
		}
		prevC, prevR = p.Cost, p.Reward
	}
	return nil
}

func meanCurve(bySeed [][]Point) []Point {
	out := make([]Point, len(bySeed[0]))
	n := float64(len(bySeed))
	for _, c := range bySeed {
		for i, p := range c {
			out[i].Step = p.Step
			out[i].Cost += p.Cost / n
			out[i].Reward += p.Reward / n
			out[i].Rho += p.Rho / n
			out[i].Executions += p.Executions
		}
	}
	return out
}
