package offline

import (
	"fmt"
	"image/color"
	"math"
	"math/rand/v2"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/wmrl/wmrl/stages/archive"
)

// ReplayCurves gathers, step by step, what a replay under other settings
// changed, for WriteReplayPlot: each step's rho against the recorded one
// and the share of its rows whose fused advantage kept its sign, and a
// sample of rows' fused advantages, replayed against recorded. It holds
// at most SampleRows rows, whatever the archive's size.
type ReplayCurves struct {
	Steps []ReplayStep
	// Rows is a uniform sample of the replayed world-model and anchor
	// rows (late anchor rows have no fused advantage).
	Rows []FusedPair

	seen int
	rng  *rand.Rand
}

// ReplayStep is one step of ReplayCurves.
type ReplayStep struct {
	Step             int64
	Rho, RecordedRho float64
	SignAgreement    float64
}

// FusedPair is a row's fused advantage as recorded and as replayed.
type FusedPair struct {
	Recorded, Replayed float64
	Anchor             bool
}

// SampleRows is how many rows ReplayCurves keeps for its scatter.
const SampleRows = 4000

// Add takes a replayed step.
func (c *ReplayCurves) Add(r StepReport) {
	if c.rng == nil {
		c.rng = rand.New(rand.NewPCG(1, 2)) // the same sample for the same archive
	}
	c.Steps = append(c.Steps, ReplayStep{Step: r.Step, Rho: r.Rho, RecordedRho: r.RecordedRho, SignAgreement: r.SignAgreement})
	for _, it := range r.Items {
		if it.Row.Source == archive.SourceLateAnchor {
			continue
		}
		p := FusedPair{Recorded: it.Row.FusedAdvantage, Replayed: it.FusedAdvantage, Anchor: it.Anchor}
		c.seen++ // reservoir sampling: each row seen so far is kept with the same chance
		if len(c.Rows) < SampleRows {
			c.Rows = append(c.Rows, p)
		} else if j := c.rng.IntN(c.seen); j < SampleRows {
			c.Rows[j] = p
		}
	}
}

// WriteReplayPlot draws c to path as a PNG of three panels: rho by step,
// replayed against recorded; the share of each step's rows whose fused
// advantage kept its sign; and replayed against recorded fused advantages
// of the sampled rows. changed names the settings replayed.
func WriteReplayPlot(c *ReplayCurves, changed, path string) error {
	steps := slices.Clone(c.Steps)
	slices.SortFunc(steps, func(a, b ReplayStep) int { return int(a.Step - b.Step) }) // absorbed in the run's order, drawn in step order
	var rho, recorded, sign plotter.XYs
	for _, s := range steps {
		rho = append(rho, plotter.XY{X: float64(s.Step), Y: s.Rho})
		recorded = append(recorded, plotter.XY{X: float64(s.Step), Y: s.RecordedRho})
		sign = append(sign, plotter.XY{X: float64(s.Step), Y: 100 * s.SignAgreement})
	}
	top := newPlot("Anchor weight rho, replayed with "+changed+" and as the run recorded it", "step", "rho")
	if err := line(top, "as recorded", recorded, grey, true, false); err != nil {
		return err
	}
	if err := line(top, "replayed", rho, blue, false, false); err != nil {
		return err
	}
	mid := newPlot("Rows whose fused advantage kept its sign", "step", "% of the step's rows")
	mid.Y.Min, mid.Y.Max = 0, 100
	w := max(1, len(sign)/50)
	name := "each step"
	if w > 1 {
		name = fmt.Sprintf("mean of %d steps", w)
	}
	if err := line(mid, name, smooth(sign, w), blue, false, len(sign) <= 60); err != nil {
		return err
	}
	low, err := fusedScatter(c.Rows, c.seen)
	if err != nil {
		return err
	}
	return writeStacked([]*plot.Plot{top, mid, low}, 8*vg.Inch, 4*vg.Inch, path, "replay plot")
}

// fusedScatter draws the sampled rows' fused advantages, replayed against
// recorded, anchors apart, with the diagonal where a row is unchanged.
func fusedScatter(rows []FusedPair, of int) (*plot.Plot, error) {
	which := fmt.Sprintf("all %d rows", of)
	if len(rows) < of {
		which = fmt.Sprintf("%d of the %d rows, drawn at random", len(rows), of)
	}
	p := newPlot("Fused advantage, replayed against recorded: "+which, "recorded", "replayed")
	var wm, anchors plotter.XYs
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, r := range rows {
		xy := plotter.XY{X: r.Recorded, Y: r.Replayed}
		if math.IsNaN(xy.X) || math.IsNaN(xy.Y) || math.IsInf(xy.X, 0) || math.IsInf(xy.Y, 0) {
			continue
		}
		lo, hi = min(lo, xy.X, xy.Y), max(hi, xy.X, xy.Y)
		if r.Anchor {
			anchors = append(anchors, xy)
		} else {
			wm = append(wm, xy)
		}
	}
	if lo > hi {
		return p, nil
	}
	if err := line(p, "unchanged (y = x)", plotter.XYs{{X: lo, Y: lo}, {X: hi, Y: hi}}, grey, true, false); err != nil {
		return nil, err
	}
	for _, s := range []struct {
		name string
		xy   plotter.XYs
		c    color.Color
	}{{"world-model rows", wm, faint}, {"anchor rows", anchors, orange}} {
		if len(s.xy) > 0 {
			if err := dots(p, s.name, s.xy, s.c, vg.Points(1.5)); err != nil {
				return nil, err
			}
		}
	}
	return p, nil
}
