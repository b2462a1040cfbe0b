package pipeline

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/stagetest"
)

// startDeployCluster checks what wmrl needs of deploy/nats/n{1,2,3}.conf
// and runs each as a nats-server process of its own, with the file's text
// but free ports (its own would collide with anything else on this
// machine) and a fresh store. It returns the processes and the client URLs.
func startDeployCluster(t *testing.T) ([]*natstest.Process, string) {
	t.Helper()
	ports := map[string]string{} // a port in the files -> a free one, shared so routes agree
	addr := regexp.MustCompile(`127\.0\.0\.1:(\d+)`)
	store := regexp.MustCompile(`store_dir:\s*"[^"]*"`)
	names := map[string]bool{}
	var procs []*natstest.Process
	var urls []string
	for i := 1; i <= 3; i++ {
		file := filepath.Join("..", "deploy", "nats", fmt.Sprintf("n%d.conf", i))
		opts, err := server.ProcessConfigFile(file)
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		switch {
		case !opts.JetStream:
			t.Fatalf("%s: JetStream is off", file)
		case opts.MaxPayload < 8<<20:
			t.Fatalf("%s: max_payload %d < 8 MB: calibrate's checkpoints at --buffer 5000 and large steps' updates would be refused", file, opts.MaxPayload)
		case opts.Cluster.Name != "wmrl" || opts.Cluster.Port == 0:
			t.Fatalf("%s: cluster %q on port %d", file, opts.Cluster.Name, opts.Cluster.Port)
		case len(opts.Routes) != 3:
			t.Fatalf("%s: %d routes, want the three nodes", file, len(opts.Routes))
		case names[opts.ServerName] || opts.ServerName == "":
			t.Fatalf("%s: server name %q is empty or taken", file, opts.ServerName)
		}
		names[opts.ServerName] = true
		raw, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		conf := addr.ReplaceAllStringFunc(string(raw), func(a string) string {
			port := strings.TrimPrefix(a, "127.0.0.1:")
			if ports[port] == "" {
				ports[port] = strconv.Itoa(natstest.FreePort(t))
			}
			return "127.0.0.1:" + ports[port]
		})
		conf = store.ReplaceAllString(conf, fmt.Sprintf("store_dir: %q", t.TempDir()))
		client := fmt.Sprintf("127.0.0.1:%s", ports[strconv.Itoa(opts.Port)])
		procs = append(procs, natstest.StartProcess(t, opts.ServerName, client, conf))
		urls = append(urls, "nats://"+client)
	}
	all := strings.Join(urls, ",")
	natstest.WaitForJetStream(t, all)
	return procs, all
}

// The deploy/ cluster runs the whole pipeline with every message on three
// servers. In the middle of the run the server leading the stream is
// killed (SIGKILL: no hand-over of its leaderships, as when a machine
// fails); the run must still finish, every step fused once, and the
// calibrations and rho must be those of absorbing every anchor group once,
// in order: nothing lost or counted twice across the fail-over. Before the
// readers made their own consumers again, a kill could leave calibrate or
// fuse waiting on a consumer the library could not recreate, for good.
func TestClusterSurvivesTheLossOfTheStreamLeader(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	nodes, urls := startDeployCluster(t)
	cfg := testConfig(t)
	cfg.NATSURL, cfg.Replicas = urls, 3
	cfg.Steps = 30
	cfg.CheckpointEvery = 8
	var mu sync.Mutex
	var times []time.Time // of the updates
	cfg.OnUpdate = func(schemas.Update, time.Duration) {
		mu.Lock()
		times = append(times, time.Now())
		mu.Unlock()
	}
	fused := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(times)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	p := started(t, ctx, cfg)

	nc, err := nats.Connect(urls, nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	for _, name := range []string{StreamName("wmrl"), "KV_" + StateBucket("wmrl"), "KV_" + OutcomeBucket("wmrl")} {
		natstest.StreamLeader(t, js, name)
		s, err := js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if info := s.CachedInfo(); info.Config.Replicas != 3 || len(info.Cluster.Replicas) != 2 {
			t.Fatalf("%s: %d replicas configured, %d followers of %s", name, info.Config.Replicas, len(info.Cluster.Replicas), info.Cluster.Leader)
		}
	}

	waitFor(t, time.Minute, func() bool { return fused() >= 10 })
	leader := natstest.StreamLeader(t, js, StreamName("wmrl"))
	for _, n := range nodes {
		if n.Name() == leader {
			n.Kill()
		}
	}
	t.Logf("killed the stream leader %s after %d updates", leader, fused())

	stopped := time.Now()
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	var gap time.Duration
	mu.Lock()
	for k := 1; k < len(times); k++ {
		if times[k].After(stopped) {
			from := times[k-1]
			if from.Before(stopped) {
				from = stopped
			}
			gap = max(gap, times[k].Sub(from))
		}
	}
	mu.Unlock()
	t.Logf("the longest wait for an update after the kill: %v; the run ended %v after it", gap.Round(time.Millisecond), time.Since(stopped).Round(time.Millisecond))
	if now := natstest.StreamLeader(t, js, StreamName("wmrl")); now == leader {
		t.Fatalf("the stream's leader is still %s", now)
	}
	ups := decodeUpdates(t, scanAll(t, nc, "wmrl.default.update"))
	if len(ups) != int(cfg.Steps) {
		t.Fatalf("%d updates, want %d", len(ups), cfg.Steps)
	}
	want, rhoAfter := absorbAll(t, cfg, scanAll(t, nc, "wmrl.default.pairs"))
	if len(want) != int(cfg.Steps)*2 {
		t.Fatalf("%d anchor groups' pairs stored, want %d", len(want), cfg.Steps*2)
	}
	stored := map[int64]bool{}
	for _, b := range scanAll(t, nc, "wmrl.default.calibration") {
		var c schemas.Calibration
		if err := json.Unmarshal(b, &c); err != nil {
			t.Fatal(err)
		}
		w := want[c.Seq]
		if stored[c.Seq] || w == nil || c.Version != w.Version || c.PairsTotal != w.PairsTotal || c.GroupID != w.GroupID {
			t.Fatalf("calibration %d (group %s, version %d, %d pairs, stored before: %v); absorbing the stored pairs in order gives %v",
				c.Seq, c.GroupID, c.Version, c.PairsTotal, stored[c.Seq], describe(w, rhoAfter[c.Seq]))
		}
		stored[c.Seq] = true
	}
	late := 0
	for step := int64(0); step < cfg.Steps; step++ {
		u := ups[step]
		// An anchor the fail-over held up past --anchor-deadline is late:
		// its step used world-model rewards, its pairs still count (above).
		late += len(u.LateAnchors)
		if len(u.Items) != cfg.Groups*cfg.GroupSize || u.Anchors+len(u.LateAnchors) != 2 {
			t.Fatalf("step %d: %d items, %d anchors, late %v", step, len(u.Items), u.Anchors, u.LateAnchors)
		}
		checkFusion(t, u)
		if u.CalibrationSeq > 0 && math.Abs(u.Rho-rhoAfter[u.CalibrationSeq]) > 1e-12 {
			t.Fatalf("step %d: rho %v after calibration %d; absorbing the stored groups once gives %v", step, u.Rho, u.CalibrationSeq, rhoAfter[u.CalibrationSeq])
		}
	}
	t.Logf("%d anchor groups late", late)

	// Another process on the cluster, started without --replicas (a stage,
	// a gateway), must leave the replication as it is.
	other := testConfig(t)
	other.NATSURL, other.Stages, other.Source = urls, []string{StageCalibrate}, SourceExternal
	op, err := Start(ctx, other)
	if err != nil {
		t.Fatal(err)
	}
	op.Stop()
	for _, name := range []string{StreamName("wmrl"), "KV_" + StateBucket("wmrl"), "KV_" + OutcomeBucket("wmrl")} {
		s, err := js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if r := s.CachedInfo().Config.Replicas; r != 3 {
			t.Fatalf("%s: %d replicas after a process without --replicas connected", name, r)
		}
	}
	if dl := scanAll(t, nc, "wmrl.default.dlq"); len(dl) != 0 {
		t.Fatalf("dead letters: %s", dl[0])
	}
}

// A pipeline started before its cluster (a machine's services coming up
// together) waits for JetStream, saying so, and then runs.
func TestPipelineWaitsForItsCluster(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	opts := natstest.Options(t, "late", 3)
	var urls []string
	for _, o := range opts {
		urls = append(urls, fmt.Sprintf("nats://127.0.0.1:%d", o.Port))
	}
	cfg := testConfig(t)
	cfg.NATSURL, cfg.Replicas, cfg.Steps = strings.Join(urls, ","), 3, 4
	var out syncBuffer
	cfg.Out, cfg.Quiet = &out, false
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg) }()
	// The cluster starts once the pipeline says it is waiting (after its
	// first attempt, up to 5 s): a cluster up sooner can answer that first
	// attempt, and then there was nothing to announce.
	for deadline := time.Now().Add(30 * time.Second); !strings.Contains(out.String(), "waiting for JetStream at"); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no wait announced in 30s:\n%s", out.String())
		}
	}
	for _, o := range opts {
		n := &natstest.Node{Opts: o}
		n.Start(t)
		t.Cleanup(n.Stop)
	}
	if err := <-done; err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "step     3") {
		t.Fatalf("no step 3:\n%s", out.String())
	}
}

// syncBuffer is a bytes.Buffer the pipeline's goroutines may write to
// while the test reads it.
type syncBuffer = stagetest.Output
