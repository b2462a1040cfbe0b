// Package route chooses which rollout groups are executed for real
// ("anchors"). The Scheduler is pure: the same seed, run step and group set
// give the same choice, so a restarted pipeline re-derives the same anchors.
package route

import (
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"slices"
)

// ErrConfig reports an invalid SchedulerConfig.
var ErrConfig = errors.New("route: invalid config")

// SchedulerConfig sets the anchor share.
type SchedulerConfig struct {
	// Fraction of a step's groups to execute (0.10 in the paper; the
	// released cluster configs use 0.25), made a whole count as Rounding
	// says.
	Fraction float64 `json:"fraction"`
	// Rounding: RoundEven ("" too) or RoundSpread.
	Rounding string `json:"rounding,omitempty"`
	// MinPerStep: at least this many anchor groups per step (within the cap).
	MinPerStep int `json:"min_per_step"`
	// MaxInFlight caps executions in flight, in groups; 0 = no cap. The cap
	// beats the minimum.
	MaxInFlight int `json:"max_in_flight"`
	// Seed makes selection reproducible.
	Seed uint64 `json:"seed"`
}

// DefaultFraction is the paper's anchor share.
const DefaultFraction = 0.10

// How a step's share f*n of its n groups becomes a whole count.
const (
	// RoundEven rounds each step's f*n half to even, as the reference does:
	// 0.10 of 16 groups executes 2 (12.5%) every step.
	RoundEven = "even"
	// RoundSpread spreads the fraction over the steps: step k executes
	// floor(f*n*(k+1) + phase) - floor(f*n*k + phase) groups, the phase
	// drawn from the seed and the run. Any run of consecutive steps with n
	// groups each executes f of their groups to within one group (0.10 of
	// 16: 1 or 2 a step, 1.6 on average), and the count of a step still
	// depends on nothing but the seed, the run, the step and n.
	RoundSpread = "spread"
)

// Roundings lists the accepted Rounding values.
var Roundings = []string{RoundEven, RoundSpread}

// Validate reports the first invalid field.
func (c SchedulerConfig) Validate() error {
	switch {
	case math.IsNaN(c.Fraction) || c.Fraction < 0 || c.Fraction > 1:
		return fmt.Errorf("%w: fraction %v: want [0, 1]", ErrConfig, c.Fraction)
	case c.MinPerStep < 0:
		return fmt.Errorf("%w: min_per_step %d < 0", ErrConfig, c.MinPerStep)
	case c.MaxInFlight < 0:
		return fmt.Errorf("%w: max_in_flight %d < 0", ErrConfig, c.MaxInFlight)
	case c.Rounding != "" && !slices.Contains(Roundings, c.Rounding):
		return fmt.Errorf("%w: rounding %q: want one of %v", ErrConfig, c.Rounding, Roundings)
	}
	return nil
}

// Reasons a group was or was not chosen.
const (
	ReasonDrawn    = "drawn"
	ReasonNotDrawn = "not drawn"
	ReasonCapped   = "drawn, but the in-flight cap was reached"
	ReasonResent   = "sent for execution before a restart"
)

// Decision says what became of one group and why.
type Decision struct {
	GroupID string `json:"group_id"`
	Anchor  bool   `json:"anchor"`
	Reason  string `json:"reason"`
}

// Selection is a step's choice.
type Selection struct {
	Want      int        `json:"want"`   // max(min, f*n made whole), at most n
	Chosen    int        `json:"chosen"` // after the in-flight cap
	Decisions []Decision `json:"decisions"`
}

// Anchors lists the chosen group IDs, in the order of Decisions.
func (s Selection) Anchors() []string {
	var ids []string
	for _, d := range s.Decisions {
		if d.Anchor {
			ids = append(ids, d.GroupID)
		}
	}
	return ids
}

// Scheduler picks anchor groups. It holds no state between steps.
type Scheduler struct{ cfg SchedulerConfig }

// NewScheduler validates the config.
func NewScheduler(cfg SchedulerConfig) (*Scheduler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Scheduler{cfg: cfg}, nil
}

// Count is the number of anchors wanted for a step of n groups with
// inFlight groups already executing: want = max(min, f*n made whole as
// Rounding says), at most n, then at most max(0, cap - inFlight).
func (s *Scheduler) Count(run string, step int64, n, inFlight int) (want, chosen int) {
	want = max(s.cfg.MinPerStep, s.share(run, step, n))
	want = min(want, n)
	chosen = want
	if s.cfg.MaxInFlight > 0 {
		chosen = min(chosen, max(0, s.cfg.MaxInFlight-inFlight))
	}
	return want, chosen
}

// share is f*n made whole.
func (s *Scheduler) share(run string, step int64, n int) int {
	a := s.cfg.Fraction * float64(n)
	if s.cfg.Rounding != RoundSpread {
		return int(math.RoundToEven(a))
	}
	h := fnv.New64a()
	fmt.Fprintf(h, "%s\x00phase", run)
	phase := rand.New(rand.NewPCG(s.cfg.Seed, h.Sum64())).Float64()
	k := float64(step)
	return int(math.Floor(a*(k+1)+phase) - math.Floor(a*k+phase))
}

// Select chooses whole groups uniformly without replacement. The draw
// depends only on the seed, run, step and the set of group IDs (not their
// order); Decisions follow the sorted IDs. With the cap binding, the first
// groups of the draw are kept.
func (s *Scheduler) Select(run string, step int64, groupIDs []string, inFlight int) Selection {
	ids := slices.Clone(groupIDs)
	slices.Sort(ids)
	want, chosen := s.Count(run, step, len(ids), inFlight)
	sel := Selection{Want: want, Chosen: chosen, Decisions: make([]Decision, len(ids))}
	h := fnv.New64a()
	fmt.Fprintf(h, "%s\x00%d", run, step)
	rng := rand.New(rand.NewPCG(s.cfg.Seed, h.Sum64()))
	order := rng.Perm(len(ids))
	rank := make([]int, len(ids))
	for r, i := range order {
		rank[i] = r
	}
	for i, id := range ids {
		d := Decision{GroupID: id, Reason: ReasonNotDrawn}
		switch {
		case rank[i] < chosen:
			d.Anchor, d.Reason = true, ReasonDrawn
		case rank[i] < want:
			d.Reason = ReasonCapped
		}
		sel.Decisions[i] = d
	}
	return sel
}

// Keep makes exactly the groups sent (to execution, before a restart) the
// anchors, so a re-planned step agrees with what execute already has.
// Drawn groups not among them read as capped, as they were when the cap
// first bound.
func (s Selection) Keep(sent []string) Selection {
	out := Selection{Want: s.Want, Decisions: slices.Clone(s.Decisions)}
	for i, d := range out.Decisions {
		was := d.Anchor
		d.Anchor = slices.Contains(sent, d.GroupID)
		switch {
		case d.Anchor && !was:
			d.Reason = ReasonResent
		case !d.Anchor && was:
			d.Reason = ReasonCapped
		}
		if d.Anchor {
			out.Chosen++
		}
		out.Decisions[i] = d
	}
	return out
}
