package main

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/wmrl/wmrl/stages/archive"
)

// This file is wmrl compact.

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
Files recorded with other settings (a restart with other flags, or on
another build of wmrl) are kept apart. Safe while the pipeline runs and
after a crash at any point: no row is lost or, for wmrl's readers, read
twice. A replay or audit reading the run is waited for.

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
