package offline

import (
	"context"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"gonum.org/v1/plot/plotter"

	"github.com/wmrl/wmrl/pipeline/offline/offlinetest"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/predict"
)

// groupWM scores by group: a call error, all alike, or the truth the test
// hands it (the code is the true score, as text).
type groupWM struct{}

func (groupWM) Name() string { return "fake" }

func (groupWM) Predict(_ context.Context, trajs []schemas.Trajectory) ([]predict.Score, error) {
	out := make([]predict.Score, len(trajs))
	for i, t := range trajs {
		switch t.GroupID {
		case "down":
			return nil, errors.New("503 from the server")
		case "alike":
			out[i] = predict.Score{Value: 0.5, Graded: true}
		default:
			var v float64
			fmt.Sscan(t.Response, &v)
			out[i] = predict.Score{Value: v, Graded: true}
		}
	}
	return out, nil
}

func executedRows(groups ...string) []archive.Row {
	var rows []archive.Row
	for _, g := range groups {
		for i := range 3 {
			truth, pred := 0.2*float64(i+1), 0.9-0.2*float64(i) // the recorded model ranks backwards
			code := fmt.Sprint(truth)
			rows = append(rows, archive.Row{Run: "r", Step: 1, GroupID: g, TrajID: fmt.Sprintf("%s%d", g, i), TaskID: "t",
				IsAnchor: true, TrueScore: &truth, Predicted: &pred, Response: &code})
		}
	}
	return rows
}

// A group whose call fails counts its trajectories ungraded and the call
// as failed; a group scored all alike counts 0, not left out; the paired
// difference is over the groups both models rank. Every call failing is
// an error.
func TestEvaluateWorldModelCountsWhatItCannotRank(t *testing.T) {
	e, err := EvaluateWorldModel(context.Background(), executedRows("down", "alike", "right"), groupWM{}, EvalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if e.Groups != 3 || e.FailedCalls != 1 || e.FirstCallError == nil || len(e.Items) != 9 {
		t.Fatalf("groups %d, failed calls %d (%v), items %d", e.Groups, e.FailedCalls, e.FirstCallError, len(e.Items))
	}
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-12 }
	if e.New.Graded != 6 || e.New.RankedGroups != 2 || !near(e.New.WithinSpearman, 0.5) {
		t.Errorf("new: %+v, want 6 graded, 2 groups ranked at 0 and 1", e.New)
	}
	if e.Recorded.Graded != 9 || e.Recorded.RankedGroups != 3 || !near(e.Recorded.WithinSpearman, -1) {
		t.Errorf("recorded: %+v, want 9 graded, 3 groups ranked backwards", e.Recorded)
	}
	if e.PairedGroups != 2 || !near(e.WithinDiff, 1.5) || !near(e.WithinDiffSE, 0.5) {
		t.Errorf("paired: %d groups, %v ± %v; want 2 groups, 1.5 ± 0.5", e.PairedGroups, e.WithinDiff, e.WithinDiffSE)
	}
	if len(e.Tasks) != 1 || e.Tasks[0].Task != "t" || e.Tasks[0].Groups != 2 || !near(e.Tasks[0].Diff, 1.5) {
		t.Errorf("tasks %+v, want t with the 2 paired groups", e.Tasks)
	}
	if _, err := EvaluateWorldModel(context.Background(), executedRows("down"), groupWM{}, EvalOptions{}); err == nil {
		t.Error("every call failed, and no error")
	}
	if _, err := EvaluateWorldModel(context.Background(), nil, groupWM{}, EvalOptions{}); !errors.Is(err, ErrNoCode) {
		t.Errorf("no rows: %v, want ErrNoCode", err)
	}
}

// Executed takes a late anchor's true score from its late_anchor row and
// its code from its world-model row, and leaves out anchors never scored
// and rows without code.
func TestExecutedJoinsLateAnchors(t *testing.T) {
	dir := t.TempDir()
	w, err := archive.OpenWriter(archive.WriterConfig{Dir: dir, Run: "r", MaxAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	code, truth, late := "print(1)", 0.7, archive.ExecLate
	rows := []archive.Row{
		{Step: 1, GroupID: "a", TrajID: "late", IsAnchor: true, Source: archive.SourceWorldModel, ExecStatus: &late, Response: &code},
		{Step: 1, GroupID: "a", TrajID: "never", IsAnchor: true, Source: archive.SourceWorldModel, Response: &code},
		{Step: 1, GroupID: "a", TrajID: "nocode", IsAnchor: true, Source: archive.SourceAnchor, TrueScore: &truth},
		{Step: 1, GroupID: "w", TrajID: "wm", Source: archive.SourceWorldModel},
	}
	if _, err := w.Add(archive.UpdateKey(1), rows, nil); err != nil {
		t.Fatal(err)
	}
	lateRow := []archive.Row{{Step: 1, GroupID: "a", TrajID: "late", IsAnchor: true, Source: archive.SourceLateAnchor, TrueScore: &truth}}
	if _, err := w.Add(archive.LateKey(1, "a"), lateRow, nil); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	files, _ := archive.Files(dir, "r")
	got, err := Executed(files, ExecutedOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].TrajID != "late" || *got[0].TrueScore != truth || *got[0].Response != code {
		t.Fatalf("executed %+v, want the late anchor with its code and its late true score", got)
	}
}

// Executed of a sample of the groups keeps those rows alone, and the
// sample is the one EvaluateWorldModel draws with the same seed from all
// the rows: a late anchor's group counts once its late row has come, a
// group whose code never scored does not.
func TestExecutedKeepsTheSampleEvaluateDraws(t *testing.T) {
	dir := t.TempDir()
	w, err := archive.OpenWriter(archive.WriterConfig{Dir: dir, Run: "r", MaxAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	code, late := "0.5", archive.ExecLate
	for step := range int64(6) {
		var rows []archive.Row
		for g := range 3 {
			for i := range 2 {
				truth := 0.25 * float64(i+1)
				r := archive.Row{Step: step, GroupID: fmt.Sprint("g", g), TrajID: fmt.Sprint(step, g, i), IsAnchor: true, Source: archive.SourceAnchor,
					TrueScore: &truth, Response: &code, Predicted: &truth}
				switch g {
				case 1: // late: its truth on a late row, below
					r.Source, r.TrueScore, r.ExecStatus = archive.SourceWorldModel, nil, &late
				case 2: // never scored
					r.TrueScore = nil
				}
				rows = append(rows, r)
			}
		}
		if _, err := w.Add(archive.UpdateKey(step), rows, nil); err != nil {
			t.Fatal(err)
		}
		var lateRows []archive.Row
		for _, r := range rows[2:4] {
			truth := 0.5
			r.Source, r.TrueScore, r.ExecStatus, r.Response = archive.SourceLateAnchor, &truth, nil, nil
			lateRows = append(lateRows, r)
		}
		if _, err := w.Add(archive.LateKey(step, "g1"), lateRows, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	files, _ := archive.Files(dir, "r")
	all, err := Executed(files, ExecutedOptions{})
	if err != nil || len(all) != 6*2*2 {
		t.Fatalf("%d executed trajectories (%v); want the 24 of groups g0 and g1", len(all), err)
	}
	// The sample Executed keeps is the one EvaluateWorldModel draws from
	// rows, as trajectory IDs.
	drawn := func(rows []archive.Row, opt ExecutedOptions) (kept, want []string) {
		t.Helper()
		got, err := Executed(files, opt)
		if err != nil {
			t.Fatal(err)
		}
		e, err := EvaluateWorldModel(context.Background(), rows, groupWM{}, EvalOptions{Groups: opt.Groups, Seed: opt.Seed})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range got {
			kept = append(kept, r.TrajID)
		}
		for _, it := range e.Items {
			want = append(want, it.TrajID)
		}
		return kept, want
	}
	for seed := range uint64(8) {
		if kept, want := drawn(all, ExecutedOptions{Groups: 3, Seed: seed}); len(kept) != 6 || !slices.Equal(kept, want) {
			t.Errorf("seed %d: kept %v; the evaluation of every row draws %v", seed, kept, want)
		}
	}
	// Of steps 4 and 5 alone, every group's, or a sample of one group
	// drawn among theirs.
	from := StepRange{From: 4}
	var recent []archive.Row
	for _, r := range all {
		if r.Step >= 4 {
			recent = append(recent, r)
		}
	}
	if got, err := Executed(files, ExecutedOptions{Steps: &from}); err != nil || !slices.EqualFunc(got, recent, func(a, b archive.Row) bool { return a.TrajID == b.TrajID }) {
		t.Errorf("steps 4 and after: %d rows (%v); want the %d of steps 4 and 5", len(got), err, len(recent))
	}
	for seed := range uint64(4) {
		if kept, want := drawn(recent, ExecutedOptions{Steps: &from, Groups: 1, Seed: seed}); len(kept) != 2 || !slices.Equal(kept, want) {
			t.Errorf("seed %d, steps 4 and after: kept %v; the evaluation of those steps' rows draws %v", seed, kept, want)
		}
	}
}

// countingDown fails every call, and counts them.
type countingDown struct{ calls atomic.Int64 }

func (*countingDown) Name() string { return "down" }

func (c *countingDown) Predict(context.Context, []schemas.Trajectory) ([]predict.Score, error) {
	c.calls.Add(1)
	return nil, errors.New("connection refused")
}

// A world model that fails DownAfter calls in a row stops the evaluation,
// saying so, instead of being asked for every group.
func TestEvaluateWorldModelStopsAtAWorldModelThatIsDown(t *testing.T) {
	var groups []string
	for i := range 200 {
		groups = append(groups, fmt.Sprintf("g%d", i))
	}
	wm := &countingDown{}
	_, err := EvaluateWorldModel(context.Background(), executedRows(groups...), wm, EvalOptions{Concurrency: 2, DownAfter: 5})
	if err == nil || !strings.Contains(err.Error(), "down: 5 calls in a row failed, the last: connection refused") {
		t.Fatalf("err %v", err)
	}
	if n := wm.calls.Load(); n > 10 {
		t.Errorf("%d of 200 groups asked of a world model that is down", n)
	}
}

// claimWM takes a solution's word for its score: code that claims the top
// of the leaderboard scores 1, other code as groupWM scores it.
type claimWM struct{ groupWM }

func (c claimWM) Predict(ctx context.Context, trajs []schemas.Trajectory) ([]predict.Score, error) {
	out, err := c.groupWM.Predict(ctx, trajs)
	for i, t := range trajs {
		if err == nil && strings.Contains(t.Response, DefaultClaim) {
			out[i].Value = 1
		}
	}
	return out, err
}

// The claim probe asks again with the claim as the code's last line and
// measures what it buys: the mean rise of the score, and the GRPO
// advantage a solution gains by making the claim alone in its group. A
// world model that takes the claim's word shows both; one that ignores it
// shows nothing. Without a claim, nothing is asked twice.
func TestTheClaimProbeMeasuresWhatAClaimBuys(t *testing.T) {
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-9 }
	// GRPO's advantage of rs[i], by hand: population std, + 1e-4.
	adv := func(rs []float64, i int) float64 {
		mean, ss := (rs[0]+rs[1]+rs[2])/3, 0.0
		for _, r := range rs {
			ss += (r - mean) * (r - mean)
		}
		return (rs[i] - mean) / (math.Sqrt(ss/3) + 1e-4)
	}
	plain := []float64{0.2, 0.4, 0.6} // each group of executedRows, as groupWM scores it
	var gain float64
	for i := range plain {
		claimed := []float64{0.2, 0.4, 0.6}
		claimed[i] = 1
		gain += (adv(claimed, i) - adv(plain, i)) / 3
	}

	e, err := EvaluateWorldModel(context.Background(), executedRows("a", "b"), claimWM{}, EvalOptions{Claim: DefaultClaim})
	if err != nil {
		t.Fatal(err)
	}
	c := e.Claims
	if c == nil || c.Pairs != 6 || c.Rose != 6 || !near(c.Rise, 0.6) || c.GainPairs != 6 || !near(c.Gain, gain) || c.Gain < 1 {
		t.Fatalf("claims %+v; want 6 pairs, all higher, rise 0.6, gain %.6f", c, gain)
	}
	for _, it := range e.Items {
		if it.Claimed == nil || *it.Claimed != 1 || it.New == nil || *it.New == 1 {
			t.Fatalf("item %+v: want its plain score and 1 with the claim", it)
		}
	}

	e, err = EvaluateWorldModel(context.Background(), executedRows("a", "b"), groupWM{}, EvalOptions{Claim: DefaultClaim})
	if err != nil {
		t.Fatal(err)
	}
	if c := e.Claims; c == nil || c.Pairs != 6 || c.Rose != 0 || c.Rise != 0 || c.Gain != 0 {
		t.Errorf("claims of a world model that ignores them: %+v; want 6 pairs and nothing gained", c)
	}

	e, err = EvaluateWorldModel(context.Background(), executedRows("a"), groupWM{}, EvalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if e.Claims != nil || e.Items[0].Claimed != nil {
		t.Errorf("no claim asked for, and claims %+v, item %+v", e.Claims, e.Items[0])
	}
}

// The plot's data: every group both models rank, with its two
// within-group Spearmans (their mean difference is the paired one), and
// each model's reliability curve: on y = x for scores that are the truth,
// off it by the recorded model's error.
func TestTheEvalPlotDrawsEachGroupAndBothReliabilityCurves(t *testing.T) {
	e, err := EvaluateWorldModel(context.Background(), executedRows("alike", "right", "down"), groupWM{}, EvalOptions{Claim: "# 1"})
	if err != nil {
		t.Fatal(err)
	}
	want := []GroupRank{{Step: 1, GroupID: "alike", TaskID: "t", Recorded: -1, New: 0}, {Step: 1, GroupID: "right", TaskID: "t", Recorded: -1, New: 1}}
	if !slices.Equal(e.GroupRanks, want) {
		t.Fatalf("groups ranked by both: %+v; want %+v", e.GroupRanks, want)
	}
	sum := 0.0
	for _, g := range e.GroupRanks {
		sum += g.New - g.Recorded
	}
	if len(e.GroupRanks) != e.PairedGroups || math.Abs(sum/float64(len(e.GroupRanks))-e.WithinDiff) > 1e-12 {
		t.Errorf("%d groups drawn, mean difference %v; the paired comparison is over %d, %v", len(e.GroupRanks), sum/float64(len(e.GroupRanks)), e.PairedGroups, e.WithinDiff)
	}
	// The recorded model scores 0.9, 0.7, 0.5 where the truth is 0.2, 0.4,
	// 0.6, in each of the three groups.
	recorded := Reliability(e.Items, func(it EvalItem) *float64 { return it.Recorded })
	if want := (plotter.XYs{{X: 0.5, Y: 0.6}, {X: 0.7, Y: 0.4}, {X: 0.9, Y: 0.2}}); !nearXYs(recorded, want) {
		t.Errorf("the recorded model's reliability %v; want %v", recorded, want)
	}
	// The new model: the truth in "right" (on y = x), 0.5 for all three in
	// "alike" (whose truth averages 0.4), a bin below right's 0.6; "down"
	// ungraded.
	now := Reliability(e.Items, func(it EvalItem) *float64 { return it.New })
	if want := (plotter.XYs{{X: 0.2, Y: 0.2}, {X: 0.4, Y: 0.4}, {X: 0.5, Y: 0.4}, {X: 0.6, Y: 0.6}}); !nearXYs(now, want) {
		t.Errorf("the new model's reliability %v; want %v", now, want)
	}
	for _, c := range []*EvalClaims{e.Claims, nil} {
		e.Claims = c
		path := filepath.Join(t.TempDir(), "eval.png")
		if err := WriteEvalPlot(e, "fake", path); err != nil {
			t.Fatal(err)
		}
		panels := 2
		if c != nil {
			panels = 3
		}
		if b := offlinetest.DecodePNG(t, path).Bounds(); math.Abs(float64(b.Dy())/float64(b.Dx())-float64(panels)*4.5/8) > 0.01 {
			t.Errorf("the plot is %dx%d; want %d panels stacked", b.Dx(), b.Dy(), panels)
		}
	}
}

func nearXYs(a, b plotter.XYs) bool {
	return slices.EqualFunc(a, b, func(p, q plotter.XY) bool { return math.Abs(p.X-q.X) < 1e-12 && math.Abs(p.Y-q.Y) < 1e-12 })
}
