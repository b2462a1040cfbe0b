package archive_test

import (
	"os"
	"testing"
	"time"

	"github.com/parquet-go/parquet-go"

	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/archive/archivetest"
)

// BenchmarkReadArchive reads a million archived rows (the replay's and
// the audit's input) and reports rows per second.
func BenchmarkReadArchive(b *testing.B) {
	const n = 1_000_000
	dir := b.TempDir()
	// Ten files of 100k rows: a live run rolls a file every 10 s (its
	// 1M-row archive here had 18).
	w, err := archive.OpenWriter(archive.WriterConfig{Dir: dir, Run: "bench", MaxRows: 100_000, MaxAge: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	rows := archivetest.Rows(n)
	for i := 0; i < n; i += 128 {
		if _, err := w.Add(archive.UpdateKey(int64(i/128)), rows[i:min(i+128, n)], nil); err != nil {
			b.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		b.Fatal(err)
	}
	files, _ := archive.Files(dir, "bench")
	// Baseline: parquet-go's generic row reader over the same files.
	b.Run("generic-reader", func(b *testing.B) {
		buf := make([]archive.Row, 8192)
		for b.Loop() {
			got := 0
			for _, path := range files {
				f, _ := os.Open(path)
				r := parquet.NewGenericReader[archive.Row](f)
				for {
					k, err := r.Read(buf)
					got += k
					if err != nil {
						break
					}
				}
				r.Close()
				f.Close()
			}
			if got != n {
				b.Fatalf("read %d rows", got)
			}
		}
		b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds()/1e6, "Mrows/s")
	})
	b.Run("columns", func(b *testing.B) {
		for b.Loop() {
			got := 0
			if err := archive.Scan(files, func(r []archive.Row) error { got += len(r); return nil }); err != nil {
				b.Fatal(err)
			}
			if got != n {
				b.Fatalf("read %d rows", got)
			}
		}
		b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds()/1e6, "Mrows/s")
	})
	// Every row kept, in one slice (Read: the rehearsal's check; replay
	// and audit read so before they streamed).
	b.Run("read-all", func(b *testing.B) {
		for b.Loop() {
			all, err := archive.Read(files, nil)
			if err != nil {
				b.Fatal(err)
			}
			if len(all) != n {
				b.Fatalf("read %d rows", len(all))
			}
		}
		b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds()/1e6, "Mrows/s")
	})
}

// BenchmarkReadMergedFiles reads the same 128k rows as a live run at a
// step per file leaves them (1,000 files, --archive-max-age closing one
// every 10 s) and after Compact merged them into one; it reports both read
// rates and the merged one's speedup (x_merged).
func BenchmarkReadMergedFiles(b *testing.B) {
	const steps = 1000
	small, merged := b.TempDir(), b.TempDir()
	rows := archivetest.Rows(steps * 128)
	for _, dir := range []string{small, merged} {
		w, err := archive.OpenWriter(archive.WriterConfig{Dir: dir, Run: "bench", MaxAge: time.Hour})
		if err != nil {
			b.Fatal(err)
		}
		for s := 0; s < steps; s++ {
			if _, err := w.Add(archive.UpdateKey(int64(s)), rows[s*128:(s+1)*128], nil); err != nil {
				b.Fatal(err)
			}
			if err := w.Flush(); err != nil {
				b.Fatal(err)
			}
		}
		w.Close()
	}
	if rep, err := archive.Compact(merged, "bench", archive.CompactConfig{}); err != nil || rep.FilesAfter != 1 {
		b.Fatalf("compact: %+v, %v", rep, err)
	}
	read := func(dir string) time.Duration {
		start := time.Now()
		files, _ := archive.Files(dir, "bench")
		all, err := archive.Read(files, nil)
		if err != nil || len(all) != len(rows) {
			b.Fatalf("read %d rows: %v", len(all), err)
		}
		return time.Since(start)
	}
	var tSmall, tMerged time.Duration
	for b.Loop() {
		tSmall += read(small)
		tMerged += read(merged)
	}
	n := float64(len(rows)) * float64(b.N) / 1e6
	b.ReportMetric(n/tSmall.Seconds(), "Mrows/s_1000_files")
	b.ReportMetric(n/tMerged.Seconds(), "Mrows/s_merged")
	b.ReportMetric(tSmall.Seconds()/tMerged.Seconds(), "x_merged")
}
