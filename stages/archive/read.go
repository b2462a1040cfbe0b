package archive

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

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

// openParquet opens a file and reads its footer; close the *os.File
// when done with the *parquet.File.
func openParquet(path string, opts ...parquet.FileOption) (*os.File, *parquet.File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, fmt.Errorf("archive: %w", err)
	}
	st, err := f.Stat()
	var pf *parquet.File
	if err == nil {
		pf, err = parquet.OpenFile(f, st.Size(), append([]parquet.FileOption{parquet.SkipBloomFilters(true)}, opts...)...)
	}
	if err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("archive: %s: %w", filepath.Base(path), err)
	}
	return f, pf, nil
}

// Count is the number of rows in files, from their footers.
func Count(files []string) (int64, error) {
	var n int64
	for _, path := range files {
		f, pf, err := openParquet(path, parquet.SkipPageIndex(true))
		if err != nil {
			return 0, err
		}
		n += pf.NumRows()
		f.Close()
	}
	return n, nil
}

// Scan reads files in order and calls fn with each row group's rows,
// which fn may keep. A row's Run is its file's partition, the directory
// run=<run> (empty for a file outside one).
func Scan(files []string, fn func([]Row) error) error {
	vals := make([]parquet.Value, 4096)
	for _, path := range files {
		if err := scanFile(path, vals, fn); err != nil {
			return err
		}
	}
	return nil
}

func scanFile(path string, vals []parquet.Value, fn func([]Row) error) error {
	f, pf, err := openParquet(path)
	if err != nil {
		return err
	}
	defer f.Close()
	run, _ := strings.CutPrefix(filepath.Base(filepath.Dir(path)), "run=")
	for _, rg := range pf.RowGroups() {
		rows, err := readRowGroup(pf, rg, vals)
		if err != nil {
			return fmt.Errorf("archive: %s: %w", filepath.Base(path), err)
		}
		for i := range rows {
			rows[i].Run = run
		}
		if err := fn(rows); err != nil {
			return err
		}
	}
	return nil
}

// ReadAll reads a run's rows.
func ReadAll(root, run string) ([]Row, error) {
	files, err := Files(root, run)
	if err != nil {
		return nil, err
	}
	var out []Row
	err = Scan(files, func(b []Row) error { out = append(out, b...); return nil })
	return out, err
}

// RowWriter writes rows to one zstd Parquet file (replays, tests), made
// visible under path only by Close.
type RowWriter struct {
	f    *os.File
	w    *parquet.GenericWriter[Row]
	path string
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

// Close finishes the file, syncs it and renames it into place.
func (w *RowWriter) Close() error {
	err := w.w.Close()
	if err == nil {
		err = w.f.Sync()
	}
	if cerr := w.f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(w.f.Name(), w.path)
	}
	if err != nil {
		_ = os.Remove(w.f.Name())
		return fmt.Errorf("archive: %s: %w", w.path, err)
	}
	return nil
}
