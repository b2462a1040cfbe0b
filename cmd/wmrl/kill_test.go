package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/fuse"
)

// buildBinary is wmrl compiled for the package's tests, once: five tests
// run the binary, and each link took seconds of a core.
func buildBinary(t *testing.T) string {
	t.Helper()
	bin, err := built()
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

// binDir holds the binary buildBinary compiles; TestMain makes it and
// removes it once the tests end.
var binDir string

var built = sync.OnceValues(func() (string, error) {
	bin := filepath.Join(binDir, "wmrl")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build: %v\n%s", err, out)
	}
	return bin, nil
})

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "wmrl-cmd-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// TestSIGKILLLosesNothing kills a running `wmrl run` at random points
// several times, restarts it on the same data directory, and checks the
// stored stream: every step's update exactly once, every anchor group's
// pairs once, no dead letter, and a calibration that resumed where it was, from its
// checkpoint and the pairs after it (the stored map versions are exactly
// those a fresh replay of the stored pairs gives).
func TestSIGKILLLosesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	bin := buildBinary(t)
	data := t.TempDir()
	const steps = 60
	args := []string{"run", "--steps", fmt.Sprint(steps), "--data", data, "--listen", "127.0.0.1:0", "--exec-latency", "5ms",
		"--archive-max-age", "150ms", "--checkpoint-every", "3"} // checkpoints mid-step too, so a kill lands between them and the restart resumes from one
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	for kill := 0; kill < 3; kill++ {
		cmd := exec.Command(bin, args...)
		stdout, _ := cmd.StdoutPipe()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		lineCh := make(chan string)
		go func() {
			lines := bufio.NewScanner(stdout)
			for lines.Scan() {
				lineCh <- lines.Text()
			}
			close(lineCh)
		}()
		want := 2 + rng.IntN(6)
		seen := 0
		for seen < want {
			select {
			case _, ok := <-lineCh:
				if !ok {
					t.Fatalf("run %d exited after %d lines", kill+1, seen)
				}
				seen++
			case <-time.After(30 * time.Second):
				cmd.Process.Kill()
				t.Fatalf("run %d: no progress for 30s after %d lines (stalled after a restart)", kill+1, seen)
			}
		}
		time.Sleep(time.Duration(rng.IntN(150)) * time.Millisecond) // mid-step, not only between lines
		if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		cmd.Wait()
		go func() {
			for range lineCh {
			}
		}()
		t.Logf("kill %d after %d update lines", kill+1, seen)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("final run: %v\n%s", err, out)
	}

	read := func(subject string) [][]byte {
		out, err := pipeline.ReadStored(ctx, data, "wmrl", subject)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}

	updates := map[int64]int{}
	fused := map[string]float64{}
	var ups []schemas.Update
	for _, b := range read("wmrl.default.update") {
		var u schemas.Update
		json.Unmarshal(b, &u)
		ups = append(ups, u)
		updates[u.Step]++
		for _, it := range u.Items {
			fused[fmt.Sprintf("%d/%s", u.Step, it.TrajID)] = it.FusedAdvantage
		}
	}
	// The archive: every item of every update exactly once, as stored.
	rows, err := archive.ReadAll(filepath.Join(data, "archive"), "default")
	if err != nil {
		t.Fatal(err)
	}
	archived := map[string]int{}
	for _, r := range rows {
		k := fmt.Sprintf("%d/%s", r.Step, r.TrajID)
		if archived[k]++; archived[k] > 1 && r.Source != archive.SourceLateAnchor {
			t.Fatalf("row %s archived twice", k)
		}
		if f, ok := fused[k]; !ok || f != r.FusedAdvantage {
			t.Fatalf("row %s: fused %v, its update says %v (%v)", k, r.FusedAdvantage, f, ok)
		}
	}
	if len(archived) != len(fused) || len(rows) != steps*16*8 {
		t.Fatalf("archive: %d rows for %d distinct items; updates hold %d items", len(rows), len(archived), len(fused))
	}
	files, _ := archive.Files(filepath.Join(data, "archive"), "default")
	t.Logf("archive: %d rows in %d files", len(rows), len(files))
	// Every anchor row has its trajectory's code, kills or not: the anchor
	// groups are held until their step is archived.
	anchors, coded := 0, 0
	if err := archive.Scan(files, func(rows []archive.Row) error {
		for _, r := range rows {
			if r.IsAnchor && r.Source != archive.SourceLateAnchor {
				anchors++
				if r.Response != nil && r.Prompt != nil {
					coded++
				}
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if anchors == 0 || coded != anchors {
		t.Errorf("%d of %d anchor rows have their prompt and response", coded, anchors)
	}
	for s := int64(0); s < steps; s++ {
		if updates[s] != 1 {
			t.Errorf("step %d has %d updates, want exactly 1", s, updates[s])
		}
	}
	if len(updates) != steps {
		t.Errorf("updates for %d distinct steps, want %d", len(updates), steps)
	}
	// A server killed with its process can have lost its count of what it
	// delivered: what it delivers again as new is a copy, not bad input.
	if letters := read("wmrl.default.dlq"); len(letters) > 0 {
		var d schemas.DeadLetter
		json.Unmarshal(letters[0], &d)
		t.Errorf("%d dead letters, the first of %s: %s; want none", len(letters), d.Stage, d.Reason)
	}

	pairs := read("wmrl.default.pairs")
	groups := map[string]bool{}
	replay := &calibrate.Stage{RunID: "default", Deb: mustDebiaser(t)}
	var replayed []schemas.Calibration
	for _, b := range pairs {
		var pg schemas.PairGroup
		json.Unmarshal(b, &pg)
		key := fmt.Sprintf("%d/%s", pg.Step, pg.GroupID)
		if groups[key] {
			t.Errorf("anchor group %s paired twice", key)
		}
		groups[key] = true
		c, err := replay.Absorb(b)
		if err != nil {
			t.Fatal(err)
		}
		if c != nil {
			replayed = append(replayed, *c)
		}
	}
	if len(groups) != steps*2 {
		t.Errorf("%d anchor groups paired, want %d", len(groups), steps*2)
	}
	stored := read("wmrl.default.calibration")
	if len(stored) != len(replayed) {
		t.Fatalf("%d calibrations stored, a replay of the pairs gives %d", len(stored), len(replayed))
	}
	for i, b := range stored {
		var c schemas.Calibration
		json.Unmarshal(b, &c)
		if c.Seq != int64(i+1) || c.Version != replayed[i].Version || c.PairsTotal != replayed[i].PairsTotal {
			t.Fatalf("calibration %d: stored seq %d version %d pairs %d; replay gives seq %d version %d pairs %d",
				i, c.Seq, c.Version, c.PairsTotal, replayed[i].Seq, replayed[i].Version, replayed[i].PairsTotal)
		}
	}
	// Fuse resumed too: every update's rho is the one the calibrations up
	// to those it was fused after give.
	den, err := fuse.NewDenoiser(pipeline.DefaultConfig().Denoiser)
	if err != nil {
		t.Fatal(err)
	}
	rhoAfter := map[int64]float64{0: den.Rho()}
	for _, c := range replayed {
		cal, truth := make([]float64, len(c.Pairs)), make([]float64, len(c.Pairs))
		for i, p := range c.Pairs {
			cal[i], truth[i] = p.Before, p.True
		}
		rhoAfter[c.Seq], _ = den.Observe(cal, truth)
	}
	for _, u := range ups {
		if want, ok := rhoAfter[u.CalibrationSeq]; !ok || math.Abs(u.Rho-want) > 1e-12 {
			t.Fatalf("step %d, fused after calibration %d: rho %.15f; the stored calibrations give %.15f", u.Step, u.CalibrationSeq, u.Rho, want)
		}
	}
	last := replayed[len(replayed)-1]
	if last.Version < 2 {
		t.Errorf("final calibration version %d: too few refits to test resumption", last.Version)
	}
	t.Logf("%d steps, %d anchor groups, calibration v%d after %d pairs", len(updates), len(groups), last.Version, last.PairsTotal)
}

func mustDebiaser(t *testing.T) *calibrate.Debiaser {
	d, err := calibrate.NewDebiaser(calibrate.DefaultDebiaserConfig())
	if err != nil {
		t.Fatal(err)
	}
	return d
}
