package offline

import (
	"cmp"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/fuse"
)

// biasedRows makes anchor groups of 8 for three tasks whose world model is
// unbiased (fair), monotone-biased (squash: true = pred^2) and
// non-monotone (hump: true peaks mid-range), with calibrated scores from
// an isotonic map fitted on each task's pairs, plus world-model groups.
func biasedRows(t testing.TB, groupsPerTask int, noise float64) []archive.Row {
	rng := rand.New(rand.NewPCG(5, 6))
	truth := map[string]func(float64) float64{
		"fair":   func(p float64) float64 { return p },
		"squash": func(p float64) float64 { return p * p },
		"hump":   func(p float64) float64 { return 1 - 3*math.Abs(p-0.5) },
	}
	var rows []archive.Row
	step := int64(0)
	for _, task := range []string{"fair", "squash", "hump"} {
		start := len(rows)
		for g := range groupsPerTask {
			anchor := g%4 == 0
			for i := range 8 {
				p := rng.Float64()
				y := min(max(truth[task](p)+noise*rng.NormFloat64(), 0), 1)
				r := archive.Row{Run: "audit", Step: step, GroupID: fmt.Sprintf("%s-%d", task, g), TrajID: fmt.Sprintf("%s-%d-%d", task, g, i),
					TaskID: task, Predicted: &p, IsAnchor: anchor, Source: archive.SourceWorldModel, Rho: 2, D: 0.1}
				if anchor {
					r.Source, r.TrueScore = archive.SourceAnchor, &y
				}
				rows = append(rows, r)
			}
			if g%8 == 7 {
				step++
			}
		}
		var x, y []float64
		for _, r := range rows[start:] {
			if r.TrueScore != nil {
				x, y = append(x, *r.Predicted), append(y, *r.TrueScore)
			}
		}
		m, err := calibrate.FitIsotonic(x, y, nil)
		if err != nil {
			t.Fatal(err)
		}
		for i := start; i < len(rows); i++ {
			c := m.Predict(*rows[i].Predicted)
			rows[i].Calibrated = &c
		}
	}
	return rows
}

// RunAuditRows reads the rows twice and keeps only the anchor groups':
// over a run's archive in batches it says what RunAudit says over the
// rows in memory, to the last digit, and rows that are not the same the
// second time are refused.
func TestAuditStreamsTheRows(t *testing.T) {
	rows, _, files := archiveRunFiles(t, 30, nil)
	want, err := RunAudit(rows, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	reads := 0
	batches := func(_ []string, fn func([]archive.Row) error) error {
		reads++
		for i := 0; i < len(rows); i += 100 {
			if err := fn(rows[i:min(i+100, len(rows))]); err != nil {
				return err
			}
		}
		return nil
	}
	got, err := RunAuditRows(batches, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if reads != 2 || got.groups != 16 || got.size != 8 || got.Pairs == 0 || got.Executions == nil {
		t.Fatalf("%d reads; shape %d groups of %d; %d pairs; execution times %v", reads, got.groups, got.size, got.Pairs, got.Executions)
	}
	if g, w := summaryJSON(t, got), summaryJSON(t, want); g != w {
		t.Fatalf("streamed:\n%s\nin memory:\n%s", g, w)
	}
	// From the files, the first read only the predictions.
	if got, err = RunAuditRows(files, AuditOptions{}); err != nil {
		t.Fatal(err)
	}
	if g, w := summaryJSON(t, got), summaryJSON(t, want); g != w {
		t.Fatalf("from the files:\n%s\nin memory:\n%s", g, w)
	}
	reads = 0
	short := func(_ []string, fn func([]archive.Row) error) error {
		if reads++; reads == 2 {
			return fn(rows[1:])
		}
		return fn(rows)
	}
	if _, err := RunAuditRows(short, AuditOptions{}); err == nil || !strings.Contains(err.Error(), "was the archive written to meanwhile?") {
		t.Fatalf("a second read short of a row: %v", err)
	}
}

// summaryJSON is a's summary as audit writes it.
func summaryJSON(t *testing.T, a *Audit) string {
	t.Helper()
	b, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// An audit of the same rows says the same to the last digit every time, so
// that two audits of one archive can be diffed: the within-group means
// once summed over a map, in its order, which Go draws anew each time
// (their last digits differed between two runs of the command).
func TestAuditIsTheSameEveryTime(t *testing.T) {
	rows := biasedRows(t, 200, 0.1)
	first, err := RunAudit(rows, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	want := summaryJSON(t, first)
	for i := range 8 {
		a, err := RunAudit(rows, AuditOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if got := summaryJSON(t, a); got != want {
			t.Fatalf("audit %d of the same rows:\n%s\nthe first:\n%s", i+2, got, want)
		}
	}
}

func TestAuditVerdicts(t *testing.T) {
	a, err := RunAudit(biasedRows(t, 800, 0.05), AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// One map serves the run: it cannot fix squash's bias, which no other
	// task shares, though a map of squash's own would.
	want := map[string]string{"fair": VerdictCalibrated, "squash": VerdictTaskSpecific, "hump": VerdictNonMonotone}
	for _, task := range a.Tasks {
		if task.Verdict != want[task.Task] {
			t.Errorf("task %s: verdict %q (max residual %.3f before, %.3f run-wide map, %.3f own map), want %q", task.Task, task.Verdict, task.MaxBefore, task.MaxMonotone, task.MaxOwn, want[task.Task])
		}
	}
	for _, task := range a.Tasks {
		switch task.Task {
		case "fair", "squash": // monotone: ranks agree, as well within groups
			if task.Ranks.Spearman < 0.9 || task.Ranks.WithinKendall < 0.6 {
				t.Errorf("task %s: ranks %+v", task.Task, task.Ranks)
			}
		case "hump":
			if math.Abs(float64(task.Ranks.Spearman)) > 0.15 {
				t.Errorf("hump: Spearman %v, want near 0", task.Ranks.Spearman)
			}
		}
	}
	if a.Pairs != 3*200*8 || len(a.Drift) == 0 || len(a.MapX) == 0 {
		t.Fatalf("pairs %d drift %d map %d", a.Pairs, len(a.Drift), len(a.MapX))
	}

	// Too few pairs: no verdict rather than a noisy one.
	small, err := RunAudit(biasedRows(t, 8, 0.05), AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range small.Tasks {
		if task.Verdict != VerdictTooFewAnchor {
			t.Errorf("task %s with %d pairs got verdict %q", task.Task, task.Pairs, task.Verdict)
		}
	}
}

// sharedBiasRows: four tasks whose world model shares one monotone bias
// (true = pred^2), 8 anchor groups of 8 a step interleaved over the tasks,
// with the calibrated scores a run records: "warm-up" gives the flat map at
// the anchors' mean before the first fit (the first quarter of the steps)
// and the exact map after it; "debias off" gives the raw scores.
func sharedBiasRows(mode string) []archive.Row {
	rng := rand.New(rand.NewPCG(7, 8))
	var rows []archive.Row
	const steps = 100
	for step := range int64(steps) {
		for g := range 8 {
			task := fmt.Sprintf("task-%d", g%4)
			gid := fmt.Sprintf("g%d", g)
			for i := range 8 {
				p := rng.Float64()
				y := min(max(p*p+0.05*rng.NormFloat64(), 0), 1)
				c := p * p
				switch {
				case mode == "debias off":
					c = p
				case step < steps/4:
					c = 1.0 / 3
				}
				rows = append(rows, archive.Row{Run: "audit", Step: step, GroupID: gid, TrajID: fmt.Sprintf("%d-%s-%d", step, gid, i), TaskID: task,
					Predicted: &p, TrueScore: &y, Calibrated: &c, IsAnchor: true, Source: archive.SourceAnchor, Rho: 2, D: 0.1})
			}
		}
	}
	return rows
}

// TestAuditJudgesTheWorldModelNotTheRunsMaps: a world model with one
// monotone bias is "monotone bias corrected" for every task, whether the
// run's recorded maps include the flat map before the first fit or the run
// did not debias at all. The verdict used to judge the recorded scores and
// called both "non-monotone bias that isotonic cannot fix".
func TestAuditJudgesTheWorldModelNotTheRunsMaps(t *testing.T) {
	for _, mode := range []string{"warm-up", "debias off"} {
		a, err := RunAudit(sharedBiasRows(mode), AuditOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, ta := range append([]TaskAudit{a.Overall}, a.Tasks...) {
			if ta.Verdict != VerdictCorrected {
				t.Errorf("%s, %s: verdict %q (max residual %.3f before, %.3f recorded, %.3f monotone map, %.3f own map)",
					mode, ta.Task, ta.Verdict, ta.MaxBefore, ta.MaxAfter, ta.MaxMonotone, ta.MaxOwn)
			}
		}
		// The recorded maps still show what the run did.
		if a.Overall.MaxAfter < 0.1 || a.Overall.MaxMonotone > 0.05 {
			t.Errorf("%s: max residual %.3f recorded, %.3f monotone map; want the recorded one large, the map's small", mode, a.Overall.MaxAfter, a.Overall.MaxMonotone)
		}
	}
}

// A world model that stops ranking the policy's solutions halfway through
// a run shows as a fall of the per-step within-group rank correlation,
// while its mean residual, the level GRPO's standardisation cancels, stays
// where it was.
func TestDriftShowsAWorldModelThatStopsRanking(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	var rows []archive.Row
	for step := range int64(40) {
		for g := range 4 {
			for i := range 8 {
				y := rng.Float64()
				p := y + 0.05*rng.NormFloat64() // ranks well
				if step >= 20 {
					p = rng.Float64() // ranks nothing, at the same level
				}
				rows = append(rows, archive.Row{Run: "drift", Step: step, GroupID: fmt.Sprintf("g%d", g), TrajID: fmt.Sprintf("%d-%d-%d", step, g, i),
					TaskID: "t", Predicted: &p, TrueScore: &y, IsAnchor: true, Source: archive.SourceAnchor})
			}
		}
	}
	a, err := RunAudit(rows, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(a.Drift) != 40 {
		t.Fatalf("%d steps of drift, want 40", len(a.Drift))
	}
	var early, late, resEarly, resLate float64
	for _, s := range a.Drift {
		if s.Step < 20 {
			early, resEarly = early+float64(s.WithinSpearman)/20, resEarly+float64(s.ResidualBefore)/20
		} else {
			late, resLate = late+float64(s.WithinSpearman)/20, resLate+float64(s.ResidualBefore)/20
		}
	}
	if !(early > 0.9 && math.Abs(late) < 0.2) { // NaN fails too
		t.Errorf("within-group Spearman %.3f in the first half, %.3f in the second; want above 0.9, then near 0", early, late)
	}
	if !(math.Abs(resEarly) < 0.05 && math.Abs(resLate) < 0.05) {
		t.Errorf("mean residual %.3f then %.3f: the level was meant to stay put", resEarly, resLate)
	}
	if first, last, se, ok := a.RankTrend(); !ok || !(first > 0.9 && math.Abs(last) < 0.2 && first-last > 2*se) {
		t.Errorf("rank trend %.3f -> %.3f ± %.3f (%v); want above 0.9, then near 0, clearly", first, last, se, ok)
	}
	// One step by hand: the mean over its four groups.
	want := 0.0
	for g := range 4 {
		var x, y []float64
		for _, r := range rows[32*25+8*g : 32*25+8*(g+1)] {
			x, y = append(x, *r.Predicted), append(y, *r.TrueScore)
		}
		want += fuse.Spearman(x, y) / 4
	}
	if got := float64(a.Drift[25].WithinSpearman); !(math.Abs(got-want) < 1e-12) {
		t.Errorf("step 25: within-group Spearman %v, want %v", got, want)
	}
}

func TestWriteReport(t *testing.T) {
	rows := biasedRows(t, 200, 0.05)
	scored, crashed := schemas.ExecScored, schemas.ExecCrashed
	for i, r := range rows {
		if r.TrueScore != nil {
			rows[i].ExecStatus = &scored
			if i%7 == 0 { // some anchors fail, and score 0
				zero := 0.0
				rows[i].ExecStatus, rows[i].TrueScore = &crashed, &zero
			}
		}
	}
	a, err := RunAudit(rows, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dir, html := reportHTML(t, a)
	for _, want := range []string{"data:image/png;base64,", VerdictNonMonotone, "<td class=\"l\">squash</td>", "<h2>Execution outcomes</h2>", "<td class=\"l\">crashed</td>"} {
		if !strings.Contains(html, want) {
			t.Errorf("index.html lacks %q", want)
		}
	}
	for _, png := range []string{"reliability.png", "bias.png", "coverage.png", "drift.png", "ranks.png", "rho.png"} {
		b, err := os.ReadFile(filepath.Join(dir, png))
		if err != nil || len(b) < 1000 || string(b[1:4]) != "PNG" {
			t.Errorf("%s: %d bytes, %v", png, len(b), err)
		}
	}
	var sum struct {
		Tasks []struct {
			Task, Verdict string
			Levels        []struct {
				ResidualAfter *float64 `json:"residual_after"`
			}
		}
	}
	b, _ := os.ReadFile(filepath.Join(dir, "summary.json"))
	if err := json.Unmarshal(b, &sum); err != nil || len(sum.Tasks) != 3 || sum.Tasks[0].Task != "fair" {
		t.Fatalf("summary.json: %v %+v", err, sum)
	}
}

// BenchmarkAudit audits a million rows (the target: under 10 s).
func BenchmarkAudit(b *testing.B) {
	rows := biasedRows(b, 1_000_000/8/3, 0.1)
	for i := range rows {
		rows[i].TaskID = fmt.Sprintf("%s-%d", rows[i].TaskID, i%32)
		if rows[i].IsAnchor { // an archive with the anchors' code has their lengths
			n := int64(200 + i%4000)
			rows[i].ResponseBytes = &n
		}
	}
	dir := b.TempDir()
	b.ResetTimer()
	for b.Loop() {
		start := time.Now()
		a, err := RunAudit(rows, AuditOptions{})
		if err != nil {
			b.Fatal(err)
		}
		if err := WriteReport(a, dir); err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(time.Since(start).Seconds(), "s/Mrows")
	}
}

// TestAuditSaysWhetherTheWorldModelSeesFailuresComing: the anchors by
// how their execution ended, and how well the world model's score tells
// those that failed (scored 0) from those that scored.
func TestAuditSaysWhetherTheWorldModelSeesFailuresComing(t *testing.T) {
	var rows []archive.Row
	for i, x := range []struct {
		status      string
		pred, truth float64
	}{
		{schemas.ExecScored, 0.8, 0.9},
		{schemas.ExecScored, 0.5, 0.6},
		{schemas.ExecCrashed, 0.6, 0},
		{schemas.ExecTimedOut, 0.2, 0},
	} {
		status := x.status
		rows = append(rows, archive.Row{Step: 1, GroupID: "g", TrajID: fmt.Sprint(i), TaskID: "t", IsAnchor: true, Source: archive.SourceAnchor,
			Predicted: &x.pred, TrueScore: &x.truth, ExecStatus: &status})
	}
	a, err := RunAudit(rows, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	want := []Outcome{
		{Status: schemas.ExecScored, Pairs: 2, Share: 0.5, MeanPredicted: 0.65, MeanTrue: 0.75},
		{Status: schemas.ExecCrashed, Pairs: 1, Share: 0.25, MeanPredicted: 0.6, MeanTrue: 0},
		{Status: schemas.ExecTimedOut, Pairs: 1, Share: 0.25, MeanPredicted: 0.2, MeanTrue: 0},
	}
	if len(a.Outcomes) != len(want) {
		t.Fatalf("outcomes %+v; want %+v", a.Outcomes, want)
	}
	for i, o := range a.Outcomes {
		w := want[i]
		if o.Status != w.Status || o.Pairs != w.Pairs || math.Abs(o.Share-w.Share) > 1e-12 ||
			math.Abs(float64(o.MeanPredicted-w.MeanPredicted)) > 1e-12 || math.Abs(float64(o.MeanTrue-w.MeanTrue)) > 1e-12 {
			t.Errorf("outcome %d: %+v; want %+v", i, o, w)
		}
	}
	// Of the 4 (failed, scored) pairs the failure is predicted lower in 3.
	if a.FailureAUC != 0.75 {
		t.Errorf("failure AUC %v; want 0.75", a.FailureAUC)
	}
}

// TestAuditCountsFailuresByCause: failures whose details say the same
// thing with other numbers count as one cause, most frequent first, with
// the first as the example; failures without a detail are counted apart.
func TestAuditCountsFailuresByCause(t *testing.T) {
	var rows []archive.Row
	add := func(status, detail string, pred float64) {
		truth := 0.0
		if status == schemas.ExecScored {
			truth = 0.5
		}
		r := archive.Row{Step: int64(len(rows)), GroupID: "g", TrajID: fmt.Sprint(len(rows)), TaskID: "t", IsAnchor: true,
			Source: archive.SourceAnchor, Predicted: &pred, TrueScore: &truth, ExecStatus: &status}
		if detail != "" {
			r.ExecDetail = &detail
		}
		rows = append(rows, r)
	}
	add(schemas.ExecScored, "", 0.9)
	missing := "exit code 1: Traceback (most recent call last): | import lightgbm | ModuleNotFoundError: No module named 'lightgbm'"
	add(schemas.ExecCrashed, missing, 0.7)
	add(schemas.ExecTimedOut, "killed after 61 s of CPU time, its limit (30.2s of wall clock)", 0.4)
	add(schemas.ExecCrashed, missing, 0.5)
	add(schemas.ExecTimedOut, "killed after 64 s of CPU time, its limit (31.9s of wall clock)", 0.2)
	add(schemas.ExecCrashed, missing+" (not isolated: no permission for network and PID namespaces)", 0.6)
	add(schemas.ExecInvalid, "", 0.3)
	a, err := RunAudit(rows, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	want := []Cause{
		{Cause: "ModuleNotFoundError: No module named 'lightgbm'", Status: schemas.ExecCrashed, Pairs: 3, Share: 0.5, MeanPredicted: 0.6,
			Example: missing, Step: 1, GroupID: "g", TrajID: "1"},
		{Cause: "killed after N s of CPU time, its limit (N of wall clock)", Status: schemas.ExecTimedOut, Pairs: 2, Share: 2.0 / 6, MeanPredicted: 0.3,
			Example: "killed after 61 s of CPU time, its limit (30.2s of wall clock)", Step: 2, GroupID: "g", TrajID: "2"},
	}
	if len(a.Causes) != len(want) || a.OtherCauses != 0 || a.FailuresWithoutDetail != 1 {
		t.Fatalf("causes %+v, %d others, %d without detail; want %+v, 0, 1", a.Causes, a.OtherCauses, a.FailuresWithoutDetail, want)
	}
	for i, c := range a.Causes {
		w := want[i]
		if math.Abs(c.Share-w.Share) > 1e-12 || math.Abs(float64(c.MeanPredicted-w.MeanPredicted)) > 1e-12 {
			t.Errorf("cause %d: %+v; want %+v", i, c, w)
		}
		c.Share, c.MeanPredicted, w.Share, w.MeanPredicted = 0, 0, 0, 0
		if c != w {
			t.Errorf("cause %d: %+v; want %+v", i, c, w)
		}
	}
	_, html := reportHTML(t, a)
	if !strings.Contains(html, "<td class=\"l\">ModuleNotFoundError: No module named &#39;lightgbm&#39;</td><td class=\"l\">crashed</td><td>3</td><td>50.0%</td>") ||
		!strings.Contains(html, "1 failed anchor pairs have no detail recorded") {
		t.Errorf("the report lacks the causes table or the count without detail")
	}

	// More kinds than are listed: the rarest are counted, not listed.
	rows = rows[:0]
	for i := range maxCauses + 3 {
		add(schemas.ExecInvalid, fmt.Sprintf("column %c missing", 'A'+i), 0.1)
	}
	add(schemas.ExecInvalid, "column A missing", 0.1)
	if a, err = RunAudit(rows, AuditOptions{}); err != nil {
		t.Fatal(err)
	}
	if len(a.Causes) != maxCauses || a.OtherCauses != 3 || a.Causes[0].Cause != "column A missing" || a.Causes[0].Pairs != 2 {
		t.Errorf("%d causes listed (first %+v), %d others; want %d, column A twice first, 3 others", len(a.Causes), a.Causes[0], a.OtherCauses, maxCauses)
	}
}

// reportHTML writes a's report and returns its directory and index.html.
func reportHTML(t *testing.T, a *Audit) (dir, html string) {
	t.Helper()
	dir = t.TempDir()
	if err := WriteReport(a, dir); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dir, "index.html"))
	if err != nil {
		t.Fatal(err)
	}
	return dir, string(b)
}

// TestAuditSetsWhatTheWorldModelSaidAgainstTheExecutions: the statuses it
// predicted against the executions', and the pairs it missed most, with
// its reasons; a late anchor's pair takes them from its world-model row.
func TestAuditSetsWhatTheWorldModelSaidAgainstTheExecutions(t *testing.T) {
	str := func(s string) *string { return &s }
	f := func(x float64) *float64 { return &x }
	rows := []archive.Row{
		{Step: 1, GroupID: "g", TrajID: "a", TaskID: "t", IsAnchor: true, Source: archive.SourceAnchor, Predicted: f(0.9), TrueScore: f(0),
			ExecStatus: str(schemas.ExecCrashed), ExecDetail: str("exit code 1: x | KeyError: 'area'"), WMVerdict: str(schemas.ExecScored), WMRationale: str("uses every feature")},
		{Step: 1, GroupID: "g", TrajID: "b", TaskID: "t", IsAnchor: true, Source: archive.SourceAnchor, Predicted: f(0.5), TrueScore: f(0.6),
			ExecStatus: str(schemas.ExecScored), WMVerdict: str(schemas.ExecScored)},
		{Step: 1, GroupID: "g", TrajID: "c", TaskID: "t", IsAnchor: true, Source: archive.SourceAnchor, Predicted: f(0), TrueScore: f(0),
			ExecStatus: str(schemas.ExecInvalid), WMVerdict: str(schemas.ExecInvalid), WMRationale: str("writes no id column")},
		// A late anchor: its world-model row has the verdict, its pair the truth.
		{Step: 2, GroupID: "h", TrajID: "d", TaskID: "t", IsAnchor: true, Source: archive.SourceWorldModel, Predicted: f(0.2),
			ExecStatus: str(archive.ExecLate), WMVerdict: str(schemas.ExecCrashed), WMRationale: str("imports a missing package")},
		{Step: 2, GroupID: "h", TrajID: "d", TaskID: "t", IsAnchor: true, Source: archive.SourceLateAnchor, Predicted: f(0.2), TrueScore: f(0.8),
			ExecStatus: str(schemas.ExecScored)},
		// A world-model row of another group: not an anchor, no verdict counted.
		{Step: 2, GroupID: "w", TrajID: "e", TaskID: "t", Source: archive.SourceWorldModel, Predicted: f(0.4), WMVerdict: str(schemas.ExecScored)},
	}
	a, err := RunAudit(rows, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	wantVerdicts := []VerdictCount{
		{schemas.ExecScored, schemas.ExecScored, 1}, {schemas.ExecScored, schemas.ExecCrashed, 1},
		{schemas.ExecInvalid, schemas.ExecInvalid, 1}, {schemas.ExecCrashed, schemas.ExecScored, 1},
	}
	if !slices.Equal(a.Verdicts, wantVerdicts) {
		t.Errorf("verdicts %+v; want %+v", a.Verdicts, wantVerdicts)
	}
	if len(a.Misses) != 4 {
		t.Fatalf("%d misses; want the 4 anchor pairs", len(a.Misses))
	}
	first, second := a.Misses[0], a.Misses[1]
	if first.TrajID != "a" || first.Cause != "KeyError: 'area'" || first.WMVerdict != schemas.ExecScored || first.WMRationale != "uses every feature" ||
		second.TrajID != "d" || second.WMVerdict != schemas.ExecCrashed || second.WMRationale != "imports a missing package" || second.Step != 2 {
		t.Errorf("largest misses %+v, %+v; want a (0.9 off, crashed on KeyError, said scored), then the late d (0.6 off, said crashed)", first, second)
	}
	// The late pair's row before its world-model row (a file of late rows
	// read first): the same verdicts and misses.
	swapped := slices.Clone(rows)
	swapped[3], swapped[4] = swapped[4], swapped[3]
	b, err := RunAudit(swapped, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(b.Verdicts, a.Verdicts) || !slices.Equal(b.Misses, a.Misses) {
		t.Errorf("the late pair first: verdicts %+v, misses %+v; want %+v, %+v", b.Verdicts, b.Misses, a.Verdicts, a.Misses)
	}
	_, html := reportHTML(t, a)
	if !strings.Contains(html, "<h2>Largest misses</h2>") || !strings.Contains(html, "scored: <small>uses every feature</small>") ||
		!strings.Contains(html, "<tr><td class=\"l\">crashed</td><td class=\"l\">scored</td><td>1</td></tr>") {
		t.Error("the report lacks the verdicts or the misses")
	}

	// A world model that says no status (the simulated one): no verdicts,
	// the misses all the same.
	for i := range rows {
		rows[i].WMVerdict, rows[i].WMRationale = nil, nil
	}
	if a, err = RunAudit(rows, AuditOptions{}); err != nil || len(a.Verdicts) != 0 || len(a.Misses) != 4 || a.Misses[0].WMVerdict != "" {
		t.Errorf("without verdicts: %v, %+v, %d misses", err, a.Verdicts, len(a.Misses))
	}
}

// TestAuditCountsALateAnchorOnceAndByHowItEnded: a late anchor's
// ungraded prediction is counted once, on its world-model row, not again
// on the late row of its execution; a late pair counts under the status
// its execution ended with (a timeout scored 0 is a timeout).
func TestAuditCountsALateAnchorOnceAndByHowItEnded(t *testing.T) {
	str := func(s string) *string { return &s }
	f := func(x float64) *float64 { return &x }
	late := str(archive.ExecLate)
	rows := []archive.Row{
		{Step: 1, GroupID: "g", TrajID: "a", TaskID: "t", IsAnchor: true, Source: archive.SourceAnchor, Predicted: f(0.5), TrueScore: f(0.6), ExecStatus: str(schemas.ExecScored)},
		{Step: 1, GroupID: "g", TrajID: "b", TaskID: "t", IsAnchor: true, Source: archive.SourceAnchor, Predicted: f(0.3), TrueScore: f(0.2), ExecStatus: str(schemas.ExecScored)},
		{Step: 2, GroupID: "h", TrajID: "c", TaskID: "t", IsAnchor: true, Source: archive.SourceWorldModel, Predicted: f(0.7), ExecStatus: late},
		{Step: 2, GroupID: "h", TrajID: "d", TaskID: "t", IsAnchor: true, Source: archive.SourceWorldModel, WMStatus: schemas.PredUngraded, ExecStatus: late},
		{Step: 2, GroupID: "h", TrajID: "c", TaskID: "t", IsAnchor: true, Source: archive.SourceLateAnchor, Predicted: f(0.7), TrueScore: f(0), ExecStatus: str(schemas.ExecTimedOut)},
		{Step: 2, GroupID: "h", TrajID: "d", TaskID: "t", IsAnchor: true, Source: archive.SourceLateAnchor, WMStatus: schemas.PredUngraded, TrueScore: f(0.4), ExecStatus: str(schemas.ExecScored)},
		// e's execution gave no score: graded, and no pair.
		{Step: 2, GroupID: "h", TrajID: "e", TaskID: "t", IsAnchor: true, Source: archive.SourceWorldModel, Predicted: f(0.2), ExecStatus: late},
		{Step: 2, GroupID: "h", TrajID: "e", TaskID: "t", IsAnchor: true, Source: archive.SourceLateAnchor, WMStatus: schemas.PredOK, ExecStatus: str(schemas.ExecSandboxError), ExecSeconds: f(90)},
	}
	a, err := RunAudit(rows, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if a.Ungraded != 1 || a.Pairs != 3 || a.LatePairs != 1 {
		t.Errorf("ungraded %d, pairs %d (late %d); want d's ungraded prediction once, and 3 pairs, 1 of them late", a.Ungraded, a.Pairs, a.LatePairs)
	}
	if e := a.Executions; e == nil || e.Executions != 1 || e.Own() != 0 || len(e.ByStatus) != 1 || e.ByStatus[0].Status != schemas.ExecSandboxError || e.ByStatus[0].Max != 90 {
		t.Errorf("execution times %+v; want e's sandbox error, by its status only", e)
	}
	var timedOut *Outcome
	for i, o := range a.Outcomes {
		if o.Status == schemas.ExecTimedOut {
			timedOut = &a.Outcomes[i]
		}
	}
	if timedOut == nil || timedOut.Pairs != 1 || float64(timedOut.MeanPredicted) != 0.7 || math.Abs(timedOut.Share-1.0/3) > 1e-12 {
		t.Errorf("outcomes %+v; want the late timeout as one of 3 pairs, predicted 0.7", a.Outcomes)
	}
}

// top keeps what a stable sort, largest first, would put first.
func TestTopIsTheTopOfAStableSort(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for range 2000 {
		vals := make([]float64, rng.IntN(40))
		items := make([]int, len(vals))
		for i := range vals {
			vals[i], items[i] = float64(rng.IntN(6)), i // ties aplenty
		}
		k := 1 + rng.IntN(12)
		by := func(i int) float64 { return vals[i] }
		want := slices.Clone(items)
		slices.SortStableFunc(want, func(a, b int) int { return cmp.Compare(by(b), by(a)) })
		want = want[:min(k, len(want))]
		kept := top[int]{k: k, by: by}
		for _, it := range items {
			kept.add(it)
		}
		if !slices.Equal(kept.items, want) {
			t.Fatalf("the top %d of %v: %v; want %v", k, vals, kept.items, want)
		}
	}
}
