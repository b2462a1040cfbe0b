package execute

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/breaker"
)

// This file is the execution of one anchor group: the outcomes it already
// has, the executions it starts or waits for, and what it publishes.

// Handle executes one anchor group, its trajectories concurrently.
func (h *Handler) Handle(msg *message.Message) error {
	var g schemas.Group
	if err := schemas.Decode(msg.Payload, h.Run, &g); err != nil {
		return fmt.Errorf("execute: %w", err)
	}
	e := h.newGroupRun(msg.Context(), g)
	e.lookUp()
	if err := e.start(); err != nil {
		return err // the executions started end with the group's context
	}
	e.wg.Wait()
	e.shareCopies()
	return e.end(msg)
}

// groupRun is one delivery of an anchor group, each of its trajectories
// by its index in the group.
type groupRun struct {
	h   *Handler
	ctx context.Context
	g   schemas.Group
	// runs: the trajectory whose execution each takes (itself, or the
	// first of its copies in the group).
	runs   []int
	items  []schemas.ExecItem
	errs   []error
	downs  []*breaker.DownError // not run, or failed, while the executor is down
	have   []bool               // an outcome already paid for
	reused []bool               // the outcome of a copy in another group
	wg     sync.WaitGroup       // the executions started, and the waits for another group's
}

func (h *Handler) newGroupRun(ctx context.Context, g schemas.Group) *groupRun {
	n := len(g.Trajectories)
	return &groupRun{h: h, ctx: ctx, g: g, runs: h.runs(g.Trajectories), items: make([]schemas.ExecItem, n),
		errs: make([]error, n), downs: make([]*breaker.DownError, n), have: make([]bool, n), reused: make([]bool, n)}
}

// lookUp takes the outcomes already paid for, looked up together: one
// round trip to the store for the group, not one per trajectory.
func (e *groupRun) lookUp() {
	h := e.h
	var lookups sync.WaitGroup
	for i, t := range e.g.Trajectories {
		lookups.Go(func() {
			// An execution that gave no score (a sandbox error) is kept
			// for the record, not as an outcome: it runs again.
			if it, ok := h.outcome(e.ctx, doneKey(e.g, t)); ok && it.Score != nil {
				e.items[i], e.have[i] = it, true
				return
			}
			if e.runs[i] != i || !h.CopiesOnce {
				return
			}
			if it, ok := h.outcome(e.ctx, solutionKey(t)); ok {
				e.reuse(i, it)
			}
		})
	}
	lookups.Wait()
}

// reuse gives trajectory i the outcome it of its solution's execution in
// another group.
func (e *groupRun) reuse(i int, it schemas.ExecItem) {
	it.TrajID = e.g.Trajectories[i].TrajID
	e.items[i], e.reused[i] = it, true
}

// start starts the execution of every trajectory that has no outcome and
// is not a copy of one in the group, or a wait for another group's
// execution of its solution. Its error is a slot not taken before the
// group's context ended.
func (e *groupRun) start() error {
	h := e.h
	for i, t := range e.g.Trajectories {
		if e.have[i] || e.reused[i] || e.runs[i] != i {
			continue
		}
		release := func() {}
		if h.CopiesOnce {
			key := solutionKey(t)
			it, done, under := h.claim(key)
			switch {
			case done:
				e.reuse(i, it)
				continue
			case under != nil: // another group runs it now: take its outcome
				e.wg.Go(func() { e.await(i, under) })
				continue
			}
			release = func() { h.release(key) }
		}
		call, err := h.Breaker.Ask()
		if err != nil {
			release()
			e.errs[i] = err
			errors.As(err, &e.downs[i])
			continue
		}
		if err := h.takeSlot(e.ctx); err != nil {
			release()
			call.Abandoned()
			return fmt.Errorf("execute: group %s: %w", e.g.GroupID, err)
		}
		e.wg.Go(func() {
			defer release() // after its outcome is remembered
			e.run(i, call)
		})
	}
	return nil
}

// run executes trajectory i, its call to the breaker and a slot taken.
func (e *groupRun) run(i int, call breaker.Call) {
	h, t := e.h, e.g.Trajectories[i]
	defer h.giveSlot()
	r, err := h.Exe.Execute(e.ctx, t)
	e.downs[i] = call.End(e.ctx, err)
	if err != nil {
		e.errs[i] = err
		return
	}
	it := item(t, r)
	e.items[i] = it
	if h.Executed != nil {
		h.Executed(it)
	}
	// Kept whether or not it scored: a sandbox error is read back as how
	// the execution ended (a late group's archive rows), never reused in
	// place of running it again.
	h.remember(e.ctx, doneKey(e.g, t), it)
	if h.CopiesOnce && it.Score != nil {
		h.remember(e.ctx, solutionKey(t), sharedFrom(e.g, t, it))
	}
}

// await waits for the execution of trajectory i's solution under way in
// another group and takes its outcome; if that execution gave none (its
// executor failed, or a sandbox error), i runs here.
func (e *groupRun) await(i int, under <-chan struct{}) {
	h, t := e.h, e.g.Trajectories[i]
	select {
	case <-under:
	case <-e.ctx.Done():
		e.errs[i] = e.ctx.Err()
		return
	}
	if it, ok := h.outcome(e.ctx, solutionKey(t)); ok {
		e.reuse(i, it)
		return
	}
	call, err := h.Breaker.Ask()
	if err != nil {
		e.errs[i] = err
		errors.As(err, &e.downs[i])
		return
	}
	if err := h.takeSlot(e.ctx); err != nil {
		call.Abandoned()
		e.errs[i] = err
		return
	}
	e.run(i, call)
}

// shareCopies remembers the outcomes taken from other groups as this
// group's, and gives each copy within the group the outcome of the one
// that ran.
func (e *groupRun) shareCopies() {
	h, ts := e.h, e.g.Trajectories
	for i, t := range ts {
		if e.reused[i] {
			if h.Shared != nil {
				h.Shared(e.items[i])
			}
			h.remember(e.ctx, doneKey(e.g, t), e.items[i])
		}
	}
	for i, t := range ts {
		if e.have[i] || e.runs[i] == i {
			continue
		}
		first := e.runs[i]
		if e.errs[first] != nil {
			e.errs[i], e.downs[i] = e.errs[first], e.downs[first]
			continue
		}
		it := e.items[first]
		if it.CopyOf == "" { // else first took it from another group: name the one that ran
			it.CopyOf = ts[first].TrajID
		}
		it.TrajID, it.Seconds = t.TrajID, 0
		e.items[i] = it
		if h.Shared != nil {
			h.Shared(it)
		}
		h.remember(e.ctx, doneKey(e.g, t), it)
	}
}

// end publishes the group's Execution once every trajectory has an
// outcome. Otherwise the error is the first trajectory's the executor
// failed on, and the message is retried; but while the executor is down,
// or on the message's last attempt, the group is published with those
// trajectories ungraded, saying why, and the error says so.
func (e *groupRun) end(msg *message.Message) error {
	h, g := e.h, e.g
	var failed error
	var down *breaker.DownError
	for i, err := range e.errs {
		if err != nil && failed == nil {
			failed = fmt.Errorf("execute: %s: %w", g.Trajectories[i].TrajID, err)
		}
		if e.downs[i] != nil {
			down = e.downs[i]
		}
	}
	if failed == nil {
		return h.publish(g, e.items)
	}
	if e.ctx.Err() != nil {
		return failed
	}
	switch {
	case down != nil: // given up at once: the step need not wait for it
		failed = fmt.Errorf("execute: group %s: %w", g.GroupID, down)
	case h.LastAttempt == nil || !h.LastAttempt(msg):
		return failed
	}
	n := 0
	for i, err := range e.errs {
		if err == nil {
			continue
		}
		why := err.Error()
		switch {
		case errors.Is(err, schemas.ErrDown):
			why = "not run: " + why
		case e.downs[i] != nil:
			why += "; " + e.downs[i].Error()
		case down == nil:
			why = "executor failed on every attempt: " + why
		}
		e.items[i] = schemas.ExecItem{TrajID: g.Trajectories[i].TrajID, Status: schemas.ExecSandboxError, Detail: schemas.Clip(why, MaxDetail)}
		h.remember(e.ctx, doneKey(g, g.Trajectories[i]), e.items[i]) // how it ended, for the record: a resend runs it again
		n++
	}
	if err := h.publish(g, e.items); err != nil {
		return fmt.Errorf("%v (and publishing the group without them failed: %w: %w)", failed, schemas.ErrOutage, err)
	}
	return fmt.Errorf("%w (published the group with %d of %d ungraded)", failed, n, len(e.items))
}
