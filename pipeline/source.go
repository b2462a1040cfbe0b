package pipeline

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/connectors/sandbox"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
)

// simSource plays the trainer: it publishes each step's trajectories and
// watermark on the public subjects, at most InFlightSteps ahead of the
// updates, and resumes after the last watermark it stored.
type simSource struct {
	p      *Pipeline
	policy interface {
		Step(n int64) ([]schemas.Trajectory, schemas.StepClose)
	}
	next int64

	mu      sync.Mutex
	pending map[int64]bool
	sentAt  map[int64]time.Time
	wake    chan struct{}
}

// newSimSource rolls out the simulated policy, or, with a task, the task's
// candidate solutions.
func newSimSource(p *Pipeline) (*simSource, error) {
	c := &p.cfg
	s := &simSource{
		p:       p,
		policy:  &sim.Policy{Run: c.Run, Seed: c.Seed, Tasks: c.Tasks, Groups: c.Groups, GroupSize: c.GroupSize},
		pending: map[int64]bool{}, sentAt: map[int64]time.Time{}, wake: make(chan struct{}, 1),
	}
	if c.TaskDir != "" {
		tasks, err := sandbox.ReadTasksJSON(c.TaskDir)
		if err != nil {
			return nil, err
		}
		var pts []sim.PolicyTask
		for _, t := range tasks {
			pts = append(pts, sim.PolicyTask{Dir: t.Dir, ID: t.Name, Prompt: t.Description})
		}
		if s.policy, err = sim.NewTasksPolicy(c.Run, pts, c.Seed, c.Groups, c.GroupSize); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// resume starts after the last watermark already stored.
func (s *simSource) resume(ctx context.Context) error {
	var last schemas.StepClose
	ok, err := s.p.tr.last(ctx, s.p.topo.Subject(schemas.KindStep), &last)
	if err != nil {
		return err
	}
	if ok {
		s.next = last.Step + 1
	}
	return nil
}

func (s *simSource) run(ctx context.Context) error {
	target := s.p.cfg.Steps
	full := roomWaiter{p: s.p, who: "source", waits: "the simulated trainer waits for room to send its next step"}
	for step := s.next; target == 0 || step < target; step++ {
		for {
			s.mu.Lock()
			n := len(s.pending)
			s.mu.Unlock()
			if n < s.p.cfg.InFlightSteps {
				break
			}
			select {
			case <-s.wake:
			case <-ctx.Done():
				return nil
			}
		}
		if err := full.retry(ctx, func() error { return s.publish(step) }); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
	}
	return nil
}

func (s *simSource) publish(step int64) error {
	trajs, wm := s.policy.Step(step)
	// A group's trajectories in one message, as a trainer that samples a
	// group at once sends them: G times fewer messages to store and
	// deliver, 1.75x the pipeline's rate here (BenchmarkEndToEnd against
	// BenchmarkEndToEndOneByOne).
	var msgs []*message.Message
	kind := schemas.KindTrajs
	for _, group := range schemas.ByGroup(trajs) {
		if s.p.cfg.trajsAlone {
			kind = schemas.KindTraj
			for _, t := range group {
				m, err := schemas.NewTrajMessage(t)
				if err != nil {
					return err
				}
				msgs = append(msgs, m)
			}
			continue
		}
		m, err := schemas.NewTrajsMessage(group)
		if err != nil {
			return err
		}
		msgs = append(msgs, m)
	}
	if err := s.p.pub.Publish(s.p.topo.Subject(kind), msgs...); err != nil {
		return fmt.Errorf("source: step %d: %w", step, err)
	}
	m, err := schemas.NewMessage(fmt.Sprintf("%s/step/%d", wm.Run, step), wm)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.pending[step] = true
	s.sentAt[step] = time.Now()
	s.mu.Unlock()
	if err := s.p.pub.Publish(s.p.topo.Subject(schemas.KindStep), m); err != nil {
		return fmt.Errorf("source: watermark %d: %w", step, err)
	}
	return nil
}

// updated releases a step; it returns how long ago its last input was
// published (0 if this process did not publish it).
func (s *simSource) updated(step int64) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	var d time.Duration
	if t, ok := s.sentAt[step]; ok {
		d = time.Since(t)
		delete(s.sentAt, step)
	}
	delete(s.pending, step)
	select {
	case s.wake <- struct{}{}:
	default:
	}
	return d
}
