package fuse

import (
	"fmt"
	"math"
	"slices"
)

// AdvantageEps is added to the group's standard deviation, as in GRPO.
const AdvantageEps = 1e-4

// Normalization says how group-relative advantages are formed: as the
// trainer the fused advantages replace would form them.
type Normalization string

const (
	// Standardize: (r - mean) / (std + 1e-4), population std (GRPO;
	// verl's norm_adv_by_std_in_grpo true).
	Standardize Normalization = "std"
	// CenterOnly: r - mean, no per-group rescaling (Dr. GRPO; verl's
	// norm_adv_by_std_in_grpo false, TRL's scale_rewards "none"). Anchor
	// groups' advantages are still weighted by rho, as the reference
	// does when it only centres.
	CenterOnly Normalization = "center"
)

// Normalizations are the accepted names, the default first.
var Normalizations = []Normalization{Standardize, CenterOnly}

// Effective is n with the default filled in: "" (unset, as in every
// update and archive from before it was said) is Standardize.
func (n Normalization) Effective() Normalization {
	if n == "" {
		return Standardize
	}
	return n
}

// ParseNormalization reads a normalisation by its name; "" is Standardize.
func ParseNormalization(s string) (Normalization, error) {
	if n := Normalization(s).Effective(); slices.Contains(Normalizations, n) {
		return n, nil
	}
	return "", fmt.Errorf("%w: advantage normalisation %q: want %q (GRPO) or %q (Dr. GRPO)", ErrConfig, s, Standardize, CenterOnly)
}

// Advantages writes the group-relative advantages of rewards into dst (grown
// if short) and returns it. Entries with graded[i] false are left out of the
// statistics and get 0; graded may be nil (all graded). ok is false when fewer
// than two entries are graded: the group carries no within-group signal and
// every entry is 0.
func Advantages(dst, rewards []float64, graded []bool, norm Normalization) (out []float64, ok bool) {
	if cap(dst) < len(rewards) {
		dst = make([]float64, len(rewards))
	}
	dst = dst[:len(rewards)]
	n, sum := 0, 0.0
	for i, r := range rewards {
		if graded == nil || graded[i] {
			n++
			sum += r
		}
	}
	if n < 2 {
		clear(dst)
		return dst, false
	}
	mean := sum / float64(n)
	scale := 1.0
	if norm != CenterOnly {
		ss := 0.0
		for i, r := range rewards {
			if graded == nil || graded[i] {
				ss += (r - mean) * (r - mean)
			}
		}
		scale = 1 / (math.Sqrt(ss/float64(n)) + AdvantageEps)
	}
	for i, r := range rewards {
		if graded == nil || graded[i] {
			dst[i] = (r - mean) * scale
		} else {
			dst[i] = 0
		}
	}
	return dst, true
}

// meanVar returns the mean and population variance of v.
func meanVar(v []float64) (mean, variance float64) {
	for _, x := range v {
		mean += x
	}
	mean /= float64(len(v))
	for _, x := range v {
		variance += (x - mean) * (x - mean)
	}
	return mean, variance / float64(len(v))
}
