package calibrate

import (
	"errors"
	"fmt"
	"math"
)

// ErrConfig reports an invalid DebiaserConfig.
var ErrConfig = errors.New("calibrate: invalid config")

// Pair is one anchor observation: what the world model predicted for a
// trajectory and the score real execution gave it.
type Pair struct {
	Predicted float64 `json:"predicted"`
	True      float64 `json:"true"`
}

// DebiaserConfig sets how the online debiaser learns. The zero value of each
// count means its reference default; DefaultDebiaserConfig returns the
// project's defaults (the reference's but for BeforeFit).
type DebiaserConfig struct {
	// MinPairs: no map is fitted until this many pairs are buffered;
	// BeforeFit says what scores map to until then.
	MinPairs int `json:"min_pairs"`
	// BeforeFit is the map before the first fit: BeforeFitIdentity (the
	// reference: raw world-model scores) or BeforeFitMean (every score maps
	// to the mean true score buffered so far, so an unchecked world model
	// gives no within-group signal). "" is BeforeFitIdentity.
	BeforeFit string `json:"before_fit,omitempty"`
	// RefitEvery: refit after this many pairs since the last successful fit.
	RefitEvery int `json:"refit_every"`
	// BufferSize caps the pairs kept (FIFO); every fit uses the whole buffer.
	BufferSize int `json:"buffer_size"`
	// Bins > 0 first averages pairs into that many equal-width bins of the
	// world-model score on [0, 1] (the reference does, with 10) and fits the
	// bin means weighted by count. 0 fits the raw pairs.
	Bins int `json:"bins"`
	// HalfLife > 0 down-weights old pairs: a pair's weight halves for every
	// HalfLife pairs pushed after it, so a drifting policy does not keep a
	// stale bias. 0 weighs all buffered pairs equally (the reference).
	HalfLife float64 `json:"half_life,omitempty"`
	// Lo and Hi, when set, clip the map's output (scores are often
	// percentiles in [0, 1]). nil is an open side.
	Lo *float64 `json:"lo,omitempty"`
	Hi *float64 `json:"hi,omitempty"`
}

// BeforeFit values.
const (
	BeforeFitIdentity = "identity"
	BeforeFitMean     = "mean"
)

// Reference defaults of the released WMRL code.
const (
	DefaultMinPairs   = 200
	DefaultRefitEvery = 64
	DefaultBufferSize = 5000
	DefaultBins       = 10
)

// DefaultDebiaserConfig is the reference configuration (no fit before 200
// pairs, refit every 64, FIFO buffer of 5000, 10 bins, no decay, no bounds)
// but for BeforeFit: BeforeFitMean instead of the identity. With the
// identity, an anti-correlated world model trains the policy the wrong way
// for the steps before the first fit; under Adam, in wmrl sim, that left
// WMRL at 0.47 where the flat map reaches 0.76 (the README has the whole
// measurement). Set BeforeFit to BeforeFitIdentity for the reference whole.
func DefaultDebiaserConfig() DebiaserConfig {
	return DebiaserConfig{
		MinPairs:   DefaultMinPairs,
		RefitEvery: DefaultRefitEvery,
		BufferSize: DefaultBufferSize,
		Bins:       DefaultBins,
		BeforeFit:  BeforeFitMean,
	}
}

func (c *DebiaserConfig) setDefaults() {
	if c.MinPairs == 0 {
		c.MinPairs = DefaultMinPairs
	}
	if c.RefitEvery == 0 {
		c.RefitEvery = DefaultRefitEvery
	}
	if c.BufferSize == 0 {
		c.BufferSize = DefaultBufferSize
	}
}

// FirstFit is the number of pairs at which the first fit is tried: the
// later of MinPairs and RefitEvery, as the cadence counts pushes from
// construction.
func (c DebiaserConfig) FirstFit() int {
	c = c.Effective()
	return max(c.MinPairs, c.RefitEvery)
}

// Effective is the configuration in force: zero counts that have a
// default (MinPairs, RefitEvery, BufferSize) take it.
func (c DebiaserConfig) Effective() DebiaserConfig {
	c.setDefaults()
	return c
}

// Validate reports the first invalid field.
func (c DebiaserConfig) Validate() error {
	switch {
	case c.MinPairs < 0:
		return fmt.Errorf("%w: min_pairs %d < 0", ErrConfig, c.MinPairs)
	case c.RefitEvery < 1:
		return fmt.Errorf("%w: refit_every %d < 1", ErrConfig, c.RefitEvery)
	case c.BufferSize < 2:
		return fmt.Errorf("%w: buffer_size %d < 2", ErrConfig, c.BufferSize)
	case c.BufferSize < c.MinPairs:
		return fmt.Errorf("%w: buffer_size %d < min_pairs %d: the map would never be fitted", ErrConfig, c.BufferSize, c.MinPairs)
	case c.BeforeFit != "" && c.BeforeFit != BeforeFitIdentity && c.BeforeFit != BeforeFitMean:
		return fmt.Errorf("%w: before_fit %q: want %q or %q", ErrConfig, c.BeforeFit, BeforeFitIdentity, BeforeFitMean)
	case c.Bins < 0 || c.Bins == 1:
		return fmt.Errorf("%w: bins %d: want 0 (no binning) or at least 2", ErrConfig, c.Bins)
	case c.HalfLife < 0 || math.IsNaN(c.HalfLife) || math.IsInf(c.HalfLife, 0):
		return fmt.Errorf("%w: half_life %v: want a finite number >= 0", ErrConfig, c.HalfLife)
	case c.Lo != nil && !finite(*c.Lo), c.Hi != nil && !finite(*c.Hi):
		return fmt.Errorf("%w: bounds must be finite (leave a side unset to open it)", ErrConfig)
	case c.Lo != nil && c.Hi != nil && *c.Lo > *c.Hi:
		return fmt.Errorf("%w: lo %v > hi %v", ErrConfig, *c.Lo, *c.Hi)
	}
	return nil
}

func (c DebiaserConfig) bounds() (lo, hi float64) {
	lo, hi = math.Inf(-1), math.Inf(1)
	if c.Lo != nil {
		lo = *c.Lo
	}
	if c.Hi != nil {
		hi = *c.Hi
	}
	return lo, hi
}

// Debiaser learns a monotone map from world-model score to true score from
// anchor pairs as they stream in. It keeps a FIFO buffer of pairs, fits no
// map until MinPairs are buffered (mapping scores as BeforeFit says until
// then), and refits every RefitEvery pairs;
// each successful refit bumps Version. A failed fit (fewer than two distinct
// world-model scores or populated bins) changes nothing and is retried on the
// next push, as in the reference.
//
// A Debiaser is not safe for concurrent use.
type Debiaser struct {
	cfg      DebiaserConfig
	ring     []Pair // capacity BufferSize; oldest at head
	head     int
	size     int
	pushed   int64
	sinceFit int
	version  int64
	m        *Isotonic // nil: not fitted yet
	prior    *Isotonic // before the first fit with BeforeFitMean: flat at the buffered mean

	// scratch for fits, reused
	xs, ys, ws []float64
}

// NewDebiaser returns an empty debiaser (the identity, version 0).
func NewDebiaser(cfg DebiaserConfig) (*Debiaser, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Debiaser{cfg: cfg, ring: make([]Pair, cfg.BufferSize)}, nil
}

// Config returns the configuration in force (defaults filled in).
func (d *Debiaser) Config() DebiaserConfig { return d.cfg }

// Version counts successful refits; 0 is before the first fit.
func (d *Debiaser) Version() int64 { return d.version }

// Pairs is how many pairs are buffered now; Pushed how many were ever pushed.
func (d *Debiaser) Pairs() int    { return d.size }
func (d *Debiaser) Pushed() int64 { return d.pushed }

// Map is the map in force: the last fit, or before it the flat map of
// BeforeFitMean once a pair is buffered; nil means the identity.
func (d *Debiaser) Map() *Isotonic {
	if d.m == nil {
		return d.prior
	}
	return d.m
}

// Predict maps a world-model score through the map in force.
func (d *Debiaser) Predict(x float64) float64 {
	if m := d.Map(); m != nil {
		return m.Predict(x)
	}
	return x
}

// Push adds one pair and refits when the cadence says so. It reports whether
// a new map was fitted (BeforeFitMean's flat map moves with every push
// before the first fit, and does not count). A non-finite pair is rejected
// with ErrNonFinite and changes nothing.
func (d *Debiaser) Push(p Pair) (refit bool, err error) {
	if !finite(p.Predicted) || !finite(p.True) {
		return false, fmt.Errorf("%w: pair (%v, %v)", ErrNonFinite, p.Predicted, p.True)
	}
	n := len(d.ring)
	if d.size < n {
		d.ring[(d.head+d.size)%n] = p
		d.size++
	} else {
		d.ring[d.head] = p
		d.head = (d.head + 1) % n
	}
	d.pushed++
	d.sinceFit++
	if d.size < d.cfg.MinPairs || d.sinceFit < d.cfg.RefitEvery {
		d.setPrior()
		return false, nil
	}
	m := d.fit()
	if m == nil {
		d.setPrior()
		return false, nil
	}
	d.m, d.prior, d.version, d.sinceFit = m, nil, d.version+1, 0
	return true, nil
}

// setPrior recomputes the flat map in force before the first fit, under
// BeforeFitMean.
func (d *Debiaser) setPrior() {
	if d.m != nil || d.cfg.BeforeFit != BeforeFitMean || d.size == 0 {
		return
	}
	sx, sy, sw := 0.0, 0.0, 0.0
	for i := 0; i < d.size; i++ {
		p, w := d.at(i), d.weight(i)
		sx, sy, sw = sx+w*p.Predicted, sy+w*p.True, sw+w
	}
	lo, hi := d.cfg.bounds()
	m, err := NewIsotonic([]float64{sx / sw}, []float64{min(hi, max(lo, sy/sw))})
	if err == nil { // pairs are finite, so their means are
		d.prior = m
	}
}

// at returns the i-th buffered pair, oldest first.
func (d *Debiaser) at(i int) Pair { return d.ring[(d.head+i)%len(d.ring)] }

// weight of the i-th buffered pair under the configured decay.
func (d *Debiaser) weight(i int) float64 {
	if d.cfg.HalfLife == 0 {
		return 1
	}
	return math.Exp2(-float64(d.size-1-i) / d.cfg.HalfLife)
}

// fit builds a map from the whole buffer, or returns nil when there is not
// enough to fit.
func (d *Debiaser) fit() *Isotonic {
	if d.size < 2 {
		return nil
	}
	d.xs, d.ys, d.ws = d.xs[:0], d.ys[:0], d.ws[:0]
	if d.cfg.Bins > 0 {
		d.binMeans()
	} else {
		for i := 0; i < d.size; i++ {
			p := d.at(i)
			d.xs, d.ys, d.ws = append(d.xs, p.Predicted), append(d.ys, p.True), append(d.ws, d.weight(i))
		}
	}
	if len(d.xs) < 2 {
		return nil
	}
	lo, hi := d.cfg.bounds()
	m, err := FitIsotonic(d.xs, d.ys, d.ws, WithBounds(lo, hi))
	if err != nil || m.Len() < 1 {
		return nil
	}
	if dlo, dhi := m.Domain(); dlo == dhi {
		return nil // a single distinct score: no slope to learn
	}
	return m
}

// binMeans fills xs, ys, ws with the weighted mean score, mean true value and
// total weight of every populated bin, in bin order.
func (d *Debiaser) binMeans() {
	bins := d.cfg.Bins
	edges := binEdges(bins)
	sx := make([]float64, bins)
	sy := make([]float64, bins)
	sw := make([]float64, bins)
	for i := 0; i < d.size; i++ {
		p := d.at(i)
		b := binOf(edges, p.Predicted)
		w := d.weight(i)
		sx[b] += w * p.Predicted
		sy[b] += w * p.True
		sw[b] += w
	}
	for b := range bins {
		if sw[b] > 0 {
			d.xs = append(d.xs, sx[b]/sw[b])
			d.ys = append(d.ys, sy[b]/sw[b])
			d.ws = append(d.ws, sw[b])
		}
	}
}

// binEdges are numpy's linspace(0, 1, bins+1): i * (1/bins), last exactly 1.
// For 10 bins the edge 0.3 is 0.30000000000000004, as in the reference.
func binEdges(bins int) []float64 {
	step := 1 / float64(bins)
	e := make([]float64, bins+1)
	for i := range e {
		e[i] = float64(i) * step
	}
	e[bins] = 1
	return e
}

// binOf is the number of inner edges <= x, so values below 0 fall in the
// first bin and values of 1 and above in the last.
func binOf(edges []float64, x float64) int {
	inner := edges[1 : len(edges)-1]
	lo, hi := 0, len(inner) // first inner edge > x lies in [lo, hi]
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if inner[mid] <= x {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	return lo
}
