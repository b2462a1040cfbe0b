package archive

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"time"

	"github.com/parquet-go/parquet-go"

	"github.com/wmrl/wmrl/stages/flock"
)

// A run's directory gets a file every --archive-max-age (10 s) while the
// stage waits for input, because its inputs are acknowledged only once
// their file is closed: 8,640 files a day, most of a few steps. Readers pay
// per file (a footer read and a seek each, and DuckDB and pyarrow plan per
// file), so closed files are merged into files of up to MaxRows rows once
// they are older than a bound.
//
// A merge is crash-safe and never shows a row twice or loses one to our
// readers: the merged file is written under a temporary name and synced; a
// journal naming it and its inputs is written; the merged file is renamed
// over the first input (whose name, and so whose place in the order, it
// takes); the other inputs are removed; the journal goes last. A crash
// before the rename leaves the inputs as they were (the temporary file is
// dropped); after it, the inputs left are removed. Merges hold an
// exclusive lock on the run's directory and our readers a shared one
// (ReadLock), so a replay or audit never lists a file a merge then removes.
// Outside readers (DuckDB, pandas) that list the directory during the
// milliseconds between the rename and the removals can see an input's rows
// twice.

const (
	compactJournal = ".compact.json"
	compactLock    = ".compact.lock"
	// metaMergedTo is the number of a merged file's last input: the writer
	// numbers new files after it, so that no name is ever used for two
	// contents (an incremental backup or sync that skips names it has
	// would miss new rows).
	metaMergedTo = "wmrl.merged_to"
)

// CompactConfig bounds a merge.
type CompactConfig struct {
	// MaxRows bounds a merged file (default 1,000,000).
	MaxRows int64
	// MinAge: only files closed at least this long ago are merged (0: all).
	MinAge time.Duration
	// RowGroupRows bounds a row group of a merged file (default 65,536).
	RowGroupRows int64
	// Wait for readers holding the directory instead of returning ErrBusy.
	Wait bool
	// Upgrade also rewrites files, alone or of MaxRows, that lack a column
	// added to the archive since they were written (merged files always
	// have every column), so that readers which take one file's columns
	// for all (pyarrow's dataset) see it. Off in the archive stage's
	// background merges: it rewrites a whole archive once.
	Upgrade bool
	// Progress, if set, hears how many of the run's files were looked at.
	Progress func(done, total int)
}

// CompactReport says what a merge did.
type CompactReport struct {
	FilesBefore, FilesAfter int
	Merged                  int   // merged files written
	Rows                    int64 // rows in the merged files
	// Upgraded files were rewritten alone to add the columns Added.
	Upgraded int
	Added    []string
}

func (r *CompactReport) added(cols []string) {
	for _, c := range cols {
		if !slices.Contains(r.Added, c) {
			r.Added = append(r.Added, c)
		}
	}
}

// ErrBusy is returned by Compact when a reader holds the directory.
var ErrBusy = errors.New("archive: a reader holds the run's directory")

type journal struct {
	Tmp    string   `json:"tmp"`    // the merged file before its rename
	Output string   `json:"output"` // its final name: the first input's
	Inputs []string `json:"inputs"` // every input, Output included
	// MergedTo is what the merged file records as its merged_to: seeing it
	// in Output's footer tells the merged file from the first input.
	MergedTo int64 `json:"merged_to"`
}

// Compact merges a run's closed files, oldest first, into files of up to
// MaxRows rows. Files of different recorded settings (a restart with
// other flags, or on another build) are never merged together, nor are
// files that are not consecutive in the order. Safe while the run's
// archive stage writes: it only touches closed files, and a merged file
// keeps its first input's number, which the writer never hands out again.
func Compact(root, run string, cfg CompactConfig) (CompactReport, error) {
	if cfg.MaxRows <= 0 {
		cfg.MaxRows = 1_000_000
	}
	if cfg.RowGroupRows <= 0 {
		cfg.RowGroupRows = 65536
	}
	dir := RunDir(root, run)
	unlock, err := lockMerges(dir, cfg.Wait)
	if err != nil {
		return CompactReport{}, err
	}
	defer unlock()
	if err := recoverCompaction(dir); err != nil {
		return CompactReport{}, err
	}
	files, err := Files(root, run)
	if err != nil {
		return CompactReport{}, err
	}
	rep := CompactReport{FilesBefore: len(files), FilesAfter: len(files)}
	type info struct {
		path     string
		rows     int64
		settings string
		old      bool
		missing  []string // later columns it lacks
	}
	infos := make([]info, len(files))
	for i, path := range files {
		f, pf, err := openParquet(path, parquet.SkipPageIndex(true))
		if err != nil {
			return rep, err
		}
		st, err := f.Stat()
		f.Close()
		if err != nil {
			return rep, fmt.Errorf("archive: %w", err)
		}
		settings, _ := pf.Lookup(metaSettings)
		infos[i] = info{path: path, rows: pf.NumRows(), settings: settings, old: time.Since(st.ModTime()) >= cfg.MinAge,
			missing: missingColumns(pf.Schema())}
	}
	for i := 0; i < len(infos); {
		if !infos[i].old {
			i++
			continue
		}
		j, rows := i+1, infos[i].rows
		for j < len(infos) && infos[j].old && infos[j].settings == infos[i].settings && rows+infos[j].rows <= cfg.MaxRows {
			rows += infos[j].rows
			j++
		}
		switch {
		case j-i == 1 && cfg.Upgrade && len(infos[i].missing) > 0:
			if err := merge(dir, []string{infos[i].path}, infos[i].settings, cfg.RowGroupRows); err != nil {
				return rep, err
			}
			rep.Upgraded++
			rep.added(infos[i].missing)
		case j-i >= 2:
			batch := make([]string, 0, j-i)
			for _, in := range infos[i:j] {
				batch = append(batch, in.path)
			}
			if err := merge(dir, batch, infos[i].settings, cfg.RowGroupRows); err != nil {
				return rep, err
			}
			rep.Merged++
			rep.Rows += rows
			rep.FilesAfter -= j - i - 1
			for _, in := range infos[i:j] {
				rep.added(in.missing)
			}
		}
		i = j
		if cfg.Progress != nil {
			cfg.Progress(i, len(infos))
		}
	}
	return rep, nil
}

// merge writes the rows of inputs, in order, into one file that replaces
// them (see the package's note on merges for the steps and their order).
func merge(dir string, inputs []string, settings string, rowGroupRows int64) error {
	output := filepath.Base(inputs[0])
	tmp := filepath.Join(dir, ".compact-"+output+".tmp")
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o644)
	if err != nil {
		return fmt.Errorf("archive: %w", err)
	}
	pw := parquet.NewGenericWriter[Row](f, parquet.Compression(&parquet.Zstd), parquet.KeyValueMetadata(metaSettings, settings),
		parquet.MaxRowsPerRowGroup(rowGroupRows), parquet.CreatedBy("wmrl", "1", ""))
	var keys []string
	var late []LateGroup
	var mergedTo int64 // the highest number an input had or replaced
	err = func() error {
		for _, in := range inputs {
			k, l, to, err := readMeta(in)
			if err != nil {
				return err
			}
			n, _ := partNumber(filepath.Base(in))
			keys, late, mergedTo = append(keys, k...), append(late, l...), max(mergedTo, n, to)
			if err := Scan([]string{in}, func(rows []Row) error {
				_, err := pw.Write(rows)
				return err
			}); err != nil {
				return err
			}
		}
		b, _ := json.Marshal(keys)
		pw.SetKeyValueMetadata(metaKeys, string(b))
		pw.SetKeyValueMetadata(metaMergedTo, strconv.FormatInt(mergedTo, 10))
		if len(late) > 0 {
			b, _ := json.Marshal(late)
			pw.SetKeyValueMetadata(metaLate, string(b))
		}
		if err := pw.Close(); err != nil {
			return err
		}
		return f.Sync()
	}()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("archive: merge into %s: %w", output, err)
	}
	j := journal{Tmp: filepath.Base(tmp), Output: output, MergedTo: mergedTo}
	for _, in := range inputs {
		j.Inputs = append(j.Inputs, filepath.Base(in))
	}
	if err := writeJournal(dir, j); err != nil {
		_ = os.Remove(tmp)
		return err
	}
	if err := os.Rename(tmp, filepath.Join(dir, output)); err != nil {
		_ = os.Remove(filepath.Join(dir, compactJournal)) // first: a journal without its file reads as renamed
		_ = os.Remove(tmp)
		return fmt.Errorf("archive: merge into %s: %w", output, err)
	}
	if err := syncDir(dir); err != nil {
		return fmt.Errorf("archive: merge into %s: %w", output, err)
	}
	return finishMerge(dir, j)
}

func writeJournal(dir string, j journal) error {
	b, err := json.Marshal(j)
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, compactJournal+".tmp")
	f, err := os.Create(tmp)
	if err == nil {
		_, err = f.Write(b)
		if err == nil {
			err = f.Sync()
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err == nil {
		err = os.Rename(tmp, filepath.Join(dir, compactJournal))
	}
	if err == nil {
		err = syncDir(dir)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("archive: merge journal: %w", err)
	}
	return nil
}

// finishMerge removes a renamed merge's other inputs, then its journal.
func finishMerge(dir string, j journal) error {
	for _, in := range j.Inputs {
		if in == j.Output {
			continue
		}
		if err := os.Remove(filepath.Join(dir, in)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("archive: merge into %s: remove %s: %w", j.Output, in, err)
		}
	}
	if err := syncDir(dir); err != nil {
		return fmt.Errorf("archive: merge into %s: %w", j.Output, err)
	}
	if err := os.Remove(filepath.Join(dir, compactJournal)); err != nil {
		return fmt.Errorf("archive: merge into %s: %w", j.Output, err)
	}
	return syncDir(dir)
}

// recoverCompaction completes or undoes a merge a crash interrupted: once
// the merged file is in place (its footer has the journal's merged_to), the
// inputs left are removed; otherwise the inputs are intact, and the journal
// and any temporary file are dropped. The caller holds the directory's
// exclusive lock.
func recoverCompaction(dir string) error {
	_ = os.Remove(filepath.Join(dir, compactJournal+".tmp")) // a journal never written whole
	b, err := os.ReadFile(filepath.Join(dir, compactJournal))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("archive: merge journal: %w", err)
	}
	var j journal
	if err := json.Unmarshal(b, &j); err != nil || j.Output == "" || j.Tmp == "" || !slices.Contains(j.Inputs, j.Output) {
		return fmt.Errorf("archive: merge journal %s is not one: %q", filepath.Join(dir, compactJournal), b)
	}
	renamed := false
	if _, err := os.Stat(filepath.Join(dir, j.Tmp)); errors.Is(err, os.ErrNotExist) {
		// Removing inputs is only safe once the merged file is in place:
		// check that the output is it, not the first input still.
		_, _, mergedTo, err := readMeta(filepath.Join(dir, j.Output))
		renamed = err == nil && mergedTo == j.MergedTo && j.MergedTo > 0
	}
	if renamed {
		return finishMerge(dir, j)
	}
	if err := os.Remove(filepath.Join(dir, compactJournal)); err != nil {
		return fmt.Errorf("archive: undo merge into %s: %w", j.Output, err)
	}
	if err := os.Remove(filepath.Join(dir, j.Tmp)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("archive: undo merge into %s: %w", j.Output, err)
	}
	return syncDir(dir)
}

// ReadLock holds a run's directory for reading: no merge removes a file
// until release is called. Take it before listing the files and keep it
// until they are read. A merge a crash interrupted is finished first, when
// the directory can be written (else its inputs' rows would be read twice).
func ReadLock(root, run string) (release func(), err error) {
	dir := RunDir(root, run)
	path := filepath.Join(dir, compactLock)
	f, err := flockAt(path, os.O_RDONLY, syscall.LOCK_EX|syscall.LOCK_NB)
	switch {
	case err == nil:
		if err := recoverCompaction(dir); err != nil {
			flock.Release(f)
			return nil, err
		}
		err = flock.Lock(f, syscall.LOCK_SH)
	case errors.Is(err, syscall.EWOULDBLOCK): // a merge is running: wait for it
		f, err = flockAt(path, os.O_RDONLY, syscall.LOCK_SH)
	case errors.Is(err, syscall.EROFS) || errors.Is(err, syscall.EACCES):
		return func() {}, nil // an archive we cannot write: nothing merges in it either
	}
	if err != nil {
		if f != nil {
			flock.Release(f)
		}
		return nil, fmt.Errorf("archive: lock %s: %w", dir, err)
	}
	return func() { flock.Release(f) }, nil
}

// lockMerges holds dir for a merge; without wait, a reader or merge
// holding it returns ErrBusy.
func lockMerges(dir string, wait bool) (func(), error) {
	how := syscall.LOCK_EX
	if !wait {
		how |= syscall.LOCK_NB
	}
	f, err := flockAt(filepath.Join(dir, compactLock), os.O_RDONLY, how)
	if errors.Is(err, syscall.EWOULDBLOCK) {
		return nil, ErrBusy
	}
	if err != nil {
		return nil, fmt.Errorf("archive: lock %s: %w", dir, err)
	}
	return func() { flock.Release(f) }, nil
}

// flockAt opens path (made if missing) with flag and takes the flock how
// on it. The error is the system's, unwrapped, so that callers can tell a
// lock held by another (syscall.EWOULDBLOCK with LOCK_NB).
func flockAt(path string, flag, how int) (*os.File, error) {
	return flock.Open(path, flag|os.O_CREATE, 0o644, how)
}
