package offline

import (
	"testing"

	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// A report's legend, at the top, sits above the data: a line that starts
// at its top left, where the legend goes, runs under the legend without
// roomForLegend and below it with.
func TestTheLegendSitsAboveTheData(t *testing.T) {
	for _, room := range []bool{false, true} {
		p := newPlot("title", "x", "y")
		for _, name := range []string{"one", "two", "three"} {
			if err := line(p, name, plotter.XYs{{X: 0, Y: 1}, {X: 1, Y: 0}}, blue, false, false); err != nil {
				t.Fatal(err)
			}
		}
		if room {
			roomForLegend(p, plotW, plotH)
		}
		c := draw.Canvas{Rectangle: vg.Rectangle{Max: vg.Point{X: plotW, Y: plotH}}}
		dc := p.DataCanvas(c)
		top := dc.Y(p.Y.Norm(1))                                        // where the line starts
		bottom := dc.Max.Y - p.Legend.Rectangle(draw.Canvas{}).Size().Y // the legend's lowest, at the least
		if under := top > bottom; under == room {
			t.Errorf("room %v: the data's top at %v, the legend's bottom at %v or above", room, top, bottom)
		}
		if ticks := p.Y.Tick.Marker.Ticks(p.Y.Min, p.Y.Max); ticks[len(ticks)-1].Value > 1 {
			t.Errorf("room %v: a tick at %v, above the data", room, ticks[len(ticks)-1].Value)
		}
	}
}
