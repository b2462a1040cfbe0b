package pipeline

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// Resend is what ResendDeadLetters did with a dead letter.
type Resend int

const (
	// Resent: stored again on the subject it came on, and removed from
	// the dead letters.
	Resent Resend = iota
	// KeptRejected: rejected input (not given up): its stage would reject
	// it again.
	KeptRejected
	// KeptFused: its step's update is stored already. Every stage before
	// fuse works for a step, and fuse drops what comes for a step it has
	// published, so sending it again would change nothing; the step
	// trained without it. Pair groups and calibrations are sent whatever
	// their step: the calibration absorbs them (the map, rho), and the
	// archive keeps them as a late group's.
	KeptFused
	// KeptElsewhere: it came on a subject that is not the run's, which
	// the run's stream does not hold.
	KeptElsewhere
	// KeptCut: its payload was cut to fit the server's max_payload, and
	// the whole message is no longer in the stream (past its retention).
	KeptCut
)

// ResendOptions narrow ResendDeadLetters.
type ResendOptions struct {
	// Select, if set, picks the dead letters to consider.
	Select func(schemas.DeadLetter) bool
	// DryRun says what would be done and changes nothing.
	DryRun bool
}

// ResendDeadLetters sends the run's dead letters that an outage cost
// ("gave up ...": a stage whose service was down, after its retries or at
// once) back to the subjects they came on, once their cause is fixed, and
// removes each from the dead-letter subject once the server has stored it
// again. It hands fn every dead letter it considered, oldest first, with
// what it did. A step waits for every group's prediction, so a stage
// between predict and fuse that gave one up holds its step until the
// prediction is sent again; sent again, the step is fused.
//
// What is kept: rejected input, and dead letters of steps already fused
// (the pipeline's own stages give a group up by recording it ungraded, so
// its step goes on without it; an execution given up becomes a failed
// anchor). Each resend carries a de-duplication ID of its dead letter, so
// a resend interrupted between storing and removing, and run again within
// the stream's de-duplication window, does not send it twice.
func ResendDeadLetters(ctx context.Context, src StreamSource, run string, opt ResendOptions, fn func(schemas.DeadLetter, Resend) error) error {
	c, err := src.open(ctx, false)
	if err != nil {
		return err
	}
	defer c.close()
	if err := runHeld(ctx, c, src.Prefix, run); err != nil {
		return err
	}
	dlqSubject := schemas.Subject(src.Prefix, run, schemas.KindDLQ)
	fused := map[int64]bool{}
	if err := scanMsgIDs(ctx, c.js, c.stream, schemas.Subject(src.Prefix, run, schemas.KindUpdate), func(step int64, _ string) {
		fused[step] = true
	}); err != nil {
		return fmt.Errorf("pipeline: resend: read the updates at %s: %w", c.url, err)
	}
	type letter struct {
		dl  schemas.DeadLetter
		seq uint64
	}
	var letters []letter
	if err := natsjs.Scan(ctx, c.js, c.stream, dlqSubject, false, func(r natsjs.Record) error {
		var dl schemas.DeadLetter
		if json.Unmarshal(r.Data, &dl) != nil || dl.Stage == "" {
			return nil // not a dead letter: nothing to send back
		}
		if opt.Select == nil || opt.Select(dl) {
			letters = append(letters, letter{dl, r.Seq})
		}
		return nil
	}); err != nil {
		return fmt.Errorf("pipeline: resend: read %s at %s: %w", dlqSubject, c.url, err)
	}
	stream, err := c.js.Stream(ctx, c.stream)
	if err != nil {
		return fmt.Errorf("pipeline: resend: %w", err)
	}
	runSubjects := src.Prefix + "." + run + "."
	for _, l := range letters {
		what := Resent
		payload, whole := []byte(l.dl.Payload), true
		if l.dl.PayloadBytes > 0 { // cut to fit: the whole is in the stream, while it is retained
			raw, err := stream.GetMsg(ctx, l.dl.Seq)
			whole = err == nil && l.dl.Seq > 0 && raw.Subject == l.dl.Subject && len(raw.Data) == l.dl.PayloadBytes
			if whole {
				payload = raw.Data
			}
		}
		step, hasStep, pairs := stepAndPairs(string(payload))
		switch {
		case !GivenUp(l.dl):
			what = KeptRejected
		case hasStep && fused[step] && !pairs:
			what = KeptFused
		case !strings.HasPrefix(l.dl.Subject, runSubjects) || l.dl.Subject == dlqSubject:
			what = KeptElsewhere
		case !whole:
			what = KeptCut
		}
		if what == Resent && !opt.DryRun {
			id := fmt.Sprintf("%s/resend/%d", run, l.seq)
			if _, err := c.js.Publish(ctx, l.dl.Subject, payload, jetstream.WithMsgID(id)); err != nil {
				return fmt.Errorf("pipeline: resend dead letter %d to %s: %w", l.seq, l.dl.Subject, err)
			}
			if err := stream.DeleteMsg(ctx, l.seq); err != nil {
				return fmt.Errorf("pipeline: resent dead letter %d to %s, but could not remove it from %s (the next resend within the de-duplication window skips it): %w",
					l.seq, l.dl.Subject, dlqSubject, err)
			}
		}
		if err := fn(l.dl, what); err != nil {
			return err
		}
	}
	return nil
}

// stepAndPairs reads the step a payload is about, if it says, and whether
// it carries anchor pairs (a pair group, a calibration): those are used
// after their step is fused, since the calibration absorbs them (the map,
// rho) and the archive keeps them as a late group's.
func stepAndPairs(payload string) (step int64, ok, pairs bool) {
	var m struct {
		Step  *int64          `json:"step"`
		Pairs json.RawMessage `json:"pairs"`
	}
	if json.Unmarshal([]byte(payload), &m) != nil || m.Step == nil {
		return 0, false, false
	}
	return *m.Step, true, m.Pairs != nil
}
