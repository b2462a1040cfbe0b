package fuse

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/calibrate"
)

// Source yields the run's Calibration messages in stream order from the
// first retained one, each with its stream sequence.
type Source interface {
	Next(ctx context.Context) (calibrate.Input, error)
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
	// DeadLetter, if set, receives the calibrations fuse cannot use (a
	// stage replacing calibrate sent one invalid), once: those at or
	// before the restored checkpoint's StreamSeq were given to it before.
	// Fuse goes on without them; their anchor groups fall back to the
	// world model at the anchor deadline, as late ones do.
	DeadLetter func(in calibrate.Input, reason error)
	// Skip, if set, names the calibrations, by stream sequence, to pass
	// over: those whose absorption panicked before, so that a restart
	// does not meet them again. Panicked, if set, hears of a panic
	// absorbing in (a bug that in set off) with its value and stack: it
	// keeps in to be sent again once the bug is fixed and has Skip name it
	// from then on; Run returns its error, with no checkpoint. Unset, the
	// panic goes on.
	Skip     func(seq uint64) bool
	Panicked func(in calibrate.Input, v any, stack []byte) error
	// FusePanicked, if set, hears of a panic fusing or publishing step (a
	// bug the step's inputs set off) with its value and stack; Run returns
	// its error, with no checkpoint, and the step's inputs, unsettled, are
	// handed back: a restart fuses the step again (and stops again, until
	// the bug is fixed). Unset, the panic goes on, ending the process
	// without the stages' clean stop.
	FusePanicked func(step int64, v any, stack []byte) error
	// MaxPayload, if set, is the largest message the server takes (its
	// max_payload): an update over it is ErrUpdateTooLarge. Size, if set,
	// is what the server counts of a message against it: its payload and
	// headers (default: the payload alone). OnUpdateBytes, if set, hears
	// each published update's size.
	MaxPayload    int
	Size          func(*message.Message) int
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
	halt     chan error          // a Flush in a handler failed so that Run must end (stops)
	caughtUp bool
	broken   bool   // a panic absorbing a calibration or fusing a step: no checkpoint of this state
	read     uint64 // stream sequence of the last calibration read (the reader's, then Run's once it stopped)
	lettered uint64 // invalid calibrations up to this stream sequence were dead-lettered before the restart
	after    uint64 // the restored checkpoint stands for the calibrations up to this stream sequence
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
	return &Stage{RunID: cfg.Run, Out: out, Pub: pub, Now: time.Now, steps: steps, done: map[int64]chan struct{}{}, stuck: map[int64]time.Time{},
		halt: make(chan error, 1)}, nil
}

// DefaultCheckpointEvery is how many calibrations pass between checkpoints
// unless configured.
const DefaultCheckpointEvery = 256

// Restore starts from a checkpoint (before Run, after MarkPublished).
// Refused for other settings, it still tells which calibrations were
// dead-lettered.
func (s *Stage) Restore(c Checkpoint) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.read, s.lettered = c.StreamSeq, c.StreamSeq
	if err := s.steps.Restore(c); err != nil {
		return err
	}
	if c.AbsorbedKept {
		s.after = c.StreamSeq
	}
	return nil
}

// ReadsAfter is the stream sequence after which Run's calibrations must
// start (0: at the first retained): the restored checkpoint stands for
// all those up to it.
func (s *Stage) ReadsAfter() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.after
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
		if !stops(err) {
			return false, err
		}
		// Fusing a step failed, not this input: Run ends with the error,
		// and the input is handed back with the others as the stage
		// stops. Returned here, the error was the input's: dead-lettered
		// (a panic's at once), the restart's step waited for it.
		select {
		case s.halt <- err:
		default:
		}
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

// errFusePanicked marks the error of a Flush that panicked (FusePanicked's).
type errFusePanicked struct{ error }

func (e errFusePanicked) Unwrap() error { return e.error }

// stops reports whether Flush's err ends Run.
func stops(err error) bool {
	var panicked errFusePanicked
	return errors.Is(err, ErrUpdateTooLarge) || errors.As(err, &panicked)
}

// Flush fuses and publishes every ready step.
func (s *Stage) Flush(ctx context.Context) (err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.caughtUp || s.broken {
		return nil // rho and the map are not rebuilt yet, or a panic may have half-changed them
	}
	now := s.Now()
	ready := s.steps.Ready(now)
	var at int64 // the step being fused
	if s.FusePanicked != nil {
		defer func() {
			if v := recover(); v != nil {
				s.broken = true // s.mu is held
				err = errFusePanicked{s.FusePanicked(at, v, debug.Stack())}
			}
		}()
	}
	for _, n := range ready {
		at = n
		u := s.steps.Fuse(n, now)
		m, err := schemas.NewMessage(fmt.Sprintf("%s/update/%d", s.RunID, n), u)
		if err != nil {
			return err
		}
		schemas.SetAnchorCounts(m, u)
		if size := s.sizeOf(m); s.MaxPayload > 0 && size > s.MaxPayload {
			return fmt.Errorf("%w: step %d's update is %s (%d trajectories), and the NATS server takes at most %s: "+
				"raise its max_payload (deploy/nats sets 8MB; --nats-max-payload-mb for the embedded server, up to 64), or use fewer trajectories a step",
				ErrUpdateTooLarge, n, mib(size), len(u.Items), mib(s.MaxPayload))
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

// Run follows the calibration stream (first replaying the retained
// calibrations, through the one at stream sequence last, to rebuild rho
// and the map, after the restored checkpoint if any, from ReadsAfter;
// last 0: there are none) and closes steps on their deadlines, until ctx
// is done.
func (s *Stage) Run(ctx context.Context, cal Source, last uint64) error {
	if last == 0 {
		s.setCaughtUp()
	}
	every := int64(s.CheckpointEvery)
	if every <= 0 {
		every = DefaultCheckpointEvery
	}
	saved := s.checkpointAt()
	errc, done := make(chan error, 1), make(chan struct{})
	ctx, stop := context.WithCancel(ctx) // Run may end before ctx does
	defer func() {
		stop()
		<-done // the reader has stopped: saved is ours
		s.checkpoint(context.WithoutCancel(ctx), &saved)
	}()
	go func() {
		defer close(done)
		for {
			in, err := cal.Next(ctx)
			if err != nil {
				if ctx.Err() == nil {
					errc <- fmt.Errorf("fuse: read calibration: %w", err)
				}
				return
			}
			var c schemas.Calibration
			switch panicked, err := s.guard(in, &c); {
			case panicked:
				errc <- err
				return
			case err != nil && s.DeadLetter != nil && in.Seq > s.lettered:
				s.DeadLetter(in, err)
			}
			if in.Seq >= last {
				s.setCaughtUp()
			}
			if err := s.Flush(ctx); stops(err) {
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
		case err := <-s.halt:
			return err
		case <-t.C:
			if err := s.Flush(ctx); stops(err) {
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

// guard absorbs in into c, unless Skip names it. A panic absorbing it (a
// bug that in set off) is Panicked's, whose error it returns with
// panicked, and no checkpoint is made from then on: the state may be
// half-changed, and a restart rebuilds it. Without Panicked, the panic
// goes on.
func (s *Stage) guard(in calibrate.Input, c *schemas.Calibration) (panicked bool, err error) {
	if s.Skip != nil && s.Skip(in.Seq) {
		s.mu.Lock()
		s.read = max(s.read, in.Seq)
		s.mu.Unlock()
		return false, nil
	}
	if s.Panicked == nil {
		return false, s.absorb(in, c)
	}
	defer func() {
		if v := recover(); v != nil {
			panicked, err = true, s.Panicked(in, v, debug.Stack())
			s.mu.Lock()
			s.broken = true
			s.mu.Unlock()
		}
	}()
	return false, s.absorb(in, c)
}

// absorb decodes one calibration into c and adds it to the steps' state.
// An error is the calibration's own: it is invalid, and changed nothing.
func (s *Stage) absorb(in calibrate.Input, c *schemas.Calibration) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.read = in.Seq
	err := schemas.Decode(in.Data, s.RunID, c)
	if err == nil {
		err = s.steps.AddCalibration(*c)
	}
	if err != nil {
		return fmt.Errorf("fuse: %w", err)
	}
	return nil
}

// savedAt is where the last checkpoint stands: its calibration Seq and
// the stream sequence of the last calibration read.
type savedAt struct {
	seq    int64
	stream uint64
}

func (s *Stage) checkpointAt() savedAt {
	s.mu.Lock()
	defer s.mu.Unlock()
	return savedAt{s.steps.seq, s.read}
}

// checkpoint saves the calibrations' state if it moved since *saved (an
// invalid calibration read moves it too: a restart does not dead-letter
// it again).
func (s *Stage) checkpoint(ctx context.Context, saved *savedAt) {
	if s.Save == nil {
		return
	}
	s.mu.Lock()
	if s.broken {
		s.mu.Unlock()
		return
	}
	c := s.steps.Checkpoint()
	c.StreamSeq = s.read
	s.mu.Unlock()
	if at := (savedAt{c.Seq, c.StreamSeq}); at == *saved {
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
	*saved = savedAt{c.Seq, c.StreamSeq}
}

func (s *Stage) setCaughtUp() {
	s.mu.Lock()
	s.caughtUp = true
	s.mu.Unlock()
}

// sizeOf is what the server counts of m against its max_payload.
func (s *Stage) sizeOf(m *message.Message) int {
	if s.Size == nil {
		return len(m.Payload)
	}
	return s.Size(m)
}

// mib formats a size in bytes as MiB.
func mib(n int) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }
