package pair

import (
	"context"
	"fmt"
	"sync"

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
// have arrived and their pairs are stored. One pair stage per run.
type Handler struct {
	Run string
	Out string // pairs subject
	Pub message.Publisher

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
	return h.join(msg.Context(), key{p.Step, p.GroupID}, s)
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
	return h.join(msg.Context(), key{e.Step, e.GroupID}, s)
}

// join publishes the pairs once both sides are in, then releases both
// inputs; the first to arrive waits for that.
func (h *Handler) join(ctx context.Context, k key, s *slot) error {
	h.mu.Lock()
	ready := s.pred != nil && s.exec != nil && h.slots[k] == s
	if ready {
		delete(h.slots, k) // one caller publishes
	}
	h.mu.Unlock()
	if ready {
		out, err := schemas.NewMessage(fmt.Sprintf("%s/pairs/%d/%s", h.Run, k.step, k.group), Pairs(*s.pred, *s.exec))
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
	select {
	case <-s.done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("pair: gave up waiting for the other side of %d/%s: %w", k.step, k.group, ctx.Err())
	}
}
