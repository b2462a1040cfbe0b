package rl

import (
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/route"
)

// Method is one way of rewarding the policy.
type Method struct {
	Name string
	// ExecuteAll: every group is executed (GRPO). Otherwise anchors only,
	// or none when NoAnchors.
	ExecuteAll, NoAnchors bool
	// Debias applies the isotonic map; Estimator "" or "off" keeps rho 1.
	Debias    bool
	Estimator fuse.Estimator
}

// Methods are the compared methods, named as in the report and --json.
var Methods = []Method{
	{Name: "grpo", ExecuteAll: true},
	{Name: "wm", NoAnchors: true},
	{Name: "anchor"},
	{Name: "debias", Debias: true},
	{Name: "denoise", Estimator: fuse.DefaultEstimator},
	{Name: "wmrl", Debias: true, Estimator: fuse.DefaultEstimator},
	{Name: "wmrl-reference", Debias: true, Estimator: fuse.EstimatorReference},
	{Name: "wmrl-ratio", Debias: true, Estimator: fuse.EstimatorRatio},
	{Name: "wmrl-advantage", Debias: true, Estimator: fuse.EstimatorAdvantage},
}

// Costs are in units of one trajectory's generation.
type Costs struct {
	Generate, WorldModel, Execute float64
}

// DefaultCosts: execution 20x generation (sandboxed training dominates);
// a world-model call 4x (an LLM reading the task and the code). With them
// GRPO costs 21 per trajectory, a pure world model 5 (the paper: 0.30 of
// GRPO's GPU-hours), WMRL with 10% anchors 7 (the paper: 3.1x cheaper).
var DefaultCosts = Costs{Generate: 1, WorldModel: 4, Execute: 20}

// Config is one training run.
type Config struct {
	Seed              uint64
	Tasks, Styles     int
	Groups, GroupSize int // per step
	Steps             int
	LR                float64
	AnchorFraction    float64
	Linear            bool // the shared-feature linear policy instead of a softmax per task
	Costs             Costs
	Debiaser          calibrate.DebiaserConfig
}

// DefaultConfig is the default run's shape.
func DefaultConfig() Config {
	return Config{Tasks: 32, Styles: 8, Groups: 16, GroupSize: 8, Steps: 300, LR: 2, AnchorFraction: 0.1,
		Costs: DefaultCosts, Debiaser: calibrate.DefaultDebiaserConfig()}
}

// Point is the state after a step.
type Point struct {
	Step       int
	Cost       float64
	Reward     float64 // the policy's true expected reward
	Executions int
	Rho        float64
}

// policy is a softmax over styles, per task (tabular) or from shared
// features (linear).
type policy struct {
	env    *Env
	linear bool
	theta  [][]float64 // tabular logits
	w      []float64   // linear weights
}

func (p *policy) probs(t int, dst []float64) []float64 {
	dst = dst[:0]
	m := math.Inf(-1)
	for s := 0; s < p.env.Styles; s++ {
		l := p.logit(t, s)
		dst = append(dst, l)
		m = math.Max(m, l)
	}
	sum := 0.0
	for i, l := range dst {
		dst[i] = math.Exp(l - m)
		sum += dst[i]
	}
	for i := range dst {
		dst[i] /= sum
	}
	return dst
}

func (p *policy) logit(t, s int) float64 {
	if p.linear {
		return dot(p.w, p.env.phi[s])
	}
	return p.theta[t][s]
}

// expected is the true expected reward over tasks.
func (p *policy) expected() float64 {
	pr := make([]float64, p.env.Styles)
	total := 0.0
	for t := 0; t < p.env.Tasks; t++ {
		pr = p.probs(t, pr)
		for s, v := range pr {
			total += v * p.env.q[t][s]
		}
	}
	return total / float64(p.env.Tasks)
}

func sample(r *rand.Rand, pr []float64) int {
	u, acc := r.Float64(), 0.0
	for i, v := range pr {
		if acc += v; u < acc {
			return i
		}
	}
	return len(pr) - 1
}

// Train runs one method and returns its learning curve (one Point per
// step, after the update). The environment and sampling streams depend only
// on cfg.Seed, so methods on one seed are paired.
func Train(cfg Config, sc Scenario, m Method) ([]Point, error) {
	env := NewEnv(cfg.Seed, cfg.Tasks, cfg.Styles, sc)
	pol := &policy{env: env, linear: cfg.Linear, w: make([]float64, env.Features)}
	pol.theta = make([][]float64, cfg.Tasks)
	for t := range pol.theta {
		pol.theta[t] = make([]float64, cfg.Styles)
	}
	sampler := rand.New(rand.NewPCG(cfg.Seed, 1))
	wmRand := rand.New(rand.NewPCG(cfg.Seed, 2))
	execRand := rand.New(rand.NewPCG(cfg.Seed, 3))
	sched, err := route.NewScheduler(route.SchedulerConfig{Fraction: cfg.AnchorFraction, MinPerStep: 1, Seed: cfg.Seed})
	if err != nil {
		return nil, err
	}
	est := m.Estimator
	if est == "" {
		est = fuse.EstimatorOff
	}
	corr, err := fuse.NewCorrector(fuse.CorrectorConfig{Debias: m.Debias, Debiaser: cfg.Debiaser, Denoiser: fuse.DenoiserConfig{Estimator: est}})
	if err != nil {
		return nil, err
	}
	G := cfg.GroupSize
	curve := make([]Point, 0, cfg.Steps)
	cost, execs := 0.0, 0
	pr := make([]float64, cfg.Styles)
	ids := make([]string, cfg.Groups)
	for g := range ids {
		ids[g] = fmt.Sprintf("g%03d", g)
	}
	type traj struct{ task, style int }
	for step := 0; step < cfg.Steps; step++ {
		trajs := make([][]traj, cfg.Groups)
		for g := range trajs {
			t := sampler.IntN(cfg.Tasks)
			pr = pol.probs(t, pr)
			trajs[g] = make([]traj, G)
			for i := range trajs[g] {
				trajs[g][i] = traj{t, sample(sampler, pr)}
			}
		}
		cost += float64(cfg.Groups*G) * cfg.Costs.Generate
		anchor := make([]bool, cfg.Groups)
		switch {
		case m.ExecuteAll:
			for g := range anchor {
				anchor[g] = true
			}
		case !m.NoAnchors:
			for _, d := range sched.Select("sim", int64(step), ids, 0).Decisions {
				var g int
				fmt.Sscanf(d.GroupID, "g%d", &g)
				anchor[g] = d.Anchor
			}
		}
		groups := make([]fuse.Group, cfg.Groups)
		for g := range trajs {
			items := make([]fuse.Item, G)
			pred := make([]float64, G)
			if !m.ExecuteAll {
				for i, tr := range trajs[g] {
					pred[i] = env.Predict(wmRand, tr.task, tr.style)
				}
				cost += float64(G) * cfg.Costs.WorldModel
			}
			if anchor[g] {
				truth := make([]float64, G)
				for i, tr := range trajs[g] {
					truth[i] = env.Execute(execRand, tr.task, tr.style)
					items[i] = fuse.Item{Reward: truth[i], Graded: true}
				}
				cost += float64(G) * cfg.Costs.Execute
				execs += G
				if !m.ExecuteAll {
					if _, err := corr.ObserveAnchorGroup(pred, truth); err != nil {
						return nil, err
					}
				}
			} else {
				for i := range trajs[g] {
					items[i] = fuse.Item{Reward: corr.Calibrate(pred[i]), Graded: true}
				}
			}
			groups[g] = fuse.Group{ID: ids[g], Anchor: anchor[g] && !m.ExecuteAll, Items: items}
		}
		rho := corr.Rho()
		res := fuse.Fuse(groups, rho, fuse.Standardize)
		// Policy gradient: the step mean of fused_i * grad log pi(style_i | task_i).
		n := float64(cfg.Groups * G)
		gw := make([]float64, env.Features)
		gt := map[int][]float64{}
		for g := range trajs {
			t := trajs[g][0].task
			pr = pol.probs(t, pr)
			for i, tr := range trajs[g] {
				a := res.Items[g*G+i].FusedAdvantage / n
				if a == 0 {
					continue
				}
				if cfg.Linear {
					for k := range gw {
						mean := 0.0
						for s, p := range pr {
							mean += p * env.phi[s][k]
						}
						gw[k] += a * (env.phi[tr.style][k] - mean)
					}
					continue
				}
				if gt[t] == nil {
					gt[t] = make([]float64, cfg.Styles)
				}
				for s, p := range pr {
					ind := 0.0
					if s == tr.style {
						ind = 1
					}
					gt[t][s] += a * (ind - p)
				}
			}
		}
		for t, g := range gt {
			for s := range g {
				pol.theta[t][s] += cfg.LR * g[s]
			}
		}
		for k := range gw {
			pol.w[k] += cfg.LR * gw[k]
		}
		curve = append(curve, Point{Step: step + 1, Cost: cost, Reward: pol.expected(), Executions: execs, Rho: rho})
	}
	return curve, nil
}

// RewardAtCost interpolates a learning curve at total cost c; a curve that
// ends below c gives its final reward (it stopped before spending c).
func RewardAtCost(curve []Point, c float64) float64 {
	prevC, prevR := 0.0, math.NaN()
	for _, p := range curve {
		if p.Cost >= c {
			if math.IsNaN(prevR) {
				return p.Reward
			}
			return prevR + (p.Reward-prevR)*(c-prevC)/(p.Cost-prevC)
		}
		prevC, prevR = p.Cost, p.Reward
	}
	return curve[len(curve)-1].Reward
}
