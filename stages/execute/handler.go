// Package execute runs anchor groups for real. It is stateless: several
// processes of it share the work, and a crash loses no anchor (the group's
// message is redelivered).
package execute

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/breaker"
	"github.com/wmrl/wmrl/stages/recent"
)

// Result is one execution's outcome.
type Result struct {
	// Status is one of the schemas.Exec* statuses. Score is meaningful for
	// every status but schemas.ExecSandboxError (not a score: ungraded).
	Status  string
	Score   float64
	Seconds float64
	Detail  string
}

// Executor runs one trajectory. An error means the executor itself failed
// (the group is retried); a failing solution is a Result with its status.
type Executor interface {
	Execute(ctx context.Context, t schemas.Trajectory) (Result, error)
}

// Handler is the execute stage: an anchor Group in, an Execution out.
type Handler struct {
	Run string
	Out string // execution subject
	Pub message.Publisher
	Exe Executor
	// Slots bounds executions running at once across all groups (default 8).
	Slots chan struct{}
	// Waiting, if set, is told when an execution starts (+1) and stops
	// (-1) waiting for a slot, all of them busy; Busy, when a slot is
	// taken (+1) and given back (-1). For metrics: what holds executions
	// back.
	Waiting, Busy func(delta int)
	// LastAttempt reports whether msg is on its last delivery before it is
	// dead-lettered (nil: never). If the executor still fails some of the
	// group's trajectories then, the group is published with the failed
	// ones ungraded (and still dead-lettered, for the record): the
	// executions already paid for are used, and with fewer than two scores
	// the step uses the world model's for the group at once instead of
	// waiting for its anchor deadline.
	LastAttempt func(*message.Message) bool
	// Store, if set, keeps every outcome beyond this process, so that a
	// group taken over after a crash or restart, or by another process of
	// the stage, runs only the trajectories that have none. An execution
	// that gave no score (a sandbox error, or one given up on the last
	// attempt) is kept too, as how it ended (the archive's rows of a late
	// anchor group read it back), but never taken as an outcome: it runs
	// again. It is best effort: an error reading it is a miss, an outcome
	// it fails to store is used all the same, and both errors go to
	// OnStoreError (if set).
	Store        Outcomes
	OnStoreError func(error)
	// Breaker, if set, counts the executor's failures in a row; while it
	// is open, executions are not started and their trajectories are
	// published ungraded at once (each execution under way runs to its
	// end: it is paid for, and may score).
	Breaker *breaker.Breaker
	// Executed, if set, is told of every execution the executor ran to an
	// outcome (not those it failed on, nor those not run): for metrics, and
	// to notice when none of them scores.
	Executed func(schemas.ExecItem)
	// CopiesOnce runs a solution (the same task, prompt and response)
	// once in the run: its copies in the group, and in other anchor groups
	// while this process, or Store, still has its outcome, take that
	// outcome, with CopyOf naming the trajectory that ran (and CopyStep,
	// CopyGroup where, when another group). Right where an execution is
	// deterministic (a test suite); where its score varies with the run (a
	// training run's seed) the copies' scores are no longer independent
	// draws. Shared, if set, is told of each copy that did not run.
	CopiesOnce bool
	Shared     func(schemas.ExecItem)

	// done keeps the outcomes of this process's recent executions, so that
	// a group redelivered after one of its trajectories failed (or after
	// its Execution could not be stored) runs only what has no outcome yet:
	// an execution is the expensive thing this project exists to save.
	mu   sync.Mutex
	done *recent.Map[string, schemas.ExecItem]
	// running holds the solutions (CopiesOnce) whose execution is under
	// way, so that a copy in another group waits for it rather than run.
	running map[string]chan struct{}
}

// NewHandler builds the stage with at most slots executions at once.
func NewHandler(run, out string, pub message.Publisher, exe Executor, slots int) *Handler {
	if slots < 1 {
		slots = 8
	}
	return &Handler{Run: run, Out: out, Pub: pub, Exe: exe, Slots: make(chan struct{}, slots),
		done: recent.New[string, schemas.ExecItem](8192)}
}

// Outcomes keeps executions' outcomes by key (a trajectory's step, group
// and ID within a run) beyond the process that ran them.
type Outcomes interface {
	Load(ctx context.Context, key string) (it schemas.ExecItem, ok bool, err error)
	Save(ctx context.Context, key string, it schemas.ExecItem) error
}

// OutcomeKey is the key of a trajectory's outcome in Outcomes: its step,
// group and ID. Readers of the outcomes (the archive's late rows) use it.
func OutcomeKey(step int64, group, traj string) string {
	return fmt.Sprintf("%d/%s/%s", step, group, traj)
}

func doneKey(g schemas.Group, t schemas.Trajectory) string {
	return OutcomeKey(g.Step, g.GroupID, t.TrajID)
}

// solutionKey names t's solution within the run (CopiesOnce): a digest
// of its task, prompt and response.
func solutionKey(t schemas.Trajectory) string {
	d := schemas.Digest(t.TaskID, t.Prompt, t.Response)
	return "solution/" + hex.EncodeToString(d[:16])
}

// sharedFrom is the outcome of t's execution as its copies in other
// groups take it: naming t, its group and step, with no sandbox time.
func sharedFrom(g schemas.Group, t schemas.Trajectory, it schemas.ExecItem) schemas.ExecItem {
	step := g.Step
	it.CopyOf, it.CopyStep, it.CopyGroup, it.Seconds = t.TrajID, &step, g.GroupID, 0
	return it
}

// claim takes solution key for the caller to execute, unless this
// process has its outcome by now (done: a copy in another group ran it
// since the caller looked), or another group of it is executing it now
// (under: closed once that execution has ended, its outcome remembered).
func (h *Handler) claim(key string) (it schemas.ExecItem, done bool, under <-chan struct{}) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if it, ok := h.done.Get(key); ok {
		return it, true, nil
	}
	if ch, ok := h.running[key]; ok {
		return it, false, ch
	}
	if h.running == nil {
		h.running = map[string]chan struct{}{}
	}
	h.running[key] = make(chan struct{})
	return it, false, nil
}

// release ends a claim: the execution is over.
func (h *Handler) release(key string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	close(h.running[key])
	delete(h.running, key)
}

// outcome is key's outcome if this process has it, or else Store has.
func (h *Handler) outcome(ctx context.Context, key string) (schemas.ExecItem, bool) {
	h.mu.Lock()
	it, ok := h.done.Get(key)
	h.mu.Unlock()
	if ok || h.Store == nil {
		return it, ok
	}
	it, ok, err := h.Store.Load(ctx, key)
	if err != nil {
		h.storeError(fmt.Errorf("execute: reading the outcome of %s: %w", key, err))
		return schemas.ExecItem{}, false
	}
	if ok {
		h.keepLocal(key, it)
	}
	return it, ok
}

// remember keeps an outcome here and in Store.
func (h *Handler) remember(ctx context.Context, key string, it schemas.ExecItem) {
	h.keepLocal(key, it)
	if h.Store == nil {
		return
	}
	if err := h.Store.Save(ctx, key, it); err != nil {
		h.storeError(fmt.Errorf("execute: storing the outcome of %s: %w", key, err))
	}
}

func (h *Handler) storeError(err error) {
	if h.OnStoreError != nil && !errors.Is(err, context.Canceled) {
		h.OnStoreError(err)
	}
}

func (h *Handler) keepLocal(key string, it schemas.ExecItem) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.done.Put(key, it)
}

// takeSlot waits for a free slot until ctx ends.
func (h *Handler) takeSlot(ctx context.Context) error {
	select {
	case h.Slots <- struct{}{}:
	default:
		if h.Waiting != nil {
			h.Waiting(1)
			defer h.Waiting(-1)
		}
		select {
		case h.Slots <- struct{}{}:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if h.Busy != nil {
		h.Busy(1)
	}
	return nil
}

// giveSlot gives a slot back.
func (h *Handler) giveSlot() {
	if h.Busy != nil {
		h.Busy(-1)
	}
	<-h.Slots
}

// runs maps each trajectory to the one whose execution it takes: itself,
// or under CopiesOnce the first of the group with the same task, prompt
// and response.
func (h *Handler) runs(ts []schemas.Trajectory) []int {
	runs := make([]int, len(ts))
	first := map[[3]string]int{}
	for i, t := range ts {
		runs[i] = i
		if !h.CopiesOnce {
			continue
		}
		k := [3]string{t.TaskID, t.Prompt, t.Response}
		if f, ok := first[k]; ok {
			runs[i] = f
		} else {
			first[k] = i
		}
	}
	return runs
}

func (h *Handler) publish(g schemas.Group, items []schemas.ExecItem) error {
	e := schemas.Execution{Schema: schemas.Version, Run: g.Run, Step: g.Step, GroupID: g.GroupID, Items: items}
	out, err := schemas.NewMessage(fmt.Sprintf("%s/execution/%d/%s", g.Run, g.Step, g.GroupID), e)
	if err != nil {
		return err
	}
	return h.Pub.Publish(h.Out, out)
}

// item is t's execution as published. A score beyond schemas.MaxScore (an
// executor's bug: no reward comes near it) is recorded as a sandbox error,
// not a score, saying so: the group's other scores are still used, where
// the message carrying it would be refused downstream whole.
func item(t schemas.Trajectory, r Result) schemas.ExecItem {
	it := schemas.ExecItem{TrajID: t.TrajID, Status: r.Status, Seconds: r.Seconds, Detail: schemas.Clip(r.Detail, MaxDetail)}
	switch {
	case r.Status == schemas.ExecSandboxError:
	case !schemas.ScoreInRange(r.Score):
		it.Status = schemas.ExecSandboxError
		it.Detail = schemas.Clip(fmt.Sprintf("the executor's score %g is beyond ±%g, the largest the pipeline takes (status %s; %s)",
			r.Score, schemas.MaxScore, r.Status, r.Detail), MaxDetail)
	default:
		v := r.Score
		it.Score = &v
	}
	if !schemas.ScoreInRange(it.Seconds) || it.Seconds < 0 {
		it.Seconds = 0
	}
	return it
}
