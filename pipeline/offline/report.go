package offline

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"html/template"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"slices"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/wmrl/wmrl/connectors/sim/rl"
)

var (
	blue   = color.RGBA{R: 31, G: 119, B: 180, A: 255}
	orange = color.RGBA{R: 255, G: 127, B: 14, A: 255}
	grey   = color.RGBA{R: 120, G: 120, B: 120, A: 255}
	green  = color.RGBA{R: 44, G: 160, B: 44, A: 255}
	faint  = color.NRGBA{R: 31, G: 119, B: 180, A: 60}
)

// WriteReport writes the audit to dir: index.html (self-contained, the
// plots inline), the plots as PNG files, and summary.json.
func WriteReport(a *Audit, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("audit: %w", err)
	}
	plots := []struct {
		name, title string
		make        func(*Audit) (*plot.Plot, error)
	}{
		{"reliability.png", "Reliability: predicted vs true on anchors", plotReliability},
		{"bias.png", "Bias by score level", plotBias},
		{"coverage.png", "Anchor coverage by score level", plotCoverage},
		{"drift.png", "Residual over steps", plotDrift},
		{"ranks.png", "Within-group rank correlation over steps", plotRanks},
		{"rho.png", "rho and D over steps", plotRho},
	}
	if a.Length != nil {
		plots = append(plots, struct {
			name, title string
			make        func(*Audit) (*plot.Plot, error)
		}{"length.png", "Residual by solution length", plotLength})
	}
	if a.Executions != nil {
		plots = append(plots, struct {
			name, title string
			make        func(*Audit) (*plot.Plot, error)
		}{"exec-times.png", "Anchors' execution times against the deadline", plotExecTimes})
	}
	type img struct{ Name, Title, Data string }
	var imgs []img
	for _, pl := range plots {
		p, err := pl.make(a)
		if err != nil {
			return fmt.Errorf("audit: %s: %w", pl.name, err)
		}
		roomForLegend(p, plotW, plotH)
		path := filepath.Join(dir, pl.name)
		if err := p.Save(plotW, plotH, path); err != nil {
			return fmt.Errorf("audit: %s: %w", pl.name, err)
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		imgs = append(imgs, img{pl.name, pl.title, base64.StdEncoding.EncodeToString(data)})
	}
	var expect []expectRow
	if e := a.Expect; e != nil {
		path, err := rl.PlotCurves(dir, e.Result, e.Methods)
		if err != nil {
			return fmt.Errorf("audit: expected curves: %w", err)
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		imgs = append(imgs, img{filepath.Base(path), "What to expect (wmrl sim at this world model): true reward against cost", base64.StdEncoding.EncodeToString(data)})
		for _, m := range e.Methods {
			expect = append(expect, expectRow{m.Name, e.Result.Methods[m.Name]})
		}
	}
	js, err := json.MarshalIndent(a, "", "  ")
	if err != nil {
		return fmt.Errorf("audit: summary: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "summary.json"), append(js, '\n'), 0o644); err != nil {
		return err
	}
	f, err := os.Create(filepath.Join(dir, "index.html"))
	if err != nil {
		return err
	}
	err = page.Execute(f, struct {
		A      *Audit
		Imgs   []img
		Expect []expectRow
	}{a, imgs, expect})
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// expectRow is one method of the report's "what to expect" table.
type expectRow struct {
	Name string
	*rl.MethodResult
}

// The report's plots are drawn plotW by plotH.
const plotW, plotH = 7 * vg.Inch, 4.2 * vg.Inch

// roomForLegend raises the top of p's y axis, once its data are added, so
// that its legend (at the top) sits above them when p is drawn w by h: no
// line, point or bar runs under it. The ticks stay within the data's range.
func roomForLegend(p *plot.Plot, w, h vg.Length) {
	legend := p.Legend.Rectangle(draw.Canvas{}).Size().Y
	if !p.Legend.Top || legend == 0 {
		return
	}
	data := p.DataCanvas(draw.Canvas{Rectangle: vg.Rectangle{Max: vg.Point{X: w, Y: h}}}).Size().Y
	top := p.Y.Max
	if data <= 0 || top <= p.Y.Min {
		return
	}
	share := min(0.5, float64((legend+p.Legend.Padding)/data)+0.02) // of the axis, the legend's
	p.Y.Max = top + (top-p.Y.Min)*share/(1-share)
	p.Y.Tick.Marker = ticksUpTo{p.Y.Tick.Marker, top}
}

// ticksUpTo marks the axis as its Ticker would up to top: the ticks of
// the data's range, none in the legend's room above it.
type ticksUpTo struct {
	plot.Ticker
	top float64
}

func (t ticksUpTo) Ticks(min, _ float64) []plot.Tick { return t.Ticker.Ticks(min, t.top) }

func newPlot(title, x, y string) *plot.Plot {
	p := plot.New()
	p.Title.Text, p.X.Label.Text, p.Y.Label.Text = title, x, y
	p.Legend.Top, p.Legend.Left = true, true
	p.Add(plotter.NewGrid())
	return p
}

func line(p *plot.Plot, name string, xy plotter.XYs, c color.Color, dashed, points bool) error {
	l, err := plotter.NewLine(xy)
	if err != nil {
		return err
	}
	l.Color, l.Width = c, vg.Points(1.5)
	if dashed {
		l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
	}
	p.Add(l)
	if name != "" {
		p.Legend.Add(name, l)
	}
	if points {
		return dots(p, "", xy, c, vg.Points(2.5))
	}
	return nil
}

// dots draws xy as circles of radius r, named in the legend unless name
// is empty.
func dots(p *plot.Plot, name string, xy plotter.XYs, c color.Color, r vg.Length) error {
	s, err := plotter.NewScatter(xy)
	if err != nil {
		return err
	}
	s.GlyphStyle.Color, s.GlyphStyle.Shape, s.GlyphStyle.Radius = c, draw.CircleGlyph{}, r
	p.Add(s)
	if name != "" {
		p.Legend.Add(name, s)
	}
	return nil
}

// series draws the finite points of xy as a line with its points, if
// any are.
func series(p *plot.Plot, name string, xy plotter.XYs, c color.Color) error {
	if f := finite(xy); len(f) > 0 {
		return line(p, name, f, c, false, true)
	}
	return nil
}

// finite drops points with a NaN coordinate.
func finite(xy plotter.XYs) plotter.XYs {
	out := xy[:0:0]
	for _, p := range xy {
		if !math.IsNaN(p.X) && !math.IsNaN(p.Y) {
			out = append(out, p)
		}
	}
	return out
}

func plotReliability(a *Audit) (*plot.Plot, error) {
	p := newPlot("Reliability (anchors)", "world model's predicted score", "true score")
	step := max(1, len(a.pairs)/4000)
	var pts plotter.XYs
	for i := 0; i < len(a.pairs); i += step {
		pts = append(pts, plotter.XY{X: a.pairs[i].pred, Y: a.pairs[i].truth})
	}
	if len(pts) > 0 {
		if err := dots(p, fmt.Sprintf("anchor pairs (%d shown)", len(pts)), pts, faint, vg.Points(1.5)); err != nil {
			return nil, err
		}
	}
	lo, hi := a.Overall.Levels[0].Lo, a.Overall.Levels[len(a.Overall.Levels)-1].Hi
	if err := line(p, "ideal (y = x)", plotter.XYs{{X: lo, Y: lo}, {X: hi, Y: hi}}, grey, true, false); err != nil {
		return nil, err
	}
	var means plotter.XYs
	for _, l := range a.Overall.Levels {
		means = append(means, plotter.XY{X: float64(l.MeanPredicted), Y: float64(l.MeanTrue)})
	}
	if err := series(p, "mean true per score bin", means, orange); err != nil {
		return nil, err
	}
	if len(a.MapX) > 0 {
		xy := make(plotter.XYs, len(a.MapX))
		for i := range a.MapX {
			xy[i] = plotter.XY{X: a.MapX[i], Y: a.MapY[i]}
		}
		if err := line(p, "isotonic map fitted on all pairs", xy, blue, false, false); err != nil {
			return nil, err
		}
	}
	return p, nil
}

func plotBias(a *Audit) (*plot.Plot, error) {
	p := newPlot("Mean residual (score - true) by score level", "world model's predicted score (bin centre)", "mean residual")
	var before, after, mono plotter.XYs
	for _, l := range a.Overall.Levels {
		c := (l.Lo + l.Hi) / 2
		before = append(before, plotter.XY{X: c, Y: float64(l.ResidualBefore)})
		after = append(after, plotter.XY{X: c, Y: float64(l.ResidualAfter)})
		mono = append(mono, plotter.XY{X: c, Y: float64(l.ResidualMonotone)})
	}
	lo, hi := a.Overall.Levels[0].Lo, a.Overall.Levels[len(a.Overall.Levels)-1].Hi
	tol := a.Options.Tolerance
	for _, y := range []float64{tol, -tol} {
		if err := line(p, "", plotter.XYs{{X: lo, Y: y}, {X: hi, Y: y}}, grey, true, false); err != nil {
			return nil, err
		}
	}
	if err := line(p, "", plotter.XYs{{X: lo, Y: 0}, {X: hi, Y: 0}}, grey, false, false); err != nil {
		return nil, err
	}
	if err := series(p, "raw world model", before, orange); err != nil {
		return nil, err
	}
	if err := series(p, "the run's maps, as recorded", after, blue); err != nil {
		return nil, err
	}
	if err := series(p, "one monotone map, cross-fitted", mono, green); err != nil {
		return nil, err
	}
	return p, nil
}

func plotLength(a *Audit) (*plot.Plot, error) {
	p := newPlot("Mean residual (score - true) by solution length", "mean length of the band's responses (bytes)", "mean residual")
	var before, mono plotter.XYs
	for _, l := range a.Length.Levels {
		before = append(before, plotter.XY{X: l.MeanBytes, Y: float64(l.ResidualBefore)})
		mono = append(mono, plotter.XY{X: l.MeanBytes, Y: float64(l.ResidualMonotone)})
	}
	if len(before) > 0 {
		lo, hi := before[0].X, before[len(before)-1].X
		if err := line(p, "", plotter.XYs{{X: lo, Y: 0}, {X: hi, Y: 0}}, grey, false, false); err != nil {
			return nil, err
		}
	}
	if err := series(p, "raw world model", before, orange); err != nil {
		return nil, err
	}
	if err := series(p, "one monotone map, cross-fitted", mono, green); err != nil {
		return nil, err
	}
	return p, nil
}

func plotCoverage(a *Audit) (*plot.Plot, error) {
	p := newPlot("Anchor coverage: executed share of predictions per score bin", "bin", "anchor pairs / predictions")
	v := make(plotter.Values, len(a.Overall.Levels))
	names := make([]string, len(a.Overall.Levels))
	for i, l := range a.Overall.Levels {
		v[i] = l.Coverage
		names[i] = fmt.Sprintf("%.2f", (l.Lo+l.Hi)/2)
	}
	b, err := plotter.NewBarChart(v, vg.Points(20))
	if err != nil {
		return nil, err
	}
	b.Color = blue
	p.Add(b)
	p.NominalX(names...)
	return p, nil
}

// smooth is a trailing moving average over w points, skipping NaNs.
func smooth(xy plotter.XYs, w int) plotter.XYs {
	out := make(plotter.XYs, 0, len(xy))
	for i := range xy {
		var s float64
		n := 0
		for j := max(0, i-w+1); j <= i; j++ {
			if !math.IsNaN(xy[j].Y) {
				s += xy[j].Y
				n++
			}
		}
		if n > 0 {
			out = append(out, plotter.XY{X: xy[i].X, Y: s / float64(n)})
		}
	}
	return out
}

func plotDrift(a *Audit) (*plot.Plot, error) {
	w := max(1, len(a.Drift)/50)
	p := newPlot(fmt.Sprintf("Mean anchor residual per step (moving average of %d)", w), "step", "mean residual")
	var before, after plotter.XYs
	for _, s := range a.Drift {
		before = append(before, plotter.XY{X: float64(s.Step), Y: float64(s.ResidualBefore)})
		after = append(after, plotter.XY{X: float64(s.Step), Y: float64(s.ResidualAfter)})
	}
	if b := smooth(before, w); len(b) > 1 {
		if err := line(p, "raw world model", b, orange, false, false); err != nil {
			return nil, err
		}
	}
	if af := smooth(after, w); len(af) > 1 {
		if err := line(p, "after calibration (out of sample)", af, blue, false, false); err != nil {
			return nil, err
		}
	}
	return p, nil
}

func plotRanks(a *Audit) (*plot.Plot, error) {
	w := max(1, len(a.Drift)/50)
	p := newPlot(fmt.Sprintf("World model's within-group Spearman on anchors per step (moving average of %d)", w), "step", "Spearman")
	var xy plotter.XYs
	for _, s := range a.Drift {
		xy = append(xy, plotter.XY{X: float64(s.Step), Y: float64(s.WithinSpearman)})
	}
	if r := smooth(xy, w); len(r) > 1 {
		if err := line(p, "within-group Spearman", r, blue, false, false); err != nil {
			return nil, err
		}
	}
	p.Y.Min, p.Y.Max = -1, 1
	return p, nil
}

func plotRho(a *Audit) (*plot.Plot, error) {
	p := newPlot("Anchor weight rho and world-model disagreement D", "step", "")
	var rho, d plotter.XYs
	for _, s := range a.Drift {
		rho = append(rho, plotter.XY{X: float64(s.Step), Y: s.Rho})
		d = append(d, plotter.XY{X: float64(s.Step), Y: s.D})
	}
	if len(rho) > 1 {
		if err := line(p, "rho", rho, blue, false, false); err != nil {
			return nil, err
		}
		if err := line(p, "D", d, orange, false, false); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// plotExecTimes draws the share of executions, and of anchor groups by
// their slowest execution, ended within each time, with the deadline. A
// spread as real executions have (the longest ten times the median or
// more) gets a log axis, on which both the bulk and the tail show.
func plotExecTimes(a *Audit) (*plot.Plot, error) {
	e := a.Executions
	ax := execAxisOf(e)
	label := "seconds (exec_seconds: not counting the wait for a slot)"
	if ax.log {
		label += ", log scale"
	}
	p := newPlot("Share of anchor executions ended within a time", label, "share ended")
	p.X.Min, p.X.Max = ax.min, ax.max
	if ax.log {
		p.X.Scale, p.X.Tick.Marker = plot.LogScale{}, plot.LogTicks{Prec: -1}
	}
	cdf := func(xs []float64) plotter.XYs {
		xy := make(plotter.XYs, 0, 2*len(xs)+2)
		xy = append(xy, plotter.XY{X: ax.min, Y: 0})
		for i, x := range xs { // a step up at each value; on a log axis, 0 s at its left end
			x = max(x, ax.min)
			xy = append(xy, plotter.XY{X: x, Y: float64(i) / float64(len(xs))}, plotter.XY{X: x, Y: float64(i+1) / float64(len(xs))})
		}
		return append(xy, plotter.XY{X: ax.max, Y: 1})
	}
	if len(e.each) > 0 {
		if err := line(p, "each execution", cdf(e.each), faint, false, false); err != nil {
			return nil, err
		}
	}
	if len(e.slowest) > 0 {
		if err := line(p, "each anchor group's slowest", cdf(e.slowest), blue, false, false); err != nil {
			return nil, err
		}
	}
	if e.Deadline > 0 {
		if err := line(p, "--anchor-deadline "+time.Duration(e.Deadline*float64(time.Second)).Round(time.Millisecond).String(), plotter.XYs{{X: e.Deadline, Y: 0}, {X: e.Deadline, Y: 1}}, orange, true, false); err != nil {
			return nil, err
		}
	}
	p.Y.Min, p.Y.Max = 0, 1
	return p, nil
}

// execAxis is the x axis of the execution-times plot: from 0 (or, on a log
// axis, below the shortest time) to past the longest time and the
// deadline, so that neither runs along the plot's edge.
type execAxis struct {
	log      bool
	min, max float64
}

func execAxisOf(e *ExecTimes) execAxis {
	hi, lo := e.Deadline, math.Inf(1)
	if e.Deadline > 0 {
		lo = e.Deadline
	}
	for _, xs := range [][]float64{e.each, e.slowest} {
		if len(xs) == 0 {
			continue
		}
		hi = max(hi, xs[len(xs)-1])
		if i, _ := slices.BinarySearch(xs, math.SmallestNonzeroFloat64); i < len(xs) {
			lo = min(lo, xs[i]) // the shortest time above 0
		}
	}
	switch {
	case hi <= 0:
		return execAxis{min: 0, max: 1}
	case e.Seconds.Median > 0 && hi >= 10*e.Seconds.Median && lo < hi:
		return execAxis{log: true, min: lo / 1.5, max: hi * 1.5}
	}
	return execAxis{min: 0, max: hi * 1.08}
}

func fmtNum(n Num) string {
	if math.IsNaN(float64(n)) {
		return "–"
	}
	return fmt.Sprintf("%.3f", float64(n))
}

var page = template.Must(template.New("audit").Funcs(template.FuncMap{
	"num": fmtNum,
	"f3":  func(f float64) string { return fmt.Sprintf("%.3f", f) },
	"sf3": func(f float64) string { return fmt.Sprintf("%+.3f", f) },
	"pct": func(f float64) string { return fmt.Sprintf("%.1f%%", 100*f) },
	"npct": func(n Num) string {
		if math.IsNaN(float64(n)) {
			return "n/a"
		}
		return fmt.Sprintf("%.1f%%", 100*float64(n))
	},
	"x2":  func(n Num) Num { return 2 * n },
	"few": func() int { return FewLengths },
	"cls": func(v string) string {
		switch v {
		case VerdictCalibrated:
			return "good"
		case VerdictCorrected:
			return "fixed"
		case VerdictNonMonotone, VerdictTaskSpecific, LengthOverrated, LengthUnderrated:
			return "bad"
		case LengthNone:
			return "good"
		}
		return "none"
	},
}).Parse(`<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>wmrl audit: run {{.A.Run}}</title>
<style>
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222;padding:0 1em}
h1{font-size:1.6em}h2{font-size:1.25em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}th{background:#f3f3f3}
td.l,th.l{text-align:left}
.good{background:#e3f4e1}.fixed{background:#fff4d6}.bad{background:#fbe0e0}.none{background:#eee}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:1em}
figure{margin:0}figure img{width:100%;border:1px solid #ddd}figcaption{font-size:.85em;color:#555}
.note{color:#555;font-size:.9em}
</style></head><body>
<h1>World-model bias audit: run <code>{{.A.Run}}</code></h1>
<p>{{.A.Rows}} rows over {{.A.Steps}} steps{{with .A.Options.Steps}} ({{.}} of the run alone){{end}}; {{.A.Pairs}} anchor pairs (predicted and true){{if .A.LatePairs}}, of which {{.A.LatePairs}} from anchors late for their step{{end}}; {{.A.Ungraded}} ungraded predictions.
{{if gt (len .A.WorldModels) 1}}World models: {{range $i, $m := .A.WorldModels}}{{if $i}}, {{end}}<code>{{or $m.Model "not recorded"}}</code> (steps {{$m.FirstStep}}-{{$m.LastStep}}: {{$m.Rows}} rows, {{$m.Pairs}} anchor pairs){{end}};
this audit measures them together, as if one: <code>wmrl audit --wm-model NAME</code> audits one alone.
{{else}}{{range .A.WorldModels}}World model: <code>{{or .Model "not recorded"}}</code>.
{{end}}{{end}}{{with .A.Builds}}Written by {{range $i, $b := .}}{{if $i}}, then {{end}}{{if $b}}wmrl <code>{{$b}}</code>{{else}}a build from before the archive kept it{{end}}{{end}}.
{{end}}Overall rank agreement: Spearman {{num .A.Overall.Ranks.Spearman}}, Kendall {{num .A.Overall.Ranks.Kendall}};
within groups (what GRPO's advantages depend on): Spearman {{num .A.Overall.Ranks.WithinSpearman}}, Kendall {{num .A.Overall.Ranks.WithinKendall}} over {{.A.Overall.Ranks.Groups}} groups.
Overall verdict: <span class="{{cls .A.Overall.Verdict}}"><b>{{.A.Overall.Verdict}}</b></span>.</p>

<h2>Verdict per task</h2>
<p class="note">A score level counts when it holds at least {{.A.Options.MinBinPairs}} anchor pairs; a residual within ±{{.A.Options.Tolerance}} counts as unbiased.
The verdicts judge the world model, not the run's warm-up: "after" is one isotonic map for the run, as the pipeline fits,
cross-fitted (the anchor groups split in two halves, each scored by the map the other half trained).
<i>calibrated well</i>: every level unbiased before calibration. <i>monotone bias corrected</i>: biased before, unbiased after that map.
<i>task-specific bias</i>: the run's map leaves the task biased, a map fitted on the task alone would not: its bias differs from the other tasks'.
<i>non-monotone bias</i>: levels stay biased even after a map of the task's own, which no monotone map can fix (for example one style over-scored whatever its quality).
"Recorded" is the run's own maps as the steps used them, the flat or identity map before the first fit included.</p>
<table><tr><th class="l">task</th><th>pairs</th><th>max |residual| before</th><th>run's map</th><th>own map</th><th>recorded</th><th>Spearman</th><th>Kendall</th><th>within-group Kendall</th><th class="l">verdict</th></tr>
{{range .A.Tasks}}<tr><td class="l">{{.Task}}</td><td>{{.Pairs}}</td><td>{{f3 .MaxBefore}}</td><td>{{f3 .MaxMonotone}}</td><td>{{f3 .MaxOwn}}</td><td>{{f3 .MaxAfter}}</td><td>{{num .Ranks.Spearman}}</td><td>{{num .Ranks.Kendall}}</td><td>{{num .Ranks.WithinKendall}}</td><td class="l {{cls .Verdict}}">{{.Verdict}}</td></tr>
{{end}}</table>

{{with .A.Expect}}<h2>What to expect</h2>
<p><code>wmrl sim</code>'s training runs on a simulated world model whose error is set so that it ranks within groups as this run's did on its anchors
(within-group Spearman {{f3 .RankCorr}} over {{.Measured}}; the simulated one's {{f3 .SimRankCorr}} over uniformly drawn solutions, from fresh noise {{f3 .Fresh}} and an error per task and style of {{f3 .Persistent}}{{if .Reversed}}, better solutions scored lower{{end}}{{if .Note}}: {{.Note}}{{end}}),
with this run's groups per step, group size and recorded correction settings, on {{.Seeds}} seeds (paired).
Rewards are the simulated policy's true expected reward in [0, 1]; intervals are 95%.
Over all their steps an audit of the simulated run measures {{f3 .SimAuditedRankCorr}}, this one {{num $.A.Overall.Ranks.WithinSpearman}}:
a learning policy's groups grow alike, which lowers the correlation however good the world model (the simulated policy's become copies of one solution,
whose scores differ by execution noise alone), so the run's earliest groups, its most varied, place it.</p>
<table><tr><th class="l">method</th><th>final reward</th><th>vs grpo (paired)</th><th>cost ratio to grpo</th><th>rho</th><th>at wmrl's cost</th><th>vs grpo there</th></tr>
{{range $.Expect}}<tr><td class="l">{{.Name}}</td><td>{{f3 .FinalReward}} ± {{f3 .CI95}}</td><td>{{sf3 .DiffGRPO.Mean}} ± {{f3 .DiffGRPO.CI95}}</td><td>{{printf "%.2f" .CostRatio}}</td><td>{{printf "%.2f" .Rho}}</td><td>{{f3 .EqualCostReward.Mean}} ± {{f3 .EqualCostReward.CI95}}</td><td>{{sf3 .EqualCostDiff.Mean}} ± {{f3 .EqualCostDiff.CI95}}</td></tr>
{{end}}</table>
<p class="note">grpo executes every group; grpo-anchors executes only as many groups as wmrl does and trains on them alone (what wmrl falls back to);
wm trains on the raw world model. The simulated learner is not your model: the benchmark's learners (SGD or Adam, parameters per task or shared)
differ in how much the world-model groups add (README, "What the corrections buy"). Read this as what a world model that ranks this well does in that
benchmark, and settle it on your setup by training on the same executions with and without the world-model groups.</p>
{{end}}
{{if .A.Outcomes}}<h2>Execution outcomes</h2>
<p class="note">The anchor pairs by how their execution ended; invalid_submission, crashed and timed_out all score 0.
The world model tells those that failed from those that scored with AUC {{num .A.FailureAUC}} (0.5: not at all, 1: every failure predicted below every success).
A world model that does not see failures coming scores them as if they ran, and its error on them is no monotone distortion a map can remove.</p>
<table><tr><th class="l">status</th><th>anchor pairs</th><th>share</th><th>mean predicted</th><th>mean true</th></tr>
{{range .A.Outcomes}}<tr><td class="l">{{.Status}}</td><td>{{.Pairs}}</td><td>{{pct .Share}}</td><td>{{num .MeanPredicted}}</td><td>{{num .MeanTrue}}</td></tr>
{{end}}</table>
{{if .A.Causes}}<h3>Failures by cause</h3>
<p class="note">The failed anchor pairs by what their executions' details say went wrong (a crash's last line of stderr, the signal or limit that ended it, what the grader refused), numbers as N;
most frequent first{{if .A.OtherCauses}}, {{.A.OtherCauses}} rarer kinds left out{{end}}. A cause the world model scores high is one it does not see coming:
a missing package or a limit belongs to the sandbox, not the policy, and a fix there is worth more than any map.</p>
<table><tr><th class="l">cause</th><th class="l">status</th><th>pairs</th><th>share of failures</th><th>mean predicted</th><th class="l">first seen (step, group, trajectory): detail as recorded</th></tr>
{{range .A.Causes}}<tr><td class="l">{{.Cause}}</td><td class="l">{{.Status}}</td><td>{{.Pairs}}</td><td>{{pct .Share}}</td><td>{{num .MeanPredicted}}</td><td class="l"><small>{{.Step}}, {{.GroupID}}, {{.TrajID}}: {{.Example}}</small></td></tr>
{{end}}</table>
{{end}}{{if .A.FailuresWithoutDetail}}<p class="note">{{.A.FailuresWithoutDetail}} failed anchor pairs have no detail recorded (an archive written before the exec_detail column, or an executor that says nothing).</p>
{{end}}{{end}}{{if .A.Verdicts}}<h2>What the world model said would happen</h2>
<p class="note">The anchor pairs by the status the world model predicted and the one their execution ended in. A failure it calls "scored" is one it does not see coming.</p>
<table><tr><th class="l">predicted</th><th class="l">execution</th><th>anchor pairs</th></tr>
{{range .A.Verdicts}}<tr><td class="l">{{.Predicted}}</td><td class="l">{{.Actual}}</td><td>{{.Pairs}}</td></tr>
{{end}}</table>
{{end}}{{if .A.Misses}}<h2>Largest misses</h2>
<p class="note">The anchor pairs whose raw world-model score was furthest from the true score, with what the world model said and how the execution ended.</p>
<table><tr><th>step</th><th class="l">group, trajectory</th><th class="l">task</th><th>predicted</th><th>true</th><th class="l">execution</th><th class="l">world model</th></tr>
{{range .A.Misses}}<tr><td>{{.Step}}</td><td class="l">{{.GroupID}}, {{.TrajID}}</td><td class="l">{{.TaskID}}</td><td>{{f3 .Predicted}}</td><td>{{f3 .True}}</td><td class="l">{{.ExecStatus}}{{if .Cause}}: {{.Cause}}{{end}}</td><td class="l">{{.WMVerdict}}{{if .WMRationale}}: <small>{{.WMRationale}}</small>{{end}}</td></tr>
{{end}}</table>
{{end}}{{with .A.Executions}}<h2>Execution times</h2>
<p class="note">How long the anchors' executions took (exec_seconds): {{.Executions}} recorded, {{.Own}} of them in the first row, which leaves out {{if .Copies}}the {{.Copies}} that took an identical solution's outcome, and {{end}}sandbox errors (a service that is down gives them at once; the table by status has them).
A step waits for an anchor group until its slowest execution has ended and its pairs are calibrated, or until <code>--anchor-deadline</code>, after which the group is late: fused on the world model for its step, its pairs calibrated when they come.
{{.LateGroups}} of the run's {{.AnchorGroups}} anchor groups were late{{if gt .Deadline 0.0}}; the deadline was {{.Deadline}} s, and {{npct .WithinDeadline}} of the {{.Groups}} groups with every time recorded had their slowest execution end within it{{end}}.{{with .LateAfterFused}}
The {{$.A.Executions.LateTimed}} late groups with late rows were calibrated a median {{f3 .Median}} s after their step's update (p90 {{f3 .P90}} s, max {{f3 .Max}} s): a step held only by its late groups is fused at the deadline, so a deadline longer by {{f3 .P90}} s would have let 90% of them in, holding each such step that much longer.{{end}}
These times leave out the wait for a slot (<code>--exec-slots</code>), for the group's prediction and for its calibration, so a deadline needs room above them.</p>
<table><tr><th class="l"></th><th>count</th><th>median (s)</th><th>p90</th><th>p95</th><th>p99</th><th>max</th></tr>
<tr><td class="l">each execution</td><td>{{.Own}}</td><td>{{f3 .Seconds.Median}}</td><td>{{f3 .Seconds.P90}}</td><td>{{f3 .Seconds.P95}}</td><td>{{f3 .Seconds.P99}}</td><td>{{f3 .Seconds.Max}}</td></tr>
<tr><td class="l">each anchor group's slowest</td><td>{{.Groups}}</td><td>{{f3 .Slowest.Median}}</td><td>{{f3 .Slowest.P90}}</td><td>{{f3 .Slowest.P95}}</td><td>{{f3 .Slowest.P99}}</td><td>{{f3 .Slowest.Max}}</td></tr>
</table>
<table><tr><th class="l">execution ended</th><th>executions</th><th>median (s)</th><th>max (s)</th></tr>
{{range .ByStatus}}<tr><td class="l">{{.Status}}</td><td>{{.Executions}}</td><td>{{f3 .Median}}</td><td>{{f3 .Max}}</td></tr>
{{end}}</table>
{{end}}{{with .A.Length}}<h2>Bias by solution length</h2>
<p class="note">The anchor pairs by the length of their solution ({{.Pairs}} with the length archived), in five bands of equal pairs.
An LLM judge that rates longer solutions higher, whatever they score, makes an error no monotone map of its score removes: within a group it ranks the longer solutions up, and GRPO then teaches the policy to write longer.
Within the anchor groups, the rank correlation between a solution's length and its residual after one monotone map (cross-fitted) is {{num .WithinSpearman}} ± {{num (x2 .SE)}} (2 SE) over {{.Groups}} groups:
<span class="{{cls .Verdict}}"><b>{{.Verdict}}</b></span>.{{if lt .Distinct few}}
Only {{.Distinct}} distinct lengths: a length here stands for which solution it is, so this may be a bias by solution rather than by length.{{end}}</p>
<table><tr><th>bytes</th><th>anchor pairs</th><th>mean bytes</th><th>residual before</th><th>after one monotone map</th></tr>
{{range .Levels}}<tr><td>{{index .Bytes 0}} to {{index .Bytes 1}}</td><td>{{.Pairs}}</td><td>{{printf "%.0f" .MeanBytes}}</td><td>{{num .ResidualBefore}}</td><td>{{num .ResidualMonotone}}</td></tr>
{{end}}</table>
{{end}}<h2>Plots</h2>
<div class="grid">{{range .Imgs}}<figure><img alt="{{.Title}}" src="data:image/png;base64,{{.Data}}"><figcaption>{{.Title}} ({{.Name}})</figcaption></figure>
{{end}}</div>

<h2>Bias by score level (all tasks)</h2>
<table><tr><th>predicted in</th><th>anchor pairs</th><th>predictions</th><th>coverage</th><th>mean predicted</th><th>mean true</th><th>residual before</th><th>monotone map</th><th>recorded</th></tr>
{{range .A.Overall.Levels}}<tr><td>[{{f3 (index .Range 0)}}, {{f3 (index .Range 1)}})</td><td>{{.Pairs}}</td><td>{{.Predictions}}</td><td>{{pct .Coverage}}</td><td>{{num .MeanPredicted}}</td><td>{{num .MeanTrue}}</td><td>{{num .ResidualBefore}}</td><td>{{num .ResidualMonotone}}</td><td>{{num .ResidualAfter}}</td></tr>
{{end}}</table>
<p class="note">Residual = score − true, on anchors. "Monotone map": the cross-fitted map of the verdicts. "Recorded": each anchor's out-of-sample calibrated score as the run computed it (the map before its own pairs were absorbed).
The machine-readable summary is summary.json beside this page.</p>
</body></html>
`))
