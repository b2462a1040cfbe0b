package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/calibrate"
)

// TestPenaltyReachesTheUpdates runs the pipeline with the topology file and
// this stage as a separate process, and checks that every world-model
// reward in the updates is the penalised score, not the raw one. The
// run's server asks, as one reached from other machines would, for a
// token and a client certificate over TLS.
func TestPenaltyReachesTheUpdates(t *testing.T) {
	bin := buildStage(t)
	cfg := pipeline.DefaultConfig()
	cfg.DataDir, cfg.Listen, cfg.Quiet, cfg.Steps = t.TempDir(), "127.0.0.1:0", true, 6
	cfg.TopologyFile = "topology.yaml"
	pki := natstest.NewPKI(t)
	cfg.NATSAuth.Token = "t0ken"
	cfg.ListenTLS = natsjs.ServerTLS{Cert: pki.ServerCert, Key: pki.ServerKey, ClientCA: pki.CA}
	cfg.ExecLatency = time.Millisecond
	// No refit in 6 steps: world-model rewards are the scores themselves.
	cfg.Debiaser = calibrate.DebiaserConfig{MinPairs: 10000, BufferSize: 10000}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, err := pipeline.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	const limit, perChar = 210, 0.01
	stage := exec.CommandContext(ctx, bin, "--nats", p.URL(), "--limit", "210", "--per-char", "0.01",
		"--nats-ca", pki.CA, "--nats-cert", pki.ClientCert, "--nats-key", pki.ClientKey)
	stage.Env = append(os.Environ(), "WMRL_NATS_TOKEN=t0ken")
	stage.Stderr = testWriter{t}
	if err := stage.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { stage.Process.Kill(); stage.Wait() }()

	if err := p.Wait(); err != nil || ctx.Err() != nil { // returns after the 6th update
		t.Fatalf("the run ended with %v, its context with %v", err, ctx.Err())
	}
	read := func(subject string) [][]byte {
		out, err := pipeline.ReadStored(ctx, cfg.DataDir, "wmrl", subject)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	updates := read("wmrl.default.update")
	if len(updates) != 6 {
		t.Fatalf("%d updates, want 6", len(updates))
	}
	raw := map[string]schemas.PredItem{}
	for _, b := range read("wmrl.default.pred_raw") {
		var pr schemas.Prediction
		json.Unmarshal(b, &pr)
		for _, it := range pr.Items {
			raw[it.TrajID] = it
		}
	}
	checked, penalised := 0, 0
	for _, b := range updates {
		var u schemas.Update
		json.Unmarshal(b, &u)
		for _, it := range u.Items {
			if it.Source != "world_model" || it.Reward == nil {
				continue
			}
			r := raw[it.TrajID]
			want := math.Max(0, *r.Score-penalty(r.ResponseChars, limit, perChar))
			if math.Abs(*it.Reward-want) > 1e-12 {
				t.Fatalf("%s: reward %v, want the penalised score %v (raw %v, %d bytes)", it.TrajID, *it.Reward, want, *r.Score, r.ResponseChars)
			}
			checked++
			if want < *r.Score {
				penalised++
			}
		}
	}
	t.Logf("%d world-model rewards checked, %d penalised", checked, penalised)
	if checked == 0 || penalised == 0 {
		t.Fatalf("nothing shown: %d checked, %d penalised", checked, penalised)
	}
}

// buildStage builds this stage's binary for the test, or skips it with
// -short.
func buildStage(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("builds and runs the stage")
	}
	bin := filepath.Join(t.TempDir(), "length-penalty")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Logf("length-penalty: %s", b)
	return len(b), nil
}

// TestTheStageLeavesWhenRefused: a run that comes back asking for a token
// the stage does not have makes nats.go close the connection for good;
// the stage exits non-zero saying so, instead of waiting for ever on a
// connection that will not come back.
func TestTheStageLeavesWhenRefused(t *testing.T) {
	bin := buildStage(t)
	cfg := pipeline.DefaultConfig()
	cfg.DataDir, cfg.Listen, cfg.Quiet, cfg.Steps = t.TempDir(), fmt.Sprintf("127.0.0.1:%d", natstest.FreePort(t)), true, 2
	cfg.TopologyFile, cfg.ExecLatency = "topology.yaml", time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, err := pipeline.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	stage := exec.CommandContext(ctx, bin, "--nats", p.URL())
	var out bytes.Buffer
	stage.Stderr = &out
	if err := stage.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- stage.Wait() }()
	defer stage.Process.Kill()
	if err := p.Wait(); err != nil { // two steps through the stage
		t.Fatal(err)
	}
	cfg.Steps, cfg.NATSAuth.Token = 4, "not-the-stage's"
	if p, err = pipeline.Start(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	select {
	case err := <-exited:
		for _, want := range []string{"lost the server at", "closed for good", "Authorization Violation"} {
			if err == nil || !strings.Contains(out.String(), want) {
				t.Errorf("the refused stage exited with %v, without %q:\n%s", err, want, out.String())
			}
		}
	case <-time.After(time.Minute):
		t.Fatal("the refused stage still runs a minute on")
	}
}
