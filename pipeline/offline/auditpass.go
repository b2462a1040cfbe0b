package offline

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/fuse"
)

// This file is the audit's second read of the rows (what it keeps of each)
// and its summing up into the report's figures.

// levels are the audit's equal-width bins of the world model's score over
// the range its first read found.
type levels struct {
	lo, hi float64
	n      int
}

// of is the level of score x.
func (l levels) of(x float64) int { return min(int(float64(l.n)*(x-l.lo)/(l.hi-l.lo)), l.n-1) }

// bounds are level i's [lo, hi).
func (l levels) bounds(i int) (lo, hi float64) {
	return l.lo + (l.hi-l.lo)*float64(i)/float64(l.n), l.lo + (l.hi-l.lo)*float64(i+1)/float64(l.n)
}

// taskAcc is what the pass keeps of a task, or of the whole run.
type taskAcc struct {
	pairs       []pairRow            // the run's; a task's only while it is summed up
	of          []int32              // a task's: its pairs' places in the run's, in the order they came
	predictions []int                // graded predictions by level
	groups      map[string]*groupAcc // a group's accumulator is its task's and the run's
	order       []*groupAcc          // groups as they first came: means sum in it, the same every time
}

func newTaskAcc(lv levels) *taskAcc {
	return &taskAcc{predictions: make([]int, lv.n), groups: map[string]*groupAcc{}}
}

// stepAcc is what the pass keeps of a step.
type stepAcc struct {
	n                     int // anchor pairs
	before, after, d, rho float64
	seen                  bool // d and rho are the step's
	groups                []*groupAcc
}

// latePair is a late anchor's pair, whose length is on its world-model row.
type latePair struct {
	i   int // in the run's pairs
	key trajKey
}

// auditPass is the audit's second read. It keeps the anchor pairs' scores,
// each anchor execution's time, the largest misses so far and the
// measures' sums, not the rows.
type auditPass struct {
	a          *Audit
	lv         levels
	all        *taskAcc
	tasks      map[string]*taskAcc
	steps      map[int64]*stepAcc
	outcomes   map[string]*Outcome
	causes     causeCounter
	failPred   []float64 // each executed pair's prediction, and whether its execution failed
	failed     []bool
	latePairs  []latePair
	lateLength map[trajKey]int64 // late anchors' lengths, from their world-model rows
	misses     *missAcc
	execs      *execAcc
	shape      shapeAcc
	models     map[string]*WorldModelUse
	read       int
}

func newAuditPass(a *Audit, lv levels) *auditPass {
	return &auditPass{a: a, lv: lv, all: newTaskAcc(lv), tasks: map[string]*taskAcc{}, steps: map[int64]*stepAcc{},
		outcomes: map[string]*Outcome{}, lateLength: map[trajKey]int64{}, misses: newMissAcc(), execs: newExecAcc(),
		models: map[string]*WorldModelUse{}}
}

// add takes one row.
func (p *auditPass) add(r archive.Row) {
	a := p.a
	p.read++
	p.misses.add(r)
	p.execs.add(r)
	p.shape.add(r)
	if r.ResponseBytes != nil && r.Source == archive.SourceWorldModel && r.IsAnchor {
		p.lateLength[missKey(r)] = *r.ResponseBytes
	}
	t := p.tasks[r.TaskID]
	if t == nil {
		t = newTaskAcc(p.lv)
		p.tasks[r.TaskID] = t
	}
	s := p.steps[r.Step]
	if s == nil {
		s = &stepAcc{}
		p.steps[r.Step] = s
	}
	if r.Source != archive.SourceLateAnchor && !s.seen {
		s.d, s.rho, s.seen = r.D, r.Rho, true
	}
	m := p.model(r)
	if m != nil && r.Source != archive.SourceLateAnchor {
		m.Rows++
	}
	if r.Predicted == nil {
		if r.Source != archive.SourceLateAnchor { // else counted on its world-model row
			a.Ungraded++
		}
		return
	}
	if r.Source != archive.SourceLateAnchor {
		b := p.lv.of(*r.Predicted)
		p.all.predictions[b]++
		t.predictions[b]++
	}
	if r.TrueScore == nil || !r.IsAnchor || r.Source == archive.SourceWorldModel {
		return
	}
	key := fmt.Sprintf("%d/%s", r.Step, r.GroupID)
	pr := pairRow{pred: *r.Predicted, truth: *r.TrueScore, fold: fold(key), group: key, bytes: -1}
	if r.ResponseBytes != nil {
		pr.bytes = *r.ResponseBytes
	} else if r.Source == archive.SourceLateAnchor { // its length is on its world-model row
		p.latePairs = append(p.latePairs, latePair{len(p.all.pairs), missKey(r)})
	}
	if r.Calibrated != nil {
		pr.cal, pr.hasCal = *r.Calibrated, true
	}
	a.Pairs++
	if m != nil {
		m.Pairs++
	}
	if r.Source == archive.SourceLateAnchor {
		a.LatePairs++
	}
	if r.ExecStatus != nil {
		o := p.outcomes[*r.ExecStatus]
		if o == nil {
			o = &Outcome{Status: *r.ExecStatus}
			p.outcomes[o.Status] = o
		}
		o.Pairs++
		o.MeanPredicted += Num(pr.pred)
		o.MeanTrue += Num(pr.truth)
		p.failPred, p.failed = append(p.failPred, pr.pred), append(p.failed, *r.ExecStatus != schemas.ExecScored)
		if *r.ExecStatus != schemas.ExecScored {
			p.causes.add(r, pr.pred)
		}
	}
	t.of = append(t.of, int32(len(p.all.pairs)))
	p.all.pairs = append(p.all.pairs, pr)
	g := p.all.groups[key]
	if g == nil { // a group is of one task (route refuses one whose task disagrees)
		g = &groupAcc{}
		p.all.groups[key], t.groups[key] = g, g
		p.all.order, t.order = append(p.all.order, g), append(t.order, g)
		s.groups = append(s.groups, g)
	}
	g.pred, g.truth = append(g.pred, pr.pred), append(g.truth, pr.truth)
	s.n++
	s.before += pr.pred - pr.truth
	if pr.hasCal {
		s.after += pr.cal - pr.truth
	}
}

// model is the use of the world model that scored r, nil for a row no
// world model was asked for (its group over max_payload).
func (p *auditPass) model(r archive.Row) *WorldModelUse {
	if r.WMStatus == schemas.PredNotSent {
		return nil
	}
	name := modelOf(r)
	m := p.models[name]
	if m == nil {
		m = &WorldModelUse{Model: name, FirstStep: r.Step, LastStep: r.Step}
		p.models[name] = m
	}
	m.FirstStep, m.LastStep = min(m.FirstStep, r.Step), max(m.LastStep, r.Step)
	return m
}

// finish sums up what the pass kept into its Audit.
func (p *auditPass) finish() {
	a := p.a
	a.WorldModels = make([]WorldModelUse, 0, len(p.models))
	for _, m := range p.models {
		a.WorldModels = append(a.WorldModels, *m)
	}
	slices.SortFunc(a.WorldModels, func(x, y WorldModelUse) int {
		return cmp.Or(cmp.Compare(x.FirstStep, y.FirstStep), strings.Compare(x.Model, y.Model))
	})
	a.groups, a.size = p.shape.result()
	a.Steps = len(p.steps)
	for _, s := range []string{schemas.ExecScored, schemas.ExecInvalid, schemas.ExecCrashed, schemas.ExecTimedOut} {
		if o := p.outcomes[s]; o != nil {
			n := float64(o.Pairs)
			o.Share, o.MeanPredicted, o.MeanTrue = n/float64(len(p.failed)), o.MeanPredicted/Num(n), o.MeanTrue/Num(n)
			a.Outcomes = append(a.Outcomes, *o)
		}
	}
	// Failures are the positives: a world model that sees them coming
	// scores them lower, so the AUC is of the negated score.
	neg := make([]float64, len(p.failPred))
	for i, x := range p.failPred {
		neg[i] = -x
	}
	a.FailureAUC = Num(fuse.AUC(neg, p.failed))
	a.Causes, a.OtherCauses = p.causes.result()
	a.Misses, a.Verdicts = p.misses.result()
	a.Executions = p.execs.result(a.Options.AnchorDeadline)
	a.FailuresWithoutDetail = p.causes.noDetail
	// The run-wide map, cross-fitted on the anchor groups, and each task's
	// own map likewise on its pairs alone.
	runMaps := crossFit(p.all.pairs)
	a.Overall = p.summarize("(all tasks)", p.all, runMaps, crossMaps{})
	for name, c := range p.tasks {
		c.pairs = make([]pairRow, len(c.of))
		for i, at := range c.of {
			c.pairs[i] = p.all.pairs[at]
		}
		a.Tasks = append(a.Tasks, p.summarize(name, c, runMaps, crossFit(c.pairs)))
		c.pairs = nil
	}
	slices.SortFunc(a.Tasks, func(x, y TaskAudit) int { return naturalCompare(x.Task, y.Task) })
	for n, s := range p.steps {
		sp := StepPoint{Step: n, Pairs: s.n, D: s.d, Rho: s.rho, ResidualBefore: Num(math.NaN()), ResidualAfter: Num(math.NaN())}
		if s.n > 0 {
			sp.ResidualBefore, sp.ResidualAfter = Num(s.before/float64(s.n)), Num(s.after/float64(s.n))
		}
		sp.WithinSpearman = Num(meanWithinSpearman(s.groups))
		a.Drift = append(a.Drift, sp)
	}
	slices.SortFunc(a.Drift, func(x, y StepPoint) int { return cmp.Compare(x.Step, y.Step) })
	a.pairs = p.all.pairs
	for _, lp := range p.latePairs {
		if n, ok := p.lateLength[lp.key]; ok {
			p.all.pairs[lp.i].bytes = n
		}
	}
	a.Length = lengthBias(p.all.pairs, runMaps)
	if len(p.all.pairs) >= 2 {
		x, y := make([]float64, len(p.all.pairs)), make([]float64, len(p.all.pairs))
		for i, pr := range p.all.pairs {
			x[i], y[i] = pr.pred, pr.truth
		}
		if m, err := calibrate.FitIsotonic(x, y, nil); err == nil {
			a.MapX, a.MapY = m.Thresholds()
		}
	}
}

// summarize is a task's summary (or the run's, with no map of its own):
// each level's residuals under the run's maps as recorded, the run-wide
// map and the task's own, its ranks and its verdict.
func (p *auditPass) summarize(name string, c *taskAcc, runMaps, own crossMaps) TaskAudit {
	opt := p.a.Options
	ta := TaskAudit{Task: name, Pairs: len(c.pairs), Levels: make([]Level, opt.Bins)}
	sums := make([]struct {
		n, ncal            int
		p, t               float64
		rb, ra, rm, ro     float64
		rb2, ra2, rm2, ro2 float64
	}, opt.Bins)
	var biasedBefore, biasedMono, biasedOwn bool
	fitted, ownFitted := runMaps.ok(), own.ok()
	for _, pr := range c.pairs {
		b := &sums[p.lv.of(pr.pred)]
		b.n++
		b.p += pr.pred
		b.t += pr.truth
		b.rb += pr.pred - pr.truth
		b.rb2 += (pr.pred - pr.truth) * (pr.pred - pr.truth)
		if fitted {
			e := runMaps.at(pr) - pr.truth
			b.rm, b.rm2 = b.rm+e, b.rm2+e*e
		}
		if ownFitted {
			e := own.at(pr) - pr.truth
			b.ro, b.ro2 = b.ro+e, b.ro2+e*e
		}
		if pr.hasCal {
			b.ncal++
			b.ra += pr.cal - pr.truth
			b.ra2 += (pr.cal - pr.truth) * (pr.cal - pr.truth)
		}
	}
	for i := range ta.Levels {
		l := &ta.Levels[i]
		l.Lo, l.Hi = p.lv.bounds(i)
		l.Range = [2]float64{l.Lo, l.Hi}
		s := sums[i]
		l.Pairs, l.Predictions = s.n, c.predictions[i]
		if l.Predictions > 0 {
			l.Coverage = float64(l.Pairs) / float64(l.Predictions)
		}
		nan := Num(math.NaN())
		l.MeanPredicted, l.MeanTrue, l.ResidualBefore, l.ResidualAfter, l.ResidualMonotone = nan, nan, nan, nan, nan
		if s.n > 0 {
			n := float64(s.n)
			l.MeanPredicted, l.MeanTrue, l.ResidualBefore = Num(s.p/n), Num(s.t/n), Num(s.rb/n)
			if fitted {
				l.ResidualMonotone = Num(s.rm / n)
			}
		}
		if s.ncal > 0 {
			l.ResidualAfter = Num(s.ra / float64(s.ncal))
		}
		if s.n >= opt.MinBinPairs {
			ta.MaxBefore = max(ta.MaxBefore, math.Abs(float64(l.ResidualBefore)))
			biasedBefore = biasedBefore || clearly(s.rb, s.rb2, s.n, opt.Tolerance)
			if fitted {
				ta.MaxMonotone = max(ta.MaxMonotone, math.Abs(float64(l.ResidualMonotone)))
				biasedMono = biasedMono || clearly(s.rm, s.rm2, s.n, opt.Tolerance)
			}
			if ownFitted {
				ta.MaxOwn = max(ta.MaxOwn, math.Abs(s.ro/float64(s.n)))
				biasedOwn = biasedOwn || clearly(s.ro, s.ro2, s.n, opt.Tolerance)
			}
			if s.ncal >= opt.MinBinPairs {
				ta.MaxAfter = max(ta.MaxAfter, math.Abs(float64(l.ResidualAfter)))
			}
		}
	}
	ta.Ranks = ranksOf(c)
	switch {
	case ta.Pairs < opt.MinTaskPairs:
		ta.Verdict = VerdictTooFewAnchor
	case !biasedBefore:
		ta.Verdict = VerdictCalibrated
	case !fitted:
		ta.Verdict = VerdictTooFewAnchor
	case !biasedMono:
		ta.Verdict = VerdictCorrected
	case ownFitted && !biasedOwn:
		ta.Verdict = VerdictTaskSpecific
	default:
		ta.Verdict = VerdictNonMonotone
	}
	return ta
}

// ranksOf is how the world model ranks a task's pairs (or the run's):
// over them all, and within each anchor group on average.
func ranksOf(c *taskAcc) Ranks {
	x, y := make([]float64, len(c.pairs)), make([]float64, len(c.pairs))
	for i, pr := range c.pairs {
		x[i], y[i] = pr.pred, pr.truth
	}
	r := Ranks{Spearman: Num(fuse.Spearman(x, y)), Kendall: Num(fuse.Kendall(x, y))}
	var ws, wk float64
	for _, g := range c.order {
		s, k := fuse.Spearman(g.pred, g.truth), fuse.Kendall(g.pred, g.truth)
		if math.IsNaN(s) || math.IsNaN(k) {
			continue
		}
		ws += s
		wk += k
		r.Groups++
	}
	r.WithinSpearman, r.WithinKendall = Num(math.NaN()), Num(math.NaN())
	if r.Groups > 0 {
		r.WithinSpearman, r.WithinKendall = Num(ws/float64(r.Groups)), Num(wk/float64(r.Groups))
	}
	return r
}
