package offline

import (
	"cmp"
	"math"
	"slices"
	"strings"

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

// missAcc lists, over a stream of rows, the anchor pairs with the largest
// |predicted - true|, and counts the world model's predicted statuses
// against the executions'. It keeps the largest few misses, and of the
// other pairs only the late anchors' (few), not every anchor row: a real
// world model's reasons and an executor's stderr would be kept for each.
//
// A late anchor's pair row has no verdict of its own: its step's
// world-model row of the same trajectory has it, which may come before or
// after it (another file), so late pairs without one are settled at the
// end.
type missAcc struct {
	said    map[trajKey]said // anchor groups' world-model rows with a verdict
	counts  map[[2]string]int
	pending []pendingPair // late pairs whose verdict was not known when they came
	top     top[candidate]
}

// said is what the world model said of a trajectory: the status it
// predicted ("" when none) and why.
type said struct{ verdict, rationale string }

// saidOf is what r says, as values: a decoded row's pointers point into
// its row group's columns, which are not to be kept.
func saidOf(r archive.Row) said {
	var s said
	if r.WMVerdict != nil {
		s.verdict = *r.WMVerdict
	}
	if r.WMRationale != nil {
		s.rationale = *r.WMRationale
	}
	return s
}

type pendingPair struct {
	key    trajKey
	status string
}

// candidate is a pair among the largest misses so far; settled is false
// while its verdict may be on a world-model row still to come.
type candidate struct {
	Miss
	gap     float64
	settled bool
}

func newMissAcc() *missAcc {
	return &missAcc{said: map[trajKey]said{}, counts: map[[2]string]int{},
		top: top[candidate]{k: maxMisses, by: func(c candidate) float64 { return c.gap }}}
}

func (m *missAcc) add(r archive.Row) {
	switch {
	case r.Predicted == nil || r.TrueScore == nil || !r.IsAnchor:
		if r.IsAnchor && r.Source == archive.SourceWorldModel && r.WMVerdict != nil {
			m.said[missKey(r)] = saidOf(r)
		}
		return
	case r.Source == archive.SourceWorldModel:
		return
	}
	s, settled := saidOf(r), true
	if r.WMVerdict == nil {
		s, settled = m.said[missKey(r)]
		settled = settled || r.Source != archive.SourceLateAnchor
	}
	switch {
	case r.ExecStatus == nil:
	case s.verdict != "":
		m.counts[[2]string{s.verdict, *r.ExecStatus}]++
	case !settled:
		m.pending = append(m.pending, pendingPair{missKey(r), *r.ExecStatus})
	}
	gap := math.Abs(*r.Predicted - *r.TrueScore)
	if !m.top.wants(gap) {
		return
	}
	c := candidate{Miss: Miss{Step: r.Step, GroupID: r.GroupID, TrajID: r.TrajID, TaskID: r.TaskID,
		Predicted: *r.Predicted, True: *r.TrueScore, WMVerdict: s.verdict, WMRationale: s.rationale}, gap: gap, settled: settled}
	if r.ExecStatus != nil {
		c.ExecStatus = *r.ExecStatus
	}
	if r.ExecDetail != nil {
		c.Cause = strings.Clone(execute.Cause(*r.ExecDetail)) // not the whole detail it is cut from
	}
	m.top.add(c)
}

// result is the largest misses, largest first, and the verdicts counted
// (nil when the world model predicted none).
func (m *missAcc) result() ([]Miss, []VerdictCount) {
	for _, p := range m.pending {
		if s := m.said[p.key]; s.verdict != "" {
			m.counts[[2]string{s.verdict, p.status}]++
		}
	}
	var verdicts []VerdictCount
	for k, n := range m.counts {
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

	misses := make([]Miss, 0, len(m.top.items))
	for _, c := range m.top.items {
		if !c.settled {
			s := m.said[trajKey{c.Step, c.GroupID, c.TrajID}]
			c.WMVerdict, c.WMRationale = s.verdict, s.rationale
		}
		misses = append(misses, c.Miss)
	}
	return misses, verdicts
}

type trajKey struct {
	step        int64
	group, traj string
}

func missKey(r archive.Row) trajKey { return trajKey{r.Step, r.GroupID, r.TrajID} }

// top keeps the k items added with the largest by, largest first, the
// earlier first among equals: what a stable sort of them all would put
// first, without keeping them all (an archive has a pair for every anchor
// trajectory).
type top[T any] struct {
	k     int
	by    func(T) float64
	items []T
}

// wants reports whether an item with by v would be kept.
func (t *top[T]) wants(v float64) bool {
	return t.k > 0 && (len(t.items) < t.k || v > t.by(t.items[t.k-1]))
}

func (t *top[T]) add(it T) {
	v := t.by(it)
	if !t.wants(v) {
		return
	}
	at := len(t.items)
	for at > 0 && v > t.by(t.items[at-1]) {
		at--
	}
	t.items = slices.Insert(t.items, at, it)
	if len(t.items) > t.k {
		t.items = t.items[:t.k]
	}
}
