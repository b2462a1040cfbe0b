package offline

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/wmrl/wmrl/connectors/sim/rl"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/route"
)

// TestExpectTakesTheRunsShapeAndSettings: the benchmark an audit runs has
// the run's groups per step and group size, its recorded anchor fraction,
// rounding and rho estimator, and its world model's within-group rank
// correlation over its earliest steps; the report shows it.
func TestExpectTakesTheRunsShapeAndSettings(t *testing.T) {
	rows := biasedRows(t, 64, 0.05) // 8 groups of 8 a step
	a, err := RunAudit(rows, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	s := archive.Settings{Debias: true, Debiaser: calibrate.DefaultDebiaserConfig(), Denoiser: fuse.DenoiserConfig{Estimator: fuse.EstimatorOff},
		AnchorFraction: 0.25, AnchorRounding: route.RoundSpread}
	e, err := Expect(a, s, ExpectOptions{Seeds: 2, Optimizer: rl.Adam})
	if err != nil {
		t.Fatal(err)
	}
	if e.Groups != 8 || e.GroupSize != 8 || e.AnchorFraction != 0.25 || e.AnchorRounding != route.RoundSpread || e.Optimizer != rl.Adam || e.Costs != rl.DefaultCosts {
		t.Errorf("expectation at %d groups of %d, fraction %v %s, %s, costs %+v", e.Groups, e.GroupSize, e.AnchorFraction, e.AnchorRounding, e.Optimizer, e.Costs)
	}
	if first, _, _, ok := a.RankTrend(); !ok || e.RankCorr != first || e.Measured != "the first quarter of the steps" {
		t.Errorf("placed at rank correlation %.4f (%s); the audit measured %.4f over the first quarter of the steps", e.RankCorr, e.Measured, first)
	}
	if rho := e.Result.Methods["wmrl"].Rho; rho != 1 {
		t.Errorf("the run's rho was off; wmrl trained at %.3f", rho)
	}
	// Settings recorded with the estimator unset are the pipeline's
	// default, which the benchmark would read as off.
	s.Denoiser = fuse.DenoiserConfig{}
	if e, err := Expect(a, s, ExpectOptions{Seeds: 2}); err != nil || e.Estimator != fuse.DefaultEstimator || e.Result.Methods["wmrl"].Rho <= 1 {
		t.Errorf("an unset estimator: %v, expectation at %q", err, e.Estimator)
	}

	a.Expect = e
	dir := t.TempDir()
	if err := WriteReport(a, dir); err != nil {
		t.Fatal(err)
	}
	html, _ := os.ReadFile(filepath.Join(dir, "index.html"))
	for _, want := range []string{"<h2>What to expect</h2>", `<td class="l">grpo-anchors</td>`, "curves-audited.png"} {
		if !strings.Contains(string(html), want) {
			t.Errorf("index.html lacks %q", want)
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "curves-audited.png")); err != nil || string(b[1:4]) != "PNG" {
		t.Errorf("curves-audited.png: %v", err)
	}
	var sum struct {
		Expect struct {
			Groups int `json:"groups"`
			Result struct {
				Methods map[string]struct {
					DiffGRPO struct{ Mean *float64 } `json:"diff_to_grpo"`
				}
			}
		}
	}
	b, _ := os.ReadFile(filepath.Join(dir, "summary.json"))
	if err := json.Unmarshal(b, &sum); err != nil || sum.Expect.Groups != 8 || sum.Expect.Result.Methods["wmrl"].DiffGRPO.Mean == nil {
		t.Errorf("summary.json's expect: %v %+v", err, sum.Expect)
	}
}

// TestExpectNeedsARanking: a run none of whose anchor groups can be
// ranked (no anchors here) has nothing to place.
func TestExpectNeedsARanking(t *testing.T) {
	rows := biasedRows(t, 16, 0.05)
	for i := range rows {
		rows[i].IsAnchor, rows[i].TrueScore, rows[i].Source = false, nil, archive.SourceWorldModel
	}
	a, err := RunAudit(rows, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Expect(a, archive.Settings{AnchorFraction: 0.1}, ExpectOptions{}); !errors.Is(err, ErrNoRanking) {
		t.Errorf("Expect without anchors: %v; want ErrNoRanking", err)
	}
}

// TestShapeCountsEachGroupOnce: a late anchor group's pairs are rows of
// its group again, not a larger group.
func TestShapeCountsEachGroupOnce(t *testing.T) {
	var rows []archive.Row
	for g, group := range []string{"a", "b", "c"} {
		for i := range 4 {
			rows = append(rows, archive.Row{Step: 7, GroupID: group, Source: archive.SourceWorldModel})
			if g < 2 {
				rows = append(rows, archive.Row{Step: 7, GroupID: group, Source: archive.SourceLateAnchor, TrajID: string(rune('0' + i))})
			}
		}
	}
	var shape shapeAcc
	for _, r := range rows {
		shape.add(r)
	}
	if groups, size := shape.result(); groups != 3 || size != 4 {
		t.Errorf("shape %d groups of %d; want 3 of 4", groups, size)
	}
}
