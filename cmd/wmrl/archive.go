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

	"github.com/spf13/pflag"

	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/pipeline/offline"
	"github.com/wmrl/wmrl/stages/archive"
)

// This file finds a run's archive for the offline commands and reads the
// steps they are given.

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

// runRecord is what streamRun says of a run besides its rows.
type runRecord struct {
	name     string
	settings archive.Settings // those its newest file recorded
	builds   []string         // the wmrl builds that wrote its files (archive.Description)
	steps    func() int       // how many steps it holds, once the first read is through
}

// buildNames lists the builds that wrote an archive (archive.Description) for
// people, oldest first.
func buildNames(builds []string) string {
	names := make([]string, len(builds))
	for i, b := range builds {
		names[i] = "wmrl " + b
		if b == "" {
			names[i] = "a build from before the archive kept it"
		}
	}
	return strings.Join(names, ", then ")
}

// streamRun opens one run of an archive root (run "" picks the only one)
// for replay and audit: its rows as a stream, which offline.ReplayRows and
// offline.RunAuditRows read twice, with a progress bar over the first read
// and, labelled again, over the second (the replay's has its own, by
// steps), and what its files record. release, once the reads are done,
// lets a merge of the archive's files go ahead (a second call does
// nothing).
func streamRun(root, run, again string, stderr io.Writer) (src offline.Rows, rec runRecord, release func(), err error) {
	run, files, release, err := openRun(root, run)
	if err != nil {
		return nil, rec, nil, err
	}
	fail := func(err error) (offline.Rows, runRecord, func(), error) {
		release()
		return nil, rec, nil, err
	}
	if len(files) == 0 {
		return fail(fmt.Errorf("run %s has no closed archive files in %s", run, archive.RunDir(root, run)))
	}
	d, err := archive.Describe(files)
	if err != nil {
		return fail(err)
	}
	rec.settings, rec.builds = d.Settings, d.Builds
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
			show(done, int(d.Rows))
			return fn(rows)
		})
		bar.done()
		if err == nil && reads == 1 {
			fmt.Fprintf(stderr, "read %d rows of run %s from %d files in %s (%.2fM rows/s)\n", done, run, len(files),
				time.Since(start).Round(time.Millisecond), float64(done)/time.Since(start).Seconds()/1e6)
		}
		return err
	}
	rec.name, rec.steps = run, func() int { return max(len(seen), 1) }
	return src, rec, sync.OnceFunc(release), nil
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
