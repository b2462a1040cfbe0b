package offline

import (
	"cmp"
	"math"
	"slices"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/execute"
)

// Miss is an anchor pair the world model got far wrong: what it predicted
// and why, against how the execution went.
type Miss struct {
	Step      int64   `json:"step"`
	GroupID   string  `json:"group_id"`
	TrajID    string  `json:"traj_id"`
	TaskID    string  `json:"task_id"`
	Predicted float64 `json:"predicted"`
	True      float64 `json:"true"`
	// ExecStatus and Cause (execute.Cause of its detail): how the
	// execution ended; WMVerdict and WMRationale: what the world model
	// said would happen, and why (empty when it did not say).
	ExecStatus  string `json:"exec_status"`
	Cause       string `json:"cause,omitempty"`
	WMVerdict   string `json:"wm_verdict,omitempty"`
	WMRationale string `json:"wm_rationale,omitempty"`
}

// VerdictCount is how many anchor pairs the world model predicted to end
// one way (Predicted) that ended another (Actual).
type VerdictCount struct {
	Predicted string `json:"predicted"`
	Actual    string `json:"actual"`
	Pairs     int    `json:"pairs"`
}

// maxMisses is how many of the largest misses an audit lists.
const maxMisses = 10

// missesAndVerdicts lists the anchor pairs with the largest |predicted -
// true|, and counts the world model's predicted statuses against the
// executions' (nil when it predicted none). A late anchor's pair row has
// no verdict of its own: its step's world-model row of the same
// trajectory has it.
func missesAndVerdicts(rows []archive.Row) ([]Miss, []VerdictCount) {
	type said struct{ verdict, rationale *string }
	wmRow := map[trajKey]said{} // an anchor group's world-model rows
	var pairs []int
	for i, r := range rows {
		switch {
		case r.Predicted == nil || r.TrueScore == nil || !r.IsAnchor:
			if r.IsAnchor && r.Source == archive.SourceWorldModel && r.WMVerdict != nil {
				wmRow[missKey(r)] = said{r.WMVerdict, r.WMRationale}
			}
		case r.Source != archive.SourceWorldModel:
			pairs = append(pairs, i)
		}
	}
	gap := func(i int) float64 { return math.Abs(*rows[i].Predicted - *rows[i].TrueScore) }
	verdictOf := func(r archive.Row) (verdict, rationale string) {
		v, why := r.WMVerdict, r.WMRationale
		if v == nil {
			s := wmRow[missKey(r)]
			v, why = s.verdict, s.rationale
		}
		if v != nil {
			verdict = *v
		}
		if why != nil {
			rationale = *why
		}
		return verdict, rationale
	}

	counts := map[[2]string]int{}
	for _, i := range pairs {
		r := rows[i]
		if v, _ := verdictOf(r); v != "" && r.ExecStatus != nil {
			counts[[2]string{v, *r.ExecStatus}]++
		}
	}
	var verdicts []VerdictCount
	for k, n := range counts {
		verdicts = append(verdicts, VerdictCount{Predicted: k[0], Actual: k[1], Pairs: n})
	}
	order := map[string]int{schemas.ExecScored: 0, schemas.ExecInvalid: 1, schemas.ExecCrashed: 2, schemas.ExecTimedOut: 3}
	rank := func(s string) int {
		if o, ok := order[s]; ok {
			return o
		}
		return len(order)
	}
	slices.SortFunc(verdicts, func(a, b VerdictCount) int {
		return cmp.Or(cmp.Compare(rank(a.Predicted), rank(b.Predicted)), cmp.Compare(rank(a.Actual), rank(b.Actual)),
			cmp.Compare(a.Predicted, b.Predicted), cmp.Compare(a.Actual, b.Actual))
	})

	misses := make([]Miss, 0, min(maxMisses, len(pairs)))
	for _, i := range largest(pairs, maxMisses, gap) {
		r := rows[i]
		m := Miss{Step: r.Step, GroupID: r.GroupID, TrajID: r.TrajID, TaskID: r.TaskID, Predicted: *r.Predicted, True: *r.TrueScore}
		if r.ExecStatus != nil {
			m.ExecStatus = *r.ExecStatus
		}
		if r.ExecDetail != nil {
			m.Cause = execute.Cause(*r.ExecDetail)
		}
		m.WMVerdict, m.WMRationale = verdictOf(r)
		misses = append(misses, m)
	}
	return misses, verdicts
}

type trajKey struct {
	step        int64
	group, traj string
}

func missKey(r archive.Row) trajKey { return trajKey{r.Step, r.GroupID, r.TrajID} }

// largest is the k of items with the largest by, largest first, the
// earlier first among equals: one pass, not a sort of them all (an
// archive has a pair for every anchor trajectory).
func largest(items []int, k int, by func(int) float64) []int {
	top := make([]int, 0, k+1)
	for _, it := range items {
		v := by(it)
		if len(top) == k && v <= by(top[k-1]) {
			continue
		}
		at := len(top)
		for at > 0 && v > by(top[at-1]) {
			at--
		}
		top = slices.Insert(top, at, it)
		if len(top) > k {
			top = top[:k]
		}
	}
	return top
}
