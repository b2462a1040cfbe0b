package offline

import (
	"cmp"
	"math"
	"slices"

	"github.com/wmrl/wmrl/stages/fuse"
)

// Length-bias verdicts.
const (
	LengthOverrated  = "it rates longer solutions above what they score"
	LengthUnderrated = "it rates longer solutions below what they score"
	LengthNone       = "no clear bias by length"
	LengthTooFew     = "too few anchor groups with lengths to tell"
)

// FewLengths is the count of distinct lengths under which a bias by
// length is said to be perhaps one by solution.
const FewLengths = 20

// LengthBands is how many bands of equal pairs the solutions' lengths
// are split into; LengthMinGroups the anchor groups a verdict needs.
const (
	LengthBands     = 5
	LengthMinGroups = 10
)

// LengthLevel is the anchor pairs of one band of solution length.
type LengthLevel struct {
	// Bytes is the band's shortest and longest response.
	Bytes     [2]int64 `json:"bytes"`
	Pairs     int      `json:"pairs"`
	MeanBytes float64  `json:"mean_bytes"`
	// ResidualBefore is the mean of predicted minus true;
	// ResidualMonotone after the run-wide cross-fitted monotone map.
	ResidualBefore   Num `json:"residual_before"`
	ResidualMonotone Num `json:"residual_monotone"`
}

// LengthBias is the world model's error by the length of the solution.
// An LLM judge that rates longer solutions higher, whatever they score,
// makes an error no monotone map of its score removes: within a group it
// ranks the longer solutions up, and GRPO then teaches the policy to
// write longer.
type LengthBias struct {
	Pairs int `json:"pairs"`
	// Distinct counts the lengths the pairs have: with few (a policy that
	// writes a handful of solutions), a length stands for which solution
	// it is, and a bias by length may be one by solution.
	Distinct int           `json:"distinct_lengths"`
	Levels   []LengthLevel `json:"levels"`
	// WithinSpearman is the mean over Groups anchor groups of the rank
	// correlation, within the group, between a solution's length and its
	// residual after the monotone map (positive: the longer, the more
	// overrated), and SE its standard error.
	WithinSpearman Num    `json:"within_group_spearman"`
	SE             Num    `json:"se"`
	Groups         int    `json:"groups"`
	Verdict        string `json:"verdict"`
}

// lengthBias measures the residual by length over the pairs whose
// response length is known; nil when none is.
func lengthBias(pairs []pairRow, maps crossMaps) *LengthBias {
	type pl struct {
		bytes             int64
		before, monotonic float64
		group             string
	}
	var ps []pl
	for _, p := range pairs {
		if p.bytes < 0 {
			continue
		}
		after := p.pred - p.truth
		if maps.ok() {
			after = maps.at(p) - p.truth
		}
		ps = append(ps, pl{p.bytes, p.pred - p.truth, after, p.group})
	}
	if len(ps) == 0 {
		return nil
	}
	lb := &LengthBias{Pairs: len(ps)}
	seen := map[int64]bool{}
	for _, p := range ps {
		seen[p.bytes] = true
	}
	lb.Distinct = len(seen)
	type band struct {
		bytes             int64
		before, monotonic float64
	}
	byLen := make([]band, len(ps))
	for i, p := range ps {
		byLen[i] = band{p.bytes, p.before, p.monotonic}
	}
	slices.SortFunc(byLen, func(a, b band) int { return cmp.Compare(a.bytes, b.bytes) })
	for b := range LengthBands {
		band := byLen[b*len(byLen)/LengthBands : (b+1)*len(byLen)/LengthBands]
		if len(band) == 0 {
			continue
		}
		l := LengthLevel{Bytes: [2]int64{band[0].bytes, band[len(band)-1].bytes}, Pairs: len(band)}
		var sb, sm float64
		for _, p := range band {
			l.MeanBytes += float64(p.bytes)
			sb += p.before
			sm += p.monotonic
		}
		n := float64(len(band))
		l.MeanBytes /= n
		l.ResidualBefore, l.ResidualMonotone = Num(sb/n), Num(math.NaN())
		if maps.ok() {
			l.ResidualMonotone = Num(sm / n)
		}
		lb.Levels = append(lb.Levels, l)
	}
	groups := map[string][]pl{}
	var order []string
	for _, p := range ps {
		if groups[p.group] == nil {
			order = append(order, p.group)
		}
		groups[p.group] = append(groups[p.group], p)
	}
	var rs []float64
	for _, k := range order {
		g := groups[k]
		x, y := make([]float64, len(g)), make([]float64, len(g))
		for i, p := range g {
			x[i], y[i] = float64(p.bytes), p.monotonic
		}
		if r := fuse.Spearman(x, y); !math.IsNaN(r) {
			rs = append(rs, r)
		}
	}
	lb.Groups = len(rs)
	mean, se := meanSE(rs)
	lb.WithinSpearman, lb.SE = Num(mean), Num(se)
	switch {
	case lb.Groups < LengthMinGroups || !maps.ok():
		lb.Verdict = LengthTooFew
	case mean > 2*se:
		lb.Verdict = LengthOverrated
	case mean < -2*se:
		lb.Verdict = LengthUnderrated
	default:
		lb.Verdict = LengthNone
	}
	return lb
}
