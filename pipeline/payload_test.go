package pipeline

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/pipeline/offline"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
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
	// Both steps are too large; whichever fuse completes first stops the run.
	if !errors.Is(err, fuse.ErrUpdateTooLarge) || !regexp.MustCompile(`step [01]'s update is `).MatchString(err.Error()) ||
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
// planned, the trainer waiting for its update for ever; later the run
// stopped on it. Now the step goes on without it: the run says which group
// and what to change, and the update has the group skipped with the reason
// and its trajectories ungraded (wm_status not_sent), the other groups
// fused, and the next step as usual. A trajectory over max_payload by
// itself is refused by the gateway with 413, not 503, since no retry
// stores it.
func TestAGroupTooLargeForTheServerIsSkipped(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPAddr, cfg.HTTPToken, cfg.MaxPayloadMB = SourceExternal, "127.0.0.1:0", token, 1
	cfg.Anchors.Fraction = 0.5 // one of the two groups an anchor
	out := &syncBuffer{}
	cfg.Quiet, cfg.Out = false, out
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
	// One whose JSON fits and whose headers take it over: the server
	// counts both (it answered 503 before, for a retry that never stores).
	edge := trajs[0]
	edge.Response = ""
	bare, _ := json.Marshal(edge)
	edge.Response = strings.Repeat("y", 1<<20-30-len(bare))
	if b, _ := json.Marshal(edge); len(b) != 1<<20-30 {
		t.Fatalf("the edge trajectory is %d bytes", len(b))
	}
	body, _ = json.Marshal([]schemas.Trajectory{edge})
	h.want(http.StatusRequestEntityTooLarge, "POST", "/trajectories", body, token, "is 1048")
	big := trajs[0].GroupID
	for i := range trajs {
		if trajs[i].GroupID == big {
			trajs[i].Response += "\n#" + strings.Repeat("x", 200_000) // 8 of them: 1.6 MB a group
		}
	}
	body, _ = json.Marshal(trajs)
	h.want(http.StatusAccepted, "POST", "/trajectories", body, token, "")
	h.want(http.StatusAccepted, "POST", "/steps/0/close", []byte(fmt.Sprintf(`{"groups": %d}`, wm.Groups)), token, "")
	var u schemas.Update
	if err := json.Unmarshal(h.want(http.StatusOK, "GET", "/steps/0/update?wait=60", nil, token, ""), &u); err != nil {
		t.Fatal(err)
	}
	// The dropped group was this step's anchor (seeded choice): no anchor
	// is left to wait for, and none is reported late.
	if len(u.Items) != len(trajs) || u.Groups != 1 || u.Anchors != 0 || len(u.LateAnchors) != 0 || len(u.Skipped) != 1 || u.Skipped[0].GroupID != big ||
		!strings.Contains(u.Skipped[0].Reason, "(8 trajectories), over the NATS server's max_payload of 1.0 MiB") {
		t.Fatalf("step 0's update: %d items, %d groups, skipped %+v; want its %d items, %s skipped for its size", len(u.Items), u.Groups, u.Skipped, len(trajs), big)
	}
	for _, it := range u.Items {
		notSent := it.GroupID == big
		if notSent != (it.WMStatus == schemas.PredNotSent) || notSent != (it.Reward == nil) || (notSent && it.FusedAdvantage != 0) {
			t.Errorf("item %s of group %s: %+v", it.TrajID, it.GroupID, it)
		}
	}
	if !strings.Contains(out.String(), "route: step 0's group "+big+": not scored: the group's message is 1.5 MiB (8 trajectories), over the NATS server's max_payload of 1.0 MiB. The step went on without it") ||
		!strings.Contains(out.String(), "--nats-max-payload-mb") {
		t.Errorf("the run did not say which group it skipped and what to change:\n%s", out.String())
	}
	if strings.Contains(out.String(), "wm ungraded") {
		t.Errorf("the group never sent counts as the world model's failure:\n%s", out.String())
	}

	// The run goes on.
	trajs, wm = pol.Step(1)
	body, _ = json.Marshal(trajs)
	h.want(http.StatusAccepted, "POST", "/trajectories", body, token, "")
	h.want(http.StatusAccepted, "POST", "/steps/1/close", []byte(fmt.Sprintf(`{"groups": %d}`, wm.Groups)), token, "")
	if err := json.Unmarshal(h.want(http.StatusOK, "GET", "/steps/1/update?wait=60", nil, token, ""), &u); err != nil {
		t.Fatal(err)
	}
	if len(u.Items) != len(trajs) || u.Groups != 2 || len(u.Skipped) != 0 {
		t.Fatalf("step 1's update: %d items, %d groups, skipped %v", len(u.Items), u.Groups, u.Skipped)
	}
	checkFusion(t, u)

	// The archive replays as it was fused, the group never sent included,
	// once it holds both steps (step 1's update was served before the
	// archive stage had it stored, sometimes).
	waitFor(t, 30*time.Second, func() bool { return testutil.ToFloat64(p.Metrics().Archived) == 2 })
	if err := p.Stop(); err != nil {
		t.Fatal(err)
	}
	rows, settings, err := archive.ReadRun(cfg.ArchiveRoot(), cfg.Run)
	if err != nil {
		t.Fatal(err)
	}
	sum, err := offline.Replay(rows, offline.ReplayOptions{Settings: settings}, nil)
	if err != nil || sum.Rows != 32 || sum.MaxFusedDiff > 1e-9 || len(sum.Gaps) != 0 {
		t.Fatalf("replay of the archive: %+v, %v", sum, err)
	}
}

// A trajectory's meta reaches the stages' subjects (group, exec) as its
// trainer published it, through the real server. Decoded into Go values
// at route, as it was, an integer past 2^53 reached them rounded.
func TestATrajectorysMetaReachesTheStagesAsSent(t *testing.T) {
	cfg := testConfig(t)
	cfg.Source = SourceExternal
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, nc, js := startClient(t, ctx, cfg)
	const meta = `{"sample_id":12345678901234567890,"lr":0.1,"tags":["a","b"]}`
	for g := range 2 {
		for i := range 4 {
			tr := fmt.Sprintf(`{"schema":1,"run":"default","step":0,"group_id":"g%d","traj_id":"g%d-t%d","group_size":4,"task_id":"t%d","prompt":"p","response":"print(%d)","policy_version":0,"meta":%s}`, g, g, i, g, i, meta)
			if _, err := js.Publish(ctx, "wmrl.default.traj", []byte(tr)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := js.Publish(ctx, "wmrl.default.step", []byte(`{"schema":1,"run":"default","step":0,"groups":2}`)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, func() bool { return len(scanAll(t, nc, "wmrl.default.update")) == 1 })
	for subject, want := range map[string]int{"wmrl.default.group": 2, "wmrl.default.exec": 1} {
		groups := scanAll(t, nc, subject)
		if len(groups) != want {
			t.Fatalf("%s: %d groups, want %d", subject, len(groups), want)
		}
		for _, b := range groups {
			if n := strings.Count(string(b), `"meta":`+meta); n != 4 {
				t.Errorf("%s: %d of the group's 4 trajectories carry their meta as sent:\n%s", subject, n, b)
			}
		}
	}
}
