package route

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/recent"
)

// Topics are route's output subjects.
type Topics struct {
	Group, Exec, Plan string
}

// Handler is the route stage: it consumes trajectories and watermarks,
// assembles steps, picks anchors, and publishes every group (to predict),
// each anchor group (to execute) and the step's plan. Input messages are
// held (their handler call blocks) until the step's outputs are stored, so
// a crash loses nothing: unacknowledged inputs are redelivered and the step
// re-assembled, and outputs carry deterministic de-duplication IDs.
// One route per run: two would split a step's trajectories.
type Handler struct {
	run   string
	out   Topics
	pub   message.Publisher
	sched *Scheduler
	now   func() time.Time

	redelivered func(*message.Message) bool
	seq         func(*message.Message) uint64
	askPlanned  func(*message.Message, schemas.Trajectory) (bool, error)
	inFlight    func(context.Context) (int, error)
	maxPayload  int
	size        func(*message.Message) int
	onShort     func(Short)
	onDropped   func(Dropped)
	reject      func(msg *message.Message, item int, payload []byte, reason error) error
	onTaken     func(kind schemas.Kind, n int)

	onNoWatermark func(NoWatermark)
	watermarkWait time.Duration

	astray     func(context.Context) (int, error)
	astrayWait time.Duration
	onAstray   func(Astray)

	mu   sync.Mutex
	asm  *Assembly
	done map[int64]chan struct{} // closed when the step's outputs are stored
	sent map[int64][]string      // anchors sent before a restart, of steps not planned
	// firstAt: when this process got an open step's first trajectory;
	// noWatermarkSaid: the steps OnNoWatermark heard of.
	firstAt         map[int64]time.Time
	noWatermarkSaid map[int64]bool
	// astrayAt, astrayN, astrayErr: the last count of inputs astray,
	// asked at most once a second; astraySaid: the steps OnAstray heard
	// of.
	astrayAt   time.Time
	astrayN    int
	astrayErr  error
	astraySaid map[int64]bool
	// againInHand counts the messages delivered again that a handler has
	// and has not taken yet: an input astray, just come, that the count
	// of those astray no longer counts (this process holds it).
	againInHand atomic.Int64
	// taken: the stream sequences of the trajectories an open step took;
	// planned: those of the newest keepPlanned steps planned, sorted; with
	// Seq, what tells a trajectory delivered again from a late one.
	taken   map[int64][]uint64
	planned *recent.Map[int64, []uint64]
}

// keepPlanned: how many planned steps' trajectory sequences route keeps.
// A server that restarts after a crash can deliver again what route
// acknowledged in its last moments: a few steps.
const keepPlanned = 1024

// Config configures a Handler.
type Config struct {
	Run         string
	Out         Topics
	Scheduler   SchedulerConfig
	StepTimeout time.Duration    // default 30s
	Now         func() time.Time // default time.Now
	// Redelivered tells a message delivered before (to a process that may
	// have planned its step) from a first delivery. Default: never.
	Redelivered func(*message.Message) bool
	// Seq, if set, is a message's stream sequence. A trajectory of a step
	// this process planned is then a copy when its sequence is one the
	// plan took, and late otherwise, however often it was delivered: a
	// server restarted after a crash can have lost what it had counted of
	// its deliveries and acknowledgements, and deliver as new what route
	// had planned (Redelivered tells only steps planned before this
	// process started, or long ago).
	Seq func(*message.Message) uint64
	// PlannedBefore, if set, says whether the plan of a step planned
	// before, stored after msg, took t. It is asked of a trajectory
	// delivered as new of a step whose plan this process does not hold
	// (planned before it started, or long ago): a server that
	// crashed with its process (a run killed, a disk that filled) can have
	// lost what it had counted of its deliveries and acknowledgements,
	// and deliver as new what was planned. A trajectory it took is a copy;
	// without PlannedBefore, or when it did not, the trajectory is late
	// (schemas.ErrInvalid).
	PlannedBefore func(msg *message.Message, t schemas.Trajectory) (bool, error)
	// InFlight counts anchor groups sent for execution and not executed
	// yet. With Scheduler.MaxInFlight > 0 it is asked before each step is
	// planned, and the cap lowers that step's anchors; a failed count
	// leaves the step open until the next try. Nil: nothing in flight.
	InFlight func(context.Context) (int, error)
	// MaxPayload, if set, is the largest message the server takes (its
	// max_payload): a group whose message is over it is not sent on; its
	// plan marks it dropped (PlanGroup.Dropped) and OnDropped hears of it.
	MaxPayload int
	// Size, if set, is what the server counts of a message against
	// MaxPayload: its payload and headers (default: the payload alone).
	Size      func(*message.Message) int
	OnDropped func(Dropped)
	// OnNoWatermark, if set, hears once of each step that has had
	// trajectories for WatermarkWait (default 5 minutes) and no watermark:
	// it is planned only once its watermark comes, which a trainer may
	// have forgotten to send.
	OnNoWatermark func(NoWatermark)
	WatermarkWait time.Duration
	// OnShort, if set, hears of each step planned with less than its
	// watermark declared (fewer groups, or groups with fewer trajectories
	// than their group_size), once it is stored: such a step waited out
	// StepTimeout.
	OnShort func(Short)
	// Reject, if set, stores one trajectory of a trajs message on the
	// dead-letter subject (item is its index in the message, payload its
	// JSON), so that the message's other trajectories go on; an error
	// hands the whole message back. Nil: a message with one bad trajectory
	// fails whole, as a single bad trajectory does.
	Reject func(msg *message.Message, item int, payload []byte, reason error) error
	// Astray, if set, counts route's inputs delivered and neither settled
	// nor held by this process: lost on their way at a server's failover,
	// or held by a route process that ended. The server delivers them
	// again after its AckWait. A step whose StepTimeout comes while it
	// lacks groups and inputs are astray waits for them, up to AstrayWait
	// more (default 1m), rather than be planned without what is on its
	// way again; OnAstray hears of it once. A failed count waits as well.
	Astray     func(context.Context) (int, error)
	AstrayWait time.Duration
	OnAstray   func(Astray)
	// OnTaken, if set, hears after each message on kind (schemas.KindTraj
	// or KindTrajs) how many trajectories it brought that route did not
	// have: copies, and trajectories delivered again, are not counted, nor
	// are those rejected. Messages count messages; this counts what a
	// trainer sent.
	OnTaken func(kind schemas.Kind, n int)
}

// Dropped is a group of a step not sent on to be scored, and why.
type Dropped struct {
	Step    int64
	GroupID string
	Reason  string
}

// NoWatermark is a step that has had trajectories for Waited and no
// watermark.
type NoWatermark struct {
	Step                 int64
	Trajectories, Groups int
	Waited               time.Duration
	// NewerPlanned is the newest step planned, when it is newer than
	// Step (else -1): the trainer went on without it, as one that crashed
	// during the step and resumed past it does.
	NewerPlanned int64
}

// Astray is a step whose timeout came while it lacked groups and route's
// inputs were astray (Config.Astray): it waits for them.
type Astray struct {
	Step int64
	// Inputs counts those astray (0: the count failed, with Err).
	Inputs int
	Err    error
	// Upto is how much longer the step waits for them at most.
	Upto time.Duration
}

// Short is a step planned with less than its watermark declared, on its
// timeout.
type Short struct {
	Step int64
	// Declared is the watermark's group count, Groups the groups that came.
	Declared, Groups int
	// Waited is from the watermark to the plan.
	Waited time.Duration
	// Incomplete are the groups with fewer trajectories than their size.
	Incomplete []ShortGroup
}

// ShortGroup is a group with Got of its Want trajectories.
type ShortGroup struct {
	GroupID   string
	Got, Want int
}

// NewHandler builds the stage.
func NewHandler(cfg Config, pub message.Publisher) (*Handler, error) {
	sched, err := NewScheduler(cfg.Scheduler)
	if err != nil {
		return nil, err
	}
	if cfg.StepTimeout == 0 {
		cfg.StepTimeout = 30 * time.Second
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Redelivered == nil {
		cfg.Redelivered = func(*message.Message) bool { return false }
	}
	if cfg.WatermarkWait == 0 {
		cfg.WatermarkWait = 5 * time.Minute
	}
	if cfg.AstrayWait == 0 {
		cfg.AstrayWait = time.Minute
	}
	return &Handler{
		run: cfg.Run, out: cfg.Out, pub: pub, sched: sched, now: cfg.Now, redelivered: cfg.Redelivered, seq: cfg.Seq, askPlanned: cfg.PlannedBefore, inFlight: cfg.InFlight, maxPayload: cfg.MaxPayload, size: cfg.Size, onShort: cfg.OnShort,
		onDropped: cfg.OnDropped, reject: cfg.Reject, onTaken: cfg.OnTaken,
		onNoWatermark: cfg.OnNoWatermark, watermarkWait: cfg.WatermarkWait,
		astray: cfg.Astray, astrayWait: cfg.AstrayWait, onAstray: cfg.OnAstray, astraySaid: map[int64]bool{},
		asm: NewAssembly(cfg.StepTimeout), done: map[int64]chan struct{}{}, sent: map[int64][]string{},
		firstAt: map[int64]time.Time{}, noWatermarkSaid: map[int64]bool{},
		taken: map[int64][]uint64{}, planned: recent.New[int64, []uint64](keepPlanned),
	}, nil
}

// Resume records the anchor groups of steps not planned yet that were sent
// for execution before a restart (route stores a step's anchors first and
// its plan last). Their re-plan keeps exactly those anchors, whatever the
// in-flight count is now, so the plan agrees with what execute has.
func (h *Handler) Resume(sent map[int64][]string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for step, ids := range sent {
		if !h.asm.IsClosed(step) {
			h.sent[step] = slices.Clone(ids)
		}
	}
}

// MarkClosed records steps planned before a restart.
func (h *Handler) MarkClosed(steps ...int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, s := range steps {
		h.asm.MarkClosed(s)
	}
}

func (h *Handler) doneFor(step int64) chan struct{} {
	c := h.done[step]
	if c == nil {
		c = make(chan struct{})
		h.done[step] = c
	}
	return c
}

// HandleTraj takes one trajectory message.
func (h *Handler) HandleTraj(msg *message.Message) error {
	leave := h.inHand(msg)
	done, fresh, err := h.take(msg, msg.Payload)
	leave()
	if err != nil {
		return fmt.Errorf("route: %w", err)
	}
	if fresh {
		h.tellTaken(schemas.KindTraj, 1)
	}
	if done == nil {
		return nil
	}
	return h.hold(msg.Context(), done)
}

// HandleTrajs takes a message of several trajectories, a JSON array (a
// trainer that has a group's rollouts at once sends them so: one message
// where there were G). Each is taken as if it had come alone: one that is
// invalid, of another run, or refused by its step is dead-lettered alone,
// through Config.Reject, and the others go on. The message is held until
// every step it fed is planned.
func (h *Handler) HandleTrajs(msg *message.Message) error {
	items, err := schemas.SplitTrajectories(msg.Payload)
	if err != nil {
		return fmt.Errorf("route: %w", err)
	}
	var dones []<-chan struct{}
	taken := 0
	defer func() { h.tellTaken(schemas.KindTrajs, taken) }()
	leave := h.inHand(msg)
	defer leave()
	for i, item := range items {
		done, fresh, err := h.take(msg, item)
		if fresh {
			taken++
		}
		if err != nil {
			err = fmt.Errorf("route: trajectory %d of the %d in the message: %w", i, len(items), err)
			if h.reject == nil || !(errors.Is(err, schemas.ErrInvalid) || errors.Is(err, schemas.ErrUnusable)) {
				return err
			}
			if err := h.reject(msg, i, item, err); err != nil {
				return err
			}
			continue
		}
		if done != nil && !slices.Contains(dones, done) {
			dones = append(dones, done)
		}
	}
	leave() // taken: held now until the steps are planned
	for _, done := range dones {
		if err := h.hold(msg.Context(), done); err != nil {
			return err
		}
	}
	return nil
}

// inHand counts msg among againInHand, when it was delivered again, until
// the function it returns is called (more than once is as once).
func (h *Handler) inHand(msg *message.Message) func() {
	if !h.redelivered(msg) {
		return func() {}
	}
	h.againInHand.Add(1)
	var once sync.Once
	return func() { once.Do(func() { h.againInHand.Add(-1) }) }
}

// tellTaken tells OnTaken of n trajectories new to route from a message on
// kind.
func (h *Handler) tellTaken(kind schemas.Kind, n int) {
	if h.onTaken != nil && n > 0 {
		h.onTaken(kind, n)
	}
}

// take decodes and records one trajectory of msg, its JSON data (msg's
// payload, or an item of it), and returns what its step's plan closes, or
// nil for a copy of a trajectory planned before, and whether route did
// not have the trajectory before.
func (h *Handler) take(msg *message.Message, data []byte) (<-chan struct{}, bool, error) {
	t, err := schemas.DecodeTrajectory(data)
	if err != nil {
		return nil, false, err
	}
	if err := schemas.CheckRun(t.Run, h.run); err != nil {
		return nil, false, err
	}
	done, fresh, err := h.addTraj(msg, t, false)
	if !errors.Is(err, errAskPlanned) {
		return done, fresh, err
	}
	// Asked outside the lock: the answer may read the stream.
	copied, err := h.askPlanned(msg, t)
	switch {
	case err != nil:
		return nil, false, fmt.Errorf("trajectory %s of step %d, planned before: whether its plan took it cannot be told: %w", t.TrajID, t.Step, err)
	case copied:
		return nil, false, nil
	}
	return h.addTraj(msg, t, true)
}

// errAskPlanned: a trajectory delivered as new of a step planned before,
// whose plan this process does not hold, is to be looked up in that plan
// (Config.PlannedBefore) before it is judged late.
var errAskPlanned = errors.New("route: ask the stored plan")

// addTraj records t and returns what its step's plan closes, or nil for a
// copy of a trajectory planned before, and whether t is new to route. Of a
// trajectory delivered as new of a step planned before, whose plan this
// process does not hold, it returns errAskPlanned unless asked says the
// stored plan was asked already (and did not take it).
func (h *Handler) addTraj(msg *message.Message, t schemas.Trajectory, asked bool) (<-chan struct{}, bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.asm.IsClosed(t.Step) {
		if seqs, ok := h.planned.Get(t.Step); ok {
			if _, taken := slices.BinarySearch(seqs, h.seq(msg)); taken {
				return nil, false, nil // delivered again: its step's plan took it
			}
		} else if h.redelivered(msg) {
			// Delivered before, to a route that planned its step and died
			// before acknowledging: a duplicate, not a late trajectory.
			return nil, false, nil
		} else if h.askPlanned != nil && !asked {
			return nil, false, errAskPlanned
		}
	}
	fresh := !h.asm.Has(t.Step, t.TrajID)
	if err := h.asm.AddTraj(t); err != nil {
		return nil, false, err
	}
	if h.seq != nil {
		h.taken[t.Step] = append(h.taken[t.Step], h.seq(msg))
	}
	if _, ok := h.firstAt[t.Step]; !ok {
		h.firstAt[t.Step] = h.now()
	}
	return h.doneFor(t.Step), fresh, nil
}

// HandleStep takes one watermark message.
func (h *Handler) HandleStep(msg *message.Message) error {
	w, err := schemas.DecodeStepClose(msg.Payload)
	if err != nil {
		return fmt.Errorf("route: %w", err)
	}
	if err := schemas.CheckRun(w.Run, h.run); err != nil {
		return fmt.Errorf("route: %w", err)
	}
	done, err := h.addWatermark(w)
	if err != nil || done == nil {
		return err
	}
	return h.hold(msg.Context(), done)
}

// addWatermark records w and returns what its step's plan closes, or nil
// for the watermark of a step planned before.
func (h *Handler) addWatermark(w schemas.StepClose) (<-chan struct{}, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.asm.IsClosed(w.Step) {
		return nil, nil
	}
	if err := h.asm.AddWatermark(w, h.now()); err != nil {
		return nil, fmt.Errorf("route: %w", err)
	}
	return h.doneFor(w.Step), nil
}

// hold waits until the step's outputs are stored: then the input can be
// acknowledged.
func (h *Handler) hold(ctx context.Context, done <-chan struct{}) error {
	if err := h.Flush(); err != nil {
		return err
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("route: gave up holding input: %w", ctx.Err())
	}
}

// Flush plans every ready step. Handlers call it after each input; Run
// calls it periodically for step timeouts.
func (h *Handler) Flush() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.now()
	for _, step := range h.asm.Ready(now) {
		if h.waitsForAstray(step, now) {
			continue
		}
		sent, resumed := h.sent[step]
		inFlight := 0
		if !resumed && h.inFlight != nil && h.sched.cfg.MaxInFlight > 0 {
			var err error
			if inFlight, err = h.countInFlight(); err != nil {
				return fmt.Errorf("route: step %d: count executions in flight: %w", step, err) // retried like a failed publish
			}
		}
		plan, groups := h.asm.Plan(h.run, step, h.sched, inFlight, sent, now)
		dropped, err := h.publish(&plan, groups)
		if err != nil {
			return err // the step stays open; the next input or tick retries
		}
		if h.onDropped != nil {
			for _, d := range dropped {
				h.onDropped(d)
			}
		}
		if h.onShort != nil {
			declared, at := h.asm.Declared(step)
			if short := shortOf(plan, declared, now.Sub(at)); short != nil {
				h.onShort(*short)
			}
		}
		h.asm.Close(step)
		h.keepPlanned(step)
		close(h.doneFor(step))
		delete(h.done, step)
		delete(h.sent, step)
		delete(h.firstAt, step)
		delete(h.noWatermarkSaid, step)
		delete(h.astraySaid, step)
	}
	if h.onNoWatermark != nil {
		for step, first := range h.firstAt {
			if _, at := h.asm.Declared(step); !at.IsZero() || h.noWatermarkSaid[step] || now.Sub(first) < h.watermarkWait {
				continue
			}
			h.noWatermarkSaid[step] = true
			trajs, groups := h.asm.Received(step)
			newer := h.asm.NewestClosed()
			if newer < step {
				newer = -1
			}
			h.onNoWatermark(NoWatermark{Step: step, Trajectories: trajs, Groups: groups, Waited: now.Sub(first), NewerPlanned: newer})
		}
	}
	return nil
}

// waitsForAstray reports whether step, ready on its timeout while it
// lacks groups or trajectories, waits for route's inputs astray: those
// the server delivers again after its AckWait could be its own. The lock
// is held.
func (h *Handler) waitsForAstray(step int64, now time.Time) bool {
	if h.astray == nil || !h.asm.Short(step) {
		return false
	}
	_, at := h.asm.Declared(step)
	left := h.asm.StepTimeout + h.astrayWait - now.Sub(at)
	if left <= 0 {
		return false
	}
	if now.Sub(h.astrayAt) >= time.Second {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		h.astrayN, h.astrayErr = h.astray(ctx)
		cancel()
		h.astrayAt = now
	}
	if h.astrayErr == nil && h.astrayN <= 0 && h.againInHand.Load() == 0 {
		return false
	}
	if h.onAstray != nil && !h.astraySaid[step] {
		h.astraySaid[step] = true
		h.onAstray(Astray{Step: step, Inputs: h.astrayN, Err: h.astrayErr, Upto: left})
	}
	return true
}

// keepPlanned keeps the sequences of the trajectories step took, now
// planned, forgetting the oldest planned step's beyond keepPlanned.
func (h *Handler) keepPlanned(step int64) {
	if h.seq == nil {
		return
	}
	seqs := h.taken[step]
	delete(h.taken, step)
	slices.Sort(seqs)
	h.planned.Put(step, slices.Compact(seqs))
}

// shortOf is what plan lacks of its watermark's declared groups, or nil.
func shortOf(plan schemas.Plan, declared int, waited time.Duration) *Short {
	short := Short{Step: plan.Step, Declared: declared, Groups: len(plan.Groups), Waited: waited}
	for _, g := range plan.Groups {
		if len(g.TrajIDs) < g.Want {
			short.Incomplete = append(short.Incomplete, ShortGroup{GroupID: g.GroupID, Got: len(g.TrajIDs), Want: g.Want})
		}
	}
	if short.Groups >= declared && short.Incomplete == nil {
		return nil
	}
	return &short
}

func (h *Handler) countInFlight() (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return h.inFlight(ctx)
}

// publish stores a step's groups, its anchor groups for execution, and
// its plan, last. A group whose message the server would refuse (over its
// max_payload: every group message carries all its trajectories, and no
// retry stores it) is not sent: the plan marks it dropped, so that the step
// goes on without it and its update says so, rather than the step, and
// every later one, waiting for it.
// sizeOf is what the server counts of m against its max_payload.
func (h *Handler) sizeOf(m *message.Message) int {
	if h.size == nil {
		return len(m.Payload)
	}
	return h.size(m)
}

func (h *Handler) publish(plan *schemas.Plan, groups []schemas.Group) ([]Dropped, error) {
	var toPredict, toExec []*message.Message
	var dropped []Dropped
	for i, g := range groups {
		m, err := schemas.NewMessage(fmt.Sprintf("%s/group/%d/%s", h.run, g.Step, g.GroupID), g)
		if err != nil {
			return nil, err
		}
		if size := h.sizeOf(m); h.maxPayload > 0 && size > h.maxPayload {
			d := Dropped{Step: g.Step, GroupID: g.GroupID,
				Reason: fmt.Sprintf("not scored: the group's message is %.1f MiB (%d trajectories), over the NATS server's max_payload of %.1f MiB",
					float64(size)/(1<<20), len(g.Trajectories), float64(h.maxPayload)/(1<<20))}
			dropped = append(dropped, d)
			// groups and plan.Groups are in the same order (Assembly.Plan).
			plan.Groups[i].Dropped = d.Reason
			if plan.Groups[i].Anchor {
				plan.Groups[i].Anchor, plan.Decisions[i].Anchor, plan.Decisions[i].Reason = false, false, "too large to send"
				plan.Anchors--
			}
			continue
		}
		toPredict = append(toPredict, m)
		if g.Anchor { // the same group, to execute: encoded once
			toExec = append(toExec, schemas.Again(m, fmt.Sprintf("%s/exec/%d/%s", h.run, g.Step, g.GroupID)))
		}
	}
	pm, err := schemas.NewMessage(fmt.Sprintf("%s/plan/%d", h.run, plan.Step), plan)
	if err != nil {
		return nil, err
	}
	// The plan goes last: a stored plan means every output of the step is
	// stored, which is what a restarted route relies on (MarkClosed).
	if err := h.pub.Publish(h.out.Exec, toExec...); err != nil {
		return nil, fmt.Errorf("route: publish anchors of step %d: %w", plan.Step, err)
	}
	if err := h.pub.Publish(h.out.Group, toPredict...); err != nil {
		return nil, fmt.Errorf("route: publish groups of step %d: %w", plan.Step, err)
	}
	if err := h.pub.Publish(h.out.Plan, pm); err != nil {
		return nil, fmt.Errorf("route: publish plan %d: %w", plan.Step, err)
	}
	return dropped, nil
}

// Run flushes steps whose timeout passed, until ctx is done.
func (h *Handler) Run(ctx context.Context) error {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			_ = h.Flush() // a failure leaves steps open; the next tick retries
		}
	}
}
