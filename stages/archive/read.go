package archive

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"

	"github.com/parquet-go/parquet-go"
)

// Runs lists the runs archived under root.
func Runs(root string) ([]string, error) {
	ents, err := os.ReadDir(root)
	if err != nil {
		return nil, fmt.Errorf("archive: %w", err)
	}
	var runs []string
	for _, e := range ents {
		if run, ok := strings.CutPrefix(e.Name(), "run="); ok && e.IsDir() {
			runs = append(runs, run)
		}
	}
	slices.Sort(runs)
	return runs, nil
}

// ErrDamaged marks a file the parquet reader could not make sense of: its
// bytes were changed on disk (a failing disk, a copy cut short and
// patched), past what the checksums and the footer's checks catch.
var ErrDamaged = errors.New("damaged")

// damaged turns a panic of the parquet reader into *err, naming the file:
// parquet-go indexes by the offsets and lengths a file records, and a
// damaged one sends it out of bounds. Without it, one such file ended the
// process reading it (an audit, a replay, the archive stage starting or
// compacting its files, again at every restart). Deferred by each function
// that calls into the reader.
func damaged(path string, err *error) {
	if r := recover(); r != nil {
		*err = fmt.Errorf("archive: %s: %w: the parquet reader failed on it (%v); move it out of %s to read the rest",
			filepath.Base(path), ErrDamaged, r, filepath.Dir(path))
	}
}

// openParquet opens a file and reads its footer; close the *os.File
// when done with the *parquet.File.
func openParquet(path string, opts ...parquet.FileOption) (f *os.File, pf *parquet.File, err error) {
	f, err = os.Open(path)
	if err != nil {
		return nil, nil, fmt.Errorf("archive: %w", err)
	}
	defer func() {
		if err != nil {
			f.Close()
			f, pf = nil, nil
		}
	}()
	defer damaged(path, &err) // before the close above
	st, err := f.Stat()
	if err == nil {
		pf, err = parquet.OpenFile(f, st.Size(), append([]parquet.FileOption{parquet.SkipBloomFilters(true)}, opts...)...)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("archive: %s: %w", filepath.Base(path), err)
	}
	return f, pf, nil
}

// Count is the number of rows in files, from their footers.
func Count(files []string) (int64, error) {
	offsets, err := rowOffsets(files)
	if err != nil {
		return 0, err
	}
	return int64(offsets[len(files)]), nil
}

// rowOffsets reads the footers: file i's rows are [offsets[i], offsets[i+1]).
func rowOffsets(files []string) ([]int, error) {
	offsets := make([]int, len(files)+1)
	for i, path := range files {
		f, pf, err := openParquet(path, parquet.SkipPageIndex(true))
		if err != nil {
			return nil, err
		}
		offsets[i+1] = offsets[i] + int(pf.NumRows())
		f.Close()
	}
	return offsets, nil
}

// Scan reads files in order and calls fn with each row group's rows,
// which fn may keep: a stream, in the memory of a few row groups (a
// row group is decoded while fn has the one before). A row's Run is its
// file's partition, the directory run=<run> (empty for a file outside
// one). Every column is read, the anchors' prompt and response too.
func Scan(files []string, fn func([]Row) error) error {
	return scan(files, func(string) bool { return false }, fn)
}

// ScanScores is Scan without the anchors' prompt and response (nil), as
// Read: what a replay and an audit stream.
func ScanScores(files []string, fn func([]Row) error) error {
	return scan(files, withoutCode, fn)
}

// ScanColumns is Scan of the named columns alone (by their Parquet names:
// predicted, step, ...); the other fields are left at their zero values
// but Run. A pass that needs a column or two (the audit's range of the
// predictions) reads at a fraction of the cost.
func ScanColumns(files []string, names []string, fn func([]Row) error) error {
	for _, name := range names {
		if !slices.ContainsFunc(columns, func(c column) bool { return c.name == name }) {
			return fmt.Errorf("archive: no column %q", name)
		}
	}
	return scan(files, func(c string) bool { return !slices.Contains(names, c) }, fn)
}

// withoutCode skips the anchors' prompt and response (Read, ScanScores).
func withoutCode(column string) bool { return codeColumns[column] }

// scan decodes on a goroutine of its own, a row group ahead of fn.
func scan(files []string, skip func(column string) bool, fn func([]Row) error) error {
	type batch struct {
		rows []Row
		err  error
	}
	ahead, stop := make(chan batch, 1), make(chan struct{})
	go func() {
		defer close(ahead)
		send := func(b batch) error {
			select {
			case ahead <- b:
				return nil
			case <-stop:
				return errStopped
			}
		}
		if err := decodeEach(files, skip, func(rows []Row) error { return send(batch{rows: rows}) }); err != nil && err != errStopped {
			_ = send(batch{err: err})
		}
	}()
	defer func() {
		close(stop)
		for range ahead { // the decoder ends at its next row group
		}
	}()
	for b := range ahead {
		if b.err != nil {
			return b.err
		}
		if err := fn(b.rows); err != nil {
			return err
		}
	}
	return nil
}

// errStopped ends a scan's decoder whose reader returned.
var errStopped = errors.New("archive: scan stopped")

// decodeEach decodes files' row groups in order, calling fn with each.
func decodeEach(files []string, skip func(column string) bool, fn func([]Row) error) error {
	vals := make([]parquet.Value, 4096)
	for _, path := range files {
		f, pf, err := openParquet(path)
		if err != nil {
			return err
		}
		at := 0
		for _, rg := range pf.RowGroups() {
			n := int(rg.NumRows())
			if err := rowGroupFits(path, n, at, int(pf.NumRows())); err != nil {
				f.Close()
				return err
			}
			at += n
			rows := make([]Row, n)
			if err := decodeRowGroup(path, pf, rg, vals, rows, skip); err != nil {
				f.Close()
				return err
			}
			if err := fn(rows); err != nil {
				f.Close()
				return err
			}
		}
		f.Close()
	}
	return nil
}

// rowGroupFits checks that a row group of n rows, after at rows of the
// file, fits in the file's total: a damaged footer can say otherwise, and
// the rows are laid out (or allocated) by these counts.
func rowGroupFits(path string, n, at, total int) error {
	if n < 0 || n > total-at {
		return fmt.Errorf("archive: %s: %w: its footer has a row group of %d rows after %d, in a file of %d; move it out of %s to read the rest",
			filepath.Base(path), ErrDamaged, n, at, total, filepath.Dir(path))
	}
	return nil
}

func decodeRowGroup(path string, pf *parquet.File, rg parquet.RowGroup, vals []parquet.Value, rows []Row, skip func(column string) bool) (err error) {
	defer damaged(path, &err)
	if err := readRowGroup(pf, rg, vals, rows, skip); err != nil {
		return fmt.Errorf("archive: %s: %w", filepath.Base(path), err)
	}
	run, _ := strings.CutPrefix(filepath.Base(filepath.Dir(path)), "run=")
	for i := range rows {
		rows[i].Run = run
	}
	return nil
}

// Read reads files whole into one slice, in order, sized from their
// footers: every file is decoded on its own core straight into its place,
// with no copy (a million rows are about 250 MB; first-touching that
// memory twice, as appending row groups would, halves the read rate).
// progress, if set, is called with the rows read so far and the total.
// The anchors' prompt and response are left out (nil).
func Read(files []string, progress func(done, total int)) ([]Row, error) {
	offsets, err := rowOffsets(files)
	if err != nil {
		return nil, err
	}
	rows := make([]Row, offsets[len(files)])
	var mu sync.Mutex
	var firstErr error
	done := 0
	next := make(chan int)
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), len(files)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			vals := make([]parquet.Value, 4096)
			for i := range next {
				err := readFileInto(files[i], vals, rows[offsets[i]:offsets[i+1]])
				mu.Lock()
				if err != nil && firstErr == nil {
					firstErr = err
				}
				done += offsets[i+1] - offsets[i]
				if progress != nil && firstErr == nil {
					progress(done, len(rows))
				}
				mu.Unlock()
			}
		}()
	}
	for i := range files {
		next <- i
	}
	close(next)
	wg.Wait()
	if firstErr != nil {
		return nil, firstErr
	}
	return rows, nil
}

// readFileInto decodes a file into dst, which holds exactly its rows.
func readFileInto(path string, vals []parquet.Value, dst []Row) error {
	f, pf, err := openParquet(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if int(pf.NumRows()) != len(dst) {
		return fmt.Errorf("archive: %s: %d rows, its footer said %d when first read", filepath.Base(path), pf.NumRows(), len(dst))
	}
	at := 0
	for _, rg := range pf.RowGroups() {
		n := int(rg.NumRows())
		if err := rowGroupFits(path, n, at, len(dst)); err != nil {
			return err
		}
		if err := decodeRowGroup(path, pf, rg, vals, dst[at:at+n], withoutCode); err != nil {
			return err
		}
		at += n
	}
	return nil
}

// ReadAll reads a run's rows (Read over its files).
func ReadAll(root, run string) ([]Row, error) {
	files, err := Files(root, run)
	if err != nil {
		return nil, err
	}
	return Read(files, nil)
}

// ReadRun reads a run's rows and the settings its newest file recorded:
// what a replay of the run needs.
func ReadRun(root, run string) ([]Row, Settings, error) {
	files, err := Files(root, run)
	if err != nil {
		return nil, Settings{}, err
	}
	if len(files) == 0 {
		return nil, Settings{}, fmt.Errorf("archive: run %s has no closed files in %s", run, RunDir(root, run))
	}
	settings, err := ReadSettings(files[len(files)-1])
	if err != nil {
		return nil, settings, err
	}
	rows, err := Read(files, nil)
	return rows, settings, err
}

// RowWriter writes rows to one zstd Parquet file (replays, tests), made
// visible under path only by Close.
type RowWriter struct {
	f      *os.File
	w      *parquet.GenericWriter[Row]
	path   string
	closed bool
}

// CreateFile starts a file at path.
func CreateFile(path string) (*RowWriter, error) {
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	f, err := os.Create(tmp)
	if err != nil {
		return nil, fmt.Errorf("archive: %w", err)
	}
	return &RowWriter{f: f, w: parquet.NewGenericWriter[Row](f, parquet.Compression(&parquet.Zstd)), path: path}, nil
}

// Write appends rows.
func (w *RowWriter) Write(rows []Row) error {
	_, err := w.w.Write(rows)
	return err
}

// Close finishes the file and moves it into place (see commitFile).
func (w *RowWriter) Close() error {
	w.closed = true
	if err := commitFile(w.w, w.f, w.path); err != nil {
		_ = os.Remove(w.f.Name())
		return fmt.Errorf("archive: %s: %w", w.path, err)
	}
	return nil
}

// Abort drops a file that was not closed: nothing is left at its path or
// beside it (its writer stopped half-way, say by an error). After Close
// it does nothing, so that it can be deferred.
func (w *RowWriter) Abort() {
	if w.closed {
		return
	}
	w.closed = true
	_ = w.f.Close()
	_ = os.Remove(w.f.Name())
}
