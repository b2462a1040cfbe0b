package archive_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/archive/archivetest"
)

// Scan decodes a row group ahead of its reader, on a goroutine of its
// own: the rows still come in the files' order, a reader that stops
// stops the decoder, and a damaged file ends the scan with its name once
// the rows before it were read. ScanColumns reads only the columns named.
func TestScanReadsAheadInOrderAndStopsWithItsReader(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "run=r")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	rows := archivetest.Rows(3 * 256)
	var files []string
	for i := range 3 {
		path := filepath.Join(dir, string(rune('a'+i))+".parquet")
		w, err := archive.CreateFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Write(rows[i*256 : (i+1)*256]); err != nil {
			t.Fatal(err)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		files = append(files, path)
	}
	base := runtime.NumGoroutine()
	decoderGone := func() {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); runtime.NumGoroutine() > base; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%d goroutines after the scan, %d before: its decoder goes on", runtime.NumGoroutine(), base)
			}
		}
	}

	var got []archive.Row
	if err := archive.ScanScores(files, func(rs []archive.Row) error { got = append(got, rs...); return nil }); err != nil {
		t.Fatal(err)
	}
	if len(got) != len(rows) {
		t.Fatalf("scanned %d rows of %d", len(got), len(rows))
	}
	for i, r := range got {
		if r.TrajID != rows[i].TrajID || r.Step != rows[i].Step || r.Run != "r" {
			t.Fatalf("row %d: %s of step %d, run %q; want %s of step %d, run r", i, r.TrajID, r.Step, r.Run, rows[i].TrajID, rows[i].Step)
		}
	}
	decoderGone()

	// ScanColumns decodes the columns named and leaves the rest zero.
	got = got[:0]
	if err := archive.ScanColumns(files, []string{"step", "predicted"}, func(rs []archive.Row) error { got = append(got, rs...); return nil }); err != nil {
		t.Fatal(err)
	}
	for i, r := range got {
		if r.Step != rows[i].Step || r.Predicted == nil || *r.Predicted != *rows[i].Predicted || r.Run != "r" || r.TrajID != "" || r.Calibrated != nil {
			t.Fatalf("row %d of step and predicted: %+v", i, r)
		}
	}
	if len(got) != len(rows) {
		t.Fatalf("scanned %d rows of %d by their columns", len(got), len(rows))
	}
	if err := archive.ScanColumns(files, []string{"step", "predicted_score"}, func([]archive.Row) error { return nil }); err == nil || !strings.Contains(err.Error(), `no column "predicted_score"`) {
		t.Fatalf("a column no archive has: %v", err)
	}
	decoderGone()

	enough := errors.New("enough")
	batches := 0
	if err := archive.Scan(files, func([]archive.Row) error { batches++; return enough }); err != enough || batches != 1 {
		t.Fatalf("a reader that stops at its first batch: %v after %d batches", err, batches)
	}
	decoderGone()

	bad := filepath.Join(dir, "b-damaged.parquet")
	if err := os.WriteFile(bad, []byte("PAR1 not a parquet file PAR1"), 0o644); err != nil {
		t.Fatal(err)
	}
	read := 0
	err := archive.Scan([]string{files[0], bad, files[1]}, func(rs []archive.Row) error { read += len(rs); return nil })
	if err == nil || !strings.Contains(err.Error(), "b-damaged.parquet") || read != 256 {
		t.Fatalf("a damaged file after one of 256 rows: %v, %d rows read", err, read)
	}
	decoderGone()
}

// A RowWriter aborted half-way leaves nothing, at its path or beside it
// (a replay that failed left a hidden .replay-<run>.parquet.tmp); one
// closed keeps its file, whatever an Abort deferred after it does.
func TestAnAbortedFileLeavesNothing(t *testing.T) {
	dir := t.TempDir()
	rows := archivetest.Rows(64)
	for _, closeFirst := range []bool{false, true} {
		path := filepath.Join(dir, "replay.parquet")
		w, err := archive.CreateFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Write(rows); err != nil {
			t.Fatal(err)
		}
		if closeFirst {
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
		}
		w.Abort()
		left, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, e := range left {
			names = append(names, e.Name())
		}
		if want := map[bool]string{false: "[]", true: "[replay.parquet]"}[closeFirst]; fmt.Sprint(names) != want {
			t.Errorf("closed first %v: the directory holds %v, want %s", closeFirst, names, want)
		}
		if closeFirst {
			got, err := archive.Read([]string{path}, nil)
			if err != nil || len(got) != len(rows) {
				t.Errorf("the closed file read back %d rows (%v), want %d", len(got), err, len(rows))
			}
		}
	}
}
