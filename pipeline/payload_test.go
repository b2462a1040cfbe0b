package pipeline

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/stages/fuse"
)

// TestAStepTooLargeForTheServerStopsTheRun: a step's update is one
// message. One over the server's max_payload used to be retried for ever,
// every later step waiting behind it, the run hanging with nothing but
// "maximum payload exceeded" in its dead letters; the run now stops at
// once and says what to change.
func TestAStepTooLargeForTheServerStopsTheRun(t *testing.T) {
	cfg := testConfig(t)
	// 64 groups of 48: 3,072 trajectories, about 1.2 MB of update, over a
	// max_payload of 1 MiB.
	cfg.Steps, cfg.Groups, cfg.GroupSize, cfg.MaxPayloadMB = 2, 64, 48, 1
	var out syncBuffer
	cfg.Quiet, cfg.Out = false, &out
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	err := Run(ctx, cfg)
	if ctx.Err() != nil {
		t.Fatal("the run hung on a step too large for the server")
	}
	if !errors.Is(err, fuse.ErrUpdateTooLarge) || !strings.Contains(err.Error(), "step 0's update is ") ||
		!strings.Contains(err.Error(), "(3072 trajectories), and the NATS server takes at most 1.0 MiB") || !strings.Contains(err.Error(), "--nats-max-payload-mb") {
		t.Fatalf("the run ended with %v; want the update too large, said with its size, the limit and what to change", err)
	}
	t.Log(err)
	// A server under 8 MiB is pointed out before the first step.
	if want := "fuse: the NATS server takes messages of at most 1.0 MiB, and a step's update is one message of about 400 bytes a trajectory: " +
		"a step of over about 2621 trajectories will stop the run"; !strings.Contains(out.String(), want) {
		t.Errorf("the run said:\n%s\nwant %q", out.String(), want)
	}

	// With room for it, the same step is published.
	cfg.DataDir, cfg.MaxPayloadMB, cfg.Steps, cfg.Quiet = t.TempDir(), 4, 1, true
	p := started(t, ctx, cfg)
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	// The metrics an alert sets side by side (WMRLUpdatesNearMaxPayload).
	if got, limit := testutil.ToFloat64(p.Metrics().UpdateBytes), testutil.ToFloat64(p.Metrics().MaxPayload); got < 1<<20 || got > 4<<20 || limit != 4<<20 {
		t.Errorf("wmrl_update_bytes %v, wmrl_nats_max_payload_bytes %v; want the 1.1 MiB update and 4 MiB", got, limit)
	}
	ups := decodeUpdates(t, readStored(t, cfg.DataDir, "wmrl.default.update"))
	if len(ups) != 1 || len(ups[0].Items) != 3072 {
		t.Fatalf("%d updates; want 1 of 3072 items", len(ups))
	}
}
