package offline

import (
	"cmp"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"math"
	"strings"

	"gonum.org/v1/gonum/stat"

	"github.com/wmrl/wmrl/connectors/sim/rl"
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
	// Model, if set, audits the rows of that world model alone (their
	// wm_model; "" for rows that name none); nil: every row.
	Model *string `json:"WMModel,omitempty"`
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
	// WorldModels are the world models whose predictions the rows hold,
	// in the order of their first steps: more than one when the run was
	// restarted onto another --wm-model, or predict processes with
	// different ones shared it.
	WorldModels []WorldModelUse `json:"world_models"`
	// Builds are the wmrl builds that wrote the audited archive's files
	// (archive.Description; "" for files from before it was kept), set by the
	// caller that opened them, wmrl audit.
	Builds []string `json:"wmrl_builds,omitempty"`

	pairs        []pairRow // for the plots
	groups, size int       // the median step's groups and group's trajectories (Expect)
}

// WorldModelUse is what the audited rows hold of one world model.
type WorldModelUse struct {
	// Model is its name as its predictions gave it (--wm-model, or
	// "sim"); empty for rows that name none (archives from before the
	// wm_model column).
	Model string `json:"model"`
	// Rows counts its rows (a late anchor's second row apart), Pairs its
	// anchor pairs; FirstStep and LastStep bound the steps it scored.
	Rows      int   `json:"rows"`
	Pairs     int   `json:"anchor_pairs"`
	FirstStep int64 `json:"first_step"`
	LastStep  int64 `json:"last_step"`
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
// the predictions (the score levels' bounds), once to measure (auditPass),
// keeping the sums and the anchor pairs' scores, not the rows.
func RunAuditRows(src Rows, opt AuditOptions) (*Audit, error) {
	opt.setDefaults()
	a := &Audit{Options: opt}
	var held func() (first, last int64, ok bool)
	if opt.Steps != nil {
		src, held = rowsIn(src, *opt.Steps)
	}
	var models func() []string
	if opt.Model != nil {
		src, models = rowsOf(src, *opt.Model)
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
		if models != nil && len(models()) > 0 {
			return nil, fmt.Errorf("audit: no rows of world model %q: the rows' world models are %s", *opt.Model, modelNames(models()))
		}
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
	pass := newAuditPass(a, levels{lo: lo, hi: hi, n: opt.Bins})
	err = src(nil, func(rows []archive.Row) error {
		for _, r := range rows {
			pass.add(r)
		}
		return nil
	})
	if err == nil && pass.read != a.Rows {
		err = fmt.Errorf("audit: %d rows read the second time, %d the first: was the archive written to meanwhile?", pass.read, a.Rows)
	}
	if err != nil {
		return nil, err
	}
	pass.finish()
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
