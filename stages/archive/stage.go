package archive

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
)

// Stage is the archive stage. It reads the run's updates and calibrations
// and holds each input until the file holding its rows is durable. An
// update becomes a row per item. A calibration becomes rows only when its
// anchor group was late for its step (the step's update says so), so a
// calibration is held until its step's update is archived: it may be
// stored before it. One archive stage per run.
type Stage struct {
	Run string
	W   *Writer
	Now func() time.Time
	// OnArchived, if set, sees every update whose rows are durable, and
	// every late anchor group's (with late true).
	OnArchived func(step int64, late bool)

	mu      sync.Mutex
	waiting map[int64]chan struct{} // steps whose update calibrations wait for
}

// NewStage builds the stage on an open writer.
func NewStage(run string, w *Writer) *Stage {
	return &Stage{Run: run, W: w, Now: time.Now, waiting: map[int64]chan struct{}{}}
}

// HandleUpdate archives an update's rows.
func (s *Stage) HandleUpdate(msg *message.Message) error {
	var u schemas.Update
	if err := schemas.Decode(msg.Payload, s.Run, &u); err != nil {
		return fmt.Errorf("archive: %w", err)
	}
	rows, late := FromUpdate(u)
	c, err := s.W.Add(UpdateKey(u.Step), rows, late)
	if err != nil {
		return outage(err)
	}
	s.release(u.Step)
	if err := wait(msg.Context(), c); err != nil {
		return err
	}
	if s.OnArchived != nil {
		s.OnArchived(u.Step, false)
	}
	return nil
}

// HandleCalibration archives the pairs of an anchor group that was late
// for its step, and acknowledges every other calibration once its step's
// update is archived.
func (s *Stage) HandleCalibration(msg *message.Message) error {
	var c schemas.Calibration
	if err := schemas.Decode(msg.Payload, s.Run, &c); err != nil {
		return fmt.Errorf("archive: %w", err)
	}
	ctx := msg.Context()
	for {
		if done := s.W.Has(LateKey(c.Step, c.GroupID)); done != nil {
			return wait(ctx, done)
		}
		if g, _, ok := s.W.Late(c.Step, c.GroupID); ok {
			commit, err := s.W.Add(LateKey(c.Step, c.GroupID), FromLate(c, g, s.Now()), nil)
			if err != nil {
				return outage(err)
			}
			if err := wait(ctx, commit); err != nil {
				return err
			}
			if s.OnArchived != nil {
				s.OnArchived(c.Step, true)
			}
			return nil
		}
		if done := s.W.Has(UpdateKey(c.Step)); done != nil {
			return wait(ctx, done) // in time for its step: no rows
		}
		select {
		case <-s.updateOf(c.Step):
		case <-ctx.Done():
			return fmt.Errorf("archive: gave up waiting for the update of step %d: %w", c.Step, ctx.Err())
		}
	}
}

func (s *Stage) updateOf(step int64) <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	ch := s.waiting[step]
	if ch == nil {
		ch = make(chan struct{})
		s.waiting[step] = ch
	}
	if s.W.Has(UpdateKey(step)) != nil { // archived while we were making ch
		close(ch)
		delete(s.waiting, step)
	}
	return ch
}

func (s *Stage) release(step int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ch := s.waiting[step]; ch != nil {
		close(ch)
		delete(s.waiting, step)
	}
}

// outage marks the writer's errors (a disk full, missing or refusing) as
// outages: the input is retried until the disk is back, never dead-lettered,
// so the archive has no holes once it is over.
func outage(err error) error { return fmt.Errorf("%w (%w)", err, schemas.ErrOutage) }

func wait(ctx context.Context, c *Commit) error {
	select {
	case <-c.Done():
		if err := c.Err(); err != nil {
			return outage(err)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("archive: gave up waiting for the file to close: %w", ctx.Err())
	}
}
