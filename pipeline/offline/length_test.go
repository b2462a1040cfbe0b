package offline

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/wmrl/wmrl/stages/archive"
)

// lengthRows makes 60 anchor groups of 8 whose world model scores
// squash(true) + noise + lean * (length in KB - 2.5); every fourth group
// was late: its true scores are on late_anchor rows, its lengths on its
// world-model rows.
func lengthRows(lean float64) []archive.Row {
	rng := rand.New(rand.NewPCG(7, 8))
	var rows []archive.Row
	for g := range 60 {
		late := g%4 == 0
		for i := range 8 {
			truth := rng.Float64()
			bytes := int64(200 + rng.IntN(4800))
			pred := min(1, max(0, truth*truth+0.03*rng.NormFloat64()+lean*(float64(bytes)/1000-2.5)))
			r := archive.Row{Run: "r", Step: int64(g / 4), GroupID: fmt.Sprintf("g%d", g), TrajID: fmt.Sprintf("g%d-%d", g, i), TaskID: "t",
				IsAnchor: true, Source: archive.SourceAnchor, Predicted: &pred, ResponseBytes: &bytes}
			if !late {
				r.TrueScore = &truth
				rows = append(rows, r)
				continue
			}
			status := archive.ExecLate
			r.Source, r.ExecStatus = archive.SourceWorldModel, &status
			lr := archive.Row{Run: "r", Step: r.Step, GroupID: r.GroupID, TrajID: r.TrajID, TaskID: "t", IsAnchor: true,
				Source: archive.SourceLateAnchor, Predicted: &pred, TrueScore: &truth}
			rows = append(rows, r, lr)
		}
	}
	return rows
}

// A world model that rates longer solutions higher is found out, on the
// residual after the monotone map (which its squash is); one without that
// lean is not; an archive without lengths gets no length section.
func TestAuditFindsBiasByLength(t *testing.T) {
	for _, c := range []struct {
		lean float64
		want string
	}{{0.08, LengthOverrated}, {-0.08, LengthUnderrated}, {0, LengthNone}} {
		a, err := RunAudit(lengthRows(c.lean), AuditOptions{})
		if err != nil {
			t.Fatal(err)
		}
		lb := a.Length
		if lb == nil || lb.Pairs != 480 || lb.Groups != 60 || len(lb.Levels) != LengthBands {
			t.Fatalf("lean %v: %+v, want 480 pairs (the late ones' lengths joined) in 60 groups and %d bands", c.lean, lb, LengthBands)
		}
		if lb.Distinct <= FewLengths {
			t.Errorf("lean %v: %d distinct lengths of 480 drawn from 4800", c.lean, lb.Distinct)
		}
		if lb.Verdict != c.want {
			t.Errorf("lean %v: %q (within-group Spearman %.3f ± %.3f), want %q", c.lean, lb.Verdict, lb.WithinSpearman, 2*lb.SE, c.want)
		}
		first, last := lb.Levels[0], lb.Levels[LengthBands-1]
		if c.lean > 0 && !(last.ResidualMonotone > first.ResidualMonotone+0.2) {
			t.Errorf("lean %v: residual after the map %.3f in the shortest band, %.3f in the longest", c.lean, first.ResidualMonotone, last.ResidualMonotone)
		}
		if first.Bytes[0] > first.Bytes[1] || first.Bytes[1] > last.Bytes[0] || first.Pairs+last.Pairs != 192 {
			t.Errorf("bands %+v", lb.Levels)
		}
	}
	// The report shows it: a table, the verdict and a plot.
	a, err := RunAudit(lengthRows(0.08), AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := WriteReport(a, dir); err != nil {
		t.Fatal(err)
	}
	page, err := os.ReadFile(filepath.Join(dir, "index.html"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"<h2>Bias by solution length</h2>", "<b>" + LengthOverrated + "</b>", `alt="Residual by solution length"`} {
		if !strings.Contains(string(page), want) {
			t.Errorf("the report lacks %q", want)
		}
	}
	if strings.Contains(string(page), "distinct lengths") {
		t.Error("the report warns of few distinct lengths among 480 drawn from 4800")
	}
	if _, err := os.Stat(filepath.Join(dir, "length.png")); err != nil {
		t.Error(err)
	}
	rows := lengthRows(0.08)
	for i := range rows {
		rows[i].ResponseBytes = nil
	}
	if a, err := RunAudit(rows, AuditOptions{}); err != nil || a.Length != nil {
		t.Errorf("without lengths: %+v, %v; want no length section", a.Length, err)
	}
}
