package offline

import (
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
)

// TestExecTimesSetsTheGroupsSlowestAgainstTheDeadline: a group counts by
// its slowest execution, a late group's times come from its late rows, a
// copy took no time of its own, and a group missing a time (a late
// sandbox error has no late row) is left out of the groups' times.
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
		// The late rows come after their steps, b2's never (a sandbox error).
		lateRow(2, "b", "b0", schemas.ExecScored, 40), lateRow(2, "b", "b1", schemas.ExecCrashed, 50),
		lateRow(3, "c", "c0", schemas.ExecScored, 35), lateRow(3, "c", "c1", schemas.ExecScored, 31),
	}
	e := execTimes(rows, 30)
	if e == nil {
		t.Fatal("no execution times")
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
