package pipeline

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/route"
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

// A group is one message too, carrying all its trajectories: one over the
// server's max_payload was retried, then dead-lettered, and its step never
// planned, the trainer waiting for its update for ever. The run now stops
// at once and says what to change; and a trajectory over max_payload by
// itself is refused by the gateway with 413, not 503, since no retry
// stores it.
func TestAGroupTooLargeForTheServerStopsTheRun(t *testing.T) {
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPAddr, cfg.HTTPToken, cfg.MaxPayloadMB = SourceExternal, "127.0.0.1:0", token, 1
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p := started(t, ctx, cfg)
	h := httpTrainer{t: t, base: p.HTTPURL() + "/v1/runs/default"}
	pol := sim.Policy{Run: "default", Tasks: 8, Groups: 2, GroupSize: 8}
	trajs, wm := pol.Step(0)
	huge := trajs[0]
	huge.Response = strings.Repeat("y", 1<<20)
	body, _ := json.Marshal([]schemas.Trajectory{huge})
	h.want(http.StatusRequestEntityTooLarge, "POST", "/trajectories", body, token, "and the NATS server takes messages of at most 1048576 bytes")
	for i := range trajs {
		trajs[i].Response += "\n#" + strings.Repeat("x", 200_000) // 8 of them: 1.6 MB a group
	}
	body, _ = json.Marshal(trajs)
	h.want(http.StatusAccepted, "POST", "/trajectories", body, token, "")
	h.want(http.StatusAccepted, "POST", "/steps/0/close", []byte(fmt.Sprintf(`{"groups": %d}`, wm.Groups)), token, "")
	err := p.Wait()
	if ctx.Err() != nil {
		t.Fatal("the run hung on a group too large for the server")
	}
	if !errors.Is(err, route.ErrGroupTooLarge) || !strings.Contains(err.Error(), "step 0's group ") ||
		!strings.Contains(err.Error(), "(8 trajectories), and the NATS server takes at most 1.0 MiB a message") || !strings.Contains(err.Error(), "--nats-max-payload-mb") {
		t.Fatalf("the run ended with %v; want the group too large, said with its size, the limit and what to change", err)
	}
}
