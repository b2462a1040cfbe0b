package rl

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

// Adam's bias correction makes its first step exactly lr times the sign of
// each gradient entry (up to epsilon), whatever the entry's size.
func TestAdamFirstStepIsLRTimesTheSign(t *testing.T) {
	cfg := Config{Optimizer: Adam, LR: 0.3}
	opt, err := cfg.newOptimizer(4)
	if err != nil {
		t.Fatal(err)
	}
	theta := []float64{0, 1, 2, 3}
	opt.ascend(theta, []float64{0.003, -0.02, 0, 7})
	for i, want := range []float64{0.3, 1 - 0.3, 2, 3 + 0.3} {
		if math.Abs(theta[i]-want) > 1e-4 {
			t.Errorf("theta[%d] = %v after one step, want %v", i, theta[i], want)
		}
	}
}

// A constant factor on every gradient (such as WMRL's m / (rho|A| + |W|))
// does not change Adam's path; it scales SGD's.
func TestAdamIgnoresAConstantFactorOnTheGradient(t *testing.T) {
	for _, o := range []Optimizer{Adam, SGD} {
		cfg := Config{Optimizer: o}
		a, _ := cfg.newOptimizer(3)
		b, _ := cfg.newOptimizer(3)
		ta, tb := make([]float64, 3), make([]float64, 3)
		r := rand.New(rand.NewPCG(1, 2))
		for step := 0; step < 50; step++ {
			g := []float64{r.NormFloat64() * 0.01, r.NormFloat64() * 0.01, 0.005}
			a.ascend(ta, g)
			for i := range g {
				g[i] *= 0.2
			}
			b.ascend(tb, g)
		}
		same := true
		for i := range ta {
			same = same && math.Abs(ta[i]-tb[i]) <= 1e-4*math.Abs(ta[i]) // epsilon: 1e-8 against gradients of 1e-3
		}
		if want := o == Adam; same != want {
			t.Errorf("%s: paths %v and %v with the gradient scaled by 0.2; same = %v, want %v", o, ta, tb, same, want)
		}
	}
}

func TestOptimizerConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Optimizer: "rmsprop"}, `unknown optimizer "rmsprop"`},
		{Config{Optimizer: Adam, LR: -1}, "learning rate -1"},
		{Config{Optimizer: SGD, LR: math.Inf(1)}, "learning rate +Inf"},
	} {
		if _, err := tc.cfg.newOptimizer(1); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v, want one naming %s", tc.cfg, err, tc.want)
		}
	}
	cfg := DefaultConfig()
	cfg.Policy = "mlp"
	sc, _ := ScenarioByName("monotone")
	if _, err := Train(cfg, sc, Methods[0]); err == nil || !strings.Contains(err.Error(), `unknown policy "mlp"`) {
		t.Errorf("policy mlp: error %v, want one naming it", err)
	}
	if lr := (Config{Optimizer: Adam}).EffectiveLR(); lr != DefaultLR(Adam, Tabular) {
		t.Errorf("Adam with LR 0 trains at %v, want its default %v", lr, DefaultLR(Adam, Tabular))
	}
}

// Every policy's gradient is the gradient of log pi, checked by finite
// differences at random parameters.
func TestPolicyGradientsMatchFiniteDifferences(t *testing.T) {
	sc, _ := ScenarioByName("monotone")
	for _, kind := range Policies {
		cfg := DefaultConfig()
		cfg.Policy, cfg.Tasks = kind, 5
		pol := newPolicy(cfg.newEnv(7, sc), kind)
		r := rand.New(rand.NewPCG(3, 4))
		for i := range pol.theta {
			pol.theta[i] = r.NormFloat64()
		}
		task, style := 3, 2
		logPi := func() float64 { return math.Log(pol.probs(task, nil)[style]) }
		grad := make([]float64, len(pol.theta))
		pol.addGrad(grad, task, style, pol.probs(task, nil), 1)
		moved := 0
		for i := range pol.theta {
			const h = 1e-6
			old := pol.theta[i]
			pol.theta[i] = old + h
			up := logPi()
			pol.theta[i] = old - h
			down := logPi()
			pol.theta[i] = old
			if num := (up - down) / (2 * h); math.Abs(num-grad[i]) > 1e-6 {
				t.Fatalf("%s: d log pi / d theta[%d] = %v, finite differences give %v", kind, i, grad[i], num)
			}
			if grad[i] != 0 {
				moved++
			}
		}
		if moved == 0 {
			t.Errorf("%s: the gradient is zero everywhere", kind)
		}
	}
}
