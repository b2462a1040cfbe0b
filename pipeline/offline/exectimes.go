package offline

import (
	"cmp"
	"math"
	"slices"
	"time"

	"gonum.org/v1/gonum/stat"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
)

// ExecTimes is how long the anchors' executions took (exec_seconds):
// what --anchor-deadline and an execution's time limit are set from. A
// step waits for an anchor group until its slowest execution has ended
// and its pairs are calibrated, so a deadline is set against the groups'
// slowest executions. exec_seconds leaves out the time an execution
// waited for a slot (--exec-slots), so a deadline needs room above them.
type ExecTimes struct {
	// Executions counts the anchor trajectories with seconds recorded,
	// Copies among them those that took the outcome of an identical
	// solution's execution (--exec-copies-once): no time of their own,
	// so they are left out of Seconds and ByStatus. Seconds leaves out
	// sandbox errors too (the executor failed, the code may not have
	// run: a service that is down gives them at once); ByStatus has them.
	Executions int           `json:"executions"`
	Copies     int           `json:"copies"`
	Seconds    Quantiles     `json:"seconds"`
	ByStatus   []StatusTimes `json:"by_status"`
	// AnchorGroups counts the run's anchor groups, LateGroups those fused
	// on the world model for missing the deadline; Groups those with
	// every trajectory's seconds (in archives written before late rows
	// carried seconds, and before they held sandbox errors, a late
	// group's have none), and Slowest their slowest execution's seconds.
	AnchorGroups int       `json:"anchor_groups"`
	LateGroups   int       `json:"late_groups"`
	Groups       int       `json:"groups_timed"`
	Slowest      Quantiles `json:"group_slowest_seconds"`
	// Deadline is the run's --anchor-deadline in seconds (0: not known),
	// and WithinDeadline the share of Groups whose slowest execution ended
	// within it.
	Deadline       float64 `json:"anchor_deadline_seconds,omitempty"`
	WithinDeadline Num     `json:"groups_within_deadline"`
	// LateAfterFused: how long after its step's update each late group
	// was calibrated (its late rows' ts against the update's), over the
	// LateTimed late groups with late rows; nil when none. A step held
	// only by its late groups is fused at the deadline, so a deadline
	// longer by its p90 would have let 90% of them in (and held each
	// step that much longer).
	LateAfterFused *Quantiles `json:"late_after_fused_seconds,omitempty"`
	LateTimed      int        `json:"late_groups_timed,omitempty"`

	each, slowest []float64 // sorted, for the plot
}

// Own counts the executions Seconds is over: Executions but the Copies
// and the sandbox errors.
func (e *ExecTimes) Own() int { return len(e.each) }

// Quantiles of a set of durations, in seconds.
type Quantiles struct {
	Median float64 `json:"median"`
	P90    float64 `json:"p90"`
	P95    float64 `json:"p95"`
	P99    float64 `json:"p99"`
	Max    float64 `json:"max"`
}

// StatusTimes is the executions that ended one way.
type StatusTimes struct {
	Status     string  `json:"status"`
	Executions int     `json:"executions"`
	Median     float64 `json:"median"`
	Max        float64 `json:"max"`
}

// quantiles of sorted xs (the empirical distribution); zero when empty.
func quantiles(xs []float64) Quantiles {
	if len(xs) == 0 {
		return Quantiles{}
	}
	q := func(p float64) float64 { return stat.Quantile(p, stat.Empirical, xs, nil) }
	return Quantiles{Median: q(0.5), P90: q(0.9), P95: q(0.95), P99: q(0.99), Max: xs[len(xs)-1]}
}

// execAcc measures the anchors' execution times over a stream of rows.
type execAcc struct {
	groups       map[groupKey]map[string]*traj // anchor groups: trajectory ID to its time
	late         map[groupKey]bool
	fusedAt      map[int64]time.Time // each step's update
	calibratedAt map[groupKey]stamp  // each late group's calibration
	byStatus     map[string][]float64
	e            ExecTimes
}

type traj struct {
	seconds float64
	timed   bool
}

type stamp struct {
	step int64
	at   time.Time
}

func newExecAcc() *execAcc {
	return &execAcc{groups: map[groupKey]map[string]*traj{}, late: map[groupKey]bool{}, fusedAt: map[int64]time.Time{},
		calibratedAt: map[groupKey]stamp{}, byStatus: map[string][]float64{}}
}

func (x *execAcc) add(r archive.Row) {
	e := &x.e
	if r.Source == archive.SourceLateAnchor {
		x.calibratedAt[groupKey{r.Step, r.GroupID}] = stamp{r.Step, r.TS}
	} else if _, ok := x.fusedAt[r.Step]; !ok {
		x.fusedAt[r.Step] = r.TS
	}
	if !r.IsAnchor {
		return
	}
	key := groupKey{r.Step, r.GroupID}
	t := x.member(key, r.TrajID) // a late anchor's world-model row and its late row: one trajectory
	if r.ExecStatus != nil && *r.ExecStatus == archive.ExecLate {
		x.late[key] = true
	}
	if r.ExecSeconds == nil || t.timed {
		return
	}
	t.seconds, t.timed = *r.ExecSeconds, true
	e.Executions++
	if r.ExecCopyOf != nil {
		e.Copies++
		return
	}
	if r.ExecStatus != nil {
		x.byStatus[*r.ExecStatus] = append(x.byStatus[*r.ExecStatus], t.seconds)
	}
	if r.ExecStatus == nil || *r.ExecStatus != schemas.ExecSandboxError {
		e.each = append(e.each, t.seconds)
	}
}

func (x *execAcc) member(key groupKey, id string) *traj {
	g := x.groups[key]
	if g == nil {
		g = map[string]*traj{}
		x.groups[key] = g
	}
	t := g[id]
	if t == nil {
		t = &traj{}
		g[id] = t
	}
	return t
}

// result is the times measured; nil when no row recorded any (an archive
// from before exec_seconds, or a run without anchors). deadline is the
// run's --anchor-deadline in seconds, 0 when not known.
func (x *execAcc) result(deadline float64) *ExecTimes {
	e := x.e
	e.Deadline = deadline
	if e.Executions == 0 {
		return nil
	}
	e.AnchorGroups, e.LateGroups = len(x.groups), len(x.late)
	within := 0
	for _, g := range x.groups {
		slowest, all := 0.0, true
		for _, t := range g {
			all = all && t.timed
			slowest = max(slowest, t.seconds)
		}
		if !all {
			continue
		}
		e.slowest = append(e.slowest, slowest)
		if slowest <= deadline {
			within++
		}
	}
	var after []float64
	for key := range x.late {
		cal, ok1 := x.calibratedAt[key]
		fused, ok2 := x.fusedAt[cal.step]
		if ok1 && ok2 {
			after = append(after, max(0, cal.at.Sub(fused).Seconds()))
		}
	}
	if len(after) > 0 {
		slices.Sort(after)
		q := quantiles(after)
		e.LateAfterFused, e.LateTimed = &q, len(after)
	}
	slices.Sort(e.each)
	slices.Sort(e.slowest)
	e.Seconds, e.Slowest, e.Groups = quantiles(e.each), quantiles(e.slowest), len(e.slowest)
	e.WithinDeadline = Num(math.NaN())
	if deadline > 0 && e.Groups > 0 {
		e.WithinDeadline = Num(float64(within) / float64(e.Groups))
	}
	for status, xs := range x.byStatus {
		slices.Sort(xs)
		e.ByStatus = append(e.ByStatus, StatusTimes{Status: status, Executions: len(xs), Median: quantiles(xs).Median, Max: xs[len(xs)-1]})
	}
	slices.SortFunc(e.ByStatus, func(a, b StatusTimes) int {
		return cmp.Or(cmp.Compare(b.Executions, a.Executions), cmp.Compare(a.Status, b.Status))
	})
	return &e
}
