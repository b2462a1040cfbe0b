package pipeline

import (
	"context"
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
)

// buggyCalibrate is calibrate's output with a bug that the third anchor
// group's calibration sets off before it is stored, until fixed.
type buggyCalibrate struct {
	message.Publisher
	group *atomic.Value // the third anchor group's id, once met
	fixed *atomic.Bool
}

func (b buggyCalibrate) Publish(topic string, msgs ...*message.Message) error {
	var c schemas.Calibration
	if json.Unmarshal(msgs[0].Payload, &c) == nil && !b.fixed.Load() && (c.Seq == 3 && b.group.Load() == nil || b.group.Load() == c.GroupID) {
		b.group.Store(c.GroupID)
		var seen map[string]int
		seen[c.GroupID]++ // a write to a nil map
	}
	return b.Publisher.Publish(topic, msgs...)
}

// A bug that one pair group sets off in calibrate's in-order reader stops
// the run, saying where, with the group dead-lettered; the restart passes
// over it and ends, saying that the group's pairs are in the dead letters;
// once the bug is fixed and the dead letter resent (its step fused
// meanwhile), a run calibrates the group and archives its pairs. Before,
// the panic ended the process, and every restart read the group again and
// ended again.
func TestAPanicInCalibrateStopsTheRunOnceAndTheRestartPassesOverIt(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	cfg := testConfig(t)
	cfg.Steps = 6
	cfg.AnchorDeadline = 2 * time.Second // the skipped group's step falls back for it
	var out syncBuffer
	cfg.Out, cfg.Quiet = &out, false
	fixed, group := new(atomic.Bool), new(atomic.Value)
	cfg.wrapPublisher = func(stage string, pub message.Publisher) message.Publisher {
		if stage != StageCalibrate {
			return pub
		}
		return buggyCalibrate{pub, group, fixed}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// Run, not Start and Wait: the panic may stop the run before Start
	// returns, and Start then returns the error.
	stopped := make(chan error, 1)
	go func() { stopped <- Run(ctx, cfg) }()
	var err error
	select {
	case err = <-stopped:
	case <-time.After(time.Minute):
		t.Fatalf("the run did not stop on the panic:\n%s", out.String())
	}
	for _, want := range []string{"calibrate: a bug: absorbing the message at ", " on wmrl.default.pairs panicked (dead-lettered to wmrl.default.dlq)",
		"a restart rebuilds it from its checkpoint, passing over it", "panic at pipeline.buggyCalibrate.Publish (skips_test.go:", "assignment to entry in nil map"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("the run stopped with %v, want it to say %q\n%s", err, want, out.String())
		}
	}
	bad, _ := group.Load().(string)
	dls := readStored(t, cfg.DataDir, "wmrl.default.dlq")
	var dl schemas.DeadLetter
	if len(dls) != 1 || json.Unmarshal(dls[0], &dl) != nil || dl.Stage != StageCalibrate || !GivenUp(dl) || dl.Seq == 0 ||
		!strings.Contains(dl.Payload, `"group_id":"`+bad+`"`) {
		t.Fatalf("dead letters %d, the first %+v; want calibrate's of group %s, given up", len(dls), dl, bad)
	}

	// The restart passes over the group (it would stop again, on the same
	// panic, had it read it) and runs to the end: every step is fused, the
	// group's falling back to the world model, and archived; the group's
	// pairs, which the dead letter holds, are not, and the run says so.
	out.Reset()
	if err := Run(ctx, cfg); err != nil {
		t.Fatalf("the restart: %v\n%s", err, out.String())
	}
	for _, want := range []string{"calibrate: passing over the messages at [",
		"not archived: the pairs of late anchor groups " + bad + " of step ", "(the first, calibrate's: gave up at once: calibrate: panic at pipeline.buggyCalibrate.Publish"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the restart did not say %q:\n%s", want, out.String())
		}
	}
	calibrated := func() (n int, ofBad bool) {
		for _, b := range readStored(t, cfg.DataDir, "wmrl.default.calibration") {
			var c schemas.Calibration
			json.Unmarshal(b, &c)
			n++
			ofBad = ofBad || c.GroupID == bad
		}
		return n, ofBad
	}
	before, ofBad := calibrated()
	if ofBad || before == 0 {
		t.Fatalf("%d calibrations, one of group %s: %v; want the others alone", before, bad, ofBad)
	}

	// Fixed, the dead letter is sent again, though its step is fused, and
	// a run on the same store calibrates the group, archives its pairs and
	// ends.
	fixed.Store(true)
	got := map[Resend]int{}
	if err := ResendDeadLetters(ctx, StreamSource{DataDir: cfg.DataDir, Prefix: "wmrl"}, "default", ResendOptions{}, func(_ schemas.DeadLetter, r Resend) error {
		got[r]++
		return nil
	}); err != nil || got[Resent] != 1 {
		t.Fatalf("resend: %v, %v; want the pair group sent", got, err)
	}
	out.Reset()
	if err := Run(ctx, cfg); err != nil || strings.Contains(out.String(), "not archived") {
		t.Fatalf("the run after the resend: %v\n%s", err, out.String())
	}
	if n, ofBad := calibrated(); !ofBad || n != before+1 {
		t.Fatalf("%d calibrations, one of group %s: %v; want %d, with it", n, bad, ofBad, before+1)
	}
}
