package rl

import (
	"fmt"
	"math"
)

// Optimizer is how the policy follows the step's gradient.
//
// SGD moves the parameters by LR times the step's mean gradient. With the
// tabular policy that makes a task's expected move per step independent of
// how many groups the step has (fewer groups, each counting more), so the
// batch only buys less noise.
//
// Adam is what LLM trainers use (verl, OpenRLHF and TRL default to AdamW):
// each parameter moves by about LR per step whatever the gradient's scale,
// in the direction of its running mean over its running root mean square.
// A noisier gradient (fewer groups) or a rarer one (a task seen in fewer
// steps) then means a shorter useful step, and a constant factor on the
// whole gradient, such as WMRL's m / (rho|A| + |W|), does not change the
// step at all. It runs on the whole parameter vector every step, as a
// dense trainer does: parameters of tasks not in the step keep moving on
// their momentum.
type Optimizer string

const (
	SGD  Optimizer = "sgd"
	Adam Optimizer = "adam"
)

// Optimizers are the accepted --optimizer values.
var Optimizers = []Optimizer{SGD, Adam}

// Adam's moment decays and epsilon are PyTorch's defaults, which the
// trainers above keep for RL fine-tuning.
const adamBeta1, adamBeta2, adamEps = 0.9, 0.999, 1e-8

// DefaultLR is the learning rate Config.LR 0 means for an optimizer and a
// policy. SGD's 2 is the benchmark's original step. The others were chosen
// by GRPO alone, before any other method ran with them: the best final
// reward at 300 steps in monotone on seeds 2000-2007, which the benchmark
// never reports (it reports 1000-1007), the grid widened until the reward
// turned down.
//   - Adam, tabular: over {0.01, 0.03, 0.1, 0.3}, GRPO ended at 0.564,
//     0.651, 0.659 and 0.659 (0.6585 and 0.6592): 0.3, on a plateau from 0.1.
//   - SGD, shared: over {0.5, 1, ..., 128}, 0.694, 0.708, 0.718, 0.720,
//     0.724, 0.732 (16), 0.722, 0.717, 0.685: 16.
//   - Adam, shared: over {0.003, 0.01, ..., 3}, 0.550, 0.683, 0.724, 0.741,
//     0.749 (0.3), 0.742, 0.730: 0.3.
//
// The linear policy takes the tabular rates.
func DefaultLR(o Optimizer, p Policy) float64 {
	switch {
	case o == Adam:
		return 0.3
	case p == Shared:
		return 16
	}
	return 2
}

// optimizer updates parameters in place from the step's ascent direction.
type optimizer interface {
	ascend(theta, grad []float64)
}

// EffectiveLR is the learning rate training uses: Config.LR, or the
// optimizer's default when that is 0.
func (cfg Config) EffectiveLR() float64 {
	if cfg.LR == 0 {
		return DefaultLR(cfg.Optimizer, cfg.Policy)
	}
	return cfg.LR
}

func (cfg Config) newOptimizer(n int) (optimizer, error) {
	lr := cfg.EffectiveLR()
	if lr <= 0 || math.IsNaN(lr) || math.IsInf(lr, 0) {
		return nil, fmt.Errorf("rl: learning rate %v: want a finite positive number (0 for the optimizer's default)", cfg.LR)
	}
	switch cfg.Optimizer {
	case SGD, "":
		return sgd{lr}, nil
	case Adam:
		return &adam{lr: lr, m: make([]float64, n), v: make([]float64, n)}, nil
	}
	return nil, fmt.Errorf("rl: unknown optimizer %q (have %v)", cfg.Optimizer, Optimizers)
}

type sgd struct{ lr float64 }

func (o sgd) ascend(theta, grad []float64) {
	for i, g := range grad {
		theta[i] += o.lr * g
	}
}

type adam struct {
	lr   float64
	t    int
	m, v []float64
}

func (o *adam) ascend(theta, grad []float64) {
	o.t++
	c1 := 1 - math.Pow(adamBeta1, float64(o.t))
	c2 := 1 - math.Pow(adamBeta2, float64(o.t))
	for i, g := range grad {
		o.m[i] = adamBeta1*o.m[i] + (1-adamBeta1)*g
		o.v[i] = adamBeta2*o.v[i] + (1-adamBeta2)*g*g
		theta[i] += o.lr * (o.m[i] / c1) / (math.Sqrt(o.v[i]/c2) + adamEps)
	}
}
