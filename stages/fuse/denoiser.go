package fuse

import (
	"errors"
	"fmt"
	"math"
)

// ErrConfig reports an invalid DenoiserConfig.
var ErrConfig = errors.New("fuse: invalid config")

// ErrOtherSettings refuses a checkpoint made with other correction
// settings than the stage's: a restart with changed flags.
var ErrOtherSettings = errors.New("fuse: the checkpoint was made with other settings")

// Estimator names how rho, the anchor groups' inverse-variance weight, is
// estimated from anchor groups.
type Estimator string

const (
	// EstimatorReference reproduces the released code: EWMA of
	// D = mean(((d-mean d)-(s-mean s))^2)/var(s) measured in-sample, a scale
	// c = (Target-1)/EWMA frozen after the warm-up, rho = clip(1 + c*EWMA).
	EstimatorReference Estimator = "reference"
	// EstimatorRatio reads rho as the variance ratio literally: rho = 1 + D,
	// with D a ratio of EWMAs (numerator and var(s) averaged separately, so a
	// near-degenerate group cannot swamp it), measured out-of-sample.
	EstimatorRatio Estimator = "ratio"
	// EstimatorAdvantage: rho = 1 + EWMA of mean((A_d - A_s)^2), the squared
	// gap between the GRPO advantages of the world model's and the true scores
	// in the same anchor group, out-of-sample. Scale-free, bounded per group,
	// and 1 + 2(1 - r) for within-group correlation r. A group whose
	// calibrated scores are all equal (a flat map: the world model cannot
	// rank it) has no r; it counts as r = 0, a gap of 2, like a world model
	// without information, not as the gap of its all-zero advantages (1),
	// which would rate "no signal" better than noise and lower the anchors'
	// weight exactly when the world-model groups have nothing to add.
	EstimatorAdvantage Estimator = "advantage"
	// EstimatorOff keeps rho at 1: no denoising (for ablations).
	EstimatorOff Estimator = "off"
)

// DefaultEstimator: the advantage gap measures what the gradient sees, and
// `wmrl sim` finds it best or tied in every scenario (README, "What the
// corrections buy").
const DefaultEstimator = EstimatorAdvantage

// DenoiserConfig sets the rho estimator. Zero values mean the reference
// defaults.
type DenoiserConfig struct {
	Estimator Estimator `json:"estimator"`
	// HalfLife of the EWMA, in anchor groups (64).
	HalfLife float64 `json:"half_life"`
	// Warmup: rho is 1 until this many anchor groups were counted (32).
	Warmup int `json:"warmup"`
	// Target is the reference estimator's rho at the end of warm-up (2).
	Target float64 `json:"target"`
	// RhoMin and RhoMax clip rho ([1, 4]).
	RhoMin float64 `json:"rho_min"`
	RhoMax float64 `json:"rho_max"`
	// MinVar: anchor groups whose true scores have a population variance
	// below it are skipped (1e-9); for the advantage estimator, calibrated
	// scores with a variance below it are a flat group (r = 0).
	MinVar float64 `json:"min_var"`
}

func (c *DenoiserConfig) setDefaults() {
	if c.Estimator == "" {
		c.Estimator = DefaultEstimator
	}
	if c.HalfLife == 0 {
		c.HalfLife = 64
	}
	if c.Warmup == 0 {
		c.Warmup = 32
	}
	if c.Target == 0 {
		c.Target = 2
	}
	if c.RhoMin == 0 {
		c.RhoMin = 1
	}
	if c.RhoMax == 0 {
		c.RhoMax = 4
	}
	if c.MinVar == 0 {
		c.MinVar = 1e-9
	}
}

// Effective is the configuration in force: zero values take the
// reference defaults.
func (c DenoiserConfig) Effective() DenoiserConfig {
	c.setDefaults()
	return c
}

// Validate reports the first invalid field.
func (c DenoiserConfig) Validate() error {
	switch c.Estimator {
	case EstimatorReference, EstimatorRatio, EstimatorAdvantage, EstimatorOff:
	default:
		return fmt.Errorf("%w: estimator %q: want reference, ratio, advantage or off", ErrConfig, c.Estimator)
	}
	switch {
	case !(c.HalfLife > 0) || math.IsInf(c.HalfLife, 0):
		return fmt.Errorf("%w: half_life %v: want a finite number > 0", ErrConfig, c.HalfLife)
	case c.Warmup < 1:
		return fmt.Errorf("%w: warmup %d < 1", ErrConfig, c.Warmup)
	case !(c.Target >= 1):
		return fmt.Errorf("%w: target %v < 1", ErrConfig, c.Target)
	case !(c.RhoMin > 0) || !(c.RhoMax >= c.RhoMin) || math.IsInf(c.RhoMax, 0):
		return fmt.Errorf("%w: rho clip [%v, %v]: want 0 < min <= max, finite", ErrConfig, c.RhoMin, c.RhoMax)
	case !(c.MinVar > 0):
		return fmt.Errorf("%w: min_var %v: want > 0", ErrConfig, c.MinVar)
	}
	return nil
}

// InSample reports whether anchor groups are scored with the map refitted
// after their own pairs were pushed (the reference) rather than before.
func (c DenoiserConfig) InSample() bool { return c.Estimator == EstimatorReference }

// Denoiser tracks, over anchor groups, how far the world model's
// within-group signal is from the truth, and turns it into rho. Not safe for
// concurrent use.
type Denoiser struct {
	cfg   DenoiserConfig
	alpha float64
	st    DenoiserState
}

// DenoiserState is a Denoiser's whole state; it round-trips through JSON.
type DenoiserState struct {
	Config  DenoiserConfig `json:"config"`
	Count   int            `json:"count"`    // anchor groups counted
	EWMA    float64        `json:"ewma"`     // of D or of the advantage gap
	EWMANum float64        `json:"ewma_num"` // ratio: numerator of D
	EWMADen float64        `json:"ewma_den"` // ratio: var(s)
	C       float64        `json:"c"`        // reference: frozen scale
	CFixed  bool           `json:"c_fixed"`
	Rho     float64        `json:"rho"`
}

// NewDenoiser returns a denoiser with rho = 1.
func NewDenoiser(cfg DenoiserConfig) (*Denoiser, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Denoiser{cfg: cfg, alpha: 1 - math.Pow(0.5, 1/cfg.HalfLife), st: DenoiserState{Config: cfg, Rho: 1}}, nil
}

// RestoreDenoiser rebuilds a denoiser from a snapshot.
func RestoreDenoiser(s DenoiserState) (*Denoiser, error) {
	d, err := NewDenoiser(s.Config)
	if err != nil {
		return nil, err
	}
	if s.Count < 0 || !(s.Rho > 0) || math.IsInf(s.Rho, 0) {
		return nil, fmt.Errorf("%w: inconsistent snapshot (count %d, rho %v)", ErrConfig, s.Count, s.Rho)
	}
	s.Config = d.cfg
	d.st = s
	return d, nil
}

// Snapshot copies the state.
func (d *Denoiser) Snapshot() DenoiserState { return d.st }

// Config returns the configuration in force (defaults filled in).
func (d *Denoiser) Config() DenoiserConfig { return d.cfg }

// Rho is the current anchor weight.
func (d *Denoiser) Rho() float64 { return d.st.Rho }

// Signal is the tracked disagreement: the EWMA of D (reference), the ratio
// of EWMAs (ratio) or the EWMA of the advantage gap (advantage); 0 before
// any group was counted.
func (d *Denoiser) Signal() float64 {
	if d.cfg.Estimator == EstimatorRatio && d.st.EWMADen > 0 {
		return d.st.EWMANum / d.st.EWMADen
	}
	return d.st.EWMA
}

// Count is the number of anchor groups counted so far.
func (d *Denoiser) Count() int { return d.st.Count }

// Observe takes one anchor group: d the calibrated world-model scores and s
// the true scores of its graded trajectories, index by index. It returns
// false, changing nothing, when the group is skipped (fewer than 2 entries or
// var(s) below MinVar), and the new rho otherwise.
func (d *Denoiser) Observe(cal, truth []float64) (rho float64, counted bool) {
	if len(cal) != len(truth) || len(cal) < 2 {
		return d.st.Rho, false
	}
	ms, vs := meanVar(truth)
	if vs < d.cfg.MinVar {
		return d.st.Rho, false
	}
	md, _ := meanVar(cal)
	num := 0.0
	for i := range cal {
		e := (cal[i] - md) - (truth[i] - ms)
		num += e * e
	}
	num /= float64(len(cal))

	st := &d.st
	first := st.Count == 0
	blend := func(old, v float64) float64 {
		if first {
			return v
		}
		return d.alpha*v + (1-d.alpha)*old
	}
	switch d.cfg.Estimator {
	case EstimatorReference:
		st.EWMA = blend(st.EWMA, num/vs)
	case EstimatorRatio, EstimatorOff:
		st.EWMANum = blend(st.EWMANum, num)
		st.EWMADen = blend(st.EWMADen, vs)
		st.EWMA = blend(st.EWMA, num/vs)
	case EstimatorAdvantage:
		if _, vd := meanVar(cal); vd < d.cfg.MinVar {
			st.EWMA = blend(st.EWMA, 2) // no ranking at all: r = 0
			break
		}
		ad, _ := Advantages(nil, cal, nil, Standardize)
		as, _ := Advantages(nil, truth, nil, Standardize)
		gap := 0.0
		for i := range ad {
			gap += (ad[i] - as[i]) * (ad[i] - as[i])
		}
		st.EWMA = blend(st.EWMA, gap/float64(len(ad)))
	}
	st.Count++
	st.Rho = d.rho()
	return st.Rho, true
}

func (d *Denoiser) rho() float64 {
	st, cfg := &d.st, d.cfg
	clip := func(v float64) float64 { return min(cfg.RhoMax, max(cfg.RhoMin, v)) }
	switch cfg.Estimator {
	case EstimatorOff:
		return 1
	case EstimatorReference:
		if !st.CFixed && st.Count >= cfg.Warmup && st.EWMA > 1e-12 {
			st.C = (cfg.Target - 1) / st.EWMA
			st.CFixed = true
		}
		if !st.CFixed {
			return 1
		}
		return clip(1 + st.C*st.EWMA)
	}
	if st.Count < cfg.Warmup {
		return 1
	}
	return clip(1 + d.Signal())
}
