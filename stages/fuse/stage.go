package fuse

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
)

// Source yields the run's Calibration messages in stream order from the
// first retained one; Backlog is how many existed when it opened.
type Source interface {
	Next(ctx context.Context) ([]byte, error)
}

// Stage is the fuse stage. Plans, predictions and executions are held (their
// handler call blocks) until their step's update is stored, so a crash loses
// nothing; the update carries a de-duplication ID and steps already
// published (MarkPublished, from the retained updates) are never fused
// twice. One fuse stage per run.
type Stage struct {
	RunID string
	Out   string // update subject
	Pub   message.Publisher
	Now   func() time.Time
	// OnUpdate, if set, sees every update stored (progress, metrics).
	OnUpdate func(schemas.Update)
	// OnLate, if set, sees executions that came after their step.
	OnLate func(schemas.Execution)
	// Save, if set, stores a checkpoint every CheckpointEvery calibrations
	// (default DefaultCheckpointEvery) and when Run ends; its error goes
	// to OnSaveError and the stage carries on (the stream still holds what
	// a restart needs, for its retention).
	Save            func(ctx context.Context, c Checkpoint) error
	CheckpointEvery int
	OnSaveError     func(error)
	// MaxPayload, if set, is the largest message the server takes (its
	// max_payload): an update over it is ErrUpdateTooLarge. OnUpdateBytes,
	// if set, hears each published update's size.
	MaxPayload    int
	OnUpdateBytes func(int)
	// StuckAfter, if set, is how long a step may wait for a group's
	// prediction before OnStuck hears of it, once a step; OnUnstuck hears
	// when such a step is fused at last, after how long. OnWait, if set,
	// hears every second how long the longest-waiting planned step has
	// waited for a prediction (0: none waits).
	StuckAfter time.Duration
	OnStuck    func(Waiting)
	OnUnstuck  func(step int64, waited time.Duration)
	OnWait     func(time.Duration)

	mu       sync.Mutex
	steps    *Steps
	done     map[int64]chan struct{}
	stuck    map[int64]time.Time // steps OnStuck heard of: when their plan came
	caughtUp bool
}

// ErrUpdateTooLarge is a step's update over the server's max_payload. The
// run cannot go on: no later step is published before it. Run returns it.
var ErrUpdateTooLarge = errors.New("fuse: update over the server's max_payload")

// NewStage builds the stage.
func NewStage(cfg StepsConfig, out string, pub message.Publisher) (*Stage, error) {
	steps, err := NewSteps(cfg)
	if err != nil {
		return nil, err
	}
	return &Stage{RunID: cfg.Run, Out: out, Pub: pub, Now: time.Now, steps: steps, done: map[int64]chan struct{}{}, stuck: map[int64]time.Time{}}, nil
}

// DefaultCheckpointEvery is how many calibrations pass between checkpoints
// unless configured.
const DefaultCheckpointEvery = 256

// Restore starts from a checkpoint (before Run).
func (s *Stage) Restore(c Checkpoint) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.steps.Restore(c)
}

// MarkPublished records steps whose updates are stored already.
func (s *Stage) MarkPublished(steps ...int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, n := range steps {
		s.steps.MarkPublished(n)
	}
}

// Rho and Signal report the denoiser's state.
func (s *Stage) Rho() (rho, signal float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.steps.Denoiser().Rho(), s.steps.Denoiser().Signal()
}

func (s *Stage) doneFor(step int64) chan struct{} {
	c := s.done[step]
	if c == nil {
		c = make(chan struct{})
		s.done[step] = c
	}
	return c
}

// HandlePlan takes a Plan.
func (s *Stage) HandlePlan(msg *message.Message) error {
	var p schemas.Plan
	if err := schemas.Decode(msg.Payload, s.RunID, &p); err != nil {
		return fmt.Errorf("fuse: %w", err)
	}
	_, err := s.add(msg.Context(), p.Step, func() { s.steps.AddPlan(p, s.Now()) })
	return err
}

// HandlePrediction takes a Prediction.
func (s *Stage) HandlePrediction(msg *message.Message) error {
	var p schemas.Prediction
	if err := schemas.Decode(msg.Payload, s.RunID, &p); err != nil {
		return fmt.Errorf("fuse: %w", err)
	}
	_, err := s.add(msg.Context(), p.Step, func() { s.steps.AddPrediction(p) })
	return err
}

// HandleExecution takes an Execution.
func (s *Stage) HandleExecution(msg *message.Message) error {
	var e schemas.Execution
	if err := schemas.Decode(msg.Payload, s.RunID, &e); err != nil {
		return fmt.Errorf("fuse: %w", err)
	}
	late, err := s.add(msg.Context(), e.Step, func() { s.steps.AddExecution(e) })
	if late && s.OnLate != nil {
		s.OnLate(e)
	}
	return err
}

// add records an input and holds it until its step is published; an
// input of a step published already is not recorded (late).
func (s *Stage) add(ctx context.Context, step int64, record func()) (late bool, err error) {
	done := s.record(step, record)
	if done == nil {
		return true, nil
	}
	if err := s.Flush(ctx); err != nil {
		return false, err
	}
	select {
	case <-done:
		return false, nil
	case <-ctx.Done():
		return false, fmt.Errorf("fuse: gave up holding input of step %d: %w", step, ctx.Err())
	}
}

// record runs record and returns what the step's publication closes, or
// nil, without running it, when the step is published already.
func (s *Stage) record(step int64, record func()) <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.steps.Published(step) {
		return nil
	}
	record()
	return s.doneFor(step)
}

// Flush fuses and publishes every ready step.
func (s *Stage) Flush(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.caughtUp {
		return nil // rho and the map are not rebuilt yet
	}
	now := s.Now()
	ready := s.steps.Ready(now)
	for _, n := range ready {
		u := s.steps.Fuse(n, now)
		m, err := schemas.NewMessage(fmt.Sprintf("%s/update/%d", s.RunID, n), u)
		if err != nil {
			return err
		}
		if s.MaxPayload > 0 && len(m.Payload) > s.MaxPayload {
			return fmt.Errorf("%w: step %d's update is %s (%d trajectories), and the NATS server takes at most %s: "+
				"raise its max_payload (deploy/nats sets 8MB; --nats-max-payload-mb for the embedded server, up to 64), or use fewer trajectories a step",
				ErrUpdateTooLarge, n, mib(len(m.Payload)), len(u.Items), mib(s.MaxPayload))
		}
		if err := s.Pub.Publish(s.Out, m); err != nil {
			return fmt.Errorf("fuse: publish update %d: %w", n, err)
		}
		if s.OnUpdateBytes != nil {
			s.OnUpdateBytes(len(m.Payload))
		}
		s.steps.Close(n)
		close(s.doneFor(n))
		delete(s.done, n)
		if at, ok := s.stuck[n]; ok {
			delete(s.stuck, n)
			if s.OnUnstuck != nil {
				s.OnUnstuck(n, now.Sub(at))
			}
		}
		if s.OnUpdate != nil {
			s.OnUpdate(u)
		}
	}
	if len(ready) > 0 {
		s.tellWait(now, nil) // a step that waited may be fused: say so now, not at the next watch
	}
	return nil
}

// Run follows the calibration stream (first replaying backlog messages to
// rebuild rho and the map, after the restored checkpoint if any) and
// closes steps on their deadlines, until ctx is done.
func (s *Stage) Run(ctx context.Context, cal Source, backlog uint64) error {
	if backlog == 0 {
		s.setCaughtUp()
	}
	every := int64(s.CheckpointEvery)
	if every <= 0 {
		every = DefaultCheckpointEvery
	}
	saved := s.checkpointSeq()
	errc, done := make(chan error, 1), make(chan struct{})
	ctx, stop := context.WithCancel(ctx) // Run may end before ctx does
	defer func() {
		stop()
		<-done // the reader has stopped: saved is ours
		s.checkpoint(context.WithoutCancel(ctx), &saved)
	}()
	go func() {
		defer close(done)
		for read := uint64(0); ; read++ {
			data, err := cal.Next(ctx)
			if err != nil {
				if ctx.Err() == nil {
					errc <- fmt.Errorf("fuse: read calibration: %w", err)
				}
				return
			}
			var c schemas.Calibration
			if err := schemas.Decode(data, s.RunID, &c); err == nil {
				s.mu.Lock()
				err = s.steps.AddCalibration(c)
				s.mu.Unlock()
			}
			if err != nil && !errors.Is(err, schemas.ErrInvalid) {
				errc <- err
				return
			}
			if read+1 >= backlog {
				s.setCaughtUp()
			}
			if err := s.Flush(ctx); errors.Is(err, ErrUpdateTooLarge) {
				errc <- err
				return
			}
			if c.Seq > 0 && c.Seq%every == 0 {
				s.checkpoint(ctx, &saved)
			}
		}
	}()
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	var watched time.Time
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-errc:
			return err
		case <-t.C:
			if err := s.Flush(ctx); errors.Is(err, ErrUpdateTooLarge) {
				return err
			}
			if now := s.Now(); now.Sub(watched) >= time.Second {
				watched = now
				s.watch(now)
			}
		}
	}
}

// watch tells OnWait how long the longest-waiting step has waited for a
// prediction, and OnStuck of each step that has now waited StuckAfter.
func (s *Stage) watch(now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.caughtUp {
		return // steps are not fused before: their waits say nothing yet
	}
	s.tellWait(now, func(w Waiting, waited time.Duration) {
		if _, said := s.stuck[w.Step]; !said && s.StuckAfter > 0 && waited >= s.StuckAfter {
			s.stuck[w.Step] = w.At
			if s.OnStuck != nil {
				s.OnStuck(w)
			}
		}
	})
}

// tellWait hands each waiting step to each, then tells OnWait the longest
// wait. Callers hold s.mu.
func (s *Stage) tellWait(now time.Time, each func(Waiting, time.Duration)) {
	var longest time.Duration
	for _, w := range s.steps.Waiting(now) {
		waited := now.Sub(w.At)
		longest = max(longest, waited)
		if each != nil {
			each(w, waited)
		}
	}
	if s.OnWait != nil {
		s.OnWait(longest)
	}
}

func (s *Stage) checkpointSeq() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.steps.seq
}

// checkpoint saves the calibrations' state if it moved since *saved.
func (s *Stage) checkpoint(ctx context.Context, saved *int64) {
	if s.Save == nil {
		return
	}
	s.mu.Lock()
	c := s.steps.Checkpoint()
	s.mu.Unlock()
	if c.Seq == *saved {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := s.Save(ctx, c); err != nil {
		if s.OnSaveError != nil {
			s.OnSaveError(err)
		}
		return
	}
	*saved = c.Seq
}

func (s *Stage) setCaughtUp() {
	s.mu.Lock()
	s.caughtUp = true
	s.mu.Unlock()
}

// mib formats a size in bytes as MiB.
func mib(n int) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }
