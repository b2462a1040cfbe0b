package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/stagetest"
)

// fillStore publishes to a stream of its own until the server refuses to
// store for lack of room, and returns that stream's name and the refusal.
func fillStore(t *testing.T, ctx context.Context, js jetstream.JetStream) (string, error) {
	t.Helper()
	const name = "FILLER"
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{"filler.>"}}); err != nil {
		t.Fatal(err)
	}
	// Blocks, then ever smaller ones: the account's limit (the server's)
	// refuses only what would go past it, and a lease is a small write.
	var refused error
	n := 0
	for size := 256 << 10; size >= 1; size /= 4 {
		block := make([]byte, size)
		for ; n < 1<<14; n++ {
			if _, err := js.Publish(ctx, fmt.Sprintf("filler.%d", n), block); err != nil {
				refused = err
				break
			}
		}
	}
	if refused == nil {
		t.Fatal("the store took 4 GiB and refused nothing")
	}
	return name, refused
}

// askForRoomOften has a full store asked again every 100 ms, not 2 s,
// until the test ends.
func askForRoomOften(t *testing.T) {
	every := roomWait
	roomWait = 100 * time.Millisecond
	t.Cleanup(func() { roomWait = every })
}

// A process started while its NATS server has no room to store (a full
// disk, the account's store limit reached) waits for room, saying what
// it waits for, and runs once there is: the lease its one-per-run stages
// take is a write the server refuses. Before, it ended at once ("lease
// ...: insufficient resources"), and a rehearsal's supervisor restarted
// every one of its stages in a loop until it gave up. The step sent
// once it runs is fused whole. So it does when its buckets (leases,
// checkpoints, outcomes) were deleted before the store filled, and must
// be made anew: it ended at once, "insufficient storage resources" (a
// rehearsal, seed 41).
func TestAProcessStartedOnAFullStoreWaitsForRoom(t *testing.T) {
	for _, deleted := range []bool{false, true} {
		t.Run(map[bool]string{false: "its buckets there", true: "its buckets deleted"}[deleted], func(t *testing.T) {
			startOnAFullStore(t, deleted)
		})
	}
}

// An execute process started while its outcome bucket is gone and the
// account is at its store limit waits for room to make the bucket anew,
// saying so, where it ran without it ("outcomes are kept in this process
// only") for as long as it lived.
func TestAnExecuteProcessWaitsForRoomToMakeItsOutcomeBucket(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	askForRoomOften(t)
	srv, _, js := startServer(t, ctx, natsjs.ServerConfig{MaxStore: 16 << 20})
	cfg := testConfig(t)
	cfg.NATSURL, cfg.Source = srv.URL(), SourceExternal
	first, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Stop(); err != nil {
		t.Fatal(err)
	}
	bucket := OutcomeBucket(cfg.Prefix)
	if err := js.DeleteKeyValue(ctx, bucket); err != nil {
		t.Fatal(err)
	}
	if err := srv.LimitAccountStore(0); err != nil {
		t.Fatal(err)
	}

	var out syncBuffer
	cfg.Quiet, cfg.Out, cfg.Stages = false, &out, []string{StageExecute}
	started := startAside(ctx, cfg)
	want := "bucket " + bucket + ": the NATS server has no room to store"
	for !strings.Contains(out.String(), want) {
		select {
		case r := <-started:
			t.Fatalf("the process did not wait for room to make %s: Start returned %v\n%s", bucket, r.err, out.String())
		case <-ctx.Done():
			t.Fatalf("the process did not say %q:\n%s", want, out.String())
		case <-time.After(20 * time.Millisecond):
		}
	}
	if err := srv.LimitAccountStore(srv.StoreLimit()); err != nil {
		t.Fatal(err)
	}
	r := <-started
	if r.err != nil {
		t.Fatalf("once there was room: %v\n%s", r.err, out.String())
	}
	t.Cleanup(func() { r.p.Stop() })
	if _, err := js.KeyValue(ctx, bucket); err != nil {
		t.Errorf("%s once there was room: %v; want it made anew", bucket, err)
	}
	if strings.Contains(out.String(), "running without it") {
		t.Errorf("the process ran without its outcome bucket:\n%s", out.String())
	}
}

// startResult is what Start returned to startAside.
type startResult struct {
	p   *Pipeline
	err error
}

// startAside runs Start in the background, for a test that watches what
// the process says while it starts.
func startAside(ctx context.Context, cfg Config) <-chan startResult {
	ch := make(chan startResult, 1)
	go func() {
		p, err := Start(ctx, cfg)
		ch <- startResult{p, err}
	}()
	return ch
}

// startOnAFullStore starts a process on a full store, its buckets deleted
// first if deleted, and checks that it waits for room and then runs.
func startOnAFullStore(t *testing.T, deleted bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	askForRoomOften(t)
	srv, _, js := startServer(t, ctx, natsjs.ServerConfig{MaxStore: 16 << 20})
	cfg := testConfig(t)
	cfg.NATSURL, cfg.Source = srv.URL(), SourceExternal
	first, err := Start(ctx, cfg) // the stream, consumers and lease bucket, made with room
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Stop(); err != nil {
		t.Fatal(err)
	}
	buckets := []string{LeaseBucket(cfg.Prefix), StateBucket(cfg.Prefix), OutcomeBucket(cfg.Prefix)}
	var room func() error
	if deleted {
		for _, b := range buckets {
			if err := js.DeleteKeyValue(ctx, b); err != nil {
				t.Fatalf("%s: %v", b, err)
			}
		}
		// A server whose store is full still makes a bucket (it reserves
		// nothing for one without a size); an account held at its limit,
		// as the rehearsal's is, does not.
		if err := srv.LimitAccountStore(0); err != nil {
			t.Fatal(err)
		}
		room = func() error { return srv.LimitAccountStore(srv.StoreLimit()) }
	} else {
		filler, refused := fillStore(t, ctx, js)
		if !natsjs.StoreFull(refused) {
			t.Fatalf("the full store refused with %v, which StoreFull does not know", refused)
		}
		room = func() error { return js.DeleteStream(ctx, filler) }
	}

	var out syncBuffer
	cfg.Quiet, cfg.Out = false, &out
	cfg.HTTPAddr = fmt.Sprintf("127.0.0.1:%d", natstest.FreePort(t))
	updates := make(chan schemas.Update, 1)
	cfg.OnUpdate = func(u schemas.Update, _ time.Duration) { updates <- u }
	startedCh := startAside(ctx, cfg)
	waited := time.After(time.Minute)
	for said := false; !said; said = strings.Contains(out.String(), "the NATS server has no room to store") {
		select {
		case r := <-startedCh:
			t.Fatalf("the process did not wait for room: Start returned %v\n%s", r.err, out.String())
		case <-waited:
			t.Fatalf("the process did not say what it waits for:\n%s", out.String())
		case <-time.After(20 * time.Millisecond):
		}
	}
	// Its gateway serves meanwhile; what a trainer sends is refused,
	// saying why, and when to ask again.
	resp, err := http.Post("http://"+cfg.HTTPAddr+"/v1/runs/"+cfg.Run+"/steps/0/close", "application/json", strings.NewReader(`{"groups":3}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "10" || !strings.Contains(string(body), "no room to store") {
		t.Errorf("a watermark sent to the gateway of a full store: %d, Retry-After %q, %s; want 503, 10, why", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	select {
	case r := <-startedCh:
		t.Fatalf("the process did not wait for room: Start returned %v\n%s", r.err, out.String())
	case <-time.After(10 * roomWait):
	}
	if err := room(); err != nil {
		t.Fatal(err)
	}
	r := <-startedCh
	if r.err != nil {
		t.Fatalf("once there was room: %v\n%s", r.err, out.String())
	}
	t.Cleanup(func() { r.p.Stop() })
	if deleted {
		for _, b := range buckets {
			if _, err := js.KeyValue(ctx, b); err != nil {
				t.Errorf("%s once there was room: %v; want it made anew", b, err)
			}
		}
		if want := "bucket " + LeaseBucket(cfg.Prefix) + ": the NATS server has no room to store"; !strings.Contains(out.String(), want) {
			t.Errorf("the process did not say which bucket it waited to make (%q):\n%s", want, out.String())
		}
	}

	pol := sim.Policy{Run: cfg.Run, Tasks: 4, Groups: 3, GroupSize: 4}
	trajs, wm := pol.Step(0)
	publishStep(t, ctx, js, pol, 0)
	select {
	case u := <-updates:
		if u.Groups != wm.Groups || len(u.Items) != len(trajs) {
			t.Errorf("step 0 fused with %d groups and %d trajectories; want %d and %d", u.Groups, len(u.Items), wm.Groups, len(trajs))
		}
	case <-ctx.Done():
		t.Fatalf("no update of step 0:\n%s", out.String())
	}
}

// A stage whose output the server refused for lack of room has its input
// handed back however often it was delivered: the store fills for as
// long as it takes someone to make room, and its messages must all go on
// once there is. Another failure on the last delivery is dead-lettered.
func TestAFullStoreIsAnOutageNotAFault(t *testing.T) {
	full := fmt.Errorf("natsjs: publish to wmrl.default.pred: 1 message(s) not stored after 1 attempt(s) in 4ms: %w",
		&jetstream.APIError{Code: 503, ErrorCode: 10023, Description: "insufficient resources"})
	for _, c := range []struct {
		err          error
		deadLettered bool
	}{{full, false}, {errors.New("nats: no responders available for request"), true}} {
		rec := &stagetest.Recorder{}
		var said []string
		d := &deadLetters{pub: rec, subject: "wmrl.default.dlq", maxAttempts: 3, metrics: NewMetrics(),
			notef: func(format string, args ...any) { said = append(said, fmt.Sprintf(format, args...)) }}
		msg := message.NewMessage("1", []byte(`{"group_id":"g"}`))
		msg.Metadata.Set(natsjs.MetaDeliveries, "10")
		h := d.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, c.err })
		_, err := h(msg)
		if got := rec.Count() == 1; got != c.deadLettered || (err == nil) != c.deadLettered {
			t.Errorf("%v on a 10th delivery: dead-lettered %v, handed back %v; want dead-lettered %v\nsaid: %q", c.err, got, err != nil, c.deadLettered, said)
		}
		if !c.deadLettered && (len(said) != 1 || !strings.Contains(said[0], "no room to store") || !strings.Contains(said[0], "nothing is dead-lettered")) {
			t.Errorf("a full store was said as %q", said)
		}
	}
}

// A store that fills during a run stops it until room is made; then every
// step goes on, whole, and nothing is dead-lettered, though the store
// stays full past the deliveries after which a failing message is
// dead-lettered (MaxAttempts, 3 here). Before, the simulated trainer
// ended the run at its first refused message ("source: watermark 41:
// ... insufficient resources"). A store fills two ways, answered with two
// codes: the server's (its disk, its max_file_store: "insufficient
// resources") and the account's share of it, as an operator of a shared
// NATS sets for each of its users ("resource limits exceeded for
// account"), which the run took for a fault.
func TestAStoreThatFillsMidRunLosesNothing(t *testing.T) {
	t.Run("the server's store", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		srv, nc, js := startServer(t, ctx, natsjs.ServerConfig{MaxStore: 16 << 20})
		// Full, then room for a few steps: the run fills it, whatever its pace.
		filler, _ := fillStore(t, ctx, js)
		st, err := js.Stream(ctx, filler)
		if err != nil {
			t.Fatal(err)
		}
		for seq := range uint64(8) {
			if err := st.DeleteMsg(ctx, seq+1); err != nil {
				t.Fatal(err)
			}
		}
		runThroughAFullStore(t, ctx, srv.URL(), nc, js, func(*atomic.Int64) (room func()) {
			waitFor(t, time.Minute, func() bool {
				_, err := js.Publish(ctx, "filler.probe", []byte{1})
				return natsjs.StoreFull(err)
			})
			return func() {
				if err := js.DeleteStream(ctx, filler); err != nil {
					t.Fatal(err)
				}
			}
		})
	})
	t.Run("the account's limit", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		srv, nc, js := startServer(t, ctx, natsjs.ServerConfig{})
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "PROBE", Subjects: []string{"probe"}}); err != nil {
			t.Fatal(err)
		}
		runThroughAFullStore(t, ctx, srv.URL(), nc, js, func(fused *atomic.Int64) (room func()) {
			waitFor(t, time.Minute, func() bool { return fused.Load() >= 3 })
			ai, err := js.AccountInfo(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := srv.LimitAccountStore(int64(ai.Store)); err != nil {
				t.Fatal(err)
			}
			_, err = js.Publish(ctx, "probe", []byte{1})
			if apiErr, ok := errors.AsType[*jetstream.APIError](err); !ok || apiErr.ErrorCode != 10002 {
				t.Fatalf("a write past the account's limit: %v; want its 10002", err)
			}
			return func() {
				if err := srv.LimitAccountStore(-1); err != nil {
					t.Fatal(err)
				}
			}
		})
	})
}

// runThroughAFullStore runs 40 steps on the server at url; full, called
// once the run has started, returns when the store refuses writes, with
// how to make room, which is done after 3 s.
func runThroughAFullStore(t *testing.T, ctx context.Context, url string, nc *nats.Conn, js jetstream.JetStream, full func(fused *atomic.Int64) (room func())) {
	askForRoomOften(t)
	cfg := testConfig(t)
	cfg.NATSURL, cfg.Steps, cfg.MaxAttempts = url, 40, 3
	var out syncBuffer
	cfg.Quiet, cfg.Out = false, &out
	var fused atomic.Int64
	cfg.OnUpdate = func(schemas.Update, time.Duration) { fused.Add(1) }
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg) }()
	room := full(&fused)
	time.Sleep(3 * time.Second) // a failing message's 3rd delivery comes 0.75 s after its 1st, its 4th 1 s later
	t.Logf("%d steps fused by the time room was made", fused.Load())
	room()
	if err := <-done; err != nil {
		t.Fatalf("the run: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "no room to store") || !strings.Contains(out.String(), "lost nothing") {
		t.Errorf("the run did not say the store was full, or lost something:\n%s", out.String())
	}
	updates := decodeUpdates(t, scanAll(t, nc, "wmrl."+cfg.Run+".update"))
	for step := range cfg.Steps {
		if u := updates[step]; u.Groups != cfg.Groups || len(u.Items) != cfg.Groups*cfg.GroupSize {
			t.Errorf("step %d fused with %d groups and %d trajectories; want %d and %d", step, u.Groups, len(u.Items), cfg.Groups, cfg.Groups*cfg.GroupSize)
		}
	}
	if dl := scanAll(t, nc, "wmrl."+cfg.Run+".dlq"); len(dl) > 0 {
		t.Errorf("%d dead letters, the first %s", len(dl), dl[0])
	}
}
