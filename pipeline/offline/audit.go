package offline

import (
	"cmp"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"strings"

	"gonum.org/v1/gonum/stat"

	"github.com/wmrl/wmrl/connectors/sim/rl"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/fuse"
)

// Verdicts of a task's world-model bias. They judge the world model, not
// the run's warm-up: "after" is a monotone map cross-fitted on the run's
// anchor pairs (see RunAudit), so the flat or identity map before a run's
// first fit, or a run with debiasing off, does not read as bias that
// isotonic cannot fix.
const (
	VerdictCalibrated = "calibrated well"
	VerdictCorrected  = "monotone bias corrected"
	// VerdictTaskSpecific: the run's one map leaves the task biased, a
	// monotone map of its own would not (its bias differs from the others').
	VerdictTaskSpecific = "task-specific bias: one map per run cannot fix it"
	VerdictNonMonotone  = "non-monotone bias that isotonic cannot fix"
	VerdictTooFewAnchor = "too few anchor pairs to tell"
)

// AuditOptions configure an audit.
type AuditOptions struct {
	// Bins of the world model's score (default 10, equal width over the
	// predicted range).
	Bins int
	// Tolerance: a score level's mean residual within it counts as
	// unbiased (default 0.05, on the score's scale).
	Tolerance float64
	// MinBinPairs: levels with fewer anchor pairs are not judged (default
	// 10); MinTaskPairs: tasks with fewer get no verdict (default 30).
	MinBinPairs, MinTaskPairs int
	// AnchorDeadline is the run's --anchor-deadline in seconds, which the
	// execution times are set against (0: not known).
	AnchorDeadline float64
	// Steps, if set, audits those steps alone (their late anchors' rows
	// too, whenever they came); nil: every step.
	Steps *StepRange `json:"Steps,omitempty"`
}

func (o *AuditOptions) setDefaults() {
	if o.Bins <= 0 {
		o.Bins = 10
	}
	if o.Tolerance <= 0 {
		o.Tolerance = 0.05
	}
	if o.MinBinPairs <= 0 {
		o.MinBinPairs = 10
	}
	if o.MinTaskPairs <= 0 {
		o.MinTaskPairs = 30
	}
}

// Level is one score bin.
type Level struct {
	Lo, Hi float64 `json:"-"`
	// Range is [lo, hi) of the predicted score.
	Range [2]float64 `json:"range"`
	// Pairs: anchor pairs; Predictions: every graded prediction.
	Pairs       int `json:"pairs"`
	Predictions int `json:"predictions"`
	// Coverage: Pairs / Predictions.
	Coverage float64 `json:"coverage"`
	// MeanPredicted, MeanTrue over the pairs; ResidualBefore = mean(predicted
	// - true), ResidualAfter = mean(calibrated - true) with the run's maps as
	// recorded (out of sample; the warm-up before the first fit included),
	// ResidualMonotone = mean(f(predicted) - true) with f the run-wide
	// monotone map cross-fitted on the other half of the anchor groups (NaN:
	// no pairs).
	MeanPredicted    Num `json:"mean_predicted"`
	MeanTrue         Num `json:"mean_true"`
	ResidualBefore   Num `json:"residual_before"`
	ResidualAfter    Num `json:"residual_after"`
	ResidualMonotone Num `json:"residual_monotone"`
}

// Ranks are rank agreements between the world model and the truth.
type Ranks struct {
	Spearman Num `json:"spearman"`
	Kendall  Num `json:"kendall"`
	// WithinGroup: mean over anchor groups of the within-group rank
	// correlation, what GRPO's advantages depend on; Groups counts the
	// groups where it is defined (neither side constant).
	WithinSpearman Num `json:"within_group_spearman"`
	WithinKendall  Num `json:"within_group_kendall"`
	Groups         int `json:"groups"`
}

// TaskAudit is one task's summary.
type TaskAudit struct {
	Task   string  `json:"task"`
	Pairs  int     `json:"pairs"`
	Ranks  Ranks   `json:"ranks"`
	Levels []Level `json:"levels"`
	// MaxBefore, MaxAfter, MaxMonotone: the largest |mean residual| over
	// levels with enough pairs, of the raw scores, the run's maps and the
	// cross-fitted run-wide map (Level); MaxOwn: of a map cross-fitted on
	// this task's pairs alone (tasks only).
	MaxBefore   float64 `json:"max_abs_residual_before"`
	MaxAfter    float64 `json:"max_abs_residual_after"`
	MaxMonotone float64 `json:"max_abs_residual_monotone"`
	MaxOwn      float64 `json:"max_abs_residual_own_map,omitempty"`
	Verdict     string  `json:"verdict"`
}

// StepPoint is one step's drift figures.
type StepPoint struct {
	Step           int64   `json:"step"`
	Pairs          int     `json:"pairs"`
	ResidualBefore Num     `json:"residual_before"`
	ResidualAfter  Num     `json:"residual_after"`
	D              float64 `json:"d"`
	Rho            float64 `json:"rho"`
	// WithinSpearman: the mean within-group rank correlation of the step's
	// anchor groups, what GRPO's advantages depend on; over days it shows
	// a world model falling behind the policy's solutions, which the
	// residual (a level GRPO's standardisation cancels) may not.
	WithinSpearman Num `json:"within_group_spearman"`
}

// Outcome is what the world model predicted for the anchors whose
// execution ended one way.
type Outcome struct {
	Status string `json:"status"`
	Pairs  int    `json:"pairs"`
	// Share of the anchor pairs; MeanPredicted and MeanTrue over them.
	Share         float64 `json:"share"`
	MeanPredicted Num     `json:"mean_predicted"`
	MeanTrue      Num     `json:"mean_true"`
}

// Audit is the whole report's data (its JSON summary).
type Audit struct {
	Run       string       `json:"run"`
	Rows      int          `json:"rows"`
	Steps     int          `json:"steps"`
	Pairs     int          `json:"anchor_pairs"`
	LatePairs int          `json:"late_anchor_pairs"`
	Ungraded  int          `json:"ungraded_predictions"`
	Options   AuditOptions `json:"options"`
	Overall   TaskAudit    `json:"overall"`
	Tasks     []TaskAudit  `json:"tasks"`
	Drift     []StepPoint  `json:"drift"`
	// Outcomes are the anchor pairs by how their execution ended (scored,
	// invalid_submission, crashed, timed_out: the last three score 0), and
	// FailureAUC how well the world model's score tells those that failed
	// from those that scored: 0.5 is chance, 1 every failure predicted
	// below every success (NaN: either kind missing). A world model that
	// does not see failures coming scores them as if they ran.
	Outcomes   []Outcome `json:"outcomes"`
	FailureAUC Num       `json:"failure_auc"`
	// Causes are the failed pairs by what their executions' details say
	// went wrong, most frequent first (OtherCauses kinds left out);
	// FailuresWithoutDetail failed with none recorded (an archive from
	// before the exec_detail column, or an executor that says nothing).
	Causes                []Cause `json:"failure_causes"`
	OtherCauses           int     `json:"other_failure_causes"`
	FailuresWithoutDetail int     `json:"failures_without_detail"`
	// Verdicts count the statuses the world model predicted for the
	// anchor pairs against how their executions ended (empty when it
	// predicted none); Misses are the pairs it got furthest wrong.
	Verdicts []VerdictCount `json:"verdicts"`
	Misses   []Miss         `json:"largest_misses"`
	// Map is an isotonic map fitted on every anchor pair, the reference
	// the reliability diagram draws.
	MapX []float64 `json:"map_x"`
	MapY []float64 `json:"map_y"`
	// Length is the residual by the length of the solution (nil: the
	// archive holds no lengths, from before response_bytes or with
	// --archive-code=false).
	Length *LengthBias `json:"length_bias,omitempty"`
	// Executions is how long the anchors' executions took (nil: the
	// archive records no execution's seconds).
	Executions *ExecTimes `json:"execution_times,omitempty"`
	// Expect, if set (Expect), is wmrl sim's benchmark at this world model.
	Expect *rl.Expectation `json:"expect,omitempty"`

	pairs        []pairRow // for the plots
	groups, size int       // the median step's groups and group's trajectories (Expect)
}

type pairRow struct {
	pred, truth, cal float64
	hasCal           bool
	fold             int    // 0 or 1, by anchor group
	group            string // "step/group"
	bytes            int64  // the response's length; -1: not known
}

// RunAudit measures the world model's bias over a run's rows.
func RunAudit(rows []archive.Row, opt AuditOptions) (*Audit, error) {
	return RunAuditRows(InMemory(rows), opt)
}

// RunAuditRows is RunAudit over rows read twice: once for the range of
// the predictions (the score levels' bounds), once to measure. It keeps
// the anchor pairs' scores, each anchor execution's time, the largest
// misses so far and the measures' sums, not the rows.
func RunAuditRows(src Rows, opt AuditOptions) (*Audit, error) {
	opt.setDefaults()
	a := &Audit{Options: opt}
	var held func() (first, last int64, ok bool)
	if opt.Steps != nil {
		src, held = rowsIn(src, *opt.Steps)
	}
	lo, hi := math.Inf(1), math.Inf(-1)
	err := src([]string{"predicted"}, func(rows []archive.Row) error {
		for i := range rows {
			if a.Rows == 0 {
				a.Run = rows[i].Run
			}
			a.Rows++
			if p := rows[i].Predicted; p != nil {
				lo, hi = min(lo, *p), max(hi, *p)
			}
		}
		return nil
	})
	switch {
	case err != nil:
		return nil, err
	case a.Rows == 0:
		if held != nil {
			if first, last, ok := held(); ok {
				return nil, fmt.Errorf("audit: no rows in %s: the run's rows are of steps %d to %d", opt.Steps, first, last)
			}
		}
		return nil, fmt.Errorf("audit: no rows")
	case lo > hi:
		return nil, fmt.Errorf("audit: no graded prediction in %d rows", a.Rows)
	}
	if hi == lo {
		hi = lo + 1
	}
	bin := func(x float64) int { return min(int(float64(opt.Bins)*(x-lo)/(hi-lo)), opt.Bins-1) }

	type acc struct {
		pairs       []pairRow // the run's; a task's only while it is summed up
		of          []int32   // a task's: its pairs' places in the run's, in the order they came
		predictions []int
		groups      map[string]*groupAcc // a group's accumulator is its task's and the run's
		order       []*groupAcc          // groups as they first came: means sum in it, the same every time
	}
	newAcc := func() *acc { return &acc{predictions: make([]int, opt.Bins), groups: map[string]*groupAcc{}} }
	all := newAcc()
	tasks := map[string]*acc{}
	type stepAcc struct {
		n                     int
		before, after, d, rho float64
		seen                  bool
		groups                []*groupAcc
	}
	steps := map[int64]*stepAcc{}
	outcomes := map[string]*Outcome{}
	var causes causeCounter
	var failPred []float64
	var failed []bool
	type latePair struct {
		i   int // in all.pairs
		key trajKey
	}
	var latePairs []latePair
	lateLength := map[trajKey]int64{} // late anchors' lengths, from their world-model rows
	misses, execs := newMissAcc(), newExecAcc()
	var shape shapeAcc
	read := 0
	err = src(nil, func(rows []archive.Row) error {
		read += len(rows)
		for _, r := range rows {
			misses.add(r)
			execs.add(r)
			shape.add(r)
			if r.ResponseBytes != nil && r.Source == archive.SourceWorldModel && r.IsAnchor {
				lateLength[missKey(r)] = *r.ResponseBytes
			}
			t := tasks[r.TaskID]
			if t == nil {
				t = newAcc()
				tasks[r.TaskID] = t
			}
			s := steps[r.Step]
			if s == nil {
				s = &stepAcc{}
				steps[r.Step] = s
			}
			if r.Source != archive.SourceLateAnchor && !s.seen {
				s.d, s.rho, s.seen = r.D, r.Rho, true
			}
			if r.Predicted == nil {
				if r.Source != archive.SourceLateAnchor { // else counted on its world-model row
					a.Ungraded++
				}
				continue
			}
			if r.Source != archive.SourceLateAnchor {
				b := bin(*r.Predicted)
				all.predictions[b]++
				t.predictions[b]++
			}
			if r.TrueScore == nil || !r.IsAnchor || r.Source == archive.SourceWorldModel {
				continue
			}
			key := fmt.Sprintf("%d/%s", r.Step, r.GroupID)
			p := pairRow{pred: *r.Predicted, truth: *r.TrueScore, fold: fold(key), group: key, bytes: -1}
			if r.ResponseBytes != nil {
				p.bytes = *r.ResponseBytes
			} else if r.Source == archive.SourceLateAnchor { // its length is on its world-model row
				latePairs = append(latePairs, latePair{len(all.pairs), missKey(r)})
			}
			if r.Calibrated != nil {
				p.cal, p.hasCal = *r.Calibrated, true
			}
			a.Pairs++
			if r.Source == archive.SourceLateAnchor {
				a.LatePairs++
			}
			if r.ExecStatus != nil {
				o := outcomes[*r.ExecStatus]
				if o == nil {
					o = &Outcome{Status: *r.ExecStatus}
					outcomes[o.Status] = o
				}
				o.Pairs++
				o.MeanPredicted += Num(p.pred)
				o.MeanTrue += Num(p.truth)
				failPred, failed = append(failPred, p.pred), append(failed, *r.ExecStatus != schemas.ExecScored)
				if *r.ExecStatus != schemas.ExecScored {
					causes.add(r, p.pred)
				}
			}
			t.of = append(t.of, int32(len(all.pairs)))
			all.pairs = append(all.pairs, p)
			g := all.groups[key]
			if g == nil { // a group is of one task (route refuses one whose task disagrees)
				g = &groupAcc{}
				all.groups[key], t.groups[key] = g, g
				all.order, t.order = append(all.order, g), append(t.order, g)
				s.groups = append(s.groups, g)
			}
			g.pred, g.truth = append(g.pred, p.pred), append(g.truth, p.truth)
			s.n++
			s.before += p.pred - p.truth
			if p.hasCal {
				s.after += p.cal - p.truth
			}
		}
		return nil
	})
	if err == nil && read != a.Rows {
		err = fmt.Errorf("audit: %d rows read the second time, %d the first: was the archive written to meanwhile?", read, a.Rows)
	}
	if err != nil {
		return nil, err
	}
	a.groups, a.size = shape.result()
	a.Steps = len(steps)
	for _, s := range []string{schemas.ExecScored, schemas.ExecInvalid, schemas.ExecCrashed, schemas.ExecTimedOut} {
		if o := outcomes[s]; o != nil {
			n := float64(o.Pairs)
			o.Share, o.MeanPredicted, o.MeanTrue = n/float64(len(failed)), o.MeanPredicted/Num(n), o.MeanTrue/Num(n)
			a.Outcomes = append(a.Outcomes, *o)
		}
	}
	// Failures are the positives: a world model that sees them coming
	// scores them lower, so the AUC is of the negated score.
	neg := make([]float64, len(failPred))
	for i, x := range failPred {
		neg[i] = -x
	}
	a.FailureAUC = Num(fuse.AUC(neg, failed))
	a.Causes, a.OtherCauses = causes.result()
	a.Misses, a.Verdicts = misses.result()
	a.Executions = execs.result(opt.AnchorDeadline)
	a.FailuresWithoutDetail = causes.noDetail
	// The run-wide map, cross-fitted on the anchor groups, and each task's
	// own map likewise on its pairs alone.
	runMaps := crossFit(all.pairs)
	summarize := func(name string, c *acc, own crossMaps) TaskAudit {
		ta := TaskAudit{Task: name, Pairs: len(c.pairs), Levels: make([]Level, opt.Bins)}
		sums := make([]struct {
			n, ncal            int
			p, t               float64
			rb, ra, rm, ro     float64
			rb2, ra2, rm2, ro2 float64
		}, opt.Bins)
		x, y := make([]float64, len(c.pairs)), make([]float64, len(c.pairs))
		var biasedBefore, biasedMono, biasedOwn bool
		fitted, ownFitted := runMaps.ok(), own.ok()
		for i, p := range c.pairs {
			x[i], y[i] = p.pred, p.truth
			b := &sums[bin(p.pred)]
			b.n++
			b.p += p.pred
			b.t += p.truth
			b.rb += p.pred - p.truth
			b.rb2 += (p.pred - p.truth) * (p.pred - p.truth)
			if fitted {
				e := runMaps.at(p) - p.truth
				b.rm, b.rm2 = b.rm+e, b.rm2+e*e
			}
			if ownFitted {
				e := own.at(p) - p.truth
				b.ro, b.ro2 = b.ro+e, b.ro2+e*e
			}
			if p.hasCal {
				b.ncal++
				b.ra += p.cal - p.truth
				b.ra2 += (p.cal - p.truth) * (p.cal - p.truth)
			}
		}
		for i := range ta.Levels {
			l := &ta.Levels[i]
			l.Lo, l.Hi = lo+(hi-lo)*float64(i)/float64(opt.Bins), lo+(hi-lo)*float64(i+1)/float64(opt.Bins)
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
		ta.Ranks = Ranks{Spearman: Num(fuse.Spearman(x, y)), Kendall: Num(fuse.Kendall(x, y))}
		var ws, wk float64
		for _, g := range c.order {
			s, k := fuse.Spearman(g.pred, g.truth), fuse.Kendall(g.pred, g.truth)
			if math.IsNaN(s) || math.IsNaN(k) {
				continue
			}
			ws += s
			wk += k
			ta.Ranks.Groups++
		}
		ta.Ranks.WithinSpearman, ta.Ranks.WithinKendall = Num(math.NaN()), Num(math.NaN())
		if ta.Ranks.Groups > 0 {
			ta.Ranks.WithinSpearman, ta.Ranks.WithinKendall = Num(ws/float64(ta.Ranks.Groups)), Num(wk/float64(ta.Ranks.Groups))
		}
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
	a.Overall = summarize("(all tasks)", all, crossMaps{})
	for name, c := range tasks {
		c.pairs = make([]pairRow, len(c.of))
		for i, at := range c.of {
			c.pairs[i] = all.pairs[at]
		}
		a.Tasks = append(a.Tasks, summarize(name, c, crossFit(c.pairs)))
		c.pairs = nil
	}
	slices.SortFunc(a.Tasks, func(x, y TaskAudit) int { return naturalCompare(x.Task, y.Task) })
	for n, s := range steps {
		p := StepPoint{Step: n, Pairs: s.n, D: s.d, Rho: s.rho, ResidualBefore: Num(math.NaN()), ResidualAfter: Num(math.NaN())}
		if s.n > 0 {
			p.ResidualBefore, p.ResidualAfter = Num(s.before/float64(s.n)), Num(s.after/float64(s.n))
		}
		p.WithinSpearman = Num(meanWithinSpearman(s.groups))
		a.Drift = append(a.Drift, p)
	}
	slices.SortFunc(a.Drift, func(x, y StepPoint) int { return cmp.Compare(x.Step, y.Step) })
	a.pairs = all.pairs
	for _, lp := range latePairs {
		if n, ok := lateLength[lp.key]; ok {
			all.pairs[lp.i].bytes = n
		}
	}
	a.Length = lengthBias(all.pairs, runMaps)
	if len(all.pairs) >= 2 {
		x, y := make([]float64, len(all.pairs)), make([]float64, len(all.pairs))
		for i, p := range all.pairs {
			x[i], y[i] = p.pred, p.truth
		}
		if m, err := calibrate.FitIsotonic(x, y, nil); err == nil {
			a.MapX, a.MapY = m.Thresholds()
		}
	}
	return a, nil
}

// RankTrend is the world model's mean within-group Spearman over the first
// and the last quarter of the audited steps that have one, and the standard
// error of their difference (steps as independent samples). A fall of more
// than two standard errors says it ranks the policy's recent solutions
// worse than its early ones. ok is false with fewer than 8 such steps.
func (a *Audit) RankTrend() (first, last, se float64, ok bool) {
	var r []float64
	for _, s := range a.Drift {
		if !math.IsNaN(float64(s.WithinSpearman)) {
			r = append(r, float64(s.WithinSpearman))
		}
	}
	if len(r) < 8 {
		return 0, 0, 0, false
	}
	q := len(r) / 4
	head, tail := r[:q], r[len(r)-q:]
	first, last = stat.Mean(head, nil), stat.Mean(tail, nil)
	se = math.Sqrt(stat.Variance(head, nil)/float64(q) + stat.Variance(tail, nil)/float64(q))
	return first, last, se, true
}

type groupAcc struct{ pred, truth []float64 }

// meanWithinSpearman is the mean rank correlation of the groups that have
// one (NaN when none has).
func meanWithinSpearman(groups []*groupAcc) float64 {
	sum, n := 0.0, 0
	for _, g := range groups {
		if r := fuse.Spearman(g.pred, g.truth); !math.IsNaN(r) {
			sum += r
			n++
		}
	}
	if n == 0 {
		return math.NaN()
	}
	return sum / float64(n)
}

// fold splits anchor groups in two by a hash of their key, so that the
// pairs of one group are scored together by a map none of them trained.
func fold(key string) int {
	h := fnv.New32a()
	h.Write([]byte(key))
	return int(h.Sum32() & 1)
}

// crossMaps are the isotonic maps fitted on each fold's pairs; the zero
// value is no map.
type crossMaps [2]*calibrate.Isotonic

func (m crossMaps) ok() bool { return m[0] != nil && m[1] != nil }

// at scores a pair with the map its own fold did not train.
func (m crossMaps) at(p pairRow) float64 { return m[1-p.fold].Predict(p.pred) }

// crossFit fits an isotonic map on each fold's pairs, or none when either
// fold cannot be fitted (too few pairs, or one prediction only).
func crossFit(pairs []pairRow) crossMaps {
	var maps crossMaps
	for f := range 2 {
		var x, y []float64
		for _, p := range pairs {
			if p.fold == f {
				x, y = append(x, p.pred), append(y, p.truth)
			}
		}
		m, err := calibrate.FitIsotonic(x, y, nil)
		if err != nil || m.Len() < 2 {
			return crossMaps{}
		}
		maps[f] = m
	}
	return maps
}

// clearly reports whether a level's mean residual (from its sum, sum of
// squares and count) is beyond tol by more than twice its standard error,
// so that a few noisy pairs do not condemn a level.
func clearly(sum, sum2 float64, n int, tol float64) bool {
	mean := sum / float64(n)
	variance := max(sum2/float64(n)-mean*mean, 0) * float64(n) / float64(max(n-1, 1))
	return math.Abs(mean)-2*math.Sqrt(variance/float64(n)) > tol
}

// naturalCompare orders "task-2" before "task-10".
func naturalCompare(a, b string) int {
	for a != "" && b != "" {
		da, db := digits(a), digits(b)
		if da > 0 && db > 0 {
			na, nb := strings.TrimLeft(a[:da], "0"), strings.TrimLeft(b[:db], "0")
			if c := cmp.Or(cmp.Compare(len(na), len(nb)), cmp.Compare(na, nb)); c != 0 {
				return c
			}
			a, b = a[da:], b[db:]
			continue
		}
		if a[0] != b[0] {
			return cmp.Compare(a[0], b[0])
		}
		a, b = a[1:], b[1:]
	}
	return cmp.Compare(len(a), len(b))
}

func digits(s string) int {
	i := 0
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	return i
}

// Num is a float that is null in JSON when it is not a number (a bin with
// no pairs, a correlation with a constant side).
type Num float64

// MarshalJSON writes NaN and infinities as null.
func (n Num) MarshalJSON() ([]byte, error) {
	f := float64(n)
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return []byte("null"), nil
	}
	return json.Marshal(f)
}
