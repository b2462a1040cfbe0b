package main

import (
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/pipeline/offline"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/fuse"
)

// This file is wmrl replay.

// onOff reads the on/off flag named flag, given v.
func onOff(flag, v string) (bool, error) {
	switch v {
	case "on", "true":
		return true, nil
	case "off", "false":
		return false, nil
	}
	return false, fmt.Errorf("--%s %q: want on or off", flag, v)
}

// replayFlags are replay's flags that change the recorded settings.
type replayFlags struct {
	debias, denoise, rho, beforeFit, norm string
	bins, buffer, minPairs, refitEvery    int
	fraction                              float64
}

// options are the replay's settings: those recorded, with what the flags
// given (fs.Changed) change, each named in changed.
func (f *replayFlags) options(fs *pflag.FlagSet, recorded archive.Settings) (opt offline.ReplayOptions, changed []string, err error) {
	opt.Settings = recorded
	if fs.Changed("debias") {
		if opt.Settings.Debias, err = onOff("debias", f.debias); err != nil {
			return opt, nil, err
		}
		changed = append(changed, "debias "+f.debias)
	}
	if fs.Changed("denoise") {
		on, err := onOff("denoise", f.denoise)
		if err != nil {
			return opt, nil, err
		}
		if !on {
			opt.Settings.Denoiser.Estimator = fuse.EstimatorOff
		}
		changed = append(changed, "denoise "+f.denoise)
	}
	if fs.Changed("rho") {
		opt.Settings.Denoiser.Estimator = fuse.Estimator(f.rho)
		changed = append(changed, "rho "+f.rho)
	}
	if fs.Changed("before-fit") {
		opt.Settings.Debiaser.BeforeFit = f.beforeFit
		changed = append(changed, "before-fit "+f.beforeFit)
	}
	for _, o := range []struct {
		flag string
		dst  *int
		v    int
	}{
		{"min-pairs", &opt.Settings.Debiaser.MinPairs, f.minPairs},
		{"refit-every", &opt.Settings.Debiaser.RefitEvery, f.refitEvery},
		{"bins", &opt.Settings.Debiaser.Bins, f.bins},
		{"buffer", &opt.Settings.Debiaser.BufferSize, f.buffer},
	} {
		if fs.Changed(o.flag) {
			*o.dst = o.v
			changed = append(changed, fmt.Sprintf("%s %d", o.flag, o.v))
		}
	}
	if fs.Changed("advantage-norm") {
		if err := pipeline.CheckAdvantageNorm(fuse.Normalization(f.norm)); err != nil {
			return opt, nil, err
		}
		opt.Settings.AdvantageNorm = fuse.Normalization(f.norm)
		changed = append(changed, "advantage-norm "+f.norm)
	}
	if err := pipeline.CheckCalibration(opt.Settings.Debiaser, opt.Settings.Denoiser.Estimator); err != nil {
		return opt, nil, err
	}
	if fs.Changed("anchor-fraction") {
		if f.fraction <= 0 || f.fraction > recorded.AnchorFraction {
			return opt, nil, fmt.Errorf("--anchor-fraction %v: replays can only subsample the recorded anchors (recorded fraction %v)", f.fraction, recorded.AnchorFraction)
		}
		opt.AnchorFraction = f.fraction
		changed = append(changed, fmt.Sprintf("anchor fraction %v (recorded %v)", f.fraction, recorded.AnchorFraction))
	}
	return opt, changed, nil
}

// sayVerdict says what the replay found: with the recorded settings
// (changed empty), whether it reproduced the archive, an error when not;
// with others, how far they moved the fused advantages.
func sayVerdict(w io.Writer, sum offline.ReplaySummary, changed []string, builds []string) error {
	if len(changed) > 0 {
		fmt.Fprintf(w, "with %v: max |d fused| %.3g, fused sign kept on %.1f%% of rows, %d anchor groups dropped\n",
			changed, sum.MaxFusedDiff, 100*sum.SignAgreement, sum.DroppedAnchors)
		return nil
	}
	ok := sum.MaxFusedDiff <= 1e-9 && sum.MaxCalibratedDiff <= 1e-9
	verdict := "REPRODUCED: identical to the archive within 1e-9"
	if !ok {
		verdict = "NOT REPRODUCED"
	}
	fmt.Fprintf(w, "%s (recorded settings; max |d fused| %.3g, max |d calibrated| %.3g)\n", verdict, sum.MaxFusedDiff, sum.MaxCalibratedDiff)
	if !ok {
		fmt.Fprintln(w, writtenBy(builds, pipeline.ReadBuild()))
		return fmt.Errorf("replay with the recorded settings differs from the archive")
	}
	if line := reproducedAcross(builds, pipeline.ReadBuild()); line != "" {
		fmt.Fprintln(w, line)
	}
	return nil
}

func replayCommand() *cobra.Command {
	var (
		root, run, out, pic string
		steps               bool
		f                   replayFlags
	)
	cmd := &cobra.Command{
		Use:   "replay [--archive DIR]",
		Short: "Re-run calibration and fusion over an archive: reproduce it, or see what other settings would have given",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			stdout, stderr := cmd.OutOrStdout(), cmd.ErrOrStderr()
			src, rec, release, err := streamRun(root, run, "", stderr)
			if err != nil {
				return err
			}
			defer release()
			run := rec.name
			opt, changed, err := f.options(cmd.Flags(), rec.settings)
			if err != nil {
				return err
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
					show(done, rec.steps())
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
			if err := sayVerdict(stdout, sum, changed, rec.builds); err != nil {
				return err
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
	fs.StringVar(&f.debias, "debias", "", "on or off: apply the isotonic map (default: as recorded)")
	fs.StringVar(&f.denoise, "denoise", "", "on or off: inverse-variance anchor weight (off: rho 1; default: as recorded)")
	fs.StringVar(&f.rho, "rho", "", "rho estimator: reference, ratio, advantage or off (default: as recorded)")
	fs.StringVar(&f.beforeFit, "before-fit", "", "the calibration map before its first fit: mean or identity (default: as recorded)")
	fs.StringVar(&f.norm, "advantage-norm", "", "how a group's advantages are formed: std (GRPO) or center (Dr. GRPO) (default: as recorded)")
	fs.IntVar(&f.minPairs, "min-pairs", 0, "anchor pairs buffered before the first isotonic fit (default: as recorded; 0: the reference's 200)")
	fs.IntVar(&f.refitEvery, "refit-every", 0, "refit the isotonic map after this many new pairs (default: as recorded; 0: the reference's 64)")
	fs.IntVar(&f.bins, "bins", 0, "equal-width bins before the isotonic fit (default: as recorded; 0: raw pairs)")
	fs.IntVar(&f.buffer, "buffer", 0, "anchor pairs kept for the fit (default: as recorded)")
	fs.Float64Var(&f.fraction, "anchor-fraction", 0, "keep this share of groups as anchors, below the recorded one: a fixed subsample (default: as recorded)")
	positive(fs, "buffer")
	fs.BoolVar(&steps, "steps", false, "print every step: its rho, replayed and recorded, its anchor groups, how far its fused advantages moved and how many kept their sign")
	fs.StringVar(&pic, "plot", "", "with changed settings, draw what they changed step by step to this PNG (default: --out's name, .png)")
	return cmd
}

// writtenBy says, of a replay that did not reproduce its archive, whether
// the wmrl build that wrote the archive (builds, archive.Description) is the one
// replaying it: an upgrade that changed what calibration or fusion
// computes is the first cause to rule out.
func writtenBy(builds []string, this pipeline.Build) string {
	switch {
	case !writtenByThis(builds, this):
		return fmt.Sprintf("the archive was written by %s; this replay ran on wmrl %s: a change between them may be why", buildNames(builds), this)
	case this.Revision == "" || this.Modified:
		return fmt.Sprintf("the archive was written by wmrl %s, as this replay ran, but a build without its commit, or with changes not committed, cannot tell whether they are the same code", this)
	default:
		return fmt.Sprintf("the archive was written by this same build (wmrl %s): not a change of wmrl", this)
	}
}

// reproducedAcross says, of a replay that reproduced its archive, which
// other builds wrote it ("" when this one wrote all of it): the upgrade
// left what calibration and fusion compute on this archive as it was.
func reproducedAcross(builds []string, this pipeline.Build) string {
	if writtenByThis(builds, this) {
		return ""
	}
	return fmt.Sprintf("the archive was written by %s; this replay ran on wmrl %s: the builds between them compute the same on it", buildNames(builds), this)
}

// writtenByThis is whether this build wrote every file (builds,
// archive.Description).
func writtenByThis(builds []string, this pipeline.Build) bool {
	for _, b := range builds {
		if b != this.String() {
			return false
		}
	}
	return true
}
