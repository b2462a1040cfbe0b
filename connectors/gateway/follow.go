package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/recent"
	"github.com/wmrl/wmrl/stages/stepset"
)

// updates indexes the run's retained updates by step: the newest few are
// kept whole, every one by stream sequence, so any step can be served.
// Those stored before the gateway started are indexed from their message
// IDs alone (index), while those from the newest then on are read whole
// (add): a start does not read every update of the run before it serves
// the new ones.
type updates struct {
	mu      sync.Mutex
	seq     map[int64]uint64
	whole   *recent.Map[int64, json.RawMessage] // the newest few
	waiters map[int64][]chan struct{}
	last    schemas.Update // the newest, for rho and D
	have    bool
	loading bool             // the updates stored before the start are being indexed
	indexed func(step int64) // if set (tests), hears each step index records
}

func newUpdates(keep int) *updates {
	return &updates{seq: map[int64]uint64{}, whole: recent.New[int64, json.RawMessage](keep), waiters: map[int64][]chan struct{}{}}
}

func (u *updates) add(rec natsjs.Record) {
	var up schemas.Update
	if err := json.Unmarshal(rec.Data, &up); err != nil {
		return
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if _, dup := u.seq[up.Step]; dup {
		return
	}
	u.seq[up.Step] = rec.Seq
	u.whole.Put(up.Step, rec.Data)
	if !u.have || up.Step >= u.last.Step {
		up.Items = nil
		u.last, u.have = up, true
	}
	u.arrived(up.Step)
}

// arrived wakes the requests waiting for step's update. Callers hold u.mu.
func (u *updates) arrived(step int64) {
	for _, w := range u.waiters[step] {
		close(w)
	}
	delete(u.waiters, step)
}

// index records the stream sequence of step's update, stored before the
// start.
func (u *updates) index(step int64, seq uint64) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if _, ok := u.seq[step]; !ok {
		u.seq[step] = seq
		u.arrived(step)
		if u.indexed != nil {
			u.indexed(step)
		}
	}
}

// setLoading says whether the updates stored before the start are being
// indexed: until they are, a step not found may be among them.
func (u *updates) setLoading(loading bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.loading = loading
}

// indexing reports whether the updates stored before the start are being
// indexed still.
func (u *updates) indexing() bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.loading
}

// get returns the update of step, or, if wait, a channel closed when it
// arrives: a caller that stops waiting before gives it back (forget).
func (u *updates) get(step int64, wait bool) (data json.RawMessage, seq uint64, arrived <-chan struct{}) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if d, ok := u.whole.Get(step); ok {
		return d, 0, nil
	}
	if s, ok := u.seq[step]; ok {
		return nil, s, nil
	}
	if !wait {
		return nil, 0, nil
	}
	c := make(chan struct{})
	u.waiters[step] = append(u.waiters[step], c)
	return nil, 0, c
}

// forget gives back a channel of get's that is no longer waited on (the
// step's update came, or the wait ended without it). A trainer that polls
// for a step no update will come for (a step it never sent, or one held
// for good) would otherwise leave one a request for the life of the
// process.
func (u *updates) forget(step int64, arrived <-chan struct{}) {
	u.mu.Lock()
	defer u.mu.Unlock()
	ws := slices.DeleteFunc(u.waiters[step], func(c chan struct{}) bool { return c == arrived })
	if len(ws) == 0 {
		delete(u.waiters, step)
		return
	}
	u.waiters[step] = ws
}

func (u *updates) newest() (schemas.Update, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.last, u.have
}

// planned is the set of steps route has planned (closed): trajectories
// for them come too late to be fused. Route plans steps about in order, so
// a run of days is held as the few ranges of consecutive steps, not a step
// at a time.
type planned struct {
	mu      sync.Mutex
	steps   stepset.Set
	last    int64
	anyYet  bool
	loading bool             // the plans stored before the start are being read
	added   func(step int64) // if set (tests), hears each step added
}

func (p *planned) setLoading(v bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.loading = v
}

// unsure reports whether step, not found planned, may be among the plans
// stored before the start that are not read yet: one at or before the
// newest plan. Before the newest is known (a message get after the start)
// every step is taken, as one of a new run must be at once.
func (p *planned) unsure(step int64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.loading && p.anyYet && step <= p.last && !p.steps.Has(step)
}

func (p *planned) add(n int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.anyYet || n > p.last {
		p.last, p.anyYet = n, true
	}
	p.steps.Add(n)
	if p.added != nil {
		p.added(n)
	}
}

func (p *planned) has(step int64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.steps.Has(step)
}

func (p *planned) newest() (int64, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.last, p.anyYet
}

// truths maps a trajectory's content to its real score once its anchor
// group was executed, for the reward endpoints. Bounded both ways for a run
// of days: keep scores, the oldest going first, and keep anchors awaiting
// their execution (one whose execution never comes, past its deadline or
// dead-lettered, is forgotten in turn). The anchor groups and the
// executions are read apart, so an execution may be read first (at a
// start, when both readers go through what was stored): its scores wait
// for their group, as many as the scores kept.
type truths struct {
	mu      sync.Mutex
	byTraj  map[trajKey]digest // trajectory -> its content's, for anchors sent to execute
	pending []trajKey          // byTraj's keys in arrival order (some already executed)
	early   map[trajKey]float64
	waiting []trajKey                    // early's keys in arrival order (some already matched)
	score   *recent.Map[digest, float64] // the newest keep
	keep    int
	groups  int // anchor groups read
}

// trajKey names a trajectory: a trainer may give its trajectories the
// same ids every step.
type trajKey struct {
	step int64
	id   string
}

func newTruths(keep int) *truths {
	return &truths{byTraj: map[trajKey]digest{}, early: map[trajKey]float64{}, score: recent.New[digest, float64](keep), keep: keep}
}

// contentKey names an executed solution. Not its task: an anchor's is the
// trainer's task id, a reward request's whatever label its trainer sends.
func contentKey(prompt, response string) digest { return digestOf(prompt, response) }

func (t *truths) addAnchor(g schemas.Group) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.groups++
	for _, tr := range g.Trajectories {
		k, key := trajKey{g.Step, tr.TrajID}, contentKey(tr.Prompt, tr.Response)
		if s, ok := t.early[k]; ok {
			delete(t.early, k)
			t.scored(key, s)
			continue
		}
		t.byTraj[k] = key
		t.pending = append(t.pending, k)
	}
	for len(t.pending) > t.keep {
		delete(t.byTraj, t.pending[0])
		t.pending = t.pending[1:]
	}
}

// addExecution records the graded items' scores; an ungraded item is no
// longer awaited either.
func (t *truths) addExecution(e schemas.Execution) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, it := range e.Items {
		k := trajKey{e.Step, it.TrajID}
		key, ok := t.byTraj[k]
		switch {
		case !ok && it.Score != nil:
			t.early[k] = *it.Score
			t.waiting = append(t.waiting, k)
		case ok:
			delete(t.byTraj, k)
			if it.Score != nil {
				t.scored(key, *it.Score)
			}
		}
	}
	for len(t.waiting) > t.keep {
		delete(t.early, t.waiting[0])
		t.waiting = t.waiting[1:]
	}
}

// scored keeps a solution's real score, forgetting the oldest past keep.
func (t *truths) scored(key digest, s float64) {
	t.score.Put(key, s)
}

func (t *truths) lookup(prompt, response string) (float64, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	s, ok := t.score.Get(contentKey(prompt, response))
	return s, ok
}

// follow reads subject from the first message after stream sequence after
// (0: the first retained), payloads too unless headersOnly, and hands each
// to fn until ctx is done.
func follow(ctx context.Context, js jetstream.JetStream, stream, subject string, after uint64, headersOnly bool, fn func(natsjs.Record)) error {
	r, err := natsjs.NewReaderAfter(ctx, js, stream, subject, after, headersOnly)
	if err != nil {
		return err
	}
	defer r.Close()
	if err := r.Follow(ctx, fn); err != nil {
		return fmt.Errorf("gateway: follow %s: %w", subject, err)
	}
	return nil
}

// newestOn is the stream sequence and payload of subject's newest message
// (0: none).
func newestOn(ctx context.Context, js jetstream.JetStream, stream, subject string) (uint64, []byte, error) {
	var m *jetstream.RawStreamMsg
	err := natsjs.UntilAnswered(ctx, func(ctx context.Context) error {
		st, err := js.Stream(ctx, stream)
		if err == nil {
			m, err = st.GetLastMsgForSubject(ctx, subject)
		}
		return err
	}, nil)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return 0, nil, nil
	case err != nil:
		return 0, nil, fmt.Errorf("gateway: the newest message on %s: %w", subject, err)
	}
	return m.Sequence, m.Data, nil
}

// stepOf reads the step of a message from its ID, or else from its
// payload, fetched if it was read without (a stage other than wmrl's may
// name its messages otherwise).
func stepOf(ctx context.Context, js jetstream.JetStream, stream string, r natsjs.Record) (int64, bool) {
	if step, ok := schemas.StepOfMsgID(r.MsgID); ok {
		return step, true
	}
	data := r.Data
	if len(data) == 0 {
		st, err := js.Stream(ctx, stream)
		if err != nil {
			return 0, false
		}
		m, err := st.GetMsg(ctx, r.Seq)
		if err != nil {
			return 0, false
		}
		data = m.Data
	}
	var v struct {
		Step *int64 `json:"step"`
	}
	if json.Unmarshal(data, &v) != nil || v.Step == nil {
		return 0, false
	}
	return *v.Step, true
}

// truthsAfter is the stream sequence that the reads of the anchors' real
// scores start after: the anchor groups of as many of the newest steps
// as the truths keep trajectories of (at the newest plan's anchors a
// step), found from a few messages. 0, from the first retained, when the
// run is not that long yet, or when the newest messages cannot be read.
// Before, a start read every retained anchor group and execution whole
// (120 MB at 13,681 simulated steps, more with real code), to keep the
// newest 100,000 scores. Route stores a step's anchor groups as it plans
// the step, so their steps rise in the stream but for a step planned
// late (its watermark late): one older than every step kept, met by the
// search, starts the read after it, and the scores stored before it are
// not read; the reward endpoints then ask the world model for those.
func (g *Gateway) truthsAfter(ctx context.Context) uint64 {
	s := g.cfg.Subjects
	last, data, err := newestOn(ctx, g.js, g.cfg.Stream, s.Exec)
	var newest schemas.Group
	if err != nil || last == 0 || json.Unmarshal(data, &newest) != nil {
		return 0
	}
	perStep := len(newest.Trajectories) // a step with an anchor group has one at least
	if _, data, err := newestOn(ctx, g.js, g.cfg.Stream, s.Plan); err == nil && data != nil {
		var p schemas.Plan
		if json.Unmarshal(data, &p) == nil {
			anchored := 0
			for _, gr := range p.Groups {
				if gr.Anchor {
					anchored += len(gr.TrajIDs)
				}
			}
			perStep = max(perStep, anchored)
		}
	}
	from := newest.Step - int64(g.truths.keep/max(perStep, 1)) - 1
	if from <= 0 {
		return 0
	}
	after, err := natsjs.SeekAfter(ctx, g.js, g.cfg.Stream, s.Exec, last, func(r natsjs.Record) bool {
		step, ok := stepOf(ctx, g.js, g.cfg.Stream, r)
		return ok && step >= from
	})
	if err != nil {
		return 0
	}
	return after
}
