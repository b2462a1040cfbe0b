package offline

import (
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync/atomic"
	"testing"
	"time"

	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/archive/archivetest"
	"github.com/wmrl/wmrl/stages/calibrate"
)

// BenchmarkStreamedMemory replays and audits two archives, of 64k and
// 320k rows (steps of 128, in files of 100k rows and row groups of 8k),
// read whole, as the commands did, and streamed, as they do. It reports
// each one's peak heap over the larger archive (MB_, collecting at 10%
// growth so that the peak is nearly what is live), how much of it grows
// with the archive (B/row: the difference between the two, over the rows
// between), and how many times less the stream takes (x_replay,
// x_audit). A stream holds the row group being decoded and the one
// before, whatever the archive's size: with the writer's row groups of
// 64k rows, about 100 MB.
func BenchmarkStreamedMemory(b *testing.B) {
	small, large := 500*128, 2500*128
	rows := archivetest.Rows(large)
	type archiveOf struct {
		n      int
		files  []string
		stream Rows
	}
	var archives []archiveOf
	for _, n := range []int{small, large} {
		files := archivetest.Write(b, b.TempDir(), rows[:n], 100_000, 8192)
		archives = append(archives, archiveOf{n, files, func(columns []string, fn func([]archive.Row) error) error {
			if len(columns) > 0 {
				return archive.ScanColumns(files, columns, fn)
			}
			return archive.ScanScores(files, fn)
		}})
	}
	whole := func(files []string) []archive.Row {
		rows, err := archive.Read(files, nil)
		if err != nil {
			b.Fatal(err)
		}
		return rows
	}
	opt := ReplayOptions{Settings: archive.Settings{Debias: true, Debiaser: calibrate.DefaultDebiaserConfig()}}
	check := func(_ any, err error) {
		if err != nil {
			b.Fatal(err)
		}
	}
	// peak[size][what]: replay whole, replay streamed, audit whole, audit streamed.
	var peak [2][4]float64
	defer debug.SetGCPercent(debug.SetGCPercent(10))
	for b.Loop() {
		for i, a := range archives {
			peak[i][0] = peakHeap(func() { check(Replay(whole(a.files), opt, nil)) })
			peak[i][1] = peakHeap(func() { check(ReplayRows(a.stream, opt, nil)) })
			peak[i][2] = peakHeap(func() { check(RunAudit(whole(a.files), AuditOptions{})) })
			peak[i][3] = peakHeap(func() { check(RunAuditRows(a.stream, AuditOptions{})) })
		}
	}
	perRow := func(what int) float64 { return (peak[1][what] - peak[0][what]) / float64(large-small) }
	for i, name := range []string{"replay_whole", "replay_stream", "audit_whole", "audit_stream"} {
		b.ReportMetric(peak[1][i]/1e6, "MB_"+name)
		b.ReportMetric(perRow(i), "B/row_"+name)
	}
	b.ReportMetric(peak[1][0]/peak[1][1], "x_replay")
	b.ReportMetric(peak[1][2]/peak[1][3], "x_audit")
}

// peakHeap is the most the heap's objects (live, and dead not yet swept)
// grew while f ran, over what they were after a collection before it.
func peakHeap(f func()) float64 {
	const name = "/memory/classes/heap/objects:bytes"
	runtime.GC()
	sample := []metrics.Sample{{Name: name}}
	metrics.Read(sample)
	base := sample[0].Value.Uint64()
	var peak atomic.Uint64
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		s := []metrics.Sample{{Name: name}}
		for {
			metrics.Read(s)
			if v := s[0].Value.Uint64(); v > peak.Load() {
				peak.Store(v)
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	f()
	close(stop)
	<-done
	return float64(max(peak.Load(), base) - base)
}
