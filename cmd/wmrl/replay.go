package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/wmrl/wmrl/connectors/sim/rl"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/pipeline/offline"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/route"
)

// openRun lists a run's archive files (run "" picks the only run),
// holding the directory so that no merge removes a file before it is
// read, until release.
func openRun(root, run string) (string, []string, func(), error) {
	if err := archiveThere(root); err != nil {
		return "", nil, nil, err
	}
	runs, err := archive.Runs(root)
	if err != nil {
		return "", nil, nil, err
	}
	if run != "" && !slices.Contains(runs, run) {
		return "", nil, nil, noSuchRun(root, run, runs)
	}
	if run == "" {
		switch len(runs) {
		case 0:
			return "", nil, nil, fmt.Errorf("%s holds no run=<name> directory: not an archive root", root)
		case 1:
			run = runs[0]
		default:
			return "", nil, nil, fmt.Errorf("%s holds several runs %v: pick one with --run", root, runs)
		}
	}
	release, err := archive.ReadLock(root, run)
	if err != nil {
		return "", nil, nil, err
	}
	files, err := archive.Files(root, run)
	if err != nil {
		release()
		return "", nil, nil, err
	}
	return run, files, release, nil
}

// noSuchRun is the error of a --run that root does not hold.
func noSuchRun(root, run string, runs []string) error {
	return fmt.Errorf("%s holds no run %s (it holds %s): give --run one of them", root, run, strings.Join(runs, ", "))
}

// defaultArchive is where wmrl run keeps its archive given neither --data
// nor --archive: the offline commands read it unless told another.
var defaultArchive = filepath.Join(pipeline.DefaultConfig().DataDir, "archive")

// archiveFlag adds --archive, the archive root an offline command reads.
func archiveFlag(fs *pflag.FlagSet, root *string) {
	fs.StringVar(root, "archive", defaultArchive, "archive root: the directory holding run=<name>/ (wmrl run's is DATA/archive, or its --archive)")
}

// archiveThere says, when root is no directory, what to give instead.
func archiveThere(root string) error {
	fi, err := os.Stat(root)
	switch {
	case errors.Is(err, os.ErrNotExist) && root == defaultArchive:
		return fmt.Errorf("no archive at %s, where wmrl run keeps it by default: give --archive, the directory holding run=<name>/ (wmrl run's DATA/archive, or its --archive)", root)
	case err != nil:
		return fmt.Errorf("archive root: %w", err)
	case !fi.IsDir():
		return fmt.Errorf("archive root %s is a file, not the directory holding run=<name>/", root)
	}
	return nil
}

// streamRun opens one run of an archive root (run "" picks the only one)
// for replay and audit: its rows as a stream, which offline.ReplayRows and
// offline.RunAuditRows read twice, with a progress bar over the first read
// and, labelled again, over the second (the replay's has its own, by
// steps: steps gives their number once the first read is through), and
// the settings its newest file recorded. release, once the reads are
// done, lets a merge of the archive's files go ahead (a second call does
// nothing).
func streamRun(root, run, again string, stderr io.Writer) (src offline.Rows, settings archive.Settings, name string, steps func() int, release func(), err error) {
	run, files, release, err := openRun(root, run)
	if err != nil {
		return nil, settings, "", nil, nil, err
	}
	fail := func(err error) (offline.Rows, archive.Settings, string, func() int, func(), error) {
		release()
		return nil, settings, "", nil, nil, err
	}
	if len(files) == 0 {
		return fail(fmt.Errorf("run %s has no closed archive files in %s", run, archive.RunDir(root, run)))
	}
	if settings, err = archive.ReadSettings(files[len(files)-1]); err != nil {
		return fail(err)
	}
	total, err := archive.Count(files)
	if err != nil {
		return fail(err)
	}
	reads := 0
	seen := map[int64]struct{}{}
	scan := func(columns []string, fn func([]archive.Row) error) error {
		if len(columns) > 0 {
			return archive.ScanColumns(files, columns, fn)
		}
		return archive.ScanScores(files, fn)
	}
	src = func(columns []string, fn func([]archive.Row) error) error {
		reads++
		label := again
		if reads == 1 {
			label = "reading"
		}
		if label == "" {
			return scan(columns, fn)
		}
		bar := newProgressBar(stderr)
		show := bar.set(label)
		start, done := time.Now(), 0
		err := scan(columns, func(rows []archive.Row) error {
			if reads == 1 {
				for i := range rows {
					seen[rows[i].Step] = struct{}{}
				}
			}
			done += len(rows)
			show(done, int(total))
			return fn(rows)
		})
		bar.done()
		if err == nil && reads == 1 {
			fmt.Fprintf(stderr, "read %d rows of run %s from %d files in %s (%.2fM rows/s)\n", done, run, len(files),
				time.Since(start).Round(time.Millisecond), float64(done)/time.Since(start).Seconds()/1e6)
		}
		return err
	}
	return src, settings, run, func() int { return max(len(seen), 1) }, sync.OnceFunc(release), nil
}

func onOff(flag, v string) (bool, error) {
	switch v {
	case "on", "true":
		return true, nil
	case "off", "false":
		return false, nil
	}
	return false, fmt.Errorf("--%s %q: want on or off", flag, v)
}

func replayCommand() *cobra.Command {
	var (
		root, run, out, pic, debias, denoise, rho, beforeFit string
		bins, buffer, minPairs, refitEvery                   int
		fraction                                             float64
		steps                                                bool
	)
	cmd := &cobra.Command{
		Use:   "replay [--archive DIR]",
		Short: "Re-run calibration and fusion over an archive: reproduce it, or see what other settings would have given",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			stdout, stderr := cmd.OutOrStdout(), cmd.ErrOrStderr()
			src, recorded, run, nsteps, release, err := streamRun(root, run, "", stderr)
			if err != nil {
				return err
			}
			defer release()
			opt := offline.ReplayOptions{Settings: recorded}
			fs := cmd.Flags()
			var changed []string
			if fs.Changed("debias") {
				if opt.Settings.Debias, err = onOff("debias", debias); err != nil {
					return err
				}
				changed = append(changed, "debias "+debias)
			}
			if fs.Changed("denoise") {
				on, err := onOff("denoise", denoise)
				if err != nil {
					return err
				}
				if !on {
					opt.Settings.Denoiser.Estimator = fuse.EstimatorOff
				}
				changed = append(changed, "denoise "+denoise)
			}
			if fs.Changed("rho") {
				opt.Settings.Denoiser.Estimator = fuse.Estimator(rho)
				changed = append(changed, "rho "+rho)
			}
			if fs.Changed("before-fit") {
				opt.Settings.Debiaser.BeforeFit = beforeFit
				changed = append(changed, "before-fit "+beforeFit)
			}
			for _, o := range []struct {
				flag string
				dst  *int
				v    int
			}{
				{"min-pairs", &opt.Settings.Debiaser.MinPairs, minPairs},
				{"refit-every", &opt.Settings.Debiaser.RefitEvery, refitEvery},
				{"bins", &opt.Settings.Debiaser.Bins, bins},
				{"buffer", &opt.Settings.Debiaser.BufferSize, buffer},
			} {
				if fs.Changed(o.flag) {
					*o.dst = o.v
					changed = append(changed, fmt.Sprintf("%s %d", o.flag, o.v))
				}
			}
			if err := pipeline.CheckCalibration(opt.Settings.Debiaser, opt.Settings.Denoiser.Estimator); err != nil {
				return err
			}
			if fs.Changed("anchor-fraction") {
				if fraction <= 0 || fraction > recorded.AnchorFraction {
					return fmt.Errorf("--anchor-fraction %v: replays can only subsample the recorded anchors (recorded fraction %v)", fraction, recorded.AnchorFraction)
				}
				opt.AnchorFraction = fraction
				changed = append(changed, fmt.Sprintf("anchor fraction %v (recorded %v)", fraction, recorded.AnchorFraction))
			}
			if len(changed) > 0 && out == "" {
				out = fmt.Sprintf("replay-%s.parquet", run)
			}
			if pic != "" && len(changed) == 0 {
				return fmt.Errorf("--plot draws what other settings changed: give one (--rho reference, --debias off, ...); with the recorded settings the replay is the archive")
			}
			if len(changed) > 0 && pic == "" {
				pic = strings.TrimSuffix(out, ".parquet") + ".png"
			}
			var curves *offline.ReplayCurves
			if len(changed) > 0 {
				curves = &offline.ReplayCurves{}
			}
			var w *archive.RowWriter
			if out != "" {
				if w, err = archive.CreateFile(out); err != nil {
					return err
				}
				defer w.Abort() // a replay that fails leaves no part of its file
			}
			bar := newProgressBar(stderr)
			show := bar.set("replay")
			done := 0
			if steps {
				fmt.Fprintf(stdout, "%8s  %8s  %8s  %7s  %12s  %6s\n", "step", "rho", "recorded", "anchors", "max|dfused|", "sign=")
			}
			var werr error
			start := time.Now()
			sum, err := offline.ReplayRows(src, opt, func(r offline.StepReport) {
				if done++; done == 1 {
					bar.start = time.Now() // the replay's time, after the first read's
				}
				if steps {
					fmt.Fprintf(stdout, "%8d  %8.4f  %8.4f  %7d  %12.3g  %5.1f%%\n", r.Step, r.Rho, r.RecordedRho, r.Anchors, r.MaxFusedDiff, 100*r.SignAgreement)
				} else {
					show(done, nsteps())
				}
				if curves != nil {
					curves.Add(r)
				}
				if w != nil && werr == nil {
					werr = w.Write(r.Rows())
				}
			})
			release() // read through: a merge may go on while the output is closed and the plot drawn
			if !steps {
				bar.done()
			}
			if err != nil {
				return err
			}
			if w != nil {
				werr = errors.Join(werr, w.Close())
				if werr != nil {
					return werr
				}
			}
			fmt.Fprintf(stdout, "replayed run %s: %d steps, %d rows (%d late anchor pairs), %d anchor groups absorbed in %s\n",
				run, sum.Steps, sum.Rows, sum.LatePairs, sum.AnchorGroups, time.Since(start).Round(time.Millisecond))
			if len(sum.Gaps) > 0 {
				fmt.Fprintf(stdout, "warning: the archive holds no anchor group for %d calibration seqs (first %d): those pairs were never archived, so the live calibration saw pairs this replay cannot\n", len(sum.Gaps), sum.Gaps[0])
			}
			if len(changed) == 0 {
				ok := sum.MaxFusedDiff <= 1e-9 && sum.MaxCalibratedDiff <= 1e-9
				verdict := "REPRODUCED: identical to the archive within 1e-9"
				if !ok {
					verdict = "NOT REPRODUCED"
				}
				fmt.Fprintf(stdout, "%s (recorded settings; max |d fused| %.3g, max |d calibrated| %.3g)\n", verdict, sum.MaxFusedDiff, sum.MaxCalibratedDiff)
				if !ok {
					return fmt.Errorf("replay with the recorded settings differs from the archive")
				}
			} else {
				fmt.Fprintf(stdout, "with %v: max |d fused| %.3g, fused sign kept on %.1f%% of rows, %d anchor groups dropped\n",
					changed, sum.MaxFusedDiff, 100*sum.SignAgreement, sum.DroppedAnchors)
			}
			if w != nil {
				abs, _ := filepath.Abs(out)
				fmt.Fprintf(stdout, "replayed rows written to %s\n", abs)
			}
			if curves != nil {
				if err := offline.WriteReplayPlot(curves, strings.Join(changed, ", "), pic); err != nil {
					return err
				}
				abs, _ := filepath.Abs(pic)
				fmt.Fprintf(stdout, "what changed, step by step: %s (rho, fused signs kept, fused advantages replayed against recorded)\n", abs)
			}
			return nil
		},
	}
	fs := cmd.Flags()
	archiveFlag(fs, &root)
	fs.StringVar(&run, "run", "", "run to replay (default: the only one)")
	fs.StringVar(&out, "out", "", "write the replayed rows to this Parquet file (default with changed settings: replay-<run>.parquet)")
	fs.StringVar(&debias, "debias", "", "on or off: apply the isotonic map (default: as recorded)")
	fs.StringVar(&denoise, "denoise", "", "on or off: inverse-variance anchor weight (off: rho 1; default: as recorded)")
	fs.StringVar(&rho, "rho", "", "rho estimator: reference, ratio, advantage or off (default: as recorded)")
	fs.StringVar(&beforeFit, "before-fit", "", "the calibration map before its first fit: mean or identity (default: as recorded)")
	fs.IntVar(&minPairs, "min-pairs", 0, "anchor pairs buffered before the first isotonic fit (default: as recorded; 0: the reference's 200)")
	fs.IntVar(&refitEvery, "refit-every", 0, "refit the isotonic map after this many new pairs (default: as recorded; 0: the reference's 64)")
	fs.IntVar(&bins, "bins", 0, "equal-width bins before the isotonic fit (default: as recorded; 0: raw pairs)")
	fs.IntVar(&buffer, "buffer", 0, "anchor pairs kept for the fit (default: as recorded)")
	fs.Float64Var(&fraction, "anchor-fraction", 0, "keep this share of groups as anchors, below the recorded one: a fixed subsample (default: as recorded)")
	positive(fs, "buffer")
	fs.BoolVar(&steps, "steps", false, "print every step: its rho, replayed and recorded, its anchor groups, how far its fused advantages moved and how many kept their sign")
	fs.StringVar(&pic, "plot", "", "with changed settings, draw what they changed step by step to this PNG (default: --out's name, .png)")
	return cmd
}

func auditCommand() *cobra.Command {
	var (
		root, run, out string
		opt            offline.AuditOptions
		expect         offline.ExpectOptions
		deadline, last time.Duration
		steps          string
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
			src, settings, run, _, release, err := streamRun(root, run, "auditing", stderr)
			if err != nil {
				return err
			}
			defer release()
			if opt.Steps, err = pickSteps("audit", steps, last, src); err != nil {
				return err
			}
			if deadline > 0 {
				opt.AnchorDeadline = deadline.Seconds()
			} else {
				opt.AnchorDeadline = settings.AnchorDeadline
			}
			start := time.Now()
			a, err := offline.RunAuditRows(src, opt)
			release() // read: a merge may go on while wmrl sim runs and the report is written
			if err != nil {
				return err
			}
			if expect.Seeds > 0 {
				bar := newProgressBar(stderr)
				expect.Progress = bar.set("what to expect (wmrl sim)")
				a.Expect, err = offline.Expect(a, settings, expect)
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
			fmt.Fprintf(stdout, "audited %s: %d rows, %d anchor pairs, %d tasks in %s\n", which, a.Rows, a.Pairs, len(a.Tasks), time.Since(start).Round(time.Millisecond))
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
	fs.IntVar(&opt.Bins, "bins", 10, "score bins")
	fs.Float64Var(&opt.Tolerance, "tolerance", 0.05, "a level's mean residual within this counts as unbiased")
	fs.IntVar(&opt.MinBinPairs, "min-bin-pairs", 10, "levels with fewer anchor pairs are not judged")
	fs.IntVar(&opt.MinTaskPairs, "min-task-pairs", 30, "tasks with fewer anchor pairs get no verdict")
	fs.DurationVar(&deadline, "anchor-deadline", 0, "the run's --anchor-deadline, which the execution times are set against (default: as the archive records it; archives from before it was recorded need it)")
	fs.IntVar(&expect.Seeds, "expect-seeds", 8, "seeds of the wmrl sim run at this world model (what to expect; 0: none)")
	expect.Optimizer, expect.Costs = rl.DefaultConfig().Optimizer, rl.DefaultCosts
	fs.Var(choiceFlag[rl.Optimizer]{&expect.Optimizer, rl.Optimizers}, "expect-optimizer", fmt.Sprintf("the simulated learner's optimizer for what to expect: %v", rl.Optimizers))
	fs.Float64Var(&expect.Costs.WorldModel, "cost-wm", expect.Costs.WorldModel, "what to expect: cost of a world-model call, in generations (0: counted free)")
	fs.Float64Var(&expect.Costs.Execute, "cost-exec", expect.Costs.Execute, "what to expect: cost of an execution, in generations (0: counted free)")
	positive(fs, "bins", "tolerance", "min-bin-pairs", "min-task-pairs", "anchor-deadline")
	return cmd
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
	fmt.Fprintf(w, "  this run's shape and settings: %d groups of %d a step, anchor fraction %.2f (%s), debias %v, rho %s; %d steps of a %s learner; costs in generations: world-model call %g, execution %g\n",
		e.Groups, e.GroupSize, e.AnchorFraction, rounding, e.Debias, est, e.Steps, e.Optimizer, e.Costs.WorldModel, e.Costs.Execute)
	fmt.Fprintf(w, "  over all their steps, an audit of the simulated run measures %.3f and this one %.3f (a learning policy's groups grow alike, which lowers it; the simulated policy's become copies of one solution)\n",
		e.SimAuditedRankCorr, overall)
	rl.WriteTable(w, e.Result, e.Methods)
}

func compactCommand() *cobra.Command {
	var (
		root, run string
		cfg       archive.CompactConfig
	)
	cmd := &cobra.Command{
		Use:   "compact [--archive DIR]",
		Short: "Merge an archive's small closed files into larger ones (the archive stage does it in the background after --archive-compact-after)",
		Long: `Merge each run's closed archive files, in order, into files of up to
--max-rows rows. A running archive stage closes a file every
--archive-max-age (10 s): 8,640 a day, which readers pay for per file.
Files recorded with other settings (a restart with other flags) are kept
apart. Safe while the pipeline runs and after a crash at any point: no row
is lost or, for wmrl's readers, read twice. A replay or audit reading the
run is waited for.

Files written before a column was added to the archive (exec_detail,
wm_verdict, wm_rationale) are rewritten with it, null throughout, even alone: pandas (pyarrow) takes a
directory's columns from its first file, and would leave the new column
out of the whole archive.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			stdout, stderr := cmd.OutOrStdout(), cmd.ErrOrStderr()
			if cfg.MinAge < 0 {
				return fmt.Errorf("--min-age %v: want a duration >= 0 (0: every file)", cfg.MinAge)
			}
			if err := archiveThere(root); err != nil {
				return err
			}
			runs, err := archive.Runs(root)
			switch {
			case err != nil:
				return err
			case len(runs) == 0:
				return fmt.Errorf("%s holds no run=<name> directory: not an archive root", root)
			case run != "" && !slices.Contains(runs, run):
				return noSuchRun(root, run, runs)
			case run != "":
				runs = []string{run}
			}
			for _, r := range runs {
				start := time.Now()
				bar := newProgressBar(stderr)
				c := cfg
				c.Upgrade = true
				c.Progress = bar.set("run " + r)
				rep, err := archive.Compact(root, r, c)
				if errors.Is(err, archive.ErrBusy) {
					fmt.Fprintf(stderr, "run %s: a replay or audit is reading it; waiting\n", r)
					c.Wait = true
					rep, err = archive.Compact(root, r, c)
				}
				bar.done()
				if err != nil {
					return fmt.Errorf("run %s: %w", r, err)
				}
				var upgraded string
				if len(rep.Added) > 0 {
					upgraded = fmt.Sprintf("; added column %s, rewriting %d files alone for it", strings.Join(rep.Added, ", "), rep.Upgraded)
				}
				fmt.Fprintf(stdout, "run %s: %d files -> %d (%d merged files, %d rows%s) in %s\n", r, rep.FilesBefore, rep.FilesAfter,
					rep.Merged, rep.Rows, upgraded, time.Since(start).Round(time.Millisecond))
			}
			return nil
		},
	}
	fs := cmd.Flags()
	archiveFlag(fs, &root)
	fs.StringVar(&run, "run", "", "run to compact (default: every run)")
	fs.Int64Var(&cfg.MaxRows, "max-rows", 1_000_000, "rows in a merged file at most")
	fs.DurationVar(&cfg.MinAge, "min-age", 0, "merge only files closed at least this long ago (0: every file)")
	positive(fs, "max-rows")
	return cmd
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

// stepFlags adds --steps and --last, which pick the steps a command
// (what it does: "audit") reads.
func stepFlags(fs *pflag.FlagSet, steps *string, last *time.Duration, what string) {
	fs.StringVar(steps, "steps", "", what+" these steps alone: FROM-TO, FROM- (and after), -TO, or one step; an anchor late for its step counts with its step (default: every step)")
	fs.DurationVar(last, "last", 0, what+" the steps fused in this span up to the run's newest step alone, such as 6h (default: every step)")
}

// pickSteps is the steps --steps or --last name (nil: every step), --last
// read from src.
func pickSteps(command, steps string, last time.Duration, src offline.Rows) (*offline.StepRange, error) {
	switch {
	case steps != "" && last != 0:
		return nil, fmt.Errorf("%s: --steps and --last both say which steps: give one", command)
	case last < 0:
		return nil, fmt.Errorf("%s: --last %s: want a span of time, such as 6h", command, last)
	case steps != "":
		r, err := offline.ParseStepRange(steps)
		if err != nil {
			return nil, fmt.Errorf("%s: --%w", command, err)
		}
		return &r, nil
	case last > 0:
		r, err := offline.LastSteps(src, last)
		if err != nil {
			return nil, fmt.Errorf("%s: --last %s: %w", command, last, err)
		}
		return &r, nil
	}
	return nil, nil
}
