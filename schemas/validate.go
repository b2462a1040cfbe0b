package schemas

import "math"

// MaxScore bounds the magnitude of every score on the wire (predictions,
// executions, pairs; a calibration's and an update's numbers, computed
// from scores, are held to twice it). No reward comes near it. Below
// it, every statistic the stages compute from scores stays finite: squared
// differences within a group, their ratio to the 1e-9 variance below which
// the denoiser skips a group (about 1e210 at most), sums over the
// calibration's buffer. Above it they can overflow to infinity and NaN,
// which JSON cannot carry: an update or a calibration made of them could not
// be sent, and its stage would stop there for good. A message carrying a
// score beyond it is invalid (dead-lettered with the reason), and the
// stages that take scores from outside (predict, execute) record such a
// score as ungraded.
const MaxScore = 1e100

// ScoreInRange reports whether v is a score the wire takes: a number at
// most MaxScore in magnitude.
func ScoreInRange(v float64) bool { return math.Abs(v) <= MaxScore }

// maxDerived bounds what the stages compute from scores (a calibration's
// map and calibrated scores, an update's numbers): an average of scores
// at MaxScore can round a little past it.
const maxDerived = 2 * MaxScore

// validator is implemented by the messages that carry scores; Decode calls
// it after the schema and run checks.
type validator interface {
	validate() error
}

func bad(v float64) bool          { return !ScoreInRange(v) }
func badp(v *float64) bool        { return v != nil && bad(*v) }
func badDerived(v float64) bool   { return !(math.Abs(v) <= maxDerived) }
func badDerivedp(v *float64) bool { return v != nil && badDerived(*v) }

// outOfRange is the error for the value v of what (built only on failure:
// Decode is on every message's path).
func outOfRange(what string, v float64) error {
	return invalid("%s %g is beyond ±%g, the largest score the pipeline takes", what, v, MaxScore)
}

// derivedOutOfRange is the error for a value computed from scores.
func derivedOutOfRange(what string, v float64) error {
	return invalid("%s %g is beyond ±%g, the largest value the pipeline computes from scores (at most ±%g)", what, v, maxDerived, MaxScore)
}

func (m *Prediction) validate() error {
	for _, it := range m.Items {
		switch {
		case badp(it.Score):
			return outOfRange("trajectory "+it.TrajID+": score", *it.Score)
		case bad(it.Spread):
			return outOfRange("trajectory "+it.TrajID+": spread", it.Spread)
		}
	}
	return nil
}

func (m *Execution) validate() error {
	for _, it := range m.Items {
		switch {
		case badp(it.Score):
			return outOfRange("trajectory "+it.TrajID+": score", *it.Score)
		case bad(it.Seconds):
			return outOfRange("trajectory "+it.TrajID+": seconds", it.Seconds)
		}
	}
	return nil
}

func (m *PairGroup) validate() error {
	for _, p := range m.Pairs {
		switch {
		case bad(p.Predicted):
			return outOfRange("trajectory "+p.TrajID+": predicted", p.Predicted)
		case bad(p.True):
			return outOfRange("trajectory "+p.TrajID+": true", p.True)
		}
	}
	return nil
}

func (m *Calibration) validate() error {
	if m.Map != nil {
		if len(m.Map.X) != len(m.Map.Y) {
			return invalid("map has %d thresholds x and %d values y", len(m.Map.X), len(m.Map.Y))
		}
		for i, x := range m.Map.X {
			switch {
			case badDerived(x):
				return derivedOutOfRange("map x", x)
			case badDerived(m.Map.Y[i]):
				return derivedOutOfRange("map y", m.Map.Y[i])
			}
		}
	}
	for _, p := range m.Pairs {
		for _, v := range [...]struct {
			what string
			v    float64
		}{{"predicted", p.Predicted}, {"true", p.True}, {"before", p.Before}, {"after", p.After}} {
			if badDerived(v.v) {
				return derivedOutOfRange("trajectory "+p.TrajID+": "+v.what, v.v)
			}
		}
	}
	return nil
}

func (m *Update) validate() error {
	switch {
	case badDerived(m.Rho):
		return derivedOutOfRange("rho", m.Rho)
	case badDerived(m.D):
		return derivedOutOfRange("d", m.D)
	}
	for _, it := range m.Items {
		for _, v := range [...]struct {
			what string
			v    *float64
		}{{"reward", it.Reward}, {"advantage", &it.Advantage}, {"weight", &it.Weight}, {"fused_advantage", &it.FusedAdvantage},
			{"predicted", it.Predicted}, {"calibrated", it.Calibrated}, {"true_score", it.TrueScore}, {"exec_seconds", it.ExecSeconds}} {
			if badDerivedp(v.v) {
				return derivedOutOfRange("trajectory "+it.TrajID+": "+v.what, *v.v)
			}
		}
	}
	return nil
}
