package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/spf13/cobra"

	"github.com/wmrl/wmrl/connectors/sim/rl"
	"github.com/wmrl/wmrl/pipeline/simrl"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/route"
)

func simCommand() *cobra.Command {
	cfg := rl.DefaultConfig()
	var linear bool
	var scenarios, methods, out string
	var seeds int
	var rankCorr float64
	var asJSON, noSweep, viaPipeline bool
	cmd := &cobra.Command{
		Use:   "sim",
		Short: "Benchmark the corrections on a synthetic RL problem: every method on the same seeds, tables, plots, a sweep",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if linear {
				cfg.Policy = rl.Linear
			}
			if cfg.Policy == rl.Shared && !cmd.Flags().Changed("tasks") {
				cfg.Tasks = rl.DefaultSharedTasks
			}
			placed := cmd.Flags().Changed("rank-corr")
			if placed && (cmd.Flags().Changed("scenario") || cmd.Flags().Changed("methods")) {
				return fmt.Errorf("sim: --rank-corr runs its own world model and methods (grpo, grpo-anchors, wm, wmrl): drop --scenario and --methods")
			}
			if placed && !(rankCorr >= -1 && rankCorr <= 1) {
				return fmt.Errorf("sim: --rank-corr %v: a correlation is in [-1, 1]", rankCorr)
			}
			var scs []rl.Scenario
			if scenarios == "all" {
				scs = rl.Scenarios
			} else {
				for _, name := range strings.Split(scenarios, ",") {
					sc, err := rl.ScenarioByName(strings.TrimSpace(name))
					if err != nil {
						return fmt.Errorf("sim: --scenario: %w", err)
					}
					scs = append(scs, sc)
				}
			}
			ms, err := pickMethods(methods)
			if err != nil {
				return err
			}
			if seeds < 2 {
				return fmt.Errorf("sim: --seeds %d: intervals need at least 2", seeds)
			}
			if !(cfg.ExecNoise > 0) {
				return fmt.Errorf("sim: --exec-noise %v: want a standard deviation > 0 (for executions that all but never vary, a tiny one such as 1e-9)", cfg.ExecNoise)
			}
			if err := cfg.Check(); err != nil { // by the settings' names, before the anchor scheduler refuses one by its own
				return fmt.Errorf("sim: %w", err)
			}
			anchors, err := cfg.AnchorGroups()
			if err != nil {
				return fmt.Errorf("sim: %w", err)
			}
			if err := os.MkdirAll(out, 0o755); err != nil {
				return err
			}
			opts := rl.Options{Config: cfg, Seeds: seeds, Scenarios: scs, Methods: ms}
			if viaPipeline {
				// A pipeline per training run, each with its own embedded
				// NATS server and stages, one per core (the default).
				opts.NewRewarder = simrl.NewRewarder("")
			}
			bar := newProgressBar(cmd.ErrOrStderr())
			opts.Progress = bar.set("training")
			var res []rl.ScenarioResult
			var at *rl.Expectation
			if placed {
				at, err = rl.Expect(rl.ExpectConfig{Config: cfg, RankCorr: rankCorr, Measured: "--rank-corr", Debias: true, Estimator: fuse.DefaultEstimator,
					Seeds: seeds, Name: "rank-corr", Progress: opts.Progress, NewRewarder: opts.NewRewarder})
				if err != nil {
					return err
				}
				res, ms, noSweep = []rl.ScenarioResult{at.Result}, at.Methods, true
			} else if res, err = rl.Run(opts); err != nil {
				return err
			}
			var cells []rl.SweepCell
			if !noSweep {
				if cells, err = rl.Sweep(cfg, seeds, opts.NewRewarder, bar.set("sweep")); err != nil {
					return err
				}
			}
			bar.done()
			var pngs []string
			for _, r := range res {
				p, err := rl.PlotCurves(out, r, curveMethods(ms))
				if err != nil {
					return err
				}
				pngs = append(pngs, p)
			}
			if cells != nil {
				p, err := rl.PlotSweep(out, cells)
				if err != nil {
					return err
				}
				pngs = append(pngs, p)
			}
			w := cmd.OutOrStdout()
			if asJSON {
				return writeSimJSON(w, cfg, seeds, anchors, viaPipeline, res, cells, at)
			}
			fmt.Fprintf(w, "cost model (units of one generation): generation %g, world-model call %g, execution %g\n",
				cfg.Costs.Generate, cfg.Costs.WorldModel, cfg.Costs.Execute)
			perStep := "a step"
			if cfg.AnchorRounding == route.RoundSpread {
				perStep = "a step on average, spread over the steps"
			}
			fmt.Fprintf(w, "%d seeds, %d steps, %d groups of %d, anchor fraction %.2f (%.4g of %d groups %s: %.1f%%), %s policy, %s at learning rate %g; intervals are 95%% (Student t)\n",
				seeds, cfg.Steps, cfg.Groups, cfg.GroupSize, cfg.AnchorFraction, anchors, cfg.Groups, perStep, 100*anchors/float64(cfg.Groups),
				policyName(cfg), cfg.Optimizer, cfg.EffectiveLR())
			fmt.Fprintf(w, "calibration: %s\n", calibrationLine(cfg))
			if cfg.AdvantageNorm == fuse.CenterOnly {
				fmt.Fprintln(w, "advantages: centred only (r - mean within the group, Dr. GRPO), for every method")
				if cfg.Optimizer == rl.SGD && cfg.LR == 0 {
					fmt.Fprintln(w, "  (their steps are five or more times shorter than standardised ones at sgd's default learning rate, which leaves every learner short: the README compares at --lr 20, where grpo ends as it does standardised, or use --optimizer adam)")
				}
			}
			if cfg.Scale == rl.ScaleReference {
				fmt.Fprintln(w, "gradient scale: reference (anchor advantages times rho, averaged over the step's trajectories: a step (rho|A|+|W|)/(|A|+|W|) times WMRL.md's)")
			}
			if cfg.ExecNoise != rl.DefaultExecNoise {
				fmt.Fprintf(w, "execution noise: %g (standard deviation of an executed score around the true quality; default %g)\n", cfg.ExecNoise, rl.DefaultExecNoise)
			}
			if at != nil {
				fmt.Fprintf(w, "world model: placed at within-group Spearman %.3f over uniformly drawn solutions (asked %.3f)", at.SimRankCorr, at.RankCorr)
				if at.Note != "" {
					fmt.Fprintf(w, ": %s", at.Note)
				}
				fmt.Fprintf(w, "; an audit of its wmrl run measures %.3f over all the steps\n", at.SimAuditedRankCorr)
			}
			if viaPipeline {
				fmt.Fprintln(w, "scored through the streaming pipeline in this process (route, predict, execute, pair, calibrate, fuse over embedded NATS)")
			}
			for _, r := range res {
				rl.WriteTable(w, r, ms)
			}
			if cells != nil {
				rl.WriteSweep(w, cells)
			}
			fmt.Fprintf(w, "\nplots: %s\n", strings.Join(pngs, ", "))
			return nil
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&scenarios, "scenario", "all", "scenarios, comma-separated, or all")
	fs.StringVar(&methods, "methods", "all", "methods, comma-separated, or all (grpo and wmrl always run: differences are paired with grpo, equal cost is wmrl's)")
	fs.BoolVar(&viaPipeline, "pipeline", false, "score every step through the streaming pipeline in this process (embedded NATS, all stages); same seeds, same numbers, slower")
	fs.IntVar(&seeds, "seeds", 8, "seeds per method (paired across methods)")
	fs.IntVar(&cfg.Steps, "steps", cfg.Steps, "training steps")
	fs.IntVar(&cfg.Groups, "groups", cfg.Groups, "groups per step")
	fs.Float64Var(&cfg.AnchorFraction, "anchor-fraction", cfg.AnchorFraction, "share of groups executed (0: one group a step)")
	fs.StringVar(&cfg.AnchorRounding, "anchor-rounding", route.RoundEven, "how the fraction of a step's groups becomes a whole count: even (round half to even every step, the reference: 2 of 16 for 0.10) or spread (1 or 2 of 16, 1.6 on average)")
	fs.Var(choiceFlag[rl.Optimizer]{&cfg.Optimizer, rl.Optimizers}, "optimizer", fmt.Sprintf("how the policy follows the gradient: %v (adam: a normalised step per parameter, as LLM trainers take)", rl.Optimizers))
	fs.Var(choiceFlag[rl.Scale]{&cfg.Scale, rl.Scales}, "scale", fmt.Sprintf("how the trainer scales a step's gradient: %v (exact: WMRL.md's fused gradient, the step mean of the fused advantages; reference: the released code's, anchor advantages times rho averaged over the step's trajectories, a step (rho|A|+|W|)/(|A|+|W|) times as long)", rl.Scales))
	fs.Var(choiceFlag[fuse.Normalization]{&cfg.AdvantageNorm, fuse.Normalizations}, "advantage-norm", "how every method forms a group's advantages: std ((r - mean) / std, GRPO) or center (r - mean, Dr. GRPO: the advantages, and so the step, scale with the scores' spread, which the isotonic map changes)")
	fs.Float64Var(&cfg.LR, "lr", 0, "learning rate; 0 is the default (sgd 2, or 16 for the shared policy; adam 0.3)")
	fs.IntVar(&cfg.Debiaser.MinPairs, "min-pairs", cfg.Debiaser.MinPairs, "anchor pairs buffered before the first isotonic fit (0: the reference's 200)")
	fs.IntVar(&cfg.Debiaser.RefitEvery, "refit-every", cfg.Debiaser.RefitEvery, "refit the isotonic map after this many new pairs (0: the reference's 64)")
	fs.StringVar(&cfg.Debiaser.BeforeFit, "before-fit", cfg.Debiaser.BeforeFit, "what the isotonic map is before its first fit: identity (raw world-model scores, the reference) or mean (flat: no within-group signal until the anchors have checked the world model)")
	fs.Var(choiceFlag[rl.Policy]{&cfg.Policy, rl.Policies}, "policy", fmt.Sprintf("the learner: %v (tabular: logits per task; linear: 4 shared style weights; shared: style logits plus a map from %d task features, on %d tasks unless --tasks)", rl.Policies, rl.DefaultTaskFeatures, rl.DefaultSharedTasks))
	fs.IntVar(&cfg.Tasks, "tasks", cfg.Tasks, "tasks in the problem")
	fs.BoolVar(&linear, "linear", false, "the same as --policy linear")
	_ = fs.MarkDeprecated("linear", "use --policy linear")
	fs.Float64Var(&cfg.ExecNoise, "exec-noise", rl.DefaultExecNoise, "standard deviation of an execution's score around the solution's true quality: how much a sandbox run varies (an ML task's training run varies with its seed more than a test suite does); the world model scores the quality itself")
	fs.Float64Var(&cfg.Costs.WorldModel, "cost-wm", cfg.Costs.WorldModel, "cost of a world-model call, in generations (0: counted free)")
	fs.Float64Var(&cfg.Costs.Execute, "cost-exec", cfg.Costs.Execute, "cost of an execution, in generations (0: counted free)")
	fs.StringVar(&out, "out", "sim-out", "folder for the PNG plots")
	fs.BoolVar(&asJSON, "json", false, "print JSON instead of tables")
	fs.BoolVar(&noSweep, "no-sweep", false, "skip the noise x anchor-fraction sweep")
	fs.Float64Var(&rankCorr, "rank-corr", 0, "instead of the scenarios: a world model whose within-group Spearman with executed scores, over varied solutions, is this (measure yours on a held-out set of executed groups, or take it from wmrl audit); runs grpo, grpo-anchors, wm and wmrl on it, without the sweep")
	fs.IntVar(&cfg.GroupSize, "group-size", cfg.GroupSize, "trajectories per group")
	return cmd
}

// pickMethods resolves --methods, in the order of rl.Methods. grpo and
// wmrl always run: the tables give every method's paired difference to
// grpo and its reward at wmrl's total cost.
func pickMethods(list string) ([]rl.Method, error) {
	if list == "all" {
		return rl.Methods, nil
	}
	want := map[string]bool{"grpo": true, "wmrl": true}
	for _, name := range strings.Split(list, ",") {
		name = strings.TrimSpace(name)
		i := slices.IndexFunc(rl.Methods, func(m rl.Method) bool { return m.Name == name })
		if i < 0 {
			names := make([]string, len(rl.Methods))
			for k, m := range rl.Methods {
				names[k] = m.Name
			}
			return nil, fmt.Errorf("sim: --methods: unknown method %q (have %s)", name, strings.Join(names, ", "))
		}
		want[name] = true
	}
	var ms []rl.Method
	for _, m := range rl.Methods {
		if want[m.Name] {
			ms = append(ms, m)
		}
	}
	return ms, nil
}

// curveMethods are the methods drawn in the learning curves: the six
// headline ones of those run (the rho variants would crowd the picture).
func curveMethods(ms []rl.Method) []rl.Method {
	var out []rl.Method
	for _, m := range ms {
		if slices.ContainsFunc(rl.Methods[:7], func(h rl.Method) bool { return h.Name == m.Name }) {
			out = append(out, m)
		}
	}
	return out
}

// calibrationLine says when the isotonic map is first fitted and what it
// is until then.
func calibrationLine(cfg rl.Config) string {
	d := cfg.Debiaser.Effective()
	before := "the identity (raw world-model scores)"
	if d.BeforeFit == calibrate.BeforeFitMean {
		before = "flat at the anchors' mean true score"
	}
	return fmt.Sprintf("first isotonic fit at %d anchor pairs, then every %d; until then the map is %s", d.FirstFit(), d.RefitEvery, before)
}

func writeSimJSON(w io.Writer, cfg rl.Config, seeds int, anchors float64, viaPipeline bool, res []rl.ScenarioResult, cells []rl.SweepCell, at *rl.Expectation) error {
	doc := map[string]any{
		"cost_model": cfg.Costs, "seeds": seeds, "steps": cfg.Steps, "groups": cfg.Groups, "group_size": cfg.GroupSize,
		"anchor_fraction": cfg.AnchorFraction, "exec_noise": cfg.ExecNoise, "scale": cfg.Scale, "advantage_norm": cfg.AdvantageNorm, "anchor_groups_per_step": anchors, "anchor_rounding": cfg.AnchorRounding, "policy": cfg.Policy, "tasks": cfg.Tasks,
		"optimizer": cfg.Optimizer, "lr": cfg.EffectiveLR(), "sweep": cells, "via_pipeline": viaPipeline,
		"debiaser": cfg.Debiaser.Effective(),
	}
	scs, targets := map[string]any{}, map[string]any{}
	for _, r := range res {
		scs[r.Scenario] = r.Methods
		targets[r.Scenario] = map[string]float64{"start_reward": r.Start, "target_reward": r.Target}
	}
	doc["scenarios"], doc["targets"] = scs, targets
	if at != nil {
		doc["rank_corr"] = at
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(doc)
}

// choiceFlag is a flag taking one of a fixed set of names.
type choiceFlag[T ~string] struct {
	v       *T
	allowed []T
}

func (f choiceFlag[T]) String() string {
	if f.v == nil {
		return ""
	}
	return string(*f.v)
}

func (f choiceFlag[T]) Set(s string) error {
	if !slices.Contains(f.allowed, T(s)) {
		return fmt.Errorf("unknown value %q (have %v)", s, f.allowed)
	}
	*f.v = T(s)
	return nil
}

func (choiceFlag[T]) Type() string { return "string" }

func policyName(cfg rl.Config) string {
	switch cfg.Policy {
	case rl.Linear:
		return "linear"
	case rl.Shared:
		return fmt.Sprintf("shared (%d tasks, %d task features)", cfg.Tasks, cfg.EffectiveTaskFeatures())
	}
	return "tabular softmax"
}
