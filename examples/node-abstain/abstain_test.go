// Package nodeabstain holds the test of abstain.js, an extra stage written
// in Node.js; the stage itself needs no Go.
package nodeabstain

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/stagetest"
)

// needNode skips the test unless node and the stage's packages are
// installed (`npm ci` here, as .ci/run does); with WMRL_REQUIRE_NODE_NATS=1
// it fails instead.
func needNode(t *testing.T) {
	_, err := exec.LookPath("node")
	if err == nil {
		_, err = os.Stat(filepath.Join("node_modules", "@nats-io", "jetstream"))
	}
	if err != nil {
		if os.Getenv("WMRL_REQUIRE_NODE_NATS") == "1" {
			t.Fatalf("node with the stage's packages required: %v", err)
		}
		t.Skipf("node with the stage's packages not available (%v): run npm ci in examples/node-abstain, or .ci/run", err)
	}
}

// judge is an OpenAI-compatible world model that answers n samples: for a
// third of the solutions (by a hash of the prompt) the samples disagree
// widely (spread about 0.33), for the rest they agree (about 0.01).
func judge(t *testing.T) *httptest.Server {
	return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			N        int
			Messages []struct{ Content string }
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		h := fnv.New32a()
		for _, m := range req.Messages {
			h.Write([]byte(m.Content))
		}
		base := 0.2 + 0.6*float64(h.Sum32()%1000)/1000
		unsure := h.Sum32()%3 == 0
		var choices []any
		for i := range max(req.N, 1) {
			s := base + 0.01*float64(i%3-1)
			if unsure {
				s = []float64{0.1, 0.9, 0.5}[i%3]
			}
			content := fmt.Sprintf(`{"status":"scored","score":%.3f,"rationale":"test"}`, s)
			choices = append(choices, map[string]any{"message": map[string]any{"content": content}})
		}
		json.NewEncoder(w).Encode(map[string]any{"choices": choices})
	}))
}

// TestNodeStageWithdrawsUnsureScores runs the pipeline with the topology
// file, a world model asked for 3 samples, and abstain.js in its own Node
// process: every prediction whose samples spread over the limit reaches
// pair and fuse ungraded, with the reason, and its reward is null; every
// other passes unchanged; a malformed message is dead-lettered by the
// stage with the reason, and the pipeline runs on. The run's server asks,
// as one reached from other machines would, for a token and a client
// certificate over TLS.
func TestNodeStageWithdrawsUnsureScores(t *testing.T) {
	needNode(t)
	srv := judge(t)
	defer srv.Close()
	cfg := pipeline.DefaultConfig()
	cfg.DataDir, cfg.Listen, cfg.Steps, cfg.ExecLatency = t.TempDir(), "127.0.0.1:0", 4, time.Millisecond
	cfg.TopologyFile = "topology.yaml"
	cfg.WorldModel, cfg.WMURL, cfg.WMModel, cfg.WMSamples = "openai", srv.URL+"/v1", "judge", 3
	cfg.Quiet = true
	pki := natstest.NewPKI(t)
	auth := natsjs.Auth{Token: "t0ken", CA: pki.CA, Cert: pki.ClientCert, Key: pki.ClientKey}
	cfg.NATSAuth.Token = auth.Token
	cfg.ListenTLS = natsjs.ServerTLS{Cert: pki.ServerCert, Key: pki.ServerKey, ClientCA: pki.CA}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, err := pipeline.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	const maxSpread = 0.15
	var stageLog stagetest.Output // the stage's output, read while it runs
	stageOut := stageLog.String
	stage := exec.CommandContext(ctx, "node", "abstain.js", "--nats", p.URL(), "--max-spread", fmt.Sprint(maxSpread),
		"--nats-ca", pki.CA, "--nats-cert", pki.ClientCert, "--nats-key", pki.ClientKey)
	stage.Env = append(os.Environ(), "WMRL_NATS_TOKEN="+auth.Token)
	stage.Stdout, stage.Stderr = &stageLog, &stageLog
	if err := stage.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { stage.Process.Kill(); stage.Wait() }()

	// A malformed message on the stage's input.
	opts, err := auth.Options()
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(p.URL(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	if _, err := js.Publish(ctx, "wmrl.default.pred_raw", []byte(`{"items":"none"}`), jetstream.WithMsgID("bad-1")); err != nil {
		t.Fatal(err)
	}

	if err := p.Wait(); err != nil || ctx.Err() != nil {
		t.Fatalf("the run ended with %v, its context with %v\nstage:\n%s", err, ctx.Err(), stageOut())
	}
	read := func(subject string) [][]byte {
		b, err := pipeline.ReadStored(ctx, cfg.DataDir, "wmrl", subject)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	raw := map[string]schemas.PredItem{}
	for _, b := range read("wmrl.default.pred_raw") {
		var pr schemas.Prediction
		if json.Unmarshal(b, &pr) != nil || pr.Items == nil {
			continue // the malformed one
		}
		for _, it := range pr.Items {
			raw[it.TrajID] = it
		}
	}
	withdrawn, kept := 0, 0
	shaped := map[string]schemas.PredItem{}
	for _, b := range read("wmrl.default.pred") {
		var pr schemas.Prediction
		if err := schemas.Decode(b, cfg.Run, &pr); err != nil { // as pair and fuse decode it
			t.Fatalf("the stage's output: %v", err)
		}
		for _, it := range pr.Items {
			shaped[it.TrajID] = it
			r, ok := raw[it.TrajID]
			switch {
			case !ok:
				t.Fatalf("%s on pred but not on pred_raw", it.TrajID)
			case r.Score != nil && r.Spread > maxSpread:
				if it.Score != nil || it.Status != schemas.PredUngraded || !strings.Contains(it.Reason, "world model unsure") {
					t.Errorf("%s: spread %.3f, passed on as %+v", it.TrajID, r.Spread, it)
				}
				withdrawn++
			default:
				if (it.Score == nil) != (r.Score == nil) || it.Score != nil && *it.Score != *r.Score || it.Status != r.Status {
					t.Errorf("%s: %+v became %+v", it.TrajID, r, it)
				}
				kept++
			}
		}
	}
	if withdrawn == 0 || kept == 0 || len(shaped) != len(raw) {
		t.Fatalf("%d withdrawn, %d kept, %d shaped of %d raw predictions\nstage:\n%s", withdrawn, kept, len(shaped), len(raw), stageOut())
	}
	nulls := 0
	for _, b := range read("wmrl.default.update") {
		var u schemas.Update
		if err := json.Unmarshal(b, &u); err != nil {
			t.Fatal(err)
		}
		for _, it := range u.Items {
			if it.Source == "world_model" && it.Reward == nil {
				nulls++
			}
			if it.Source == "world_model" && it.Reward != nil && shaped[it.TrajID].Score == nil {
				t.Errorf("step %d: %s has reward %v, but the stage withdrew its score", u.Step, it.TrajID, *it.Reward)
			}
		}
	}
	if lost := testutil.ToFloat64(p.Metrics().Lost.WithLabelValues("wm_ungraded")); nulls == 0 || lost != float64(nulls) {
		t.Errorf("%d null world-model rewards in the updates, %v counted as lost", nulls, lost)
	}
	dl := read("wmrl.default.dlq")
	var d schemas.DeadLetter
	if len(dl) != 1 || json.Unmarshal(dl[0], &d) != nil || d.Stage != "node-abstain" || d.Subject != "wmrl.default.pred_raw" ||
		!strings.Contains(d.Reason, "not a prediction") || d.Payload != `{"items":"none"}` {
		t.Errorf("dead letters %q; want the malformed message's, from the stage, with its reason", dl)
	}
	t.Logf("%d scores withdrawn, %d kept, %d null world-model rewards", withdrawn, kept, nulls)
}

// restartable is a run of steps on a fixed address, which a test can
// stop and start again where the stage finds it.
func restartable(t *testing.T, steps int64) pipeline.Config {
	cfg := pipeline.DefaultConfig()
	cfg.DataDir, cfg.Listen = t.TempDir(), fmt.Sprintf("127.0.0.1:%d", natstest.FreePort(t))
	cfg.Steps, cfg.ExecLatency, cfg.TopologyFile, cfg.Quiet = steps, time.Millisecond, "topology.yaml", true
	return cfg
}

// startStage runs abstain.js on url, its output to out, until the test
// ends; the channel has its exit once it has ended.
func startStage(t *testing.T, ctx context.Context, out io.Writer, url string) <-chan error {
	t.Helper()
	stage := exec.CommandContext(ctx, "node", "abstain.js", "--nats", url)
	stage.Stdout, stage.Stderr = out, out
	if err := stage.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- stage.Wait() }()
	t.Cleanup(func() { stage.Process.Kill() })
	return exited
}

// TestNodeStageOutlivesARestartOfTheRun: the run (and its embedded server)
// stops and stays down for longer than nats.js reconnects by default (10
// tries, 2 s apart); the stage waits, says so, reconnects when the run is
// started again on the same data and address, and the steps after the
// restart pass through it.
func TestNodeStageOutlivesARestartOfTheRun(t *testing.T) {
	needNode(t)
	cfg := restartable(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	p, err := pipeline.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var stageLog stagetest.Output // the stage's output, read while it runs
	stageOut := stageLog.String
	exited := startStage(t, ctx, &stageLog, p.URL())
	if err := p.Wait(); err != nil {
		t.Fatalf("the first run: %v\nstage:\n%s", err, stageOut())
	}
	select {
	case err := <-exited:
		t.Fatalf("the stage ended while the run was down: %v\n%s", err, stageOut())
	case <-time.After(25 * time.Second):
	}
	cfg.Steps = 6
	p, err = pipeline.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case err := <-exited:
		t.Fatalf("the stage ended after the restart: %v\n%s", err, stageOut())
	case <-time.After(time.Minute):
		t.Fatalf("steps 3-5 not fused a minute after the restart\nstage:\n%s", stageOut())
	}
	for _, want := range []string{"abstain: lost the server at ", "abstain: reconnected to "} {
		if !strings.Contains(stageOut(), want) {
			t.Errorf("the stage did not say %q:\n%s", want, stageOut())
		}
	}
}

// TestNodeStageExitsWhenRefused: a run that comes back asking for a token
// the stage does not have makes nats.js close the connection for good;
// the stage exits non-zero saying so, for its supervisor to see, instead
// of ending as if it had been asked to stop.
func TestNodeStageExitsWhenRefused(t *testing.T) {
	needNode(t)
	cfg := restartable(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, err := pipeline.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	exited := startStage(t, ctx, &out, p.URL())
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	cfg.Steps, cfg.NATSAuth.Token = 4, "not-the-stage's"
	p, err = pipeline.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	select {
	case err := <-exited:
		if err == nil || !strings.Contains(out.String(), "closed for good") {
			t.Fatalf("the refused stage exited with %v:\n%s", err, out.String())
		}
	case <-time.After(time.Minute):
		t.Fatalf("the refused stage still runs a minute on:\n%s", out.String())
	}
}

// TestNodeStageWithoutItsCertificateSaysSo: a server that asks every client
// for a certificate ends the TLS session of one without, and nats.js only
// times out; the stage exits non-zero naming the flags it lacks.
func TestNodeStageWithoutItsCertificateSaysSo(t *testing.T) {
	needNode(t)
	t.Parallel()
	cfg := pipeline.DefaultConfig()
	cfg.DataDir, cfg.Listen, cfg.Source, cfg.Quiet = t.TempDir(), "127.0.0.1:0", pipeline.SourceExternal, true
	pki := natstest.NewPKI(t)
	cfg.NATSAuth.Token = "t0ken"
	cfg.ListenTLS = natsjs.ServerTLS{Cert: pki.ServerCert, Key: pki.ServerKey, ClientCA: pki.CA}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, err := pipeline.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	stage := exec.CommandContext(ctx, "node", "abstain.js", "--nats", p.URL(), "--nats-ca", pki.CA)
	stage.Env = append(os.Environ(), "WMRL_NATS_TOKEN=t0ken")
	out, err := stage.CombinedOutput()
	if err == nil || ctx.Err() != nil || !strings.Contains(string(out), "could not connect to "+p.URL()) || !strings.Contains(string(out), "give --nats-cert and --nats-key") {
		t.Fatalf("the stage without its certificate: %v (context %v)\n%s", err, ctx.Err(), out)
	}
}
