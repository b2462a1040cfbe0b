package offline

import (
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"gonum.org/v1/plot"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
)

// TestExecTimesSetsTheGroupsSlowestAgainstTheDeadline: a group counts by
// its slowest execution, a late group's times come from its late rows, a
// copy took no time of its own, and a group missing a time (a late
// execution without a late row: an outside executor's, or a sandbox
// error in an archive from before they had one) is left out of the
// groups' times.
func TestExecTimesSetsTheGroupsSlowestAgainstTheDeadline(t *testing.T) {
	str := func(s string) *string { return &s }
	f := func(x float64) *float64 { return &x }
	late := str(archive.ExecLate)
	anchor := func(step int64, g, id, status string, seconds float64) archive.Row {
		return archive.Row{Step: step, GroupID: g, TrajID: id, IsAnchor: true, Source: archive.SourceAnchor, ExecStatus: str(status), ExecSeconds: f(seconds)}
	}
	lateWM := func(step int64, g, id string) archive.Row {
		return archive.Row{Step: step, GroupID: g, TrajID: id, IsAnchor: true, Source: archive.SourceWorldModel, ExecStatus: late}
	}
	lateRow := func(step int64, g, id, status string, seconds float64) archive.Row {
		r := anchor(step, g, id, status, seconds)
		r.Source = archive.SourceLateAnchor
		return r
	}
	copied := anchor(1, "a", "a2", schemas.ExecScored, 0)
	copied.ExecCopyOf = str("a0")
	failed := func(id string) archive.Row { // executed with fewer than two scores: fused on the world model
		r := anchor(4, "d", id, schemas.ExecSandboxError, 1)
		r.Source = archive.SourceWorldModel
		return r
	}
	rows := []archive.Row{
		anchor(1, "a", "a0", schemas.ExecScored, 2), anchor(1, "a", "a1", schemas.ExecTimedOut, 4), copied,
		{Step: 1, GroupID: "w", TrajID: "w0", Source: archive.SourceWorldModel}, // not an anchor
		lateWM(2, "b", "b0"), lateWM(2, "b", "b1"), lateWM(2, "b", "b2"),
		lateWM(3, "c", "c0"), lateWM(3, "c", "c1"),
		failed("d0"), failed("d1"),
		// The late rows come after their steps, b2's never.
		lateRow(2, "b", "b0", schemas.ExecScored, 40), lateRow(2, "b", "b1", schemas.ExecCrashed, 50),
		lateRow(3, "c", "c0", schemas.ExecScored, 35), lateRow(3, "c", "c1", schemas.ExecScored, 31),
	}
	// Each step's rows are stamped with its update; a late group's late
	// rows with its calibration: b's 50 s after step 2's update, c's 10 s
	// after step 3's.
	t0 := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	for i, r := range rows {
		rows[i].TS = t0.Add(time.Duration(r.Step) * time.Minute)
		if r.Source == archive.SourceLateAnchor {
			rows[i].TS = rows[i].TS.Add(map[string]time.Duration{"b": 50 * time.Second, "c": 10 * time.Second}[r.GroupID])
		}
	}
	e := execTimes(rows, 30)
	if e == nil {
		t.Fatal("no execution times")
	}
	if q := e.LateAfterFused; q == nil || e.LateTimed != 2 || q.Max != 50 || q.P90 != 50 || q.Median != 10 {
		t.Errorf("late groups calibrated after their steps' updates: %+v over %d; want 10 s and 50 s over 2", q, e.LateTimed)
	}
	if e.Executions != 9 || e.Copies != 1 || e.Own() != 6 || e.AnchorGroups != 4 || e.LateGroups != 2 || e.Groups != 3 {
		t.Errorf("executions %d (copies %d, own %d), anchor groups %d (late %d, timed %d); want 9 (1, and 6 without the copy and d's sandbox errors), 4 (2, 3: b lacks b2's)",
			e.Executions, e.Copies, e.Own(), e.AnchorGroups, e.LateGroups, e.Groups)
	}
	// Each: 2 4 31 35 40 50; the groups' slowest: d 1, a 4, c 35.
	if e.Seconds.Median != 31 || e.Seconds.Max != 50 || e.Slowest.Median != 4 || e.Slowest.Max != 35 {
		t.Errorf("seconds %+v, groups' slowest %+v; want median 31 and max 50, and median 4 and max 35", e.Seconds, e.Slowest)
	}
	if math.Abs(float64(e.WithinDeadline)-2.0/3) > 1e-12 {
		t.Errorf("within the deadline %v; want 2 of the 3 timed groups (c's slowest took 35 s)", e.WithinDeadline)
	}
	want := []StatusTimes{{schemas.ExecScored, 4, 31, 40}, {schemas.ExecSandboxError, 2, 1, 1}, {schemas.ExecCrashed, 1, 50, 50}, {schemas.ExecTimedOut, 1, 4, 4}}
	if !slices.Equal(e.ByStatus, want) {
		t.Errorf("by status %+v; want %+v", e.ByStatus, want)
	}
	if e := execTimes(rows, 0); !math.IsNaN(float64(e.WithinDeadline)) {
		t.Errorf("with no deadline known, %v within it; want NaN", e.WithinDeadline)
	}
	for i := range rows {
		rows[i].ExecSeconds = nil
	}
	if e := execTimes(rows, 30); e != nil {
		t.Errorf("an archive with no execution's seconds has times %+v", e)
	}
}

// The report shows the times beside the deadline, as a table and a plot.
func TestTheReportShowsTheExecutionTimes(t *testing.T) {
	rows := biasedRows(t, 40, 0.05)
	scored := schemas.ExecScored
	for i := range rows {
		if rows[i].IsAnchor {
			s := 0.1 * float64(i%9)
			rows[i].ExecSeconds, rows[i].ExecStatus = &s, &scored
		}
	}
	a, err := RunAudit(rows, AuditOptions{AnchorDeadline: 0.5})
	if err != nil {
		t.Fatal(err)
	}
	if a.Executions == nil || a.Executions.Own() == 0 {
		t.Fatalf("execution times %+v from rows with seconds", a.Executions)
	}
	dir, html := reportHTML(t, a)
	if _, err := os.Stat(filepath.Join(dir, "exec-times.png")); err != nil {
		t.Error(err)
	}
	for _, want := range []string{"<h2>Execution times</h2>", "the deadline was 0.5 s", "<td class=\"l\">each anchor group's slowest</td>"} {
		if !strings.Contains(html, want) {
			t.Errorf("the report lacks %q", want)
		}
	}
}

// The execution-times plot puts a spread as real executions have (minutes,
// a tail to half an hour) on a log axis, and runs its x axis past both the
// longest time and the deadline; a group whose slowest took 0 s (its
// executions copied an identical solution's outcome) does not break the
// log axis.
func TestTheExecutionTimesPlotFitsTheTimes(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	times := func(n int, median, sigma, cap float64) []float64 { // log-normal, at most cap, in no order
		xs := make([]float64, n)
		for i := range xs {
			xs[i] = min(cap, median*math.Exp(sigma*rng.NormFloat64()))
		}
		return xs
	}
	for _, c := range []struct {
		name     string
		each     []float64
		deadline float64
		log      bool
	}{
		{"tens of milliseconds, within the deadline", times(800, 0.031, 0.02, 0.039), 0.040, false},
		{"tens of milliseconds, past the deadline", times(800, 0.031, 0.02, 0.039), 0.010, false},
		{"minutes", times(800, 60, 1.1, 1800), 1800, true},
		{"minutes, a deadline of 5", times(800, 60, 1.1, 1800), 300, true},
	} {
		var slowest []float64
		for i := 0; i+8 <= len(c.each); i += 8 {
			slowest = append(slowest, slices.Max(c.each[i:i+8]))
		}
		slowest = append(slowest, 0)
		each := slices.Sorted(slices.Values(c.each))
		slices.Sort(slowest)
		e := &ExecTimes{Deadline: c.deadline, each: each, slowest: slowest, Seconds: quantiles(each)}
		p, err := plotExecTimes(&Audit{Executions: e})
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		_, log := p.X.Scale.(plot.LogScale)
		if log != c.log {
			t.Errorf("%s: log axis %v; want %v (median %g, longest %g)", c.name, log, c.log, e.Seconds.Median, each[len(each)-1])
		}
		if p.X.Max <= max(c.deadline, each[len(each)-1]) || (log && (p.X.Min <= 0 || p.X.Min >= each[0])) || (!log && p.X.Min != 0) {
			t.Errorf("%s: x axis %g to %g; want past the deadline %g and the longest %g, from 0 or, on a log axis, from below the shortest %g above 0",
				c.name, p.X.Min, p.X.Max, c.deadline, each[len(each)-1], each[0])
		}
		path := filepath.Join(t.TempDir(), "exec-times.png")
		if err := p.Save(plotW, plotH, path); err != nil { // a 0 s on a log axis would panic here
			t.Fatalf("%s: %v", c.name, err)
		}
		if dir := os.Getenv("WMRL_PLOTS"); dir != "" { // to look at them
			data, _ := os.ReadFile(path)
			os.WriteFile(filepath.Join(dir, strings.ReplaceAll(c.name, " ", "-")+".png"), data, 0o644)
		}
	}
}

// execTimes measures the times over rows.
func execTimes(rows []archive.Row, deadline float64) *ExecTimes {
	x := newExecAcc()
	for _, r := range rows {
		x.add(r)
	}
	return x.result(deadline)
}
