package archive

import (
	"errors"
	"fmt"
	"io"
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

// Count is the number of rows in files, from their footers.
func Count(files []string) (int64, error) {
	var n int64
	for _, path := range files {
		f, err := os.Open(path)
		if err != nil {
			return 0, fmt.Errorf("archive: %w", err)
		}
		st, err := f.Stat()
		if err == nil {
			var pf *parquet.File
			if pf, err = parquet.OpenFile(f, st.Size(), parquet.SkipPageIndex(true), parquet.SkipBloomFilters(true)); err == nil {
				n += pf.NumRows()
			}
		}
		f.Close()
		if err != nil {
			return 0, fmt.Errorf("archive: %s: %w", path, err)
		}
	}
	return n, nil
}

// Scan reads files in order and calls fn with each batch of rows; the
// batch is reused after fn returns.
func Scan(files []string, fn func([]Row) error) error {
	buf := make([]Row, 8192)
	for _, path := range files {
		if err := scanFile(path, buf, fn); err != nil {
			return err
		}
	}
	return nil
}

func scanFile(path string, buf []Row, fn func([]Row) error) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("archive: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("archive: %w", err)
	}
	pf, err := parquet.OpenFile(f, st.Size(), parquet.SkipBloomFilters(true))
	if err != nil {
		return fmt.Errorf("archive: %s: %w", filepath.Base(path), err)
	}
	r := parquet.NewGenericReader[Row](pf)
	defer r.Close()
	for {
		clear(buf)
		n, err := r.Read(buf)
		if n > 0 {
			if ferr := fn(buf[:n]); ferr != nil {
				return ferr
			}
		}
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("archive: %s: %w", filepath.Base(path), err)
		}
	}
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
