package rl

import (
	"fmt"
	"image/color"
	"io"
	"path/filepath"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/palette/moreland"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// WriteTable prints a scenario's table.
func WriteTable(w io.Writer, r ScenarioResult, methods []Method) {
	fmt.Fprintf(w, "\n%s: %s\n", r.Scenario, r.Doc)
	fmt.Fprintf(w, "%-15s %17s %19s %9s %6s %7s %5s %17s %19s %8s\n",
		"method", "final reward", "vs grpo (paired)", "cost", "ratio", "execs", "rho", "at wmrl's cost", "vs grpo there", "to target")
	for _, m := range methods {
		x := r.Methods[m.Name]
		toTarget := "never"
		if x.CostToTargetRatio != nil {
			toTarget = fmt.Sprintf("%.2f", *x.CostToTargetRatio)
		}
		fmt.Fprintf(w, "%-15s %8.4f ± %6.4f %+9.4f ± %6.4f %9.0f %6.2f %7.0f %5.2f %8.4f ± %6.4f %+9.4f ± %6.4f %8s\n",
			m.Name, x.FinalReward, x.CI95, x.DiffGRPO.Mean, x.DiffGRPO.CI95, x.Cost, x.CostRatio, x.Executions, x.Rho,
			x.EqualCostReward.Mean, x.EqualCostReward.CI95, x.EqualCostDiff.Mean, x.EqualCostDiff.CI95, toTarget)
	}
	fmt.Fprintf(w, "(to target: the cost to reach %.4f, %.0f%% of grpo's gain over the untrained policy's %.4f, as a share of grpo's cost to reach it; mean curves)\n",
		r.Target, 100*TargetShare, r.Start)
	var longer []string
	ref := r.Methods["wmrl"]
	for _, m := range methods {
		if x := r.Methods[m.Name]; ref != nil && x.TrainedSteps > ref.TrainedSteps {
			longer = append(longer, fmt.Sprintf("%s to step %d", m.Name, x.TrainedSteps))
		}
	}
	if len(longer) > 0 {
		fmt.Fprintf(w, "(cheaper per step than wmrl, trained on to its cost: %s; their other columns are at step %d)\n",
			strings.Join(longer, ", "), ref.TrainedSteps)
	}
}

// WriteSweep prints the sweep as a table: rows are noise levels, columns
// anchor fractions, cells the wmrl-grpo gap at equal steps.
func WriteSweep(w io.Writer, cells []SweepCell) {
	fmt.Fprintf(w, "\nsweep (monotone): final reward of wmrl minus grpo at equal steps\n%-28s", "world model")
	for _, f := range SweepFractions {
		fmt.Fprintf(w, " %15s", fmt.Sprintf("f=%.2f", f))
	}
	for i, c := range cells {
		if i%len(SweepFractions) == 0 {
			fmt.Fprintf(w, "\n%-28s", fmt.Sprintf("noise %.2f, rank corr %.2f", c.Fresh, c.RankCorr))
		}
		fmt.Fprintf(w, " %+7.4f ± %5.4f", c.Gap.Mean, c.Gap.CI95)
	}
	fmt.Fprintln(w)
}

// PlotCurves draws true reward against cost, one line per method.
func PlotCurves(dir string, r ScenarioResult, methods []Method) (string, error) {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("%s: true expected reward vs total cost", r.Scenario)
	p.X.Label.Text = "total cost (trajectory generations, log scale)"
	// Log cost: the methods differ most early, and GRPO's run is 3x longer.
	p.X.Scale, p.X.Tick.Marker = plot.LogScale{}, plot.LogTicks{Prec: -1}
	p.Y.Label.Text = "true expected reward"
	p.Legend.Top, p.Legend.Left = false, false
	var args []any
	for _, m := range methods {
		c := r.Methods[m.Name].Curve
		pts := make(plotter.XYs, len(c))
		for i, pt := range c {
			pts[i].X, pts[i].Y = pt.Cost, pt.Reward
		}
		args = append(args, m.Name, pts)
	}
	if err := plotutil.AddLines(p, args...); err != nil {
		return "", err
	}
	path := filepath.Join(dir, "curves-"+r.Scenario+".png")
	return path, p.Save(8*vg.Inch, 5*vg.Inch, path)
}

type sweepGrid struct{ cells []SweepCell }

func (g sweepGrid) Dims() (c, r int)   { return len(SweepFractions), len(SweepNoise) }
func (g sweepGrid) X(c int) float64    { return float64(c) }
func (g sweepGrid) Y(r int) float64    { return float64(r) }
func (g sweepGrid) Z(c, r int) float64 { return g.cells[r*len(SweepFractions)+c].Gap.Mean }

type labelTicks []string

func (t labelTicks) Ticks(min, max float64) []plot.Tick {
	out := make([]plot.Tick, len(t))
	for i, l := range t {
		out[i] = plot.Tick{Value: float64(i), Label: l}
	}
	return out
}

// PlotSweep draws the sweep as a heat map (rows: the world model's
// within-group rank correlation; columns: anchor fraction).
func PlotSweep(dir string, cells []SweepCell) (string, error) {
	lo, hi := 0.0, 0.0
	for _, c := range cells {
		lo, hi = min(lo, c.Gap.Mean), max(hi, c.Gap.Mean)
	}
	lim := max(-lo, hi, 1e-6)
	pal := moreland.SmoothBlueRed()
	pal.SetMin(-lim)
	pal.SetMax(lim)
	p := plot.New()
	p.Title.Text = "wmrl minus grpo, final true reward at equal steps (monotone)"
	hm := plotter.NewHeatMap(sweepGrid{cells}, pal.Palette(64))
	hm.Min, hm.Max = -lim, lim // 0 is the neutral middle: blue below grpo, red above
	p.Add(hm)
	var xl, yl labelTicks
	for _, f := range SweepFractions {
		xl = append(xl, fmt.Sprintf("%.2f", f))
	}
	for i := range SweepNoise {
		yl = append(yl, fmt.Sprintf("%.2f", cells[i*len(SweepFractions)].RankCorr))
	}
	p.X.Label.Text, p.Y.Label.Text = "anchor fraction", "world model's within-group rank correlation"
	p.X.Tick.Marker, p.Y.Tick.Marker = xl, yl
	for i, c := range cells {
		l, err := plotter.NewLabels(plotter.XYLabels{
			XYs:    []plotter.XY{{X: float64(i % len(SweepFractions)), Y: float64(i / len(SweepFractions))}},
			Labels: []string{fmt.Sprintf("%+.3f", c.Gap.Mean)},
		})
		if err != nil {
			return "", err
		}
		l.TextStyle[0].Color = color.Black
		p.Add(l)
	}
	path := filepath.Join(dir, "sweep.png")
	return path, p.Save(7*vg.Inch, 5*vg.Inch, path)
}
