package pipeline

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
)

// A second fuse process started beside a running one (a rolling update, or
// one started by mistake) waits, saying who runs fuse, while the run goes
// on; it takes over once the first stops, and the run's steps are each
// fused once. A lease taken from it ends it with the reason. Before leases,
// the two split every step's messages and neither fused any until one
// stopped.
func TestASecondFuseWaitsAndTakesOver(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const ttl = 3 * time.Second
	cfg := testConfig(t)
	cfg.Source, cfg.leaseTTL = SourceExternal, ttl
	cfg.Stages = []string{StageRoute, StagePredict, StageExecute, StagePair, StageCalibrate}
	_, nc, js := startClient(t, ctx, cfg)
	pol := sim.Policy{Run: "default", Tasks: 4, Groups: 4, GroupSize: 4}

	var mu sync.Mutex
	fusedBy := map[int64][]string{}
	fuseCfg := func(name string, out *syncBuffer) Config {
		c := testConfig(t)
		c.NATSURL, c.Stages, c.Source, c.leaseTTL = nc.ConnectedUrl(), []string{StageFuse}, SourceExternal, ttl
		c.Quiet, c.Out = false, out
		c.OnUpdate = func(u schemas.Update, _ time.Duration) {
			mu.Lock()
			defer mu.Unlock()
			fusedBy[u.Step] = append(fusedBy[u.Step], name)
		}
		return c
	}
	fusedUpTo := func(n int64) func() bool {
		return func() bool {
			mu.Lock()
			defer mu.Unlock()
			for s := range n {
				if len(fusedBy[s]) == 0 {
					return false
				}
			}
			return true
		}
	}
	publish := func(from, to int64) {
		for s := from; s < to; s++ {
			publishStep(t, ctx, js, pol, s)
		}
	}

	var out1, out2 syncBuffer
	first, err := Start(ctx, fuseCfg("first", &out1))
	if err != nil {
		t.Fatal(err)
	}
	// The process that runs fuse says it is not standing by: summed over
	// a run's processes by stage, the gauge counts the standbys.
	if got := testutil.ToFloat64(first.Metrics().Standby.WithLabelValues(StageFuse)); got != 0 || testutil.CollectAndCount(first.Metrics().Standby) != 1 {
		t.Errorf("wmrl_stage_standby of the process running fuse: %v in %d series, want 0 in 1", got, testutil.CollectAndCount(first.Metrics().Standby))
	}
	publish(0, 3)
	waitFor(t, time.Minute, fusedUpTo(3))

	type started struct {
		p   *Pipeline
		err error
	}
	second := make(chan started, 1)
	cfg2 := fuseCfg("second", &out2)
	cfg2.MetricsAddr = fmt.Sprintf("127.0.0.1:%d", natstest.FreePort(t))
	health := func() (int, string) {
		resp, err := http.Get("http://" + cfg2.MetricsAddr + "/healthz")
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	go func() {
		p, err := Start(ctx, cfg2)
		second <- started{p, err}
	}()
	waitFor(t, time.Minute, func() bool { return strings.Contains(out2.String(), "another process runs this stage") })
	if s := out2.String(); !strings.Contains(s, "fuse: another process runs this stage for run default (host ") {
		t.Fatalf("the waiting process said:\n%s\nwant who runs fuse", s)
	}
	// Alive, for a liveness probe; standing by, for a person.
	if code, body := health(); code != http.StatusOK || !strings.Contains(body, `"status":"standby"`) ||
		!strings.Contains(body, "waiting to run fuse, which another process runs (host ") {
		t.Errorf("/healthz of the waiting process: %d %s", code, body)
	}
	standby := func() string {
		resp, err := http.Get("http://" + cfg2.MetricsAddr + "/metrics")
		if err != nil {
			return err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "wmrl_stage_standby{") {
				return line
			}
		}
		return "no wmrl_stage_standby"
	}
	if got := standby(); got != `wmrl_stage_standby{stage="fuse"} 1` {
		t.Errorf("/metrics of the waiting process: %s", got)
	}
	// The run goes on beside the waiting process, on the first alone.
	publish(3, 6)
	waitFor(t, time.Minute, fusedUpTo(6))
	select {
	case s := <-second:
		t.Fatalf("the second fuse started while the first ran: %v", s.err)
	default:
	}

	if err := first.Stop(); err != nil {
		t.Fatal(err)
	}
	s := <-second
	if s.err != nil {
		t.Fatal(s.err)
	}
	t.Cleanup(func() { s.p.Stop() })
	if !strings.Contains(out2.String(), "took over run default's fuse stage") {
		t.Errorf("the second process did not say it took over:\n%s", out2.String())
	}
	waitFor(t, 30*time.Second, func() bool {
		code, body := health()
		return code == http.StatusOK && strings.Contains(body, `"status":"ok"`)
	})
	if got := standby(); got != `wmrl_stage_standby{stage="fuse"} 0` {
		t.Errorf("/metrics of the process that took over: %s", got)
	}
	publish(6, 9)
	waitFor(t, time.Minute, fusedUpTo(9))
	mu.Lock()
	for step := range int64(9) {
		want := "first"
		if step >= 6 {
			want = "second"
		}
		if got := fusedBy[step]; len(got) != 1 || got[0] != want {
			t.Errorf("step %d fused by %v, want once by the %s process", step, got, want)
		}
	}
	mu.Unlock()
	if n := len(decodeUpdates(t, scanAll(t, nc, "wmrl.default.update"))); n != 9 {
		t.Errorf("%d updates stored, want 9", n)
	}
	// Status says who runs what: fuse the second process, the others the
	// run's (which has no archive stage).
	runs := runnersOf(t, ctx, nc.ConnectedUrl())
	if len(runs) != 4 || runs[StageFuse] != s.p.leases[0].Holder().ID || runs[StageRoute] == runs[StageFuse] || runs[StageRoute] != runs[StageCalibrate] {
		t.Errorf("status says the stages are run by %v; want fuse by the second process (%s), route, pair and calibrate by the run's, archive by none",
			runs, s.p.leases[0].Holder().ID)
	}

	// Another process takes the lease (its holder was thought gone): the
	// second notices at its next renewal and stops, saying so, and saves
	// no checkpoint over the new holder's.
	state, err := js.KeyValue(ctx, StateBucket("wmrl"))
	if err != nil {
		t.Fatal(err)
	}
	checkpoint := func() uint64 {
		e, err := state.Get(ctx, checkpointKey("default", StageFuse))
		if err != nil {
			t.Fatal(err)
		}
		return e.Revision()
	}
	before := checkpoint()
	ls, err := natsjs.OpenLeases(ctx, js, LeaseBucket("wmrl"), 1, ttl, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ls.Free(ctx, leaseKey("default", StageFuse)); err != nil {
		t.Fatal(err)
	}
	other := natsjs.NewHolder()
	other.Host = "other-host"
	if _, err := ls.Acquire(ctx, leaseKey("default", StageFuse), other, nil); err != nil {
		t.Fatal(err)
	}
	err = s.p.Wait()
	if !errors.Is(err, natsjs.ErrLeaseLost) || !strings.Contains(err.Error(), "stage fuse") || !strings.Contains(err.Error(), "other-host") {
		t.Fatalf("the second process ended with %v, want its fuse lease lost to other-host", err)
	}
	if after := checkpoint(); after != before || !strings.Contains(out2.String(), "fuse: no checkpoint saved: another process runs this stage now") {
		t.Errorf("the process that lost its lease saved a checkpoint (revision %d, then %d), or did not say it did not:\n%s", before, after, out2.String())
	}
}

// The embedded server's process frees the leases of its own stages when
// it starts: their holder was the process before it on the same store,
// killed before it could release them (as TestSIGKILLLosesNothing does).
func TestARestartOnTheEmbeddedServerTakesItsLeasesAtOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := testConfig(t)
	cfg.Source, cfg.Steps = SourceSim, 2
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	// What a killed process leaves: every lease held, by a holder gone.
	srv, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: cfg.DataDir + "/nats"})
	if err != nil {
		t.Fatal(err)
	}
	nc, err := srv.Connect("dead-holder")
	if err != nil {
		t.Fatal(err)
	}
	js, _ := jetstream.New(nc)
	ls, err := natsjs.OpenLeases(ctx, js, LeaseBucket("wmrl"), 1, LeaseTTL, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, st := range onePerRun {
		if _, err := ls.Acquire(ctx, leaseKey("default", st), natsjs.NewHolder(), func(natsjs.Holder) {
			t.Errorf("lease %s held after the run stopped: it did not release it", st)
		}); err != nil {
			t.Fatal(err)
		}
	}
	nc.Close()
	srv.Shutdown() // the leases are renewed no more, and lapse only after LeaseTTL

	var out syncBuffer
	cfg.Steps, cfg.Quiet, cfg.Out = 4, false, &out
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(LeaseTTL / 2):
		t.Fatalf("the restart waited for the leases of the process before it:\n%s", out.String())
	}
	if s := out.String(); strings.Contains(s, "another process runs this stage") {
		t.Errorf("the restart waited for its own leases:\n%s", s)
	}
}

// A process that waits for one stage's lease holds none of its others
// meanwhile: status names nobody for them, not a process that does not
// run them yet. Once the lease is free, it takes all of them.
func TestAProcessWaitingForOneLeaseHoldsNoOther(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: t.TempDir(), Listen: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	nc, err := srv.Connect("other")
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ls, err := natsjs.OpenLeases(ctx, js, LeaseBucket("wmrl"), 1, 2*time.Second, nil)
	if err != nil {
		t.Fatal(err)
	}
	fuse, err := ls.Acquire(ctx, leaseKey("default", StageFuse), natsjs.NewHolder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t)
	var out syncBuffer
	cfg.NATSURL, cfg.Source, cfg.leaseTTL = srv.URL(), SourceExternal, 2*time.Second
	cfg.Stages, cfg.Quiet, cfg.Out = []string{StageRoute, StagePair, StageFuse}, false, &out
	started := make(chan error, 1)
	var p *Pipeline
	go func() { var err error; p, err = Start(ctx, cfg); started <- err }()
	waitFor(t, time.Minute, func() bool { return strings.Contains(out.String(), "fuse: another process runs this stage") })
	time.Sleep(time.Second) // a few of its polls
	if m := runnersOf(t, ctx, srv.URL()); len(m) != 1 || m[StageFuse] != fuse.Holder().ID {
		t.Fatalf("while the process waits for fuse, the leases are held by %v; want fuse's alone, by its holder %s", m, fuse.Holder().ID)
	}
	if err := fuse.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-started; err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	if !strings.Contains(out.String(), "took over run default's stages route, pair, fuse") {
		t.Errorf("it did not say what it took over:\n%s", out.String())
	}
	m := runnersOf(t, ctx, srv.URL())
	if len(m) != 3 || m[StageRoute] != m[StageFuse] || m[StageRoute] != p.leases[0].Holder().ID {
		t.Errorf("after the release the leases are held by %v, want route, pair and fuse by the process", m)
	}
}

// runnersOf is what status says of run default's one-per-run stages: the
// ID of each one's holder, for those with one.
func runnersOf(t *testing.T, ctx context.Context, url string) map[string]string {
	t.Helper()
	st, err := ReadStatus(ctx, StreamSource{NATSURL: url, Prefix: "wmrl"}, "default")
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]string{}
	for _, r := range st.Runners {
		if r.Holder != nil {
			m[r.Stage] = r.Holder.ID
		}
	}
	return m
}

// A process waiting to run the one-per-run stages serves its trainer
// gateway meanwhile (it reads and writes the stream, and needs none of
// them): behind a load balancer, a trainer's request may reach either
// process. Stopped while waiting, it closes the gateway.
func TestAStandbyServesTheGateway(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := testConfig(t)
	cfg.Source = SourceExternal
	first, _, _ := startClient(t, ctx, cfg)

	var out syncBuffer
	c := testConfig(t)
	c.NATSURL, c.Source, c.HTTPAddr = first.URL(), SourceExternal, fmt.Sprintf("127.0.0.1:%d", natstest.FreePort(t))
	c.Quiet, c.Out = false, &out
	standby, stop := context.WithCancel(ctx)
	defer stop()
	started := make(chan error, 1)
	go func() {
		p, err := Start(standby, c)
		if err == nil {
			p.Stop()
		}
		started <- err
	}()
	waitFor(t, time.Minute, func() bool { return strings.Contains(out.String(), "another process runs this stage") })
	if s := out.String(); !strings.Contains(s, "its trainer gateway at http://"+c.HTTPAddr+" serves meanwhile") {
		t.Errorf("the waiting process said:\n%s\nwant where its gateway serves", s)
	}

	h := httpTrainer{t: t, base: "http://" + c.HTTPAddr + "/v1/runs/default"}
	pol := sim.Policy{Run: "default", Tasks: 4, Groups: 4, GroupSize: 4}
	for step := range int64(2) {
		trajs, wm := pol.Step(step)
		body, _ := json.Marshal(trajs)
		h.want(http.StatusAccepted, "POST", "/trajectories", body, "", fmt.Sprintf(`"accepted":%d`, len(trajs)))
		h.want(http.StatusAccepted, "POST", fmt.Sprintf("/steps/%d/close", step), []byte(fmt.Sprintf(`{"groups": %d}`, wm.Groups)), "", "")
		var u schemas.Update
		b := h.want(http.StatusOK, "GET", fmt.Sprintf("/steps/%d/update?wait=60", step), nil, "", "")
		if err := json.Unmarshal(b, &u); err != nil || u.Step != step || len(u.Items) != len(trajs) {
			t.Fatalf("step %d through the standby's gateway: update %s (%v); want its %d trajectories, fused by the other process", step, b, err, len(trajs))
		}
	}
	var steps struct{ Next int64 }
	if err := json.Unmarshal(h.want(http.StatusOK, "GET", "/steps", nil, "", ""), &steps); err != nil || steps.Next != 2 {
		t.Errorf("GET /steps on the standby: next %d (%v), want 2", steps.Next, err)
	}
	if strings.Contains(out.String(), "ready:") {
		t.Errorf("the standby started its stages while the other process ran them:\n%s", out.String())
	}

	stop()
	select {
	case err := <-started:
		if !errors.Is(err, errStoppedWaiting) {
			t.Fatalf("the standby, stopped: %v; want it stopped while waiting", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the standby did not stop")
	}
	if resp, err := http.Get("http://" + c.HTTPAddr + "/healthz"); err == nil {
		resp.Body.Close()
		t.Errorf("the standby's gateway still answers (%s) after it stopped", resp.Status)
	}
}

// A gateway address another program holds fails the start, saying so,
// before the process waits for or takes any stage.
func TestAGatewayOnABusyAddressFailsTheStart(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPAddr = SourceExternal, l.Addr().String()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, err := Start(ctx, cfg)
	if err == nil {
		p.Stop()
		t.Fatal("started with its gateway's address taken")
	}
	if !strings.Contains(err.Error(), "gateway") || !strings.Contains(err.Error(), "address already in use") {
		t.Errorf("Start: %v; want the gateway's address named taken", err)
	}
}

// A process that starts while the lease bucket is deleted under a running
// run, before any holder has made it anew, makes it and marks it: the
// stages whose consumers another process reads are left to their holders
// for the TTL. Before, it took them at once, as on a run's first start,
// and their holders stopped, "lease lost"; standbys that had not read the
// bucket gone took theirs too (a rehearsal, seed 36).
func TestAProcessStartedWhileTheLeaseBucketIsGoneLeavesLiveStagesToTheirHolders(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const ttl = 4 * time.Second
	cfg := testConfig(t)
	cfg.Source, cfg.leaseTTL = SourceExternal, ttl
	first, nc, js := startClient(t, ctx, cfg)
	for _, le := range first.leases {
		le.Abandon() // its holder slow to make the bucket anew: here, never
	}
	if err := js.DeleteKeyValue(ctx, LeaseBucket(cfg.Prefix)); err != nil {
		t.Fatal(err)
	}

	var out syncBuffer
	c := testConfig(t)
	c.NATSURL, c.Stages, c.Source, c.leaseTTL = nc.ConnectedUrl(), []string{StageFuse}, SourceExternal, ttl
	c.Quiet, c.Out = false, &out
	begun := time.Now()
	second := make(chan *Pipeline, 1)
	go func() {
		p, err := Start(ctx, c)
		if err != nil {
			t.Errorf("the second process: %v", err)
		}
		second <- p
	}()
	var p *Pipeline
	select {
	case p = <-second:
	case <-time.After(time.Minute):
		t.Fatal("the second process never took fuse, which nobody held any more")
	}
	if p == nil {
		return
	}
	defer p.Stop()
	if took := time.Since(begun); took < ttl/2 {
		t.Errorf("the second process took fuse %v after it started; want it left to its holder for the TTL %v", took.Round(time.Millisecond), ttl)
	}
	// Whichever of the holder's stages had a pull request waiting then.
	if want := "was not on the NATS server, while another process reads the run's "; !strings.Contains(out.String(), want) {
		t.Errorf("the second process's output lacks %q:\n%s", want, out.String())
	}
}

// unansweredJS is a cluster in the moment it elects its leaders: the
// lease bucket is not there yet, and a list of the stream's consumers is
// not answered before the caller's deadline.
type unansweredJS struct{ jetstream.JetStream }

func (unansweredJS) KeyValue(context.Context, string) (jetstream.KeyValue, error) {
	return nil, jetstream.ErrBucketNotFound
}

func (unansweredJS) Stream(context.Context, string) (jetstream.Stream, error) {
	return unansweredStream{}, nil
}

type unansweredStream struct{ jetstream.Stream }

func (unansweredStream) ListConsumers(ctx context.Context) jetstream.ConsumerInfoLister {
	return &unansweredList{ctx: ctx}
}

type unansweredList struct{ ctx context.Context }

func (l *unansweredList) Info() <-chan *jetstream.ConsumerInfo {
	ch := make(chan *jetstream.ConsumerInfo)
	go func() { <-l.ctx.Done(); close(ch) }()
	return ch
}

func (l *unansweredList) Err() error { return l.ctx.Err() }

// The start-up look for living readers of a run whose lease bucket is gone
// gives up on a cluster that does not answer it, leaving the caller the
// rest of its time to make the bucket: it held the caller until its
// deadline, and four processes of a rehearsal (seed 41) ended at their
// start, "bucket WMRL_LEASES_...: context deadline exceeded".
func TestTheLookForLiveReadersGivesUpOnAClusterThatDoesNotAnswer(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	ctx, cancel := context.WithTimeout(context.Background(), 20*leaseCheckWait)
	defer cancel()
	p := &Pipeline{cfg: testConfig(t), tr: &transport{js: unansweredJS{}, stream: "WMRL_TEST"}}
	if running := p.runningWithoutLeases(ctx, LeaseBucket(p.cfg.Prefix)); running != nil {
		t.Errorf("stages read elsewhere, from a list never answered: %v; want none", running)
	}
	if ctx.Err() != nil {
		t.Fatal("the look for live readers held its caller until the caller's deadline")
	}
}

// A stop (Ctrl-C, SIGTERM) while the stages read their state from the
// stream ends the process as a stop, saying so, not as a failure.
func TestAStopWhileTheStagesAreBuiltIsAStop(t *testing.T) {
	cfg, _ := runToEnd(t, 4)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out bytes.Buffer
	cfg.Out, cfg.Quiet, cfg.Steps = &out, false, 8
	cfg.wrapPublisher = func(stage string, pub message.Publisher) message.Publisher {
		if stage == StageRoute {
			cancel() // as route reads the steps it planned
		}
		return pub
	}
	if err := Run(ctx, cfg); err != nil {
		t.Fatalf("stopped as route was built: %v; want a stop", err)
	}
	if !strings.Contains(out.String(), "stopped before it started: it was reading its stages' state from the stream") {
		t.Errorf("the stop did not say so:\n%s", out.String())
	}
	// A start that fails on its own, not stopped, is still a failure (the
	// stop was first read after the start's own cancel: every failure
	// passed as a stop).
	dir, _ := housingTask(t)
	bad := testConfig(t)
	bad.TaskDir, bad.ExecPython, bad.Steps = dir, filepath.Join(t.TempDir(), "no-python"), 1
	if err := Run(context.Background(), bad); err == nil || errors.Is(err, errStoppedWaiting) {
		t.Errorf("a start refused (no --exec-python there): %v; want it to fail", err)
	}
}
