package offline

import (
	"fmt"
	"image/color"
	"math"
	"os"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// overlapping is the colour of dots many of which may fall on one place
// (the same within-group Spearman, a score of 1): darker where they do.
var overlapping = color.NRGBA{R: 31, G: 119, B: 180, A: 110}

// ReliabilityBins is how many equal bins of the score, over [0, 1], a
// reliability curve has.
const ReliabilityBins = 10

// Reliability is a world model's calibration curve over the executed
// trajectories: for each of ReliabilityBins equal bins of its score with a
// trajectory in it, the mean score (X) against the mean true score (Y). A
// world model whose scores are the true ones lies on y = x; one above it
// under-scores, one below over-scores.
func Reliability(items []EvalItem, score func(EvalItem) *float64) plotter.XYs {
	var sum [ReliabilityBins]struct {
		x, y float64
		n    int
	}
	for _, it := range items {
		s := score(it)
		if s == nil || math.IsNaN(*s) {
			continue
		}
		b := min(max(int(*s*ReliabilityBins), 0), ReliabilityBins-1)
		sum[b].x += *s
		sum[b].y += it.True
		sum[b].n++
	}
	var xy plotter.XYs
	for _, b := range sum {
		if b.n > 0 {
			xy = append(xy, plotter.XY{X: b.x / float64(b.n), Y: b.y / float64(b.n)})
		}
	}
	return xy
}

// WriteEvalPlot draws e to path as a PNG of stacked panels: each anchor
// group's within-group Spearman under model against under the run's world
// model (above the diagonal, model ranks the group better); both world
// models' reliability curves; and, with the claim probe, each trajectory's
// score with the claim against without.
func WriteEvalPlot(e *Eval, model, path string) error {
	ranks := newPlot(fmt.Sprintf("Within-group Spearman of the %d groups both rank: %s %+.3f ± %.3f (2 SE) against the run's",
		e.PairedGroups, model, e.WithinDiff, 2*e.WithinDiffSE), "the run's world model", model)
	var xy plotter.XYs
	for _, g := range e.GroupRanks {
		xy = append(xy, plotter.XY{X: g.Recorded, Y: g.New})
	}
	ranks.X.Min, ranks.X.Max, ranks.Y.Min, ranks.Y.Max = -1.05, 1.05, -1.05, 1.05
	if err := line(ranks, "ranked alike (y = x)", plotter.XYs{{X: -1, Y: -1}, {X: 1, Y: 1}}, grey, true, false); err != nil {
		return err
	}
	if len(xy) > 0 {
		if err := dots(ranks, "an anchor group (darker: several)", xy, overlapping, vg.Points(3)); err != nil {
			return err
		}
	}

	rel := newPlot("Reliability: mean true score by score", "score (mean of its bin, "+fmt.Sprint(ReliabilityBins)+" bins)", "mean true score")
	rel.X.Min, rel.X.Max, rel.Y.Min, rel.Y.Max = 0, 1, 0, 1
	if err := line(rel, "the true score (y = x)", plotter.XYs{{X: 0, Y: 0}, {X: 1, Y: 1}}, grey, true, false); err != nil {
		return err
	}
	for _, s := range []struct {
		name  string
		score func(EvalItem) *float64
		c     color.Color
	}{{"the run's world model", func(it EvalItem) *float64 { return it.Recorded }, orange}, {model, func(it EvalItem) *float64 { return it.New }, blue}} {
		if err := series(rel, s.name, Reliability(e.Items, s.score), s.c); err != nil {
			return err
		}
	}

	plots := []*plot.Plot{ranks, rel}
	if c := e.Claims; c != nil {
		p := newPlot(fmt.Sprintf("%s's score with the claim as the code's last line: %+.3f ± %.3f (2 SE)", model, c.Rise, 2*c.RiseSE),
			"without the claim", "with the claim")
		p.X.Min, p.X.Max, p.Y.Min, p.Y.Max = 0, 1, 0, 1
		var xy plotter.XYs
		for _, it := range e.Items {
			if it.New != nil && it.Claimed != nil {
				xy = append(xy, plotter.XY{X: *it.New, Y: *it.Claimed})
			}
		}
		if err := line(p, "unmoved (y = x)", plotter.XYs{{X: 0, Y: 0}, {X: 1, Y: 1}}, grey, true, false); err != nil {
			return err
		}
		if len(xy) > 0 {
			if err := dots(p, "a trajectory (darker: several)", xy, overlapping, vg.Points(2)); err != nil {
				return err
			}
		}
		plots = append(plots, p)
	}
	return writeStacked(plots, 8*vg.Inch, 4.5*vg.Inch, path, "wm-eval plot")
}

// writeStacked draws plots one above the other, each w by h, to path as a
// PNG; what names the picture in an error.
func writeStacked(plots []*plot.Plot, w, h vg.Length, path, what string) error {
	rows := make([][]*plot.Plot, len(plots))
	for i, p := range plots {
		roomForLegend(p, w, h)
		rows[i] = []*plot.Plot{p}
	}
	img := vgimg.New(w, vg.Length(len(plots))*h)
	canvases := plot.Align(rows, draw.Tiles{Rows: len(rows), Cols: 1, PadY: vg.Points(12), PadTop: vg.Points(6), PadBottom: vg.Points(6),
		PadLeft: vg.Points(6), PadRight: vg.Points(6)}, draw.New(img))
	for i, p := range plots {
		p.Draw(canvases[i][0])
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return fmt.Errorf("%s: %s: %w", what, path, err)
	}
	return f.Close()
}
