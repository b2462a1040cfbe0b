package pipeline

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// deadLetters decides, in one place, whether a failed message is retried
// or dead-lettered: poison (schemas.ErrInvalid, ErrUnusable) and what a
// stage gave up on without trying (schemas.ErrDown) at once, an outage
// (schemas.ErrOutage) never, anything else once it has failed on its
// MaxAttempts-th delivery. A dead letter is stored on the dlq subject
// with the reason before the input is acknowledged.
type deadLetters struct {
	pub         message.Publisher
	subject     string
	maxAttempts int
	metrics     *Metrics
	notef       func(format string, args ...any)
	// onPanic is told of a handler's panic once its message is stored (or
	// could not be): the pipeline stops the run.
	onPanic func(stage, subject string, pe *panicError, stored string)

	mu   sync.Mutex
	said map[string]time.Time // by stage and kind: when it was last said
}

// givenUpPrefix begins the reason of a message given up for an outage
// (after its retries, or at once while what it needs is down), as against
// rejected input; outside stages use it too (README, wire contract).
const givenUpPrefix = "gave up "

// GivenUp tells a dead letter an outage cost from rejected input.
func GivenUp(dl schemas.DeadLetter) bool { return strings.HasPrefix(dl.Reason, givenUpPrefix) }

func (d *deadLetters) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err == nil {
			return out, nil
		}
		stage := stageOf(message.HandlerNameFromCtx(msg.Context()))
		if pe, ok := asPanic(err); ok {
			return nil, d.panicked(stage, msg, pe)
		}
		if msg.Context().Err() != nil {
			return nil, err // shutting down: hand it back
		}
		deliveries := msg.Metadata.Get(natsjs.MetaDeliveries)
		if errors.Is(err, schemas.ErrOutage) {
			d.say(stage, "outage", "%s; retrying until it passes, nothing is dead-lettered", ofStage(stage, err.Error()))
			return nil, err
		}
		down := errors.Is(err, schemas.ErrDown)
		if !isPoison(err) && !down && !d.lastAttempt(msg) {
			d.say(stage, "retry", "%s (delivery %s of %d; retrying)", ofStage(stage, err.Error()), deliveries, d.maxAttempts)
			return nil, err
		}
		reason := err.Error()
		switch {
		case down:
			reason = givenUpPrefix + "at once: " + reason
		case !isPoison(err):
			reason = fmt.Sprintf("%safter %s deliveries: %v", givenUpPrefix, deliveries, err)
		}
		if perr := d.send(stage, msg.Metadata.Get(natsjs.MetaSubject), reason, msg.Payload); perr != nil {
			return nil, fmt.Errorf("%v (and the dead letter could not be stored: %w)", err, perr)
		}
		d.say(stage, "dead", "%s: dead-lettered to %s: %s", stage, d.subject, reason)
		return nil, nil
	}
}

// panicked stores a message whose handler panicked on the dlq subject, as
// given up (a bug, not the input's fault: resent once it is fixed), and
// has onPanic stop the run. The message is acknowledged once stored, and
// handed back if it could not be.
func (d *deadLetters) panicked(stage string, msg *message.Message, pe *panicError) error {
	subject := msg.Metadata.Get(natsjs.MetaSubject)
	stored := "dead-lettered to " + d.subject
	err := d.send(stage, subject, givenUpPrefix+"at once: "+stage+": "+pe.Error(), msg.Payload)
	if err != nil {
		stored = "it could not be dead-lettered: " + err.Error()
	}
	if d.onPanic != nil {
		d.onPanic(stage, subject, pe, stored)
	}
	return err
}

// ofStage prefixes msg with its stage unless it names it already.
func ofStage(stage, msg string) string {
	if strings.HasPrefix(msg, stage+":") {
		return msg
	}
	return stage + ": " + msg
}

// say prints a handler's failures, at most once a minute per stage and
// kind (retried, waited out, dead-lettered), so that a world model or
// sandbox that is down shows in the run's output rather than as silence;
// the metrics count every one.
func (d *deadLetters) say(stage, kind, format string, args ...any) {
	if d.notef == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	key := stage + "/" + kind
	if time.Since(d.said[key]) < time.Minute {
		return
	}
	if d.said == nil {
		d.said = map[string]time.Time{}
	}
	d.said[key] = time.Now()
	d.notef(format, args...)
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
