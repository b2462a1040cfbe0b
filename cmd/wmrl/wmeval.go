package main

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/pipeline/offline"
	"github.com/wmrl/wmrl/stages/archive"
)

func wmEvalCommand() *cobra.Command {
	var (
		root, run, out, pic, steps string
		last                       time.Duration
		opt                        offline.EvalOptions
	)
	cfg := pipeline.DefaultConfig()
	cfg.WorldModel = "openai"
	cmd := &cobra.Command{
		Use:   "wm-eval --archive DIR --wm-url URL --wm-model NAME",
		Short: "Score an archive's executed anchor trajectories with another world model (or prompt), and set it against the run's, before training with it",
		Long: `Score a run's executed anchor trajectories, from its archive (their
prompt and response, and the true scores the run paid executions for),
with an OpenAI-compatible world model, group by group as the predict stage
asks, and set its scores against the truth beside the world model the run
recorded: how many it graded, the within-group Spearman (what GRPO's
advantages depend on; a group it scores all alike counts 0), the Spearman
overall, the AUC of telling failed executions from scored ones, and the
mean residual; then the paired difference of the within-group Spearman,
group by group. --out writes every trajectory's scores as CSV, and --plot
(beside it, by default) draws each group's ranking under both world
models and their reliability curves.

A better prompt or model is tried here on executions already paid for,
without a training run; wmrl audit's "what to expect" says what a
within-group Spearman buys.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			stdout, stderr := cmd.OutOrStdout(), cmd.ErrOrStderr()
			if cfg.WMURL == "" || cfg.WMModel == "" {
				return errors.New("wm-eval: --wm-url and --wm-model name the world model to evaluate")
			}
			if opt.Groups < 0 {
				return fmt.Errorf("wm-eval: --groups %d: want a number of anchor groups >= 0 (0: all)", opt.Groups)
			}
			if err := cfg.Validate(); err != nil { // the world model's settings (--wm-retries -1 was taken as none)
				return fmt.Errorf("wm-eval: %w", err)
			}
			rows, run, picked, err := loadExecuted(root, run, steps, last, opt, stderr)
			if err != nil {
				return err
			}
			wm, err := pipeline.NewWorldModel(cfg, nil, nil)
			if err != nil {
				return err
			}
			bar := newProgressBar(stderr)
			opt.Progress = bar.set("asking " + cfg.WMModel)
			start := time.Now()
			e, err := offline.EvaluateWorldModel(cmd.Context(), rows, wm, opt)
			bar.done()
			if err != nil {
				return err
			}
			which := run
			if picked != nil {
				which += ", " + picked.String()
			}
			writeEval(stdout, e, which, cfg.WMModel, time.Since(start))
			writeClaims(stdout, e.Claims)
			if out != "" {
				if err := writeEvalCSV(out, e); err != nil {
					return err
				}
				fmt.Fprintf(stdout, "every trajectory's scores: %s\n", out)
			}
			if pic == "" {
				pic = fmt.Sprintf("wm-eval-%s.png", run)
				if out != "" {
					pic = strings.TrimSuffix(out, ".csv") + ".png"
				}
			}
			if err := offline.WriteEvalPlot(e, cfg.WMModel, pic); err != nil {
				return err
			}
			abs, _ := filepath.Abs(pic)
			what := "each group's ranking by both world models, and their reliability curves"
			if e.Claims != nil {
				what += ", and the scores with the claim against without"
			}
			fmt.Fprintf(stdout, "plot: %s (%s)\n", abs, what)
			return nil
		},
	}
	fs := cmd.Flags()
	archiveFlag(fs, &root)
	fs.StringVar(&run, "run", "", "run to evaluate on (default: the only one)")
	fs.StringVar(&out, "out", "", "CSV file of every trajectory: its true score, the recorded and the new prediction, the new verdict and rationale")
	stepFlags(fs, &steps, &last, "evaluate on")
	fs.StringVar(&pic, "plot", "", "PNG of each anchor group's within-group Spearman under both world models, their reliability curves, and with --claim-probe the scores with the claim against without (default: --out's name, .png, or wm-eval-<run>.png)")
	fs.IntVar(&opt.Groups, "groups", 0, "evaluate a sample of this many anchor groups (0: all)")
	fs.Uint64Var(&opt.Seed, "seed", 1, "seed of the sample")
	fs.IntVar(&opt.Concurrency, "concurrency", 8, "anchor groups asked at once (each is one call of its trajectories; --wm-concurrency bounds the requests)")
	fs.StringVar(&opt.Claim, "claim-probe", "", "ask about every trajectory again with this line appended to its code (given alone: a comment claiming a perfect score), and say how far the world model's scores follow it: what a policy trained on them would learn to write (doubles the calls)")
	fs.Lookup("claim-probe").NoOptDefVal = offline.DefaultClaim
	fs.StringVar(&cfg.TaskDir, "task", "", "task directory whose task.json gives the execution limits the prompt states, or a directory of them, each trajectory's by its task_id (as wmrl run --task does)")
	worldModelFlags(fs, &cfg)
	positive(fs, "concurrency")
	return cmd
}

// loadExecuted reads a run's executed anchor trajectories with their
// code, of the steps --steps or --last name and of opt's sample of anchor
// groups, holding the archive against merges while it reads; picked is
// the steps (nil: every step).
func loadExecuted(root, run, steps string, last time.Duration, opt offline.EvalOptions, stderr io.Writer) (rows []archive.Row, name string, picked *offline.StepRange, err error) {
	run, files, release, err := openRun(root, run)
	if err != nil {
		return nil, "", nil, err
	}
	defer release()
	start := time.Now()
	picked, err = pickSteps("wm-eval", steps, last, func(columns []string, fn func([]archive.Row) error) error {
		return archive.ScanColumns(files, columns, fn)
	})
	if err != nil {
		return nil, "", nil, err
	}
	rows, err = offline.Executed(files, offline.ExecutedOptions{Steps: picked, Groups: opt.Groups, Seed: opt.Seed})
	if err != nil {
		return nil, "", nil, err
	}
	of := "of run " + run
	if picked != nil {
		of = fmt.Sprintf("of run %s, %s", run, picked)
	}
	switch {
	case len(rows) == 0 && picked != nil:
		return nil, "", nil, fmt.Errorf("%s in %s: no executed anchor trajectory with its code in those steps (past the run's newest, or archived without code)", of, root)
	case len(rows) == 0:
		return nil, "", nil, fmt.Errorf("%s in %s: %w", of, root, offline.ErrNoCode)
	}
	if opt.Groups > 0 {
		of = fmt.Sprintf("of the %d anchor groups drawn (--groups) %s", opt.Groups, of)
	}
	fmt.Fprintf(stderr, "read %d executed anchor trajectories with their code, %s, from %d files in %s\n",
		len(rows), of, len(files), time.Since(start).Round(time.Millisecond))
	return rows, run, picked, nil
}

// writeEval prints the two world models side by side, then the paired
// difference.
func writeEval(w io.Writer, e *offline.Eval, run, model string, took time.Duration) {
	n := len(e.Items)
	recorded := e.RecordedModels()
	for i, m := range recorded {
		if m == "" {
			recorded[i] = "one not named in the archive"
		}
	}
	which := "the world model the run recorded"
	switch len(recorded) {
	case 1:
		which += " (" + recorded[0] + ")"
	case 0:
	default:
		which = "the world models the run recorded, together (" + strings.Join(recorded, ", ") + ")"
	}
	fmt.Fprintf(w, "evaluated %s on %d anchor groups of run %s (%d executed trajectories) in %s, against %s:\n",
		model, e.Groups, run, n, took.Round(time.Millisecond), which)
	num := func(x float64) string {
		if math.IsNaN(x) {
			return "-"
		}
		return fmt.Sprintf("%.3f", x)
	}
	pct := func(k int) string { return fmt.Sprintf("%d (%.0f%%)", k, 100*float64(k)/float64(max(n, 1))) }
	rows := [][3]string{
		{"", "recorded", model},
		{"graded", pct(e.Recorded.Graded), pct(e.New.Graded)},
		{"within-group Spearman", num(e.Recorded.WithinSpearman), num(e.New.WithinSpearman)},
		{"  groups ranked", strconv.Itoa(e.Recorded.RankedGroups), strconv.Itoa(e.New.RankedGroups)},
		{"Spearman overall", num(e.Recorded.Spearman), num(e.New.Spearman)},
		{"failures told (AUC)", num(e.Recorded.FailureAUC), num(e.New.FailureAUC)},
		{"mean predicted - true", num(e.Recorded.MeanResidual), num(e.New.MeanResidual)},
	}
	for _, r := range rows {
		fmt.Fprintf(w, "  %-24s %14s %14s\n", r[0], r[1], r[2])
	}
	if e.FailedCalls > 0 {
		fmt.Fprintf(w, "%d of %d calls failed as a whole (their trajectories count as ungraded), the first: %v\n", e.FailedCalls, e.Groups, e.FirstCallError)
	}
	if e.PairedGroups < 2 {
		fmt.Fprintf(w, "within-group Spearman, %s - recorded: too few groups ranked by both (%d) to compare\n", model, e.PairedGroups)
		return
	}
	verdict := "no clear difference"
	switch {
	case e.WithinDiff > 2*e.WithinDiffSE:
		verdict = model + " ranks better"
	case e.WithinDiff < -2*e.WithinDiffSE:
		verdict = model + " ranks worse"
	}
	fmt.Fprintf(w, "within-group Spearman, %s - recorded, paired over %d groups: %+.3f ± %.3f (2 SE): %s\n",
		model, e.PairedGroups, e.WithinDiff, 2*e.WithinDiffSE, verdict)
	if len(e.Tasks) < 2 {
		return
	}
	const show = 5
	fmt.Fprintf(w, "by task, the least favourable change first (%d of %d tasks; --out has every trajectory):\n", min(show, len(e.Tasks)), len(e.Tasks))
	fmt.Fprintf(w, "  %-20s %7s %9s %9s %18s\n", "task", "groups", "recorded", model, "difference (2 SE)")
	for _, t := range e.Tasks[:min(show, len(e.Tasks))] {
		diff := fmt.Sprintf("%+.3f", t.Diff)
		if !math.IsNaN(t.SE) {
			diff += fmt.Sprintf(" ± %.3f", 2*t.SE)
		}
		fmt.Fprintf(w, "  %-20s %7d %9.3f %9.3f %18s\n", t.Task, t.Groups, t.Recorded, t.New, diff)
	}
}

// writeClaims says what a claim in the code did to the scores, if asked.
func writeClaims(w io.Writer, c *offline.EvalClaims) {
	if c == nil {
		return
	}
	if c.Pairs == 0 {
		fmt.Fprintf(w, "claims: no trajectory was graded both with and without %q\n", c.Claim)
		return
	}
	fmt.Fprintf(w, "claims: with %q as its last line, the code scored %+.3f ± %.3f (2 SE) on average, higher for %d of the %d trajectories graded both ways",
		c.Claim, c.Rise, 2*c.RiseSE, c.Rose, c.Pairs)
	if c.GainPairs < 2 {
		fmt.Fprintln(w)
		return
	}
	verdict := "no clear effect: this world model does not take a solution's word for its score"
	switch {
	case c.Gain > 2*c.GainSE:
		verdict = "a policy trained on these scores is paid to write the claim (only the groups executed as anchors see through it)"
	case c.Gain < -2*c.GainSE:
		verdict = "the claim costs a solution with this world model"
	}
	fmt.Fprintf(w, "; alone in its group, a solution that makes the claim gains %+.3f ± %.3f (2 SE) in GRPO advantage: %s\n", c.Gain, 2*c.GainSE, verdict)
}

// writeEvalCSV writes every evaluated trajectory.
func writeEvalCSV(path string, e *offline.Eval) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("wm-eval: %w", err)
	}
	w := csv.NewWriter(f)
	opt := func(v *float64) string {
		if v == nil {
			return ""
		}
		return strconv.FormatFloat(*v, 'g', -1, 64)
	}
	head := []string{"step", "group_id", "traj_id", "task_id", "exec_status", "true_score", "recorded", "predicted", "verdict", "rationale", "reason"}
	if e.Claims != nil {
		head = append(head, "predicted_with_claim")
	}
	w.Write(head)
	for _, it := range e.Items {
		row := []string{strconv.FormatInt(it.Step, 10), it.GroupID, it.TrajID, it.TaskID, it.ExecStatus,
			strconv.FormatFloat(it.True, 'g', -1, 64), opt(it.Recorded), opt(it.New), it.Verdict, it.Rationale, it.Reason}
		if e.Claims != nil {
			row = append(row, opt(it.Claimed))
		}
		w.Write(row)
	}
	w.Flush()
	if err := w.Error(); err != nil {
		f.Close()
		return fmt.Errorf("wm-eval: %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("wm-eval: %s: %w", path, err)
	}
	return nil
}
