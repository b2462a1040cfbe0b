package archive

import (
	"fmt"
	"math/rand/v2"
	"os"

	"testing"
	"time"

	"github.com/parquet-go/parquet-go"
)

// SyntheticRows makes n rows shaped like a run's (128 per step, 2 anchor
// groups of 8), for benchmarks.
func syntheticRows(n int) []Row {
	rng := rand.New(rand.NewPCG(1, 2))
	rows := make([]Row, n)
	t0 := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)
	status, crashed := "scored", "crashed"
	details := []string{
		"exit code 1: Traceback (most recent call last): | File \"/tmp/w/solution.py\", line 12, in <module> | import lightgbm | ModuleNotFoundError: No module named 'lightgbm'",
		"exit code 1: File \"/tmp/w/solution.py\", line 40, in <module> | df['area'] | KeyError: 'area'",
		"killed after 20m0s, its wall-clock limit",
	}
	for i := range rows {
		step, g := int64(i/128), (i%128)/8
		pred, truth, cal, rew := rng.Float64(), rng.Float64(), rng.Float64(), rng.Float64()
		r := Row{Run: "bench", Step: step, GroupID: fmt.Sprintf("s%d-g%02d", step, g), TrajID: fmt.Sprintf("s%d-g%02d-%d", step, g, i%8),
			TaskID: fmt.Sprintf("task-%02d", rng.IntN(32)), PolicyVersion: step, Predicted: &pred, Calibrated: &cal, Reward: &rew,
			Advantage: rng.NormFloat64(), Weight: 1, FusedAdvantage: rng.NormFloat64(), Rho: 2, Source: SourceWorldModel,
			WMStatus: "ok", TS: t0.Add(time.Duration(step) * time.Second), CalibrationSeq: 2 * step}
		if g < 2 {
			r.IsAnchor, r.Source, r.TrueScore, r.ExecStatus, r.AbsorbedSeq = true, SourceAnchor, &truth, &status, 2*step+int64(g)
			if i%3 == 0 { // a third of the executions fail, and say why
				r.ExecStatus, r.ExecDetail = &crashed, &details[rng.IntN(len(details))]
			}
		}
		rows[i] = r
	}
	return rows
}

// BenchmarkReadArchive reads a million archived rows (the replay's and
// the audit's input) and reports rows per second.
func BenchmarkReadArchive(b *testing.B) {
	const n = 1_000_000
	dir := b.TempDir()
	// Ten files of 100k rows: a live run rolls a file every 10 s (its
	// 1M-row archive here had 18).
	w, err := OpenWriter(WriterConfig{Dir: dir, Run: "bench", MaxRows: 100_000, MaxAge: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	rows := syntheticRows(n)
	for i := 0; i < n; i += 128 {
		if _, err := w.Add(UpdateKey(int64(i/128)), rows[i:min(i+128, n)], nil); err != nil {
			b.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		b.Fatal(err)
	}
	files, _ := Files(dir, "bench")
	// Baseline: parquet-go's generic row reader over the same files.
	b.Run("generic-reader", func(b *testing.B) {
		buf := make([]Row, 8192)
		for b.Loop() {
			got := 0
			for _, path := range files {
				f, _ := os.Open(path)
				r := parquet.NewGenericReader[Row](f)
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
			if err := Scan(files, func(r []Row) error { got += len(r); return nil }); err != nil {
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
			all, err := Read(files, nil)
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
	rows := syntheticRows(steps * 128)
	for _, dir := range []string{small, merged} {
		w, err := OpenWriter(WriterConfig{Dir: dir, Run: "bench", MaxAge: time.Hour})
		if err != nil {
			b.Fatal(err)
		}
		for s := 0; s < steps; s++ {
			if _, err := w.Add(UpdateKey(int64(s)), rows[s*128:(s+1)*128], nil); err != nil {
				b.Fatal(err)
			}
			if err := w.Flush(); err != nil {
				b.Fatal(err)
			}
		}
		w.Close()
	}
	if rep, err := Compact(merged, "bench", CompactConfig{}); err != nil || rep.FilesAfter != 1 {
		b.Fatalf("compact: %+v, %v", rep, err)
	}
	read := func(dir string) time.Duration {
		start := time.Now()
		files, _ := Files(dir, "bench")
		all, err := Read(files, nil)
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
