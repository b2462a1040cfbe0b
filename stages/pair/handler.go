package pair

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
)

type key struct {
	step  int64
	group string
}

type slot struct {
	pred *schemas.Prediction
	exec *schemas.Execution
	done chan struct{}
}

// Handler is the pair stage. A world-model-only prediction is acknowledged
// at once; an anchor group's prediction and execution are held until both
// have arrived and their pairs are stored (or, for a side delivered again,
// until it is known that they were). One pair stage per run.
type Handler struct {
	Run string
	Out string // pairs subject
	Pub message.Publisher
	// Wait bounds how long one side waits for the other (0: forever). Past
	// it the handler fails with schemas.ErrUnusable, so the side is
	// dead-lettered with the reason instead of held, and redelivered after
	// every restart, for good: the other side was dead-lettered itself (an
	// executor that kept failing).
	Wait time.Duration
	// Redelivered, if set, says whether a message was delivered before.
	Redelivered func(*message.Message) bool
	// Stored, if set, says whether a message of de-duplication ID id
	// (the pairs of a group) was stored on Out since side was. A side
	// delivered again after its group's pairs were stored (the process
	// that paired them stopped, or lost its connection, before its
	// acknowledgement reached the server) has no other side to come: it is
	// asked as it comes when it was delivered before, and by any side
	// before it goes to the dead letters, so that it is let go instead.
	Stored func(ctx context.Context, side *message.Message, id string) (bool, error)
	// LetGo, if set, is told of each side let go because its group's pairs
	// were stored (side is "prediction" or "execution").
	LetGo func(step int64, group, side string)

	mu    sync.Mutex
	slots map[key]*slot
}

// NewHandler builds the stage.
func NewHandler(run, out string, pub message.Publisher) *Handler {
	return &Handler{Run: run, Out: out, Pub: pub, slots: map[key]*slot{}}
}

func (h *Handler) slot(k key) *slot {
	s := h.slots[k]
	if s == nil {
		s = &slot{done: make(chan struct{})}
		h.slots[k] = s
	}
	return s
}

// HandlePred takes a Prediction.
func (h *Handler) HandlePred(msg *message.Message) error {
	var p schemas.Prediction
	if err := schemas.Decode(msg.Payload, h.Run, &p); err != nil {
		return fmt.Errorf("pair: %w", err)
	}
	if !p.Anchor {
		return nil
	}
	h.mu.Lock()
	s := h.slot(key{p.Step, p.GroupID})
	s.pred = &p
	h.mu.Unlock()
	return h.join(msg, key{p.Step, p.GroupID}, s, "prediction")
}

// HandleExecution takes an Execution.
func (h *Handler) HandleExecution(msg *message.Message) error {
	var e schemas.Execution
	if err := schemas.Decode(msg.Payload, h.Run, &e); err != nil {
		return fmt.Errorf("pair: %w", err)
	}
	h.mu.Lock()
	s := h.slot(key{e.Step, e.GroupID})
	s.exec = &e
	h.mu.Unlock()
	return h.join(msg, key{e.Step, e.GroupID}, s, "execution")
}

// join publishes the pairs once both sides are in, then releases both
// inputs; the first to arrive waits for that. side names msg's kind.
func (h *Handler) join(msg *message.Message, k key, s *slot, side string) error {
	ctx := msg.Context()
	h.mu.Lock()
	ready := s.pred != nil && s.exec != nil && h.slots[k] == s
	if ready {
		delete(h.slots, k) // one caller publishes
	}
	h.mu.Unlock()
	if ready {
		out, err := schemas.NewMessage(h.id(k), Pairs(*s.pred, *s.exec))
		if err == nil {
			err = h.Pub.Publish(h.Out, out)
		}
		if err != nil {
			h.mu.Lock()
			if h.slots[k] == nil {
				h.slots[k] = s // let a redelivery retry
			}
			h.mu.Unlock()
			return fmt.Errorf("pair: publish pairs of %d/%s: %w", k.step, k.group, err)
		}
		close(s.done)
		return nil
	}
	if h.Redelivered != nil && h.Redelivered(msg) {
		if stored, err := h.stored(msg, k); err == nil && stored {
			return h.letGo(ctx, k, s, side, nil)
		}
	}
	var expired <-chan time.Time
	if h.Wait > 0 {
		t := time.NewTimer(h.Wait)
		defer t.Stop()
		expired = t.C
	}
	select {
	case <-s.done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("pair: gave up waiting for the other side of %d/%s: %w", k.step, k.group, ctx.Err())
	case <-expired:
	}
	stored, err := h.stored(msg, k)
	if err != nil {
		// Handed back, to be asked again when redelivered: a side whose
		// pairs were stored is not to be dead-lettered for want of its
		// other side.
		return h.letGo(ctx, k, s, side, fmt.Errorf("pair: anchor group %d/%s: alone for %v, and whether its pairs were stored cannot be told: %w", k.step, k.group, h.Wait, err))
	}
	if stored {
		return h.letGo(ctx, k, s, side, nil)
	}
	missing := "execution"
	if side == "execution" {
		missing = "prediction"
	}
	return h.letGo(ctx, k, s, side, fmt.Errorf("pair: %w: anchor group %d/%s: no %s within %v (see the dead letters for it)", schemas.ErrUnusable, k.step, k.group, missing, h.Wait))
}

// letGo ends a side's wait with outcome (nil: its group's pairs were
// stored, which LetGo is told): its slot is taken back while the side is
// alone in it; when the other side came just now and is storing the
// pairs, the side waits for that instead.
func (h *Handler) letGo(ctx context.Context, k key, s *slot, side string, outcome error) error {
	h.mu.Lock()
	alone := h.slots[k] == s && (s.pred == nil || s.exec == nil)
	if alone {
		delete(h.slots, k)
	}
	h.mu.Unlock()
	if alone {
		if outcome == nil && h.LetGo != nil {
			h.LetGo(k.step, k.group, side)
		}
		return outcome
	}
	select {
	case <-s.done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("pair: gave up waiting for the other side of %d/%s: %w", k.step, k.group, ctx.Err())
	}
}

// id is the de-duplication ID of a group's pairs.
func (h *Handler) id(k key) string { return fmt.Sprintf("%s/pairs/%d/%s", h.Run, k.step, k.group) }

// stored says whether the pairs of k were stored since side was (false
// when Stored is not set).
func (h *Handler) stored(side *message.Message, k key) (bool, error) {
	if h.Stored == nil {
		return false, nil
	}
	return h.Stored(side.Context(), side, h.id(k))
}
