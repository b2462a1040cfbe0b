package offline

import (
	"context"
	"fmt"
	"hash/fnv"
	"math"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/pipeline/offline/offlinetest"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/execute"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/stagetest"
)

// archiveRun runs the pipeline for steps and returns its archived rows and
// recorded settings.
func archiveRun(t *testing.T, steps int64, edit func(*pipeline.Config)) ([]archive.Row, archive.Settings) {
	t.Helper()
	rows, settings, _ := archiveRunFiles(t, steps, edit)
	return rows, settings
}

// archiveRunFiles is archiveRun, with the archive's files, and a Rows
// reading them as the commands do (a pass's columns alone).
func archiveRunFiles(t *testing.T, steps int64, edit func(*pipeline.Config)) ([]archive.Row, archive.Settings, Rows) {
	t.Helper()
	cfg := pipeline.DefaultConfig()
	cfg.DataDir = t.TempDir()
	cfg.Listen = "127.0.0.1:0"
	cfg.Quiet = true
	cfg.ExecLatency = time.Millisecond
	cfg.Steps = steps
	// Small enough that the map refits and rho moves within a short run.
	cfg.Debiaser = calibrate.DebiaserConfig{MinPairs: 32, RefitEvery: 16, BufferSize: 200, Bins: 10}
	cfg.Denoiser = fuse.DenoiserConfig{Warmup: 4}
	if edit != nil {
		edit(&cfg)
	}
	var out stagetest.Output
	cfg.Quiet, cfg.Out = false, &out
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := pipeline.Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if ctx.Err() != nil {
		// What the run said, and its dead letters, for the one who
		// looks into why it did not finish.
		var dead strings.Builder
		pipeline.ReadDeadLetters(context.Background(), pipeline.StreamSource{DataDir: cfg.DataDir, Prefix: cfg.Prefix}, cfg.Run, false,
			func(dl schemas.DeadLetter) error {
				fmt.Fprintf(&dead, "%s %s: %s\n", dl.Stage, dl.Subject, dl.Reason)
				return nil
			})
		var state strings.Builder
		if st, err := pipeline.ReadStatus(context.Background(), pipeline.StreamSource{DataDir: cfg.DataDir, Prefix: cfg.Prefix}, cfg.Run); err != nil {
			fmt.Fprintf(&state, "status: %v\n", err)
		} else {
			fmt.Fprintf(&state, "subjects %v\nlast calibration %+v\n", st.Subjects, st.LastCalibration)
			for _, c := range st.Consumers {
				fmt.Fprintf(&state, "consumer %s %s backlog %d in flight %d redelivered %d waiting %d\n", c.Name, c.Subject, c.Backlog, c.InFlight, c.Redelivered, c.Waiting)
			}
		}
		t.Fatalf("the run of %d steps did not finish within 2 minutes; it said:\n%s\ndead letters:\n%s\n%s", steps, out.String(), dead.String(), state.String())
	}
	rows, settings, err := archive.ReadRun(cfg.ArchiveRoot(), cfg.Run)
	if err != nil {
		t.Fatal(err)
	}
	files, err := archive.Files(cfg.ArchiveRoot(), cfg.Run)
	if err != nil {
		t.Fatal(err)
	}
	return rows, settings, func(columns []string, fn func([]archive.Row) error) error {
		if len(columns) > 0 {
			return archive.ScanColumns(files, columns, fn)
		}
		return archive.ScanScores(files, fn)
	}
}

func TestReplayReproducesTheArchive(t *testing.T) {
	rows, settings := archiveRun(t, 30, nil)
	var steps int
	sum, err := Replay(rows, ReplayOptions{Settings: settings}, func(r StepReport) {
		steps++
		if r.MaxFusedDiff > 1e-9 || r.MaxCalibratedDiff > 1e-9 || math.Abs(r.Rho-r.RecordedRho) > 1e-9 {
			t.Errorf("step %d: fused differs by %g, calibrated by %g, rho %v vs %v", r.Step, r.MaxFusedDiff, r.MaxCalibratedDiff, r.Rho, r.RecordedRho)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	if steps != 30 || sum.Rows != 30*16*8 || len(sum.Gaps) != 0 || sum.AnchorGroups != 60 {
		t.Fatalf("summary %+v after %d steps", sum, steps)
	}
	versions := map[int64]bool{}
	for _, r := range rows {
		versions[r.CalibrationVersion] = true
	}
	if len(versions) < 3 || rows[len(rows)-1].Rho == 1 {
		t.Fatalf("the run never refitted or moved rho (versions %v): the replay proves little", versions)
	}

	// Changed settings change the numbers, step by step.
	off := settings
	off.Debias = false
	sum, err = Replay(rows, ReplayOptions{Settings: off}, func(r StepReport) {
		for _, it := range r.Items {
			if it.Row.Source == archive.SourceWorldModel && it.Row.Predicted != nil && *it.Calibrated != *it.Row.Predicted {
				t.Fatalf("debias off: step %d %s calibrated %v, want the raw %v", r.Step, it.Row.TrajID, *it.Calibrated, *it.Row.Predicted)
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	if sum.MaxFusedDiff < 1e-3 {
		t.Fatalf("debias off changed no fused advantage (max diff %g)", sum.MaxFusedDiff)
	}
	sum, err = Replay(rows, ReplayOptions{Settings: settings, AnchorFraction: settings.AnchorFraction / 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if sum.DroppedAnchors < 15 || sum.DroppedAnchors > 45 || sum.AnchorGroups+sum.DroppedAnchors != 60 {
		t.Fatalf("half the anchor fraction dropped %d of 60 anchor groups", sum.DroppedAnchors)
	}
}

// ReplayRows reads the rows twice and replays a step once its rows and
// those of the steps before it have come, so that it holds a step or two
// of rows rather than the archive (a replay of 1M rows held 1.5 GB); in
// batches out of order and steps cut across batches, it replays what
// Replay over the rows in memory does.
func TestReplayStreamsTheRows(t *testing.T) {
	rows, settings, files := archiveRunFiles(t, 30, nil)
	var byStep [][]archive.Row
	at := map[int64]int{}
	for _, r := range rows {
		i, ok := at[r.Step]
		if !ok {
			i = len(byStep)
			at[r.Step] = i
			byStep = append(byStep, nil)
		}
		byStep[i] = append(byStep[i], r)
	}
	// Every fifth step's rows come after the next one's, each step's in
	// two batches.
	for i := 1; i+1 < len(byStep); i += 5 {
		byStep[i], byStep[i+1] = byStep[i+1], byStep[i]
	}
	var batches [][]archive.Row
	for _, s := range byStep {
		batches = append(batches, s[:len(s)/3], s[len(s)/3:])
	}
	reads, given := 0, 0
	src := func(_ []string, fn func([]archive.Row) error) error {
		reads++
		given = 0
		for _, b := range batches {
			given += len(b)
			if err := fn(b); err != nil {
				return err
			}
		}
		return nil
	}
	var want []StepReport
	wantSum, err := Replay(rows, ReplayOptions{Settings: settings}, func(r StepReport) { want = append(want, r) })
	if err != nil {
		t.Fatal(err)
	}
	var got []StepReport
	replayed, mostHeld := 0, 0
	sum, err := ReplayRows(src, ReplayOptions{Settings: settings}, func(r StepReport) {
		if reads != 2 {
			t.Fatalf("step %d replayed in read %d", r.Step, reads)
		}
		mostHeld = max(mostHeld, given-replayed)
		replayed += len(r.Items)
		got = append(got, r)
	})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(sum, wantSum) || len(got) != len(want) {
		t.Fatalf("streamed: %+v after %d steps; in memory: %+v after %d", sum, len(got), wantSum, len(want))
	}
	for i := range want {
		if got[i].Step != want[i].Step || got[i].Rho != want[i].Rho || len(got[i].Items) != len(want[i].Items) {
			t.Fatalf("report %d: step %d rho %v, %d rows; in memory step %d rho %v, %d rows", i,
				got[i].Step, got[i].Rho, len(got[i].Items), want[i].Step, want[i].Rho, len(want[i].Items))
		}
		for j, it := range got[i].Items {
			if w := want[i].Items[j]; it.Row.TrajID != w.Row.TrajID || it.FusedAdvantage != w.FusedAdvantage {
				t.Fatalf("step %d row %d: %s fused %v; in memory %s fused %v", got[i].Step, j, it.Row.TrajID, it.FusedAdvantage, w.Row.TrajID, w.FusedAdvantage)
			}
		}
	}
	// What a stream must hold: a step is replayed once its rows and those
	// of every step before it in the replay's order (the archive's own is
	// not quite that: a step fused behind a later one) have come.
	rowsOf, came := map[int64]int{}, map[int64]int{}
	for _, r := range want {
		rowsOf[r.Step] = len(r.Items)
	}
	bound, next, through, out := 0, 0, 0, 0
	for _, b := range batches {
		through += len(b)
		for _, r := range b {
			if r.Source != archive.SourceLateAnchor {
				came[r.Step]++
			}
		}
		for ; next < len(want) && came[want[next].Step] == rowsOf[want[next].Step]; next++ {
			bound = max(bound, through-out)
			out += rowsOf[want[next].Step]
		}
	}
	if mostHeld > bound || bound > len(rows)/4 {
		t.Fatalf("held up to %d rows unreplayed, where the order they came in needs %d of %d: the replay does not stream", mostHeld, bound, len(rows))
	}
	t.Logf("held up to %d rows of %d", mostHeld, len(rows))

	// From the files, as wmrl replay reads them (the first read only the
	// columns it plans with), the same.
	got = nil
	sum, err = ReplayRows(files, ReplayOptions{Settings: settings}, func(r StepReport) { got = append(got, r) })
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(sum, wantSum) || len(got) != len(want) {
		t.Fatalf("from the files: %+v after %d steps; in memory: %+v after %d", sum, len(got), wantSum, len(want))
	}
	for i := range want {
		if got[i].Step != want[i].Step || got[i].Rho != want[i].Rho || got[i].MaxFusedDiff != want[i].MaxFusedDiff {
			t.Fatalf("from the files, report %d: step %d rho %v, fused off by %g; in memory step %d rho %v, off by %g", i,
				got[i].Step, got[i].Rho, got[i].MaxFusedDiff, want[i].Step, want[i].Rho, want[i].MaxFusedDiff)
		}
	}

	// Rows that are not the same the second time are refused, not replayed
	// in part.
	reads = 0
	short := func(_ []string, fn func([]archive.Row) error) error {
		reads++
		if reads == 2 {
			return fn(rows[:len(rows)-1])
		}
		return fn(rows)
	}
	if _, err := ReplayRows(short, ReplayOptions{Settings: settings}, nil); err == nil || !strings.Contains(err.Error(), "the rows changed between the two reads") {
		t.Fatalf("a second read short of a row: %v", err)
	}
}

// Late anchors are absorbed after their steps; the replay absorbs them at
// their recorded seq and still reproduces every step. Their trajectories
// the world model did not grade have late rows too, which are no pairs.
func TestReplayReproducesLateAnchors(t *testing.T) {
	wm := sim.DefaultWorldModel()
	wm.UngradedEvery = 5
	rows, settings := archiveRun(t, 12, func(c *pipeline.Config) {
		c.ExecLatency = 60 * time.Millisecond
		c.AnchorDeadline = 40 * time.Millisecond
		c.ArchiveMaxAge = 50 * time.Millisecond
		c.WorldModelImpl = wm
		c.ExecutorImpl = &losingExecutor{sim.Executor{Latency: c.ExecLatency, Noise: 0.02}}
	})
	pairs, ungraded, lost := 0, 0, 0
	for _, r := range rows {
		switch {
		case r.Source != archive.SourceLateAnchor:
		case r.TrueScore == nil:
			lost++
		case r.Predicted == nil:
			ungraded++
		default:
			pairs++
		}
	}
	sum, err := Replay(rows, ReplayOptions{Settings: settings}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if sum.LatePairs == 0 || ungraded == 0 || lost == 0 {
		t.Fatalf("%d late pairs, %d late rows of ungraded trajectories, %d of sandbox errors: the test proves nothing (%+v)", sum.LatePairs, ungraded, lost, sum)
	}
	if sum.LatePairs != pairs {
		t.Errorf("replay counted %d late pairs; the archive has %d, and %d late rows without a prediction or a score", sum.LatePairs, pairs, ungraded+lost)
	}
	if sum.MaxFusedDiff > 1e-9 || sum.MaxCalibratedDiff > 1e-9 || len(sum.Gaps) != 0 {
		t.Fatalf("replay differs: %+v", sum)
	}
	t.Logf("%d late pairs, and late rows of %d ungraded trajectories and %d sandbox errors, of %d rows", sum.LatePairs, ungraded, lost, len(rows))
}

// losingExecutor scores as the simulated one, but every sixth trajectory
// (by ID) ends in a sandbox error after its execution's time.
type losingExecutor struct{ sim.Executor }

func (e *losingExecutor) Execute(ctx context.Context, t schemas.Trajectory) (execute.Result, error) {
	r, err := e.Executor.Execute(ctx, t)
	h := fnv.New32a()
	h.Write([]byte(t.TrajID))
	if err != nil || h.Sum32()%6 != 0 {
		return r, err
	}
	return execute.Result{Status: schemas.ExecSandboxError, Seconds: r.Seconds, Detail: "sandbox lost"}, nil
}

// evictingExecutor scores as the simulated one, but the sandbox of every
// third group (by ID) fails on all its trajectories but the first, as
// evicted containers do.
type evictingExecutor struct{ sim.Executor }

func (e *evictingExecutor) Execute(ctx context.Context, t schemas.Trajectory) (execute.Result, error) {
	h := fnv.New32a()
	h.Write([]byte(t.GroupID))
	if h.Sum32()%3 == 0 && !strings.HasSuffix(t.TrajID, "-t0") {
		return execute.Result{Status: schemas.ExecSandboxError, Detail: "container evicted"}, nil
	}
	return e.Executor.Execute(ctx, t)
}

// Anchor groups executed with fewer than two scores are fused on the world
// model; the replay absorbs their lone pairs at their recorded seq and
// reproduces every step.
func TestReplayReproducesFailedAnchors(t *testing.T) {
	rows, settings := archiveRun(t, 20, func(c *pipeline.Config) {
		c.ExecutorImpl = &evictingExecutor{sim.Executor{Latency: time.Millisecond, Noise: 0.02}}
	})
	failed := map[string]bool{}
	for _, r := range rows {
		if r.IsAnchor && r.Source == archive.SourceWorldModel && r.ExecStatus != nil && *r.ExecStatus == schemas.ExecSandboxError {
			failed[fmt.Sprintf("%d/%s", r.Step, r.GroupID)] = true
		}
	}
	if len(failed) == 0 {
		t.Fatal("no failed anchor group in the archive: the test proves nothing")
	}
	sum, err := Replay(rows, ReplayOptions{Settings: settings}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if sum.MaxFusedDiff > 1e-9 || sum.MaxCalibratedDiff > 1e-9 || len(sum.Gaps) != 0 || sum.AnchorGroups != 40 {
		t.Fatalf("replay differs: %+v", sum)
	}
	t.Logf("%d of 40 anchor groups failed", len(failed))
}

// ReplayCurves keeps what a replay under other settings changed, step by
// step, and every row's fused advantage, replayed and recorded, while the
// archive is small; WriteReplayPlot draws it.
func TestReplayCurvesFollowTheReplay(t *testing.T) {
	rows, settings := archiveRun(t, 30, nil)
	off := settings
	off.Debias = false
	var curves ReplayCurves
	var reports []StepReport
	var pairs []FusedPair
	if _, err := Replay(rows, ReplayOptions{Settings: off}, func(r StepReport) {
		curves.Add(r)
		reports = append(reports, StepReport{Step: r.Step, Rho: r.Rho, RecordedRho: r.RecordedRho, SignAgreement: r.SignAgreement})
		for _, it := range r.Items {
			if it.Row.Source == archive.SourceLateAnchor {
				continue // no fused advantage
			}
			pairs = append(pairs, FusedPair{Recorded: it.Row.FusedAdvantage, Replayed: it.FusedAdvantage, Anchor: it.Anchor})
		}
	}); err != nil {
		t.Fatal(err)
	}
	if len(curves.Steps) != len(reports) {
		t.Fatalf("%d steps kept of %d replayed", len(curves.Steps), len(reports))
	}
	moved := false
	for i, s := range curves.Steps {
		r := reports[i]
		if s != (ReplayStep{Step: r.Step, Rho: r.Rho, RecordedRho: r.RecordedRho, SignAgreement: r.SignAgreement}) {
			t.Errorf("step %d kept as %+v; the replay said rho %v (recorded %v), signs kept %v", r.Step, s, r.Rho, r.RecordedRho, r.SignAgreement)
		}
		moved = moved || s.Rho != s.RecordedRho
	}
	if !moved {
		t.Fatal("debias off moved no step's rho: the curves show nothing")
	}
	if len(pairs) > SampleRows {
		t.Fatalf("the run has %d rows; this part of the test wants them all kept (at most %d)", len(pairs), SampleRows)
	}
	if !reflect.DeepEqual(curves.Rows, pairs) {
		t.Errorf("%d rows kept; want every one of the %d replayed, in order", len(curves.Rows), len(pairs))
	}
	path := filepath.Join(t.TempDir(), "replay.png")
	if err := WriteReplayPlot(&curves, "debias off", path); err != nil {
		t.Fatal(err)
	}
	if b := offlinetest.DecodePNG(t, path).Bounds(); b.Dx() < 600 || b.Dy() < 3*b.Dx()/2 {
		t.Errorf("the plot is %dx%d; want three panels stacked, 600 wide or more", b.Dx(), b.Dy())
	}
}

// Past SampleRows rows, ReplayCurves keeps a uniform sample: as many rows
// of a late step as of an early one, not the first rows it saw.
func TestReplayCurvesSampleEveryStepAlike(t *testing.T) {
	var c ReplayCurves
	const steps, each = 10, 1000
	for step := range steps {
		items := make([]Replayed, each)
		for i := range items {
			items[i] = Replayed{Row: archive.Row{Source: archive.SourceWorldModel, FusedAdvantage: float64(step)}, FusedAdvantage: float64(step)}
		}
		items = append(items, Replayed{Row: archive.Row{Source: archive.SourceLateAnchor, FusedAdvantage: -1}, FusedAdvantage: -1})
		c.Add(StepReport{Step: int64(step), Items: items})
	}
	if len(c.Rows) != SampleRows {
		t.Fatalf("%d rows kept of %d; want %d", len(c.Rows), steps*each, SampleRows)
	}
	per := make([]int, steps)
	for _, r := range c.Rows {
		if r.Recorded < 0 {
			t.Fatal("a late anchor row, which has no fused advantage, was kept")
		}
		per[int(r.Recorded)]++
	}
	want := SampleRows / steps
	for step, n := range per {
		if n < want*3/4 || n > want*5/4 {
			t.Errorf("step %d has %d of the %d rows kept; want about %d each: %v", step, n, SampleRows, want, per)
		}
	}
}
