package fuse

// Item is one trajectory of a group as fusion sees it.
type Item struct {
	TrajID string
	// Reward is the true score for an anchor group, the calibrated
	// world-model score otherwise.
	Reward float64
	// Graded is false when there is no usable score (an unparseable world-model
	// reply, a sandbox error): the item is dropped, never scored as 0.
	Graded bool
}

// Group is one rollout group of a step.
type Group struct {
	ID     string
	Anchor bool // rewards come from real execution
	Items  []Item
}

// Source names where an item's reward came from, as on the wire.
const (
	SourceAnchor     = "anchor"
	SourceWorldModel = "world_model"
)

// ItemResult is one trajectory's share of the step's gradient.
type ItemResult struct {
	TrajID  string
	GroupID string
	Source  string // SourceAnchor or SourceWorldModel
	Reward  float64
	Graded  bool
	// Advantage is the group-relative advantage A_i (0 when dropped).
	Advantage float64
	// Weight is w_i: rho for anchor trajectories, 1 otherwise, 0 when the
	// item does not contribute (ungraded or in a skipped group).
	Weight float64
	// FusedAdvantage = A_i * w_i * m / (rho*|A| + |W|): a trainer that
	// averages FusedAdvantage * grad log pi over the step follows the fused
	// gradient exactly (equal graded group sizes; see Fuse).
	FusedAdvantage float64
}

// Skip records a group that does not contribute and why.
type Skip struct {
	GroupID string
	Reason  string
}

// SkipTooFewGraded is the reason given for groups with fewer than 2 graded
// trajectories.
const SkipTooFewGraded = "fewer than 2 graded trajectories"

// StepResult is a fused step.
type StepResult struct {
	Rho     float64
	Groups  int // groups that contribute (m = |A| + |W|)
	Anchors int // anchor groups that contribute (|A|)
	Items   []ItemResult
	Skipped []Skip
}

// Fuse turns a step's groups into per-trajectory fused advantages:
//
//	fused_i = A_i * w_i * m / (rho*|A| + |W|),  w_i = rho for anchors, 1 otherwise,
//
// where m, |A| and |W| count only the groups that contribute (at least two
// graded trajectories). Every input item appears in the result, in input
// order; those that do not contribute carry zeros.
//
// For any per-trajectory vectors x_i, the mean over contributing groups of
// the group mean of fused_i * x_i equals (rho*g_E + g_WM)/(rho*|A| + |W|);
// when contributing groups have equal graded sizes this is also the plain
// mean over the step's graded trajectories.
func Fuse(groups []Group, rho float64, norm Normalization) StepResult {
	res := StepResult{Rho: rho}
	advs := make([][]float64, len(groups))
	var rewards []float64
	var graded []bool
	for gi, g := range groups {
		rewards, graded = rewards[:0], graded[:0]
		for _, it := range g.Items {
			rewards = append(rewards, it.Reward)
			graded = append(graded, it.Graded)
		}
		a, ok := Advantages(nil, rewards, graded, norm)
		if !ok {
			res.Skipped = append(res.Skipped, Skip{GroupID: g.ID, Reason: SkipTooFewGraded})
			continue
		}
		advs[gi] = a
		res.Groups++
		if g.Anchor {
			res.Anchors++
		}
	}
	denom := rho*float64(res.Anchors) + float64(res.Groups-res.Anchors)
	scale := 0.0
	if denom > 0 {
		scale = float64(res.Groups) / denom
	}
	for gi, g := range groups {
		src, w := SourceWorldModel, 1.0
		if g.Anchor {
			src, w = SourceAnchor, rho
		}
		for ii, it := range g.Items {
			r := ItemResult{TrajID: it.TrajID, GroupID: g.ID, Source: src, Reward: it.Reward, Graded: it.Graded}
			if advs[gi] != nil && it.Graded {
				r.Advantage = advs[gi][ii]
				r.Weight = w
				r.FusedAdvantage = r.Advantage * w * scale
			}
			res.Items = append(res.Items, r)
		}
	}
	return res
}
