// Package rl is a synthetic RL problem with the structure of WMRL's real
// one, for measuring what the corrections buy: tasks of varying difficulty,
// a learnable policy over solution styles, groups of G per task, a true
// score per candidate in [0, 1] (a leaderboard-percentile stand-in) with
// execution noise, and a world model whose score distorts the truth with
// fresh noise per call and a persistent error per (task, style) that
// repeated calls do not average away.
package rl

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
)

// Scenario is a named kind of world model.
type Scenario struct {
	Name, Doc string
	// Distort maps true quality to the world model's noiseless score.
	Distort func(q float64) float64
	// Fresh: noise per call; Persistent: error per (task, style).
	Fresh, Persistent float64
	// StyleBias is added to style 0's score whatever its quality.
	StyleBias float64
	// Useless: the score carries no information about quality.
	Useless bool
}

func compress(q float64) float64 { return 0.3 + 0.45*q*q } // compressed, over-confident

// Scenarios are the documented world models, in the order reported.
var Scenarios = []Scenario{
	{Name: "monotone", Doc: "monotone non-linear distortion (compressed, over-confident) plus moderate noise", Distort: compress, Fresh: 0.05, Persistent: 0.03},
	{Name: "noisy", Doc: "the same distortion with heavy fresh noise", Distort: compress, Fresh: 0.25, Persistent: 0.03},
	{Name: "persistent", Doc: "large errors per (task, style) that repeated calls do not average away", Distort: compress, Fresh: 0.05, Persistent: 0.2},
	{Name: "useless", Doc: "no information: scores independent of quality", Useless: true, Fresh: 0.25},
	{Name: "adversarial", Doc: "anti-correlated: better solutions score lower", Distort: func(q float64) float64 { return 1 - q }, Fresh: 0.05, Persistent: 0.03},
	{Name: "style-bias", Doc: "style 0 over-scored by 0.4 whatever its quality (non-monotone: isotonic cannot fix it)", Distort: compress, Fresh: 0.05, Persistent: 0.03, StyleBias: 0.4},
}

// ScenarioByName finds a scenario.
func ScenarioByName(name string) (Scenario, error) {
	for _, s := range Scenarios {
		if s.Name == name {
			return s, nil
		}
	}
	names := make([]string, len(Scenarios))
	for i, s := range Scenarios {
		names[i] = s.Name
	}
	sort.Strings(names)
	return Scenario{}, fmt.Errorf("rl: unknown scenario %q (have %v)", name, names)
}

// Env is one drawn problem: true qualities, persistent errors and style
// features, fixed by the seed.
type Env struct {
	Seed                    uint64
	Tasks, Styles, Features int
	ExecNoise               float64
	Scenario                Scenario
	q, persist              [][]float64
	phi                     [][]float64 // style features, shared across tasks
	// TaskFeatures and x: each task's observable features, for the shared
	// policy (none otherwise).
	TaskFeatures int
	x            [][]float64
}

// newEnv draws the problem cfg trains on: with the shared policy, tasks
// have features that shape their qualities.
func (cfg Config) newEnv(seed uint64, sc Scenario) *Env {
	e := NewEnvWith(seed, cfg.Tasks, cfg.Styles, cfg.EffectiveTaskFeatures(), sc)
	if cfg.ExecNoise > 0 {
		e.ExecNoise = cfg.ExecNoise
	}
	return e
}

// DefaultExecNoise is how far an execution's score strays from the true
// quality by default: a test suite's score, not a training run's.
const DefaultExecNoise = 0.05

// EffectiveTaskFeatures is how many features a task has: TaskFeatures (or
// DefaultTaskFeatures for 0) under the shared policy, none otherwise.
func (cfg Config) EffectiveTaskFeatures() int {
	switch {
	case cfg.Policy != Shared:
		return 0
	case cfg.TaskFeatures == 0:
		return DefaultTaskFeatures
	}
	return cfg.TaskFeatures
}

// NewEnv draws a problem. Quality = sigmoid(task offset + u . phi(style) +
// idiosyncrasy), so part of what makes a style good transfers across tasks.
func NewEnv(seed uint64, tasks, styles int, sc Scenario) *Env {
	return NewEnvWith(seed, tasks, styles, 0, sc)
}

// NewEnvWith draws a problem whose tasks have taskFeatures observable
// features x_t (each N(0, 1/taskFeatures)). They add 1.5 x_t' B phi(style)
// to the quality's logit, B a fixed N(0, 1) matrix, so which style is best
// depends on the task in a way a policy over x_t can learn, beside the
// idiosyncrasy it cannot. The features come from their own stream: with 0
// the problem is NewEnv's, draw for draw.
func NewEnvWith(seed uint64, tasks, styles, taskFeatures int, sc Scenario) *Env {
	r := rand.New(rand.NewPCG(seed, 0xe57))
	const d = 4
	e := &Env{Seed: seed, Tasks: tasks, Styles: styles, Features: d, ExecNoise: DefaultExecNoise, Scenario: sc, TaskFeatures: taskFeatures}
	var b [][]float64
	if taskFeatures > 0 {
		fr := rand.New(rand.NewPCG(seed, 0x7a5c))
		b = make([][]float64, taskFeatures)
		for k := range b {
			b[k] = make([]float64, d)
			for j := range b[k] {
				b[k][j] = fr.NormFloat64()
			}
		}
		e.x = make([][]float64, tasks)
		for t := range e.x {
			e.x[t] = make([]float64, taskFeatures)
			for k := range e.x[t] {
				e.x[t][k] = fr.NormFloat64() / math.Sqrt(float64(taskFeatures))
			}
		}
	}
	u := make([]float64, d)
	for k := range u {
		u[k] = r.NormFloat64()
	}
	e.phi = make([][]float64, styles)
	for s := range e.phi {
		e.phi[s] = make([]float64, d)
		for k := range e.phi[s] {
			e.phi[s][k] = r.NormFloat64() / math.Sqrt(d)
		}
	}
	e.q, e.persist = make([][]float64, tasks), make([][]float64, tasks)
	for t := range e.q {
		offset := r.NormFloat64() - 0.5 // difficulty
		e.q[t], e.persist[t] = make([]float64, styles), make([]float64, styles)
		for s := range e.q[t] {
			z := offset + dot(u, e.phi[s]) + 0.7*r.NormFloat64()
			for k, row := range b {
				z += 1.5 * e.x[t][k] * dot(row, e.phi[s])
			}
			e.q[t][s] = 1 / (1 + math.Exp(-z))
			e.persist[t][s] = sc.Persistent * r.NormFloat64()
		}
	}
	return e
}

func dot(a, b []float64) float64 {
	s := 0.0
	for i := range a {
		s += a[i] * b[i]
	}
	return s
}

func clip01(x float64) float64 { return math.Min(1, math.Max(0, x)) }

// Quality is the true expected score of style s on task t.
func (e *Env) Quality(t, s int) float64 { return e.q[t][s] }

// Execute returns a real, noisy score.
func (e *Env) Execute(r *rand.Rand, t, s int) float64 {
	return clip01(e.q[t][s] + e.ExecNoise*r.NormFloat64())
}

// Streams of the keyed draws of PredictAt and ExecuteAt.
const (
	streamPredict = 2
	streamExecute = 3
)

// drawAt is a random source keyed by the seed, a stream and a
// trajectory's place, so that a draw does not depend on the order in which
// trajectories are scored (the pipeline scores groups concurrently).
func (e *Env) drawAt(stream uint64, step, g, i int) *rand.Rand {
	h := e.Seed
	for _, v := range []uint64{uint64(step), uint64(g), uint64(i)} {
		h = (h ^ v) * 0x9e3779b97f4a7c15 // golden-ratio multiply: cheap mixing, distinct seeds for distinct places
		h ^= h >> 31
	}
	return rand.New(rand.NewPCG(h, stream))
}

// PredictAt is the world model's score of trajectory i of group g of a
// step.
func (e *Env) PredictAt(step, g, i int, tr Traj) float64 {
	return e.Predict(e.drawAt(streamPredict, step, g, i), tr.Task, tr.Style)
}

// ExecuteAt is the executed score of trajectory i of group g of a step.
func (e *Env) ExecuteAt(step, g, i int, tr Traj) float64 {
	return e.Execute(e.drawAt(streamExecute, step, g, i), tr.Task, tr.Style)
}

// Predict returns the world model's score.
func (e *Env) Predict(r *rand.Rand, t, s int) float64 {
	sc := e.Scenario
	if sc.Useless {
		return clip01(0.5 + sc.Fresh*r.NormFloat64())
	}
	v := sc.Distort(e.q[t][s]) + e.persist[t][s] + sc.Fresh*r.NormFloat64()
	if s == 0 {
		v += sc.StyleBias
	}
	return clip01(v)
}
