package calibrate

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
)

// Errors returned by FitIsotonic and NewIsotonic. Compare with errors.Is; the
// wrapped message names the offending argument and index.
var (
	ErrEmpty          = errors.New("isotonic: no points")
	ErrLength         = errors.New("isotonic: mismatched lengths")
	ErrNonFinite      = errors.New("isotonic: NaN or Inf value")
	ErrNegativeWeight = errors.New("isotonic: negative weight")
	ErrZeroWeight     = errors.New("isotonic: all weights are zero")
	ErrBounds         = errors.New("isotonic: invalid bounds")
	ErrThresholds     = errors.New("isotonic: invalid thresholds")
)

// Isotonic is a fitted non-decreasing map from x to y. It predicts by linear
// interpolation between its thresholds and is flat outside them, exactly as
// scikit-learn's IsotonicRegression(out_of_bounds="clip").
//
// An Isotonic is immutable after construction and safe for concurrent use.
type Isotonic struct {
	x, y []float64 // thresholds: x strictly increasing, y non-decreasing

	// A bucket index over [x[0], x[n-1]]: bucket[b] is the largest j with
	// x[j] <= x[0] + b/inv. A query jumps to its bucket and searches only
	// the thresholds inside it.
	bucket []int32
	inv    float64
}

// newIsotonic takes ownership of valid thresholds and builds the index.
func newIsotonic(x, y []float64) *Isotonic {
	m := &Isotonic{x: x, y: y}
	n := len(x)
	if n < 2 {
		return m
	}
	nb := 2 * n
	m.inv = float64(nb) / (x[n-1] - x[0])
	if math.IsInf(m.inv, 0) || math.IsNaN(m.inv) {
		return m // a range too narrow to divide: plain search
	}
	m.bucket = make([]int32, nb+1)
	j := 0
	for b := range m.bucket {
		start := x[0] + float64(b)/m.inv
		for j < n-1 && x[j+1] <= start {
			j++
		}
		m.bucket[b] = int32(j)
	}
	return m
}

// IsotonicOption tweaks a fit.
type IsotonicOption func(*isotonicConfig)

type isotonicConfig struct {
	lo, hi float64
}

// WithBounds clips the fitted values to [lo, hi] after the fit (not inside
// it), as scikit-learn's y_min / y_max do. Use math.Inf for an open side.
func WithBounds(lo, hi float64) IsotonicOption {
	return func(c *isotonicConfig) { c.lo, c.hi = lo, hi }
}

type point struct{ x, y, w float64 }

// FitIsotonic fits a weighted non-decreasing isotonic regression of y on x
// with scikit-learn 1.2.1 semantics: points of weight 0 are dropped, the rest
// sorted by x, equal x merged into their weighted mean, pooled by
// pool-adjacent-violators, clipped to the bounds, and reduced to the first and
// last point of every constant run. w may be nil (all ones).
func FitIsotonic(x, y, w []float64, opts ...IsotonicOption) (*Isotonic, error) {
	cfg := isotonicConfig{lo: math.Inf(-1), hi: math.Inf(1)}
	for _, o := range opts {
		o(&cfg)
	}
	if math.IsNaN(cfg.lo) || math.IsNaN(cfg.hi) || cfg.lo > cfg.hi {
		return nil, fmt.Errorf("%w: lo=%v hi=%v", ErrBounds, cfg.lo, cfg.hi)
	}
	pts, err := collect(x, y, w)
	if err != nil {
		return nil, err
	}
	sortPoints(pts)
	ux, uy, uw := makeUnique(pts)
	pava(uy, uw)
	if !math.IsInf(cfg.lo, -1) || !math.IsInf(cfg.hi, 1) {
		for i, v := range uy {
			uy[i] = min(max(v, cfg.lo), cfg.hi)
		}
	}
	tx, ty := trim(ux, uy)
	return newIsotonic(tx, ty), nil
}

// collect validates the input and returns the points of positive weight.
func collect(x, y, w []float64) ([]point, error) {
	if len(x) != len(y) {
		return nil, fmt.Errorf("%w: x has %d values, y has %d", ErrLength, len(x), len(y))
	}
	if w != nil && len(w) != len(x) {
		return nil, fmt.Errorf("%w: x has %d values, w has %d", ErrLength, len(x), len(w))
	}
	if len(x) == 0 {
		return nil, ErrEmpty
	}
	pts := make([]point, 0, len(x))
	for i := range x {
		wi := 1.0
		if w != nil {
			wi = w[i]
		}
		switch {
		case !finite(x[i]):
			return nil, fmt.Errorf("%w: x[%d] = %v", ErrNonFinite, i, x[i])
		case !finite(y[i]):
			return nil, fmt.Errorf("%w: y[%d] = %v", ErrNonFinite, i, y[i])
		case !finite(wi):
			return nil, fmt.Errorf("%w: w[%d] = %v", ErrNonFinite, i, wi)
		case wi < 0:
			return nil, fmt.Errorf("%w: w[%d] = %v", ErrNegativeWeight, i, wi)
		case wi > 0:
			pts = append(pts, point{x[i], y[i], wi})
		}
	}
	if len(pts) == 0 {
		return nil, fmt.Errorf("%w (%d points)", ErrZeroWeight, len(x))
	}
	return pts, nil
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

// makeUnique merges sorted points whose x differ by less than float64
// resolution (1e-15, scikit-learn's eps) into one point at the first x, with
// the weighted mean y and the summed weight.
func makeUnique(pts []point) (x, y, w []float64) {
	const eps = 1e-15
	x = make([]float64, 0, len(pts))
	y = make([]float64, 0, len(pts))
	w = make([]float64, 0, len(pts))
	cx, cy, cw := pts[0].x, 0.0, 0.0
	for _, p := range pts {
		if p.x-cx >= eps {
			x, y, w = append(x, cx), append(y, cy/cw), append(w, cw)
			cx, cy, cw = p.x, p.y*p.w, p.w
			continue
		}
		cw += p.w
		cy += p.y * p.w
	}
	return append(x, cx), append(y, cy/cw), append(w, cw)
}

// pava runs weighted pool-adjacent-violators in place on y (and w), pooling
// whenever a value is not strictly below its successor. It is a port of
// scikit-learn's _inplace_contiguous_isotonic_regression: single pass with
// backtracking, O(n).
func pava(y, w []float64) {
	n := len(y)
	target := make([]int, n) // for an active block [i..j]: target[i] = j, target[j] = i
	for i := range target {
		target[i] = i
	}
	for i := 0; i < n; {
		k := target[i] + 1
		if k == n {
			break
		}
		if y[i] < y[k] {
			i = k
			continue
		}
		sumWY, sumW := w[i]*y[i], w[i]
		for {
			prev := y[k]
			sumWY += w[k] * y[k]
			sumW += w[k]
			k = target[k] + 1
			if k == n || prev < y[k] {
				y[i] = sumWY / sumW
				w[i] = sumW
				target[i] = k - 1
				target[k-1] = i
				if i > 0 {
					i = target[i-1]
				}
				break
			}
		}
	}
	for i := 0; i < n; {
		k := target[i] + 1
		for j := i + 1; j < k; j++ {
			y[j] = y[i]
		}
		i = k
	}
}

// trim keeps the first and last point and every point whose value differs
// from one of its neighbours.
func trim(x, y []float64) ([]float64, []float64) {
	n := len(y)
	if n <= 2 {
		return x, y
	}
	tx, ty := x[:1], y[:1] // in place: writes never overtake reads
	for i := 1; i < n-1; i++ {
		if y[i] != y[i-1] || y[i] != y[i+1] {
			tx, ty = append(tx, x[i]), append(ty, y[i])
		}
	}
	return append(tx, x[n-1]), append(ty, y[n-1])
}

// NewIsotonic restores a map from its thresholds, as returned by Thresholds.
// x must be strictly increasing and y non-decreasing, both finite and of the
// same non-zero length.
func NewIsotonic(x, y []float64) (*Isotonic, error) {
	if len(x) != len(y) {
		return nil, fmt.Errorf("%w: %d x thresholds, %d y thresholds", ErrThresholds, len(x), len(y))
	}
	if len(x) == 0 {
		return nil, fmt.Errorf("%w: none", ErrThresholds)
	}
	for i := range x {
		if !finite(x[i]) || !finite(y[i]) {
			return nil, fmt.Errorf("%w: threshold %d is (%v, %v)", ErrThresholds, i, x[i], y[i])
		}
		if i > 0 && (x[i] <= x[i-1] || y[i] < y[i-1]) {
			return nil, fmt.Errorf("%w: threshold %d (%v, %v) does not follow (%v, %v) monotonically",
				ErrThresholds, i, x[i], y[i], x[i-1], y[i-1])
		}
	}
	return newIsotonic(slices.Clone(x), slices.Clone(y)), nil
}

// Thresholds returns copies of the map's breakpoints.
func (m *Isotonic) Thresholds() (x, y []float64) {
	return slices.Clone(m.x), slices.Clone(m.y)
}

// Len is the number of thresholds.
func (m *Isotonic) Len() int { return len(m.x) }

// Domain is the fitted x range [X_min, X_max]; queries outside are clamped.
func (m *Isotonic) Domain() (lo, hi float64) { return m.x[0], m.x[len(m.x)-1] }

// Predict maps one value. It interpolates linearly between thresholds and
// clamps x to the fitted range first, as numpy.interp does. NaN maps to NaN.
func (m *Isotonic) Predict(x float64) float64 {
	xs, ys := m.x, m.y
	n := len(xs)
	if n == 1 || math.IsNaN(x) {
		if math.IsNaN(x) {
			return x
		}
		return ys[0]
	}
	if x <= xs[0] {
		return ys[0]
	}
	if x >= xs[n-1] {
		return ys[n-1]
	}
	// Largest j with xs[j] <= x; 0 <= j < n-1 here.
	lo, span := 0, n-1
	if m.bucket != nil {
		b := min(int((x-xs[0])*m.inv), len(m.bucket)-2)
		lo = int(m.bucket[b])
		span = int(m.bucket[b+1]) - lo + 1
		// Rounding in the bucket arithmetic can be off by one either way.
		for lo > 0 && xs[lo] > x {
			lo, span = lo-1, span+1
		}
		span = min(span, n-1-lo)
	}
	// Branch-free halving (the comparison compiles to a conditional move):
	// random queries would mispredict a branch half the time.
	for span > 1 {
		half := span >> 1
		if xs[lo+half] <= x {
			lo += half
		}
		span -= half
	}
	for lo < n-2 && xs[lo+1] <= x {
		lo++
	}
	slope := (ys[lo+1] - ys[lo]) / (xs[lo+1] - xs[lo])
	return slope*(x-xs[lo]) + ys[lo]
}

// PredictBatch maps every value of xs into dst (grown if too short) and
// returns it. dst may be xs itself.
func (m *Isotonic) PredictBatch(dst, xs []float64) []float64 {
	dst = slices.Grow(dst[:0], len(xs))[:len(xs)]
	for i, x := range xs {
		dst[i] = m.Predict(x)
	}
	return dst
}

type isotonicJSON struct {
	X []float64 `json:"x"`
	Y []float64 `json:"y"`
}

// MarshalJSON encodes the thresholds as {"x": [...], "y": [...]}; float64
// values round-trip exactly.
func (m *Isotonic) MarshalJSON() ([]byte, error) {
	return json.Marshal(isotonicJSON{X: m.x, Y: m.y})
}

// UnmarshalJSON restores a map encoded by MarshalJSON, validating it as
// NewIsotonic does.
func (m *Isotonic) UnmarshalJSON(b []byte) error {
	var j isotonicJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return fmt.Errorf("isotonic: decode: %w", err)
	}
	r, err := NewIsotonic(j.X, j.Y)
	if err != nil {
		return err
	}
	*m = *r
	return nil
}
