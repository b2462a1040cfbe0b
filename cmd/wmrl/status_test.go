package main

import (
	"context"
	"encoding/json"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/sim"
)

// TestStatusShowsWhereTheRunIs: wmrl status shows the last step received
// and fused, the dead letters and every stage consumer of a live run, and
// on a stopped run's data the backlog that came in after it stopped, with
// no pull waiting for it.
func TestStatusShowsWhereTheRunIs(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, cfg, js := startExternal(t, ctx)
	pol := sim.Policy{Run: "default", Tasks: 4, Groups: 4, GroupSize: 4}
	publishStep := func(js jetstream.JetStream, n int64, watermark bool) {
		t.Helper()
		trajs, wm := pol.Step(n)
		for _, tr := range trajs {
			b, _ := json.Marshal(tr)
			if _, err := js.Publish(ctx, "wmrl.default.traj", b); err != nil {
				t.Fatal(err)
			}
		}
		if watermark {
			b, _ := json.Marshal(wm)
			if _, err := js.Publish(ctx, "wmrl.default.step", b); err != nil {
				t.Fatal(err)
			}
		}
	}
	publishStep(js, 0, true)
	if _, err := js.Publish(ctx, "wmrl.default.traj", []byte(`{"schema":1`)); err != nil {
		t.Fatal(err)
	}
	var out string
	var err error
	waitUntil(t, time.Minute, func() bool {
		out, err = wmrl(ctx, "status", "--nats", p.URL())
		return err == nil && strings.Contains(out, "steps fused:     up to 0") && strings.Contains(out, "dead letters:    1 ")
	})
	t.Logf("wmrl status:\n%s", out)
	for _, want := range []string{"steps received:  up to 0", "rho ", "groups 4, anchors 1", "(wmrl dlq lists them)"} {
		if !strings.Contains(out, want) {
			t.Errorf("status does not show %q", want)
		}
	}
	for _, consumer := range []string{"route_default_traj", "route_default_step", "predict_default_group", "execute_default_exec",
		"pair_default_pred", "pair_default_execution", "fuse_default_plan", "archive_default_update"} {
		row := regexp.MustCompile(`(?m)^\s*` + consumer + `\s+wmrl\.default\.\w+\s+0\s+\d+\s+\d+\s+\d+\s+\S+ ago\s*$`)
		if !row.MatchString(out) {
			t.Errorf("no row for %s with no backlog and a last delivery", consumer)
		}
	}

	if err := p.Stop(); err != nil {
		t.Fatal(err)
	}
	// Step 1 arrives while the pipeline is down.
	srv, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: filepath.Join(cfg.DataDir, "nats")})
	if err != nil {
		t.Fatal(err)
	}
	nc2, _ := srv.Connect("trainer")
	js2, _ := jetstream.New(nc2)
	publishStep(js2, 1, false)
	nc2.Close()
	srv.Shutdown()
	out, err = wmrl(ctx, "status", "--data", cfg.DataDir)
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^\s*route_default_traj\s+wmrl\.default\.traj\s+16\s+0\s+\d+\s+0\s+- \*\s*$`).MatchString(out) ||
		!strings.Contains(out, "* 1 consumer(s) with a backlog and no pull request waiting: nothing reads them") {
		t.Errorf("the stopped run's status does not show the 16 trajectories waiting for route, unread:\n%s", out)
	}
	if !strings.Contains(out, "steps fused:     up to 0") {
		t.Errorf("the stopped run's status lost its last update:\n%s", out)
	}
}
