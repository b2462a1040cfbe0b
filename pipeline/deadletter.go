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
// (schemas.ErrOutage, or a NATS store with no room) never, anything else
// once it has failed on its MaxAttempts-th delivery. A dead letter is
// stored on the dlq subject with the reason before the input is
// acknowledged.
type deadLetters struct {
	pub         message.Publisher
	subject     string
	maxAttempts int
	maxPayload  int // the server's max_payload, which a dead letter must fit (0: unknown)
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
		if natsjs.StoreFull(err) {
			d.say(stage, "outage", "%s: %s; retrying until there is, nothing is dead-lettered: %v", stage, natsjs.StoreFullHint, err)
			return nil, err
		}
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
		dl, perr := d.sendMsg(stage, msg, reason)
		if perr != nil {
			d.say(stage, "unstored", "%s: could not store the dead letter (%v), so the message is handed back and tried again: %s", stage, perr, reason)
			return nil, fmt.Errorf("%v (and the dead letter could not be stored: %w)", err, perr)
		}
		d.say(stage, "dead", "%s: dead-lettered to %s%s: %s", stage, d.subject, cutNote(dl), reason)
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
	_, err := d.sendMsg(stage, msg, panicReason(stage, pe))
	if err != nil {
		stored = "it could not be dead-lettered: " + err.Error()
	} else {
		// Acknowledged before the run is stopped: the router would only
		// acknowledge it once this returns, and a subscriber closing
		// before then hands it back, so that the restart met the panic
		// again.
		msg.Ack()
	}
	if d.onPanic != nil {
		d.onPanic(stage, subject, pe, stored)
	}
	return err
}

// reject stores a message an in-order reader (calibrate's, fuse's) cannot
// use on the dlq subject, saying so as the middleware does; the reader
// goes on without it.
func (d *deadLetters) reject(stage, subject string, seq uint64, reason error, payload []byte) {
	dl, err := d.send(stage, subject, seq, "", reason.Error(), payload)
	if err != nil {
		d.say(stage, "unstored", "%s: could not store the dead letter (%v) of the message at %d on %s, which is skipped: %v", stage, err, seq, subject, reason)
		return
	}
	d.say(stage, "dead", "%s: dead-lettered to %s%s: %v", stage, d.subject, cutNote(dl), reason)
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

// sendMsg dead-letters a message a handler was given.
func (d *deadLetters) sendMsg(stage string, msg *message.Message, reason string) (schemas.DeadLetter, error) {
	return d.send(stage, msg.Metadata.Get(natsjs.MetaSubject), natsjs.StreamSeq(msg), "", reason, msg.Payload)
}

// rejectItem stores one item of a message of several (a trajectory of a
// trajs message) on the dlq subject with reason, its payload the item
// alone; the handler goes on with the others.
func (d *deadLetters) rejectItem(stage string, msg *message.Message, item int, payload []byte, reason error) error {
	dl, err := d.send(stage, msg.Metadata.Get(natsjs.MetaSubject), natsjs.StreamSeq(msg), "/"+strconv.Itoa(item), reason.Error(), payload)
	if err != nil {
		d.say(stage, "unstored", "%s: could not store the dead letter (%v), so the message is handed back and tried again: %v", stage, err, reason)
		return fmt.Errorf("%v (and the dead letter could not be stored: %w)", reason, err)
	}
	d.say(stage, "dead", "%s: dead-lettered to %s%s: %v", stage, d.subject, cutNote(dl), reason)
	return nil
}

// send stores a message of subject, at seq on the stream, on the dlq
// subject with reason. A dead letter over the server's max_payload (a
// message near the limit: its payload, escaped in a JSON string, can
// double) would never be stored, and its message would be handed back for
// ever: its payload is cut to fit, PayloadBytes saying so, and Seq names
// the whole on the stream. item names the part of the message dead-lettered
// ("/3"), "" for the whole.
func (d *deadLetters) send(stage, subject string, seq uint64, item, reason string, payload []byte) (schemas.DeadLetter, error) {
	dl := schemas.DeadLetter{Schema: schemas.Version, Subject: subject, Stage: stage, Reason: reason,
		Payload: string(payload), Time: time.Now().UTC(), Seq: seq}
	// The message's place names the letter: one dead-lettered again (a
	// reader's restart re-reads what followed its checkpoint; a lost
	// acknowledgement redelivers) is dropped by the server within the
	// stream's de-duplication window.
	id := ""
	if seq > 0 {
		id = fmt.Sprintf("dlq/%s/%d%s", stage, seq, item)
	}
	m, err := schemas.NewMessage(id, dl)
	if err == nil && d.maxPayload > 0 && natsjs.WireSize(m) > d.maxPayload {
		full := dl.Payload
		dl.Payload, dl.PayloadBytes = "", len(payload)
		bare, _ := schemas.NewMessage(id, dl) // the letter without its payload
		// As much of the payload as its JSON, growing about evenly, fits;
		// then less, by at least what is over, until it fits.
		n := len(full) * (d.maxPayload - natsjs.WireSize(bare) - 64) / (natsjs.WireSize(m) - natsjs.WireSize(bare))
		for {
			dl.Payload = schemas.Prefix(full, n)
			if m, err = schemas.NewMessage(id, dl); err != nil || natsjs.WireSize(m) <= d.maxPayload || n <= 0 {
				break
			}
			n -= natsjs.WireSize(m) - d.maxPayload
		}
	}
	if err != nil {
		return dl, err
	}
	if err := d.pub.Publish(d.subject, m); err != nil {
		return dl, err
	}
	d.metrics.DeadLetters.WithLabelValues(stage).Inc()
	return dl, nil
}

// cutNote says, when dl's payload was cut to fit, how much it holds and
// where the whole is.
func cutNote(dl schemas.DeadLetter) string {
	if dl.PayloadBytes == 0 {
		return ""
	}
	return fmt.Sprintf(" (its payload cut to %d of %d bytes to fit the server's max_payload; the whole is at stream sequence %d)",
		len(dl.Payload), dl.PayloadBytes, dl.Seq)
}
