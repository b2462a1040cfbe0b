package calibrate

import "fmt"

// DebiaserState is everything a Debiaser holds, in a form that travels as
// JSON: restoring it gives a debiaser that behaves exactly as the original
// would on every later push.
type DebiaserState struct {
	Config   DebiaserConfig `json:"config"`
	Pairs    []Pair         `json:"pairs"` // buffered, oldest first
	Pushed   int64          `json:"pushed"`
	SinceFit int            `json:"since_fit"`
	Version  int64          `json:"version"`
	Map      *Isotonic      `json:"map"` // the fitted map; nil before the first fit
}

// Snapshot copies the debiaser's state.
func (d *Debiaser) Snapshot() DebiaserState {
	s := DebiaserState{
		Config:   d.cfg,
		Pairs:    make([]Pair, d.size),
		Pushed:   d.pushed,
		SinceFit: d.sinceFit,
		Version:  d.version,
		Map:      d.m,
	}
	for i := range s.Pairs {
		s.Pairs[i] = d.at(i)
	}
	return s
}

// RestoreDebiaser rebuilds a debiaser from a snapshot.
func RestoreDebiaser(s DebiaserState) (*Debiaser, error) {
	d, err := NewDebiaser(s.Config)
	if err != nil {
		return nil, err
	}
	if len(s.Pairs) > d.cfg.BufferSize {
		return nil, fmt.Errorf("%w: snapshot holds %d pairs, buffer_size is %d", ErrConfig, len(s.Pairs), d.cfg.BufferSize)
	}
	if s.Pushed < int64(len(s.Pairs)) || s.SinceFit < 0 || s.Version < 0 {
		return nil, fmt.Errorf("%w: inconsistent snapshot counters (pushed %d, pairs %d, since_fit %d, version %d)",
			ErrConfig, s.Pushed, len(s.Pairs), s.SinceFit, s.Version)
	}
	for i, p := range s.Pairs {
		if !finite(p.Predicted) || !finite(p.True) {
			return nil, fmt.Errorf("%w: snapshot pair %d is (%v, %v)", ErrNonFinite, i, p.Predicted, p.True)
		}
	}
	copy(d.ring, s.Pairs)
	d.size = len(s.Pairs)
	d.pushed, d.sinceFit, d.version, d.m = s.Pushed, s.SinceFit, s.Version, s.Map
	d.setPrior()
	return d, nil
}
