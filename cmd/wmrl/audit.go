package main

import (
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/wmrl/wmrl/connectors/sim/rl"
	"github.com/wmrl/wmrl/pipeline/offline"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/route"
)

// This file is wmrl audit.

func auditCommand() *cobra.Command {
	var (
		root, run, out string
		opt            offline.AuditOptions
		expect         offline.ExpectOptions
		deadline, last time.Duration
		steps, model   string
	)
	cmd := &cobra.Command{
		Use:   "audit [--archive DIR] [--out REPORT]",
		Short: "Measure the world model's bias over an archive (HTML page with plots, summary.json), and what wmrl sim expects at this world model",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			stdout, stderr := cmd.OutOrStdout(), cmd.ErrOrStderr()
			if expect.Seeds == 1 || expect.Seeds < 0 {
				return fmt.Errorf("audit: --expect-seeds %d: intervals need at least 2 (0 skips what to expect)", expect.Seeds)
			}
			src, rec, release, err := streamRun(root, run, "auditing", stderr)
			if err != nil {
				return err
			}
			defer release()
			run := rec.name
			if opt.Steps, err = pickSteps("audit", steps, last, src); err != nil {
				return err
			}
			if cmd.Flags().Changed("wm-model") {
				opt.Model = &model
			}
			if deadline > 0 {
				opt.AnchorDeadline = deadline.Seconds()
			} else {
				opt.AnchorDeadline = rec.settings.AnchorDeadline
			}
			start := time.Now()
			a, err := offline.RunAuditRows(src, opt)
			release() // read: a merge may go on while wmrl sim runs and the report is written
			if err != nil {
				return err
			}
			a.Builds = rec.builds
			if expect.Seeds > 0 {
				bar := newProgressBar(stderr)
				expect.Progress = bar.set("what to expect (wmrl sim)")
				a.Expect, err = offline.Expect(a, rec.settings, expect)
				bar.done()
				if err != nil { // the audit stands without it
					fmt.Fprintf(stderr, "audit: nothing to expect: %v\n", err)
				}
			}
			if out == "" {
				out = "audit-" + run
			}
			if err := offline.WriteReport(a, out); err != nil {
				return err
			}
			which := "run " + run
			if opt.Steps != nil {
				which += ", " + opt.Steps.String()
			}
			if last > 0 {
				which += fmt.Sprintf(" (fused in the last %s of the run)", last)
			}
			if opt.Model != nil {
				which += fmt.Sprintf(", world model %q", model)
			}
			fmt.Fprintf(stdout, "audited %s: %d rows, %d anchor pairs, %d tasks in %s\n", which, a.Rows, a.Pairs, len(a.Tasks), time.Since(start).Round(time.Millisecond))
			printWorldModels(stdout, a.WorldModels)
			printBuilds(stdout, a.Builds)
			fmt.Fprintf(stdout, "overall: %s (max |residual| by level %.3f before, %.3f after one monotone map, %.3f after the run's maps as recorded; within-group Kendall %.3f)\n",
				a.Overall.Verdict, a.Overall.MaxBefore, a.Overall.MaxMonotone, a.Overall.MaxAfter, float64(a.Overall.Ranks.WithinKendall))
			if first, last, se, ok := a.RankTrend(); ok {
				verdict := "no clear change"
				switch {
				case first-last > 2*se:
					verdict = "it ranks the policy's recent solutions worse than its early ones (ranks.png)"
				case last-first > 2*se:
					verdict = "it ranks the policy's recent solutions better"
				}
				fmt.Fprintf(stdout, "within-group Spearman on the anchors: %.3f over the first quarter of the steps, %.3f over the last (± %.3f): %s\n",
					first, last, 2*se, verdict)
			}
			if len(a.Outcomes) > 1 || len(a.Outcomes) == 1 && a.Outcomes[0].Status != schemas.ExecScored {
				var parts []string
				for _, o := range a.Outcomes {
					parts = append(parts, fmt.Sprintf("%s %d (%.0f%%; mean predicted %.3f, true %.3f)", o.Status, o.Pairs, 100*o.Share, float64(o.MeanPredicted), float64(o.MeanTrue)))
				}
				fmt.Fprintf(stdout, "anchor executions: %s; the world model tells those that failed from those that scored with AUC %.3f (0.5: not at all)\n",
					strings.Join(parts, ", "), float64(a.FailureAUC))
				printCauses(stdout, a)
			}
			printMisses(stdout, a)
			printExecTimes(stdout, a.Executions)
			if l := a.Length; l != nil && len(l.Levels) > 0 {
				first, last := l.Levels[0], l.Levels[len(l.Levels)-1]
				fmt.Fprintf(stdout, "by solution length (%d anchor pairs): %s; within-group Spearman of length and residual after one monotone map %+.3f ± %.3f over %d groups; residual after it %+.3f in the shortest fifth (%d-%d bytes), %+.3f in the longest (%d-%d)\n",
					l.Pairs, l.Verdict, float64(l.WithinSpearman), 2*float64(l.SE), l.Groups,
					float64(first.ResidualMonotone), first.Bytes[0], first.Bytes[1], float64(last.ResidualMonotone), last.Bytes[0], last.Bytes[1])
				if l.Distinct < offline.FewLengths {
					fmt.Fprintf(stdout, "  (only %d distinct lengths: a length stands for which solution it is, so this may be a bias by solution rather than by length)\n", l.Distinct)
				}
			}
			verdicts := map[string]int{}
			for _, t := range a.Tasks {
				verdicts[t.Verdict]++
			}
			for _, v := range []string{offline.VerdictCalibrated, offline.VerdictCorrected, offline.VerdictTaskSpecific, offline.VerdictNonMonotone, offline.VerdictTooFewAnchor} {
				if verdicts[v] > 0 {
					fmt.Fprintf(stdout, "  %3d tasks: %s\n", verdicts[v], v)
				}
			}
			if e := a.Expect; e != nil {
				writeExpectation(stdout, e, float64(a.Overall.Ranks.WithinSpearman))
			}
			abs, _ := filepath.Abs(filepath.Join(out, "index.html"))
			fmt.Fprintf(stdout, "report: %s (summary.json beside it)\n", abs)
			return nil
		},
	}
	fs := cmd.Flags()
	archiveFlag(fs, &root)
	fs.StringVar(&run, "run", "", "run to audit (default: the only one)")
	fs.StringVar(&out, "out", "", "report directory (index.html, PNG plots, summary.json; default: audit-<run>)")
	stepFlags(fs, &steps, &last, "audit")
	fs.StringVar(&model, "wm-model", "", `audit the rows of this world model alone (the name its predictions gave, as wmrl audit lists them: the run's --wm-model, with its own --wm-template's digest, --wm-samples and --wm-temperature when set, or "sim"; "" for rows from before the archive kept it), where a run was scored by more than one`)
	fs.IntVar(&opt.Bins, "bins", 10, "score bins")
	fs.Float64Var(&opt.Tolerance, "tolerance", 0.05, "a level's mean residual within this counts as unbiased")
	fs.IntVar(&opt.MinBinPairs, "min-bin-pairs", 10, "levels with fewer anchor pairs are not judged")
	fs.IntVar(&opt.MinTaskPairs, "min-task-pairs", 30, "tasks with fewer anchor pairs get no verdict")
	fs.DurationVar(&deadline, "anchor-deadline", 0, "the run's --anchor-deadline, which the execution times are set against (default: as the archive records it; archives from before it was recorded need it)")
	fs.IntVar(&expect.Seeds, "expect-seeds", 8, "seeds of the wmrl sim run at this world model (what to expect; 0: none)")
	expect.Costs = rl.DefaultCosts
	fs.Var(choiceFlag[rl.Optimizer]{&expect.Optimizer, rl.Optimizers}, "expect-optimizer", fmt.Sprintf("the simulated learner's optimizer for what to expect: %v (default: sgd, the benchmark's; adam for a run of centred advantages, --advantage-norm center, which sgd at the benchmark's learning rate leaves short)", rl.Optimizers))
	fs.Float64Var(&expect.Costs.WorldModel, "cost-wm", expect.Costs.WorldModel, "what to expect: cost of a world-model call, in generations (0: counted free)")
	fs.Float64Var(&expect.Costs.Execute, "cost-exec", expect.Costs.Execute, "what to expect: cost of an execution, in generations (0: counted free)")
	positive(fs, "bins", "tolerance", "min-bin-pairs", "min-task-pairs", "anchor-deadline")
	return cmd
}

// printWorldModels names the world models whose predictions were
// audited: more than one are measured together, as if one, unless
// --wm-model picks one.
func printWorldModels(w io.Writer, models []offline.WorldModelUse) {
	name := func(m offline.WorldModelUse) string {
		if m.Model == "" {
			return "not recorded (rows from before the archive kept it)"
		}
		return m.Model
	}
	switch len(models) {
	case 0:
	case 1:
		fmt.Fprintf(w, "world model: %s\n", name(models[0]))
	default:
		parts := make([]string, len(models))
		for i, m := range models {
			parts[i] = fmt.Sprintf("%s (steps %d-%d: %d rows, %d anchor pairs)", name(m), m.FirstStep, m.LastStep, m.Rows, m.Pairs)
		}
		fmt.Fprintf(w, "world models: %s; this audit measures them together, as if one: --wm-model NAME audits one alone\n", strings.Join(parts, ", "))
	}
}

// printBuilds names the wmrl builds that wrote the audited archive.
func printBuilds(w io.Writer, builds []string) {
	if len(builds) > 0 {
		fmt.Fprintf(w, "written by %s\n", buildNames(builds))
	}
}

// writeExpectation prints what wmrl sim expects at the audited world
// model: where it placed it, and the table of wmrl sim.
func writeExpectation(w io.Writer, e *rl.Expectation, overall float64) {
	fmt.Fprintf(w, "what to expect (wmrl sim at this world model: within-group Spearman %.3f over %s, simulated %.3f over uniformly drawn solutions; %d seeds):\n",
		e.RankCorr, e.Measured, e.SimRankCorr, e.Seeds)
	if e.Note != "" {
		fmt.Fprintf(w, "  %s\n", e.Note)
	}
	rounding := e.AnchorRounding
	if rounding == "" {
		rounding = route.RoundEven
	}
	est := e.Estimator
	if est == "" {
		est = fuse.EstimatorOff
	}
	fmt.Fprintf(w, "  this run's shape and settings: %d groups of %d a step, anchor fraction %.2f (%s), debias %v, rho %s, advantages %s; %d steps of a %s learner; costs in generations: world-model call %g, execution %g\n",
		e.Groups, e.GroupSize, e.AnchorFraction, rounding, e.Debias, est, e.AdvantageNorm, e.Steps, e.Optimizer, e.Costs.WorldModel, e.Costs.Execute)
	fmt.Fprintf(w, "  over all their steps, an audit of the simulated run measures %.3f and this one %.3f (a learning policy's groups grow alike, which lowers it; the simulated policy's become copies of one solution)\n",
		e.SimAuditedRankCorr, overall)
	rl.WriteTable(w, e.Result, e.Methods)
}

// printCauses lists the most frequent causes of failed anchor executions.
func printCauses(w io.Writer, a *offline.Audit) {
	const show = 5
	for i, c := range a.Causes[:min(show, len(a.Causes))] {
		if i == 0 {
			fmt.Fprintln(w, "failures by cause (the report lists more, with an example of each):")
		}
		fmt.Fprintf(w, "  %5d %3.0f%%  %-18s %s (mean predicted %.3f)\n", c.Pairs, 100*c.Share, c.Status, c.Cause, float64(c.MeanPredicted))
	}
	if n := len(a.Causes) - show + a.OtherCauses; n > 0 {
		fmt.Fprintf(w, "  and %d more kinds\n", n)
	}
	if a.FailuresWithoutDetail > 0 {
		fmt.Fprintf(w, "  %d failures have no detail recorded (an archive written before exec_detail, or an executor that said nothing)\n", a.FailuresWithoutDetail)
	}
}

// printMisses lists the anchor pairs the world model missed most.
func printMisses(w io.Writer, a *offline.Audit) {
	const show = 3
	for i, m := range a.Misses[:min(show, len(a.Misses))] {
		if i == 0 {
			fmt.Fprintf(w, "largest misses of the world model (the report lists %d, and what it predicted against how executions ended):\n", len(a.Misses))
		}
		ended := m.ExecStatus
		if m.Cause != "" {
			ended += ": " + m.Cause
		}
		said := ""
		if m.WMVerdict != "" {
			said = "; it said " + m.WMVerdict
			if m.WMRationale != "" {
				said += ": " + m.WMRationale
			}
		}
		fmt.Fprintf(w, "  step %d, %s, %s: predicted %.3f, true %.3f (%s)%s\n", m.Step, m.GroupID, m.TrajID, m.Predicted, m.True, ended, cut(oneLine(said), 200))
	}
}

// printExecTimes says how long the anchors' executions took, against the
// run's deadline.
func printExecTimes(w io.Writer, e *offline.ExecTimes) {
	if e == nil {
		return
	}
	fmt.Fprintf(w, "execution times: %d anchor executions, median %s, p99 %s, max %s", e.Own(), seconds(e.Seconds.Median), seconds(e.Seconds.P99), seconds(e.Seconds.Max))
	if e.Groups > 0 {
		fmt.Fprintf(w, "; each anchor group's slowest: median %s, p95 %s, max %s", seconds(e.Slowest.Median), seconds(e.Slowest.P95), seconds(e.Slowest.Max))
	}
	late := float64(e.LateGroups) / float64(e.AnchorGroups)
	fmt.Fprintf(w, "; %d of %d anchor groups (%.1f%%) late", e.LateGroups, e.AnchorGroups, 100*late)
	if e.Deadline > 0 && e.Groups > 0 {
		past := 1 - float64(e.WithinDeadline)
		fmt.Fprintf(w, " for the deadline of %s, and %.1f%% of the groups' slowest executions ran past it (exec-times.png)", seconds(e.Deadline), 100*past)
		if late > past+0.05 {
			fmt.Fprint(w, ": more groups were late than executions ran past it, so the time a group waits outside its executions (for a slot, its prediction, its calibration) matters too")
		}
	}
	if q := e.LateAfterFused; q != nil {
		fmt.Fprintf(w, "; the late groups were calibrated median %s, p90 %s, max %s after their step was fused: a deadline longer by %s would have let 90%% of them in, each step held that much longer",
			seconds(q.Median), seconds(q.P90), seconds(q.Max), seconds(q.P90))
	}
	fmt.Fprintln(w)
}
