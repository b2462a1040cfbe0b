package pipeline

import (
	"context"
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus/testutil"

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
// over it, and once the bug is fixed, resending the dead letter (its step
// fused meanwhile) calibrates and archives it, and the run ends. Before, the panic ended the
// process, and every restart read the group again and ended again.
func TestAPanicInCalibrateStopsTheRunOnceAndTheRestartPassesOverIt(t *testing.T) {
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
	// panic, had it read it) and runs to the end.
	// Every step is fused, the group's falling back to the world model.
	// The run does not end yet: the archive waits for the group's pairs.
	out.Reset()
	p, nc, _ := startClient(t, ctx, cfg)
	waitFor(t, time.Minute, func() bool { return testutil.ToFloat64(p.Metrics().Archived) == float64(cfg.Steps) })
	if !strings.Contains(out.String(), "calibrate: passing over the messages at [") {
		t.Errorf("the restart did not say what it passes over:\n%s", out.String())
	}
	calibrated := func() (n int, ofBad bool) {
		for _, b := range scanAll(t, nc, "wmrl.default.calibration") {
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

	// Fixed, the dead letter is sent again, though its step is fused: the
	// group is calibrated, its pairs archived, and the run ends.
	fixed.Store(true)
	if got := resendAll(t, ctx, p); got[Resent] != 1 {
		t.Fatalf("resend: %v; want the pair group sent", got)
	}
	waitFor(t, 30*time.Second, func() bool { n, ofBad := calibrated(); return ofBad && n == before+1 })
	if err := p.Wait(); err != nil {
		t.Fatalf("the restart: %v\n%s", err, out.String())
	}
}
