package calibrate

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
)

// Source yields the run's pair groups in stream order, from the first
// retained one, then follows new ones.
type Source interface {
	Next(ctx context.Context) ([]byte, error)
}

// Stage is the calibrate stage. It owns the run's Debiaser and keeps no
// state of its own: on start it replays every retained pair group in order,
// which rebuilds exactly the map and version it had, and publishes a
// Calibration for each group after the last one already published.
// One calibrate stage per run.
type Stage struct {
	RunID string
	Out   string // calibration subject
	Pub   message.Publisher
	Deb   *Debiaser
	// Published is the Seq of the last Calibration already stored (0: none).
	Published int64
	// DeadLetter receives pair groups that cannot be used.
	DeadLetter func(payload []byte, reason error)
	// OnCalibration, if set, sees every Calibration (metrics, progress).
	OnCalibration func(schemas.Calibration)

	seq  int64
	seen map[string]bool
}

// Seq is the number of anchor groups absorbed.
func (s *Stage) Seq() int64 { return s.seq }

// Run consumes src until ctx is done.
func (s *Stage) Run(ctx context.Context, src Source) error {
	if s.seen == nil {
		s.seen = map[string]bool{}
	}
	for {
		data, err := src.Next(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("calibrate: read pairs: %w", err)
		}
		c, err := s.Absorb(data)
		if errors.Is(err, schemas.ErrInvalid) {
			if s.DeadLetter != nil {
				s.DeadLetter(data, err)
			}
			continue
		}
		if err != nil || c == nil {
			continue
		}
		if c.Seq <= s.Published {
			continue // stored before a restart
		}
		if err := s.publish(ctx, *c); err != nil {
			return err
		}
		s.Published = c.Seq
	}
}

// Absorb feeds one encoded PairGroup to the debiaser and returns the
// resulting Calibration, or nil for a group seen before.
func (s *Stage) Absorb(data []byte) (*schemas.Calibration, error) {
	var pg schemas.PairGroup
	if err := schemas.Decode(data, s.RunID, &pg); err != nil {
		return nil, fmt.Errorf("calibrate: %w", err)
	}
	key := fmt.Sprintf("%d/%s", pg.Step, pg.GroupID)
	if s.seen == nil {
		s.seen = map[string]bool{}
	}
	if s.seen[key] {
		return nil, nil
	}
	s.seen[key] = true
	c := schemas.Calibration{Schema: schemas.Version, Run: s.RunID, Step: pg.Step, GroupID: pg.GroupID,
		Pairs: make([]schemas.CalibratedPair, 0, len(pg.Pairs))}
	for _, p := range pg.Pairs {
		c.Pairs = append(c.Pairs, schemas.CalibratedPair{TrajID: p.TrajID, Predicted: p.Predicted, True: p.True, Before: s.Deb.Predict(p.Predicted)})
	}
	for i, p := range pg.Pairs {
		if _, err := s.Deb.Push(Pair{Predicted: p.Predicted, True: p.True}); err != nil {
			c.Pairs = c.Pairs[:i] // NaN cannot come through JSON; keep what was pushed
			break
		}
	}
	for i := range c.Pairs {
		c.Pairs[i].After = s.Deb.Predict(c.Pairs[i].Predicted)
	}
	s.seq++
	c.Seq, c.Version, c.PairsTotal = s.seq, s.Deb.Version(), s.Deb.Pushed()
	if m := s.Deb.Map(); m != nil {
		x, y := m.Thresholds()
		c.Map = &schemas.Thresholds{X: x, Y: y}
	}
	return &c, nil
}

func (s *Stage) publish(ctx context.Context, c schemas.Calibration) error {
	m, err := schemas.NewMessage(fmt.Sprintf("%s/calibration/%d", s.RunID, c.Seq), c)
	if err != nil {
		return err
	}
	for wait := 100 * time.Millisecond; ; wait = min(2*wait, 5*time.Second) {
		err := s.Pub.Publish(s.Out, m)
		if err == nil {
			if s.OnCalibration != nil {
				s.OnCalibration(c)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
}
