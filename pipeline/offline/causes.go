package offline

import (
	"cmp"
	"slices"

	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/execute"
)

// Cause is one kind of failed execution among the anchor pairs: those whose
// recorded detail comes to the same execute.Cause, with one as an example.
type Cause struct {
	Cause  string `json:"cause"`
	Status string `json:"status"`
	Pairs  int    `json:"pairs"`
	// Share of the failed anchor pairs; MeanPredicted the world model's
	// mean score for them (a world model that sees the failure coming
	// scores it low).
	Share         float64 `json:"share"`
	MeanPredicted Num     `json:"mean_predicted"`
	// The first such failure: its detail as recorded, and where.
	Example string `json:"example"`
	Step    int64  `json:"step"`
	GroupID string `json:"group_id"`
	TrajID  string `json:"traj_id"`
}

// maxCauses bounds the causes an audit lists; the rest are counted in
// OtherCauses.
const maxCauses = 20

// causeCounter groups failed anchor pairs by cause.
type causeCounter struct {
	byKey    map[[2]string]*Cause
	failures int
	// noDetail: failures recorded without a detail (an archive from before
	// exec_detail, or an executor that says nothing).
	noDetail int
}

func (c *causeCounter) add(r archive.Row, predicted float64) {
	c.failures++
	if r.ExecDetail == nil {
		c.noDetail++
		return
	}
	key := [2]string{*r.ExecStatus, execute.Cause(*r.ExecDetail)}
	if c.byKey == nil {
		c.byKey = map[[2]string]*Cause{}
	}
	k := c.byKey[key]
	if k == nil {
		k = &Cause{Cause: key[1], Status: key[0], Example: *r.ExecDetail, Step: r.Step, GroupID: r.GroupID, TrajID: r.TrajID}
		c.byKey[key] = k
	}
	k.Pairs++
	k.MeanPredicted += Num(predicted)
}

// result is the causes, most frequent first, at most maxCauses, and how
// many kinds were left out.
func (c *causeCounter) result() (causes []Cause, others int) {
	for _, k := range c.byKey {
		k.Share = float64(k.Pairs) / float64(c.failures)
		k.MeanPredicted /= Num(k.Pairs)
		causes = append(causes, *k)
	}
	slices.SortFunc(causes, func(a, b Cause) int {
		return cmp.Or(cmp.Compare(b.Pairs, a.Pairs), cmp.Compare(a.Status, b.Status), cmp.Compare(a.Cause, b.Cause))
	})
	if len(causes) > maxCauses {
		others = len(causes) - maxCauses
		causes = causes[:maxCauses]
	}
	return causes, others
}
