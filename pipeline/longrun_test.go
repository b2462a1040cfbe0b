package pipeline

import (
	"bufio"
	"context"
	"io"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// BenchmarkHeapOverALongRun: what a pipeline keeps in memory as its run
// goes on, for a run of days. Every stage runs in this process, and the
// NATS server in a process of its own, as a deployment has it, so that
// the heap read is wmrl's alone (an embedded server's caches are most of
// a process's heap, and grow with the rate of messages, not the run's
// length). At least 4,000 steps of 64 trajectories; after every 50th
// update the live heap is read after a collection. heap_MB is the median
// of the reads after the first third. growth_B/step is the Theil–Sen
// slope (median of the slopes between every two points) of the least
// read of each 500 steps, past the first 500: what stays, not what is in
// flight (files of the archive being written, batches between stages).
// It swings by hundreds of bytes from run to run and reads high over a
// short run (what grows to its steady size is still growing), so it tells
// a leak of a kilobyte or more a step (16 bytes a trajectory here), not
// less; -benchtime 16000x reads closer.
func BenchmarkHeapOverALongRun(b *testing.B) {
	cfg := DefaultConfig()
	cfg.NATSURL = serverProcess(b)
	steps := max(b.N, 4000)
	cfg.DataDir, cfg.Listen, cfg.Quiet = b.TempDir(), "127.0.0.1:0", true
	cfg.Groups, cfg.GroupSize, cfg.Steps = 8, 8, int64(steps)
	cfg.ExecLatency = time.Millisecond
	cfg.ArchiveMaxAge = time.Second // what a file holds unacknowledged is not what the run keeps
	var at, heap []float64
	n := 0
	cfg.OnUpdate = func(schemas.Update, time.Duration) {
		if n++; n%50 != 0 {
			return
		}
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		at, heap = append(at, float64(n)), append(heap, float64(m.HeapAlloc))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	b.ResetTimer()
	if err := Run(ctx, cfg); err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	if len(at) < 10 {
		b.Fatalf("%d heap reads in %d updates, want at least 10", len(at), n)
	}
	third := slices.Clone(heap[len(heap)/3:])
	slices.Sort(third)
	b.ReportMetric(third[len(third)/2]/(1<<20), "heap_MB")
	var wx, wy []float64 // the least heap of each 500 steps: what is kept, the least in flight
	for i := 0; i+10 <= len(at); i += 10 {
		wx, wy = append(wx, at[i+9]), append(wy, slices.Min(heap[i:i+10]))
	}
	b.ReportMetric(theilSen(wx[1:], wy[1:]), "growth_B/step")
}

// theilSen is the median of the slopes between every two points.
func theilSen(x, y []float64) float64 {
	var slopes []float64
	for i := range x {
		for j := i + 1; j < len(x); j++ {
			if x[j] != x[i] {
				slopes = append(slopes, (y[j]-y[i])/(x[j]-x[i]))
			}
		}
	}
	slices.Sort(slopes)
	return slopes[len(slopes)/2]
}

func TestTheilSenIgnoresASwing(t *testing.T) {
	var x, y []float64
	for i := range 40 {
		swing := 0.0
		if i%3 == 0 {
			swing = 5e6 // an archive file's batch held at this read
		}
		x, y = append(x, float64(100*i)), append(y, 30e6+250*float64(100*i)+swing)
	}
	if got := theilSen(x, y); got < 249 || got > 251 {
		t.Errorf("slope %.1f, want 250 despite every third read 5 MB up", got)
	}
}

// serverProcess starts a NATS server (natsjs.StartServer, as wmrl embeds
// it) in a child process of this test binary and returns its URL; the
// child ends with the benchmark, or with this process (its stdin closes).
func serverProcess(b *testing.B) string {
	b.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperServerProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), "WMRL_TEST_SERVER_STORE="+b.TempDir())
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { stdin.Close(); cmd.Wait() })
	lines := bufio.NewScanner(out)
	for lines.Scan() {
		if url, ok := strings.CutPrefix(lines.Text(), "url "); ok {
			go io.Copy(io.Discard, out)
			return url
		}
	}
	b.Fatalf("the server process ended without its URL: %v", lines.Err())
	return ""
}

// TestHelperServerProcess is serverProcess's child: a server until stdin
// closes.
func TestHelperServerProcess(t *testing.T) {
	store := os.Getenv("WMRL_TEST_SERVER_STORE")
	if store == "" {
		t.Skip("run by serverProcess")
	}
	srv, err := natsjs.StartServer(context.Background(), natsjs.ServerConfig{StoreDir: store})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	os.Stdout.WriteString("url " + srv.URL() + "\n")
	io.Copy(io.Discard, os.Stdin)
}
