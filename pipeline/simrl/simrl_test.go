package simrl

import (
	"math"
	"testing"

	"github.com/wmrl/wmrl/connectors/sim/rl"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/route"
)

// TestPipelineGivesTheCoreNumbers trains the same seeds through the core
// packages and through the streaming pipeline, and wants the same learning
// curves: reward, rho, cost and executions after every step. The methods
// cover every path of the pipeline: every group executed (grpo, and
// grpo-anchors on a step of two groups), none (wm), anchors without
// corrections, the out-of-sample default and the in-sample reference
// estimator, and both maps before the first fit (the default flat one,
// which travels as a one-threshold map, and the reference's identity);
// and spread rounding, where a step's anchor count varies with the step.
func TestPipelineGivesTheCoreNumbers(t *testing.T) {
	cfg := rl.DefaultConfig()
	cfg.Steps = 30 // past the warm-ups of the map (200 pairs: 13 steps) and of rho (32 anchor groups: 16 steps)
	sc, err := rl.ScenarioByName("monotone")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, beforeFit, rounding string
		norm                      fuse.Normalization
	}{
		{"grpo", "", "", ""}, {"grpo-anchors", "", "", ""}, {"wm", "", "", ""}, {"anchor", "", "", ""}, {"wmrl", "", "", ""}, {"wmrl-reference", "", "", ""},
		{"wmrl", calibrate.BeforeFitIdentity, "", ""},
		{"wmrl", "", route.RoundSpread, ""}, {"grpo-anchors", "", route.RoundSpread, ""},
		{"wmrl", "", "", fuse.CenterOnly},
	} {
		name, m, label := tc.name, rl.Methods[methodIndex(t, tc.name)], tc.name
		if tc.beforeFit != "" {
			label += "/before-fit=" + tc.beforeFit
		}
		if tc.rounding != "" {
			label += "/rounding=" + tc.rounding
		}
		if tc.norm != "" {
			label += "/advantage-norm=" + string(tc.norm)
		}
		t.Run(label, func(t *testing.T) {
			cfg := cfg
			cfg.Seed = 1000
			if tc.beforeFit != "" {
				cfg.Debiaser.BeforeFit = tc.beforeFit
			}
			cfg.AnchorRounding = tc.rounding
			if tc.norm != "" {
				cfg.AdvantageNorm = tc.norm
			}
			core, err := rl.Train(cfg, sc, m)
			if err != nil {
				t.Fatal(err)
			}
			streamed, err := rl.TrainWith(cfg, sc, m, NewRewarder(t.TempDir()))
			if err != nil {
				t.Fatal(err)
			}
			if len(streamed) != len(core) {
				t.Fatalf("%d steps through the pipeline, %d in the core", len(streamed), len(core))
			}
			moved := false
			for i, c := range core {
				s := streamed[i]
				if math.Abs(s.Reward-c.Reward) > 1e-9 || math.Abs(s.Rho-c.Rho) > 1e-9 || s.Cost != c.Cost || s.Executions != c.Executions {
					t.Fatalf("step %d: pipeline reward %.12f rho %.12f cost %v execs %d; core %.12f %.12f %v %d",
						c.Step, s.Reward, s.Rho, s.Cost, s.Executions, c.Reward, c.Rho, c.Cost, c.Executions)
				}
				moved = moved || c.Rho != core[0].Rho
			}
			last := core[len(core)-1]
			t.Logf("%d steps equal: final reward %.6f, rho %.4f, %d executions", len(core), last.Reward, last.Rho, last.Executions)
			if last.Reward <= core[0].Reward {
				t.Errorf("the policy did not learn (%.4f to %.4f): the comparison is vacuous", core[0].Reward, last.Reward)
			}
			if (name == "wmrl" || name == "wmrl-reference") && !moved {
				t.Errorf("rho never moved from %v: the denoiser was not exercised", core[0].Rho)
			}
		})
	}
}

func methodIndex(t *testing.T, name string) int {
	for i, m := range rl.Methods {
		if m.Name == name {
			return i
		}
	}
	t.Fatalf("no method %q", name)
	return -1
}
