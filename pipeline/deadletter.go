package pipeline

import (
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// deadLetters decides, in one place, whether a failed message is retried
// or dead-lettered: poison (schemas.ErrInvalid, ErrUnusable) at once, an
// outage (schemas.ErrOutage) never, anything else once it has failed on
// its MaxAttempts-th delivery. A dead letter is stored on the dlq subject
// with the reason before the input is acknowledged.
type deadLetters struct {
	pub         message.Publisher
	subject     string
	maxAttempts int
	metrics     *Metrics
	notef       func(format string, args ...any)

	mu         sync.Mutex
	lastOutage map[string]time.Time // by stage: when an outage was last said
}

func (d *deadLetters) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err == nil {
			return out, nil
		}
		if msg.Context().Err() != nil {
			return nil, err // shutting down: hand it back
		}
		if errors.Is(err, schemas.ErrOutage) {
			d.outage(msg, err)
			return nil, err
		}
		if !isPoison(err) && !d.lastAttempt(msg) {
			return nil, err
		}
		reason := err.Error()
		if !isPoison(err) {
			reason = fmt.Sprintf("gave up after %s deliveries: %v", msg.Metadata.Get(natsjs.MetaDeliveries), err)
		}
		stage := stageOf(message.HandlerNameFromCtx(msg.Context()))
		if perr := d.send(stage, msg.Metadata.Get(natsjs.MetaSubject), reason, msg.Payload); perr != nil {
			return nil, fmt.Errorf("%v (and the dead letter could not be stored: %w)", err, perr)
		}
		return nil, nil
	}
}

// outage says, at most once a minute per stage, that a stage is waiting
// out an outage; the handler error counter counts every attempt.
func (d *deadLetters) outage(msg *message.Message, err error) {
	stage := stageOf(message.HandlerNameFromCtx(msg.Context()))
	d.mu.Lock()
	defer d.mu.Unlock()
	if time.Since(d.lastOutage[stage]) < time.Minute {
		return
	}
	if d.lastOutage == nil {
		d.lastOutage = map[string]time.Time{}
	}
	d.lastOutage[stage] = time.Now()
	if d.notef != nil {
		d.notef("%s: %v (retrying until it passes; nothing is dead-lettered)", stage, err)
	}
}

// lastAttempt reports whether msg is on the delivery after which a failing
// handler's message is dead-lettered.
func (d *deadLetters) lastAttempt(msg *message.Message) bool {
	n, _ := strconv.Atoi(msg.Metadata.Get(natsjs.MetaDeliveries))
	return n >= d.maxAttempts
}

func (d *deadLetters) send(stage, subject, reason string, payload []byte) error {
	dl := schemas.DeadLetter{Schema: schemas.Version, Subject: subject, Stage: stage, Reason: reason,
		Payload: string(payload), Time: time.Now().UTC()}
	m, err := schemas.NewMessage("", dl)
	if err != nil {
		return err
	}
	if err := d.pub.Publish(d.subject, m); err != nil {
		return err
	}
	d.metrics.DeadLetters.WithLabelValues(stage).Inc()
	return nil
}
