package rl

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"

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
	// AnchorGroupsOnly: each step has only as many groups as the anchored
	// methods execute (Config.AnchorGroups), with no world model: GRPO on
	// the anchors alone, what WMRL falls back to.
	AnchorGroupsOnly bool
	// Debias applies the isotonic map; Estimator "" or "off" keeps rho 1.
	Debias    bool
	Estimator fuse.Estimator
}

// Methods are the compared methods, named as in the report and --json.
var Methods = []Method{
	{Name: "grpo", ExecuteAll: true},
	{Name: "grpo-anchors", ExecuteAll: true, AnchorGroupsOnly: true},
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
	LR                float64 // 0: the optimizer's default (DefaultLR)
	Optimizer         Optimizer
	AnchorFraction    float64
	// AnchorRounding: how AnchorFraction of a step's groups becomes a
	// whole count (route.RoundEven, the default, or route.RoundSpread).
	AnchorRounding string
	Policy         Policy
	// TaskFeatures is how many observable features a task has under the
	// shared policy (they also shape the true qualities); 0: DefaultTaskFeatures.
	TaskFeatures int
	// ExecNoise is the standard deviation of an execution's score around
	// the solution's true quality (0: DefaultExecNoise). The world model
	// scores the quality itself, so its error does not grow with it.
	ExecNoise float64
	// Scale is how the trainer turns a step's fused advantages into its
	// gradient: ScaleExact (""), or ScaleReference.
	Scale Scale
	// AdvantageNorm is how a group's advantages are formed, for every
	// method alike: fuse.Standardize (GRPO) or fuse.CenterOnly (Dr. GRPO).
	AdvantageNorm fuse.Normalization
	Costs         Costs
	Debiaser      calibrate.DebiaserConfig
}

// Scale is how a trainer scales a step's gradient.
type Scale string

const (
	// ScaleExact follows WMRL.md's fused gradient,
	// g = (rho*g_E + g_WM) / (rho*|A| + |W|): the step mean of the fused
	// advantages.
	ScaleExact Scale = "exact"
	// ScaleReference is the released code's: anchor advantages times rho,
	// and the trainer's mean over the step's trajectories as the only
	// denominator. Its step is (rho*|A| + |W|) / (|A| + |W|) times the
	// exact one: the same direction, a longer step whenever rho > 1.
	ScaleReference Scale = "reference"
)

// Scales are the accepted --scale values.
var Scales = []Scale{ScaleExact, ScaleReference}

// length is how much longer than the exact step a step of r is under s:
// the weighted count of its groups over their count.
func (s Scale) length(r StepRewards) float64 {
	if s != ScaleReference || len(r.Anchor) == 0 {
		return 1
	}
	weighted := 0.0
	for _, a := range r.Anchor {
		if a {
			weighted += r.Rho
		} else {
			weighted++
		}
	}
	return weighted / float64(len(r.Anchor))
}

// DefaultConfig is the default run's shape.
func DefaultConfig() Config {
	return Config{Tasks: 32, Styles: 8, Groups: 16, GroupSize: 8, Steps: 300, Policy: Tabular, Optimizer: SGD, AnchorFraction: 0.1,
		Scale: ScaleExact, AdvantageNorm: fuse.Standardize, Costs: DefaultCosts, Debiaser: calibrate.DefaultDebiaserConfig()}
}

// Check names what in c cannot make a training run: a problem without
// tasks or styles, a step without groups, a group of one (its
// group-relative advantage is 0 whatever it scores), no steps, a share of
// anchors outside [0, 1], a negative or non-finite noise or cost. It names
// a setting by wmrl sim's flag for it, where there is one.
func (c Config) Check() error {
	var errs []error
	for _, n := range []struct {
		name     string
		v, least int
	}{{"--tasks", c.Tasks, 1}, {"styles", c.Styles, 1}, {"--groups", c.Groups, 1}, {"--group-size", c.GroupSize, 2}, {"--steps", c.Steps, 1}} {
		if n.v < n.least {
			errs = append(errs, fmt.Errorf("%s %d: want at least %d", n.name, n.v, n.least))
		}
	}
	if !(c.AnchorFraction >= 0 && c.AnchorFraction <= 1) {
		errs = append(errs, fmt.Errorf("--anchor-fraction %v: want [0, 1]", c.AnchorFraction))
	}
	if _, err := fuse.ParseNormalization(string(c.AdvantageNorm)); err != nil {
		errs = append(errs, fmt.Errorf("--advantage-norm %q: want %q or %q", c.AdvantageNorm, fuse.Standardize, fuse.CenterOnly))
	}
	for _, x := range []struct {
		name string
		v    float64
	}{{"--exec-noise", c.ExecNoise}, {"generation cost", c.Costs.Generate}, {"--cost-wm", c.Costs.WorldModel}, {"--cost-exec", c.Costs.Execute}} {
		if !(x.v >= 0) || math.IsInf(x.v, 0) {
			errs = append(errs, fmt.Errorf("%s %v: want a finite number, 0 or more", x.name, x.v))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("rl: %w", err)
	}
	return nil
}

// Point is the state after a step.
type Point struct {
	Step       int
	Cost       float64
	Reward     float64 // the policy's true expected reward
	Executions int
	Rho        float64
}

// Policy is the learner's parameterisation.
type Policy string

const (
	// Tabular: a softmax over styles with its own logits per task.
	Tabular Policy = "tabular"
	// Linear: one weight per shared style feature (4), the same for every
	// task.
	Linear Policy = "linear"
	// Shared: a logit per style plus a linear map from the task's
	// observable features to every style's logit, so that what is learnt on
	// one task moves every other (as an LLM's shared weights do), with
	// more tasks than a run sees often (DefaultSharedTasks).
	Shared Policy = "shared"
)

// Policies are the accepted --policy values.
var Policies = []Policy{Tabular, Linear, Shared}

// DefaultTaskFeatures and DefaultSharedTasks shape the shared policy's
// problem: 256 tasks with 8 features each, so a 300-step run of 16 groups
// sees a task about 19 times and must learn through the shared map.
const (
	DefaultTaskFeatures = 8
	DefaultSharedTasks  = 256
)

// policy is a softmax over styles. Its parameters are one vector, so an
// optimizer sees the whole model as a trainer does: tabular logits
// task-major (theta[t*Styles+s]); the linear policy's feature weights; or
// the shared policy's style logits theta[s] followed by its feature map
// theta[Styles + k*Styles + s].
type policy struct {
	env   *Env
	kind  Policy
	theta []float64
}

func newPolicy(env *Env, kind Policy) *policy {
	n := env.Tasks * env.Styles
	switch kind {
	case Linear:
		n = env.Features
	case Shared:
		n = env.Styles * (1 + env.TaskFeatures)
	}
	return &policy{env: env, kind: kind, theta: make([]float64, n)}
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
	switch p.kind {
	case Linear:
		return dot(p.theta, p.env.phi[s])
	case Shared:
		S, l := p.env.Styles, p.theta[s]
		for k, x := range p.env.x[t] {
			l += x * p.theta[S+k*S+s]
		}
		return l
	}
	return p.theta[t*p.env.Styles+s]
}

// addGrad adds a * grad log pi(style | t) to grad; pr is pi(. | t).
func (p *policy) addGrad(grad []float64, t, style int, pr []float64, a float64) {
	switch p.kind {
	case Linear:
		for k := range grad {
			mean := 0.0
			for s, q := range pr {
				mean += q * p.env.phi[s][k]
			}
			grad[k] += a * (p.env.phi[style][k] - mean)
		}
		return
	case Shared:
		S := p.env.Styles
		for s, q := range pr {
			d := -q
			if s == style {
				d = 1 - q
			}
			grad[s] += a * d
			for k, x := range p.env.x[t] {
				grad[S+k*S+s] += a * x * d
			}
		}
		return
	}
	row := grad[t*p.env.Styles : (t+1)*p.env.Styles]
	for s, q := range pr {
		ind := 0.0
		if s == style {
			ind = 1
		}
		row[s] += a * (ind - q)
	}
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

// Traj is one sampled trajectory: the task its group answers and its style.
type Traj struct{ Task, Style int }

// StepRewards is what a rewarder makes of one step's groups.
type StepRewards struct {
	// Fused[g][i] is trajectory i of group g's fused advantage.
	Fused [][]float64
	// Anchor[g]: group g was executed (every group under grpo).
	Anchor []bool
	Rho    float64
}

// A Rewarder scores a step's groups for the policy gradient: the core
// packages in this process (CoreRewarder), or the streaming pipeline.
type Rewarder interface {
	Reward(step int, groups [][]Traj) (StepRewards, error)
	Close() error
}

// NewRewarder builds the rewarder of one training run.
type NewRewarder func(cfg Config, env *Env, m Method) (Rewarder, error)

// RunName is the run name every rewarder gives the anchor scheduler, so
// that both draw the same anchors.
const RunName = "sim"

// GroupID names group g of a step; the IDs sort in group order, which is
// the order a step's anchor groups are absorbed in.
func GroupID(step, g int) string { return fmt.Sprintf("s%d-g%03d", step, g) }

// SchedulerConfig is the anchor choice of a method: every group for grpo,
// none for wm, else cfg.AnchorFraction with at least one per step.
func SchedulerConfig(cfg Config, m Method) route.SchedulerConfig {
	sc := route.SchedulerConfig{Fraction: cfg.AnchorFraction, Rounding: cfg.AnchorRounding, MinPerStep: 1, Seed: cfg.Seed}
	switch {
	case m.ExecuteAll:
		sc.Fraction = 1
	case m.NoAnchors:
		sc.Fraction, sc.MinPerStep = 0, 0
	}
	return sc
}

// anchorsAt is how many of step's groups the anchored methods execute:
// AnchorFraction * Groups made whole as AnchorRounding says, at least one.
// Rounded half to even (the default) it is the same every step and can
// differ from the fraction (2 of 16 for 0.10); spread, it varies by one
// between steps and averages the fraction.
func (cfg Config) anchorsAt(step int) (int, error) {
	sched, err := route.NewScheduler(SchedulerConfig(cfg, Method{}))
	if err != nil {
		return 0, err
	}
	_, n := sched.Count(RunName, int64(step), cfg.Groups, 0)
	return n, nil
}

// AnchorGroups is the mean number of a step's groups the anchored methods
// execute, over cfg.Steps steps.
func (cfg Config) AnchorGroups() (float64, error) {
	total := 0
	for step := range max(cfg.Steps, 1) {
		n, err := cfg.anchorsAt(step)
		if err != nil {
			return 0, err
		}
		total += n
	}
	return float64(total) / float64(max(cfg.Steps, 1)), nil
}

// StepShape is what step `step` of method m draws: groups, and how many
// of them are executed; its cost follows from them (StepCost).
func StepShape(cfg Config, m Method, step int) (groups, executed int, err error) {
	anchors, err := cfg.anchorsAt(step)
	if err != nil {
		return 0, 0, err
	}
	switch {
	case m.AnchorGroupsOnly:
		return anchors, anchors, nil
	case m.ExecuteAll:
		return cfg.Groups, cfg.Groups, nil
	case m.NoAnchors:
		return cfg.Groups, 0, nil
	}
	return cfg.Groups, anchors, nil
}

// StepCost is the cost of step `step` of method m: a generation for every
// trajectory, a world-model call for every one unless every group is
// executed, and an execution for every trajectory of an executed group.
func StepCost(cfg Config, m Method, step int) (float64, error) {
	groups, executed, err := StepShape(cfg, m, step)
	if err != nil {
		return 0, err
	}
	return cfg.stepCost(m, groups, executed), nil
}

// stepCost prices a step of groups groups, executed of them executed.
func (cfg Config) stepCost(m Method, groups, executed int) float64 {
	n := float64(groups * cfg.GroupSize)
	c := n * cfg.Costs.Generate
	if !m.ExecuteAll {
		c += n * cfg.Costs.WorldModel
	}
	return c + float64(executed*cfg.GroupSize)*cfg.Costs.Execute
}

// CorrectorConfig is a method's corrections.
func CorrectorConfig(cfg Config, m Method) fuse.CorrectorConfig {
	est := m.Estimator
	if est == "" {
		est = fuse.EstimatorOff
	}
	return fuse.CorrectorConfig{Debias: m.Debias, Debiaser: cfg.Debiaser, Denoiser: fuse.DenoiserConfig{Estimator: est}}
}

// CoreRewarder runs the project's correction packages directly, in the
// order the streaming pipeline applies them: the step's anchor groups are
// absorbed first, in group order (each scored out-of-sample by the map
// before its own pairs), then every world-model group is calibrated with
// the resulting map, and the step is fused at the resulting rho.
type CoreRewarder struct {
	cfg   Config
	env   *Env
	m     Method
	sched *route.Scheduler
	corr  *fuse.Corrector
}

// NewCoreRewarder is the default NewRewarder.
func NewCoreRewarder(cfg Config, env *Env, m Method) (Rewarder, error) {
	sched, err := route.NewScheduler(SchedulerConfig(cfg, m))
	if err != nil {
		return nil, err
	}
	corr, err := fuse.NewCorrector(CorrectorConfig(cfg, m))
	if err != nil {
		return nil, err
	}
	return &CoreRewarder{cfg: cfg, env: env, m: m, sched: sched, corr: corr}, nil
}

// Close releases nothing.
func (c *CoreRewarder) Close() error { return nil }

// Reward scores one step.
func (c *CoreRewarder) Reward(step int, groups [][]Traj) (StepRewards, error) {
	ids := make([]string, len(groups))
	for g := range ids {
		ids[g] = GroupID(step, g)
	}
	out := StepRewards{Anchor: make([]bool, len(groups)), Fused: make([][]float64, len(groups))}
	for _, d := range c.sched.Select(RunName, int64(step), ids, 0).Decisions {
		out.Anchor[slices.Index(ids, d.GroupID)] = d.Anchor
	}
	pred, truth := make([][]float64, len(groups)), make([][]float64, len(groups))
	for g, trajs := range groups {
		pred[g], truth[g] = make([]float64, len(trajs)), make([]float64, len(trajs))
		for i, tr := range trajs {
			pred[g][i] = c.env.PredictAt(step, g, i, tr)
			if out.Anchor[g] {
				truth[g][i] = c.env.ExecuteAt(step, g, i, tr)
			}
		}
	}
	for g := range groups {
		if out.Anchor[g] {
			if _, err := c.corr.ObserveAnchorGroup(pred[g], truth[g]); err != nil {
				return out, err
			}
		}
	}
	fg := make([]fuse.Group, len(groups))
	for g, trajs := range groups {
		items := make([]fuse.Item, len(trajs))
		for i := range trajs {
			r := truth[g][i]
			if !out.Anchor[g] {
				r = c.corr.Calibrate(pred[g][i])
			}
			items[i] = fuse.Item{Reward: r, Graded: true}
		}
		fg[g] = fuse.Group{ID: ids[g], Anchor: out.Anchor[g], Items: items}
	}
	out.Rho = c.corr.Rho()
	res := fuse.Fuse(fg, out.Rho, c.cfg.AdvantageNorm)
	k := 0
	for g, trajs := range groups {
		out.Fused[g] = make([]float64, len(trajs))
		for i := range trajs {
			out.Fused[g][i] = res.Items[k].FusedAdvantage
			k++
		}
	}
	return out, nil
}

// Train runs one method with the core packages and returns its learning
// curve (one Point per step, after the update).
func Train(cfg Config, sc Scenario, m Method) ([]Point, error) {
	return TrainWith(cfg, sc, m, NewCoreRewarder)
}

// TrainWith runs one method with the given rewarder. The environment, the
// sampling stream and every world-model and execution draw depend only on
// cfg.Seed and the trajectory's place (step, group, index), so methods on
// one seed are paired and the rewarders agree whatever order they score in.
func TrainWith(cfg Config, sc Scenario, m Method, newRewarder NewRewarder) (curve []Point, err error) {
	if err := cfg.Check(); err != nil {
		return nil, err
	}
	if cfg.Policy != "" && !slices.Contains(Policies, cfg.Policy) {
		return nil, fmt.Errorf("rl: unknown policy %q (have %v)", cfg.Policy, Policies)
	}
	if cfg.Scale != "" && !slices.Contains(Scales, cfg.Scale) {
		return nil, fmt.Errorf("rl: unknown scale %q (have %v)", cfg.Scale, Scales)
	}
	env := cfg.newEnv(cfg.Seed, sc)
	pol := newPolicy(env, cfg.Policy)
	opt, err := cfg.newOptimizer(len(pol.theta))
	if err != nil {
		return nil, err
	}
	rw, err := newRewarder(cfg, env, m)
	if err != nil {
		return nil, err
	}
	defer func() {
		if cerr := rw.Close(); err == nil && cerr != nil {
			curve, err = nil, cerr
		}
	}()
	sampler := rand.New(rand.NewPCG(cfg.Seed, 1))
	G := cfg.GroupSize
	curve = make([]Point, 0, cfg.Steps)
	cost, execs := 0.0, 0
	pr := make([]float64, cfg.Styles)
	grad := make([]float64, len(pol.theta))
	for step := 0; step < cfg.Steps; step++ {
		ng, _, err := StepShape(cfg, m, step)
		if err != nil {
			return nil, err
		}
		groups := make([][]Traj, ng)
		for g := range groups {
			t := sampler.IntN(cfg.Tasks)
			pr = pol.probs(t, pr)
			groups[g] = make([]Traj, G)
			for i := range groups[g] {
				groups[g][i] = Traj{t, sample(sampler, pr)}
			}
		}
		res, err := rw.Reward(step, groups)
		if err != nil {
			return nil, fmt.Errorf("rl: step %d: %w", step, err)
		}
		executed := 0
		for _, a := range res.Anchor {
			if a {
				executed++
			}
		}
		cost += cfg.stepCost(m, ng, executed)
		execs += executed * G
		// Policy gradient: the step mean of fused_i * grad log pi(style_i | task_i).
		n := float64(ng*G) / cfg.Scale.length(res)
		clear(grad)
		for g := range groups {
			t := groups[g][0].Task
			pr = pol.probs(t, pr)
			for i, tr := range groups[g] {
				a := res.Fused[g][i] / n
				if a == 0 {
					continue
				}
				pol.addGrad(grad, t, tr.Style, pr, a)
			}
		}
		opt.ascend(pol.theta, grad)
		curve = append(curve, Point{Step: step + 1, Cost: cost, Reward: pol.expected(), Executions: execs, Rho: res.Rho})
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
