package pipeline

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/sim"
)

// The store's metrics follow what the stream holds, what the account
// uses, its limit and the disk's free room.
func TestStoreMetricsFollowTheStream(t *testing.T) {
	defer func(every time.Duration) { storeEvery = every }(storeEvery)
	storeEvery = 20 * time.Millisecond
	cfg := testConfig(t)
	cfg.Source = SourceExternal
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, nc, js := startClient(t, ctx, cfg)
	defer nc.Close()
	m := p.Metrics()
	publishStep(t, ctx, js, sim.Policy{Run: "default", Tasks: 4, Groups: 4, GroupSize: 4}, 0)
	stream := func() uint64 {
		s, err := js.Stream(ctx, StreamName("wmrl"))
		if err != nil {
			t.Fatal(err)
		}
		info, err := s.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return info.State.Bytes
	}
	// The account's use is counted apart from the stream's, and may lag it.
	waitFor(t, 20*time.Second, func() bool {
		b := stream()
		return b > 0 && testutil.ToFloat64(m.StreamBytes) == float64(b) && testutil.ToFloat64(m.StoreBytes) >= float64(b)
	})
	ai, err := js.AccountInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if used := testutil.ToFloat64(m.StoreBytes); used > float64(ai.Store)*2 {
		t.Errorf("wmrl_jetstream_store_bytes %v; the stream holds %v, the account %d", used, testutil.ToFloat64(m.StreamBytes), ai.Store)
	}
	if got, want := testutil.ToFloat64(m.StoreLimit), float64(p.tr.srv.StoreLimit()); got != want || got <= 0 {
		t.Errorf("wmrl_jetstream_store_limit_bytes %v, want the embedded server's %v", got, want)
	}
	var fs syscall.Statfs_t
	if err := syscall.Statfs(cfg.DataDir, &fs); err != nil {
		t.Fatal(err)
	}
	free := float64(fs.Bavail) * float64(fs.Bsize)
	if got := testutil.ToFloat64(m.StoreDiskFree); got <= 0 || got < free/2 || got > free*2 {
		t.Errorf("wmrl_store_disk_free_bytes %v; statfs of the data directory says %v", got, free)
	}
}

// --nats-max-store-gb bounds the embedded server's store: the run's
// metrics measure against it, and so does a reading of the stopped store
// (wmrl status --data), which starts a server of its own on it, and a
// client of the running server (wmrl status --nats), which reads its
// account's limit, not the server's. A run
// without the bound leaves its readers the disk's. A bound beyond
// what the disk gives the store is pointed out.
func TestTheEmbeddedStoreKeepsItsBound(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := testConfig(t)
	cfg.Steps, cfg.MaxStoreGB = 2, 0.25
	p, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(p.Metrics().StoreLimit); got != 1<<28 {
		t.Errorf("wmrl_jetstream_store_limit_bytes %v; want the bound, %d", got, 1<<28)
	}
	// A client of the running server reads it too, as its account's.
	live := cfg
	live.Steps, live.Source = 0, SourceExternal
	p = started(t, ctx, live)
	if st, err := ReadStatus(ctx, StreamSource{NATSURL: p.URL(), Prefix: cfg.Prefix}, cfg.Run); err != nil || st.StoreLimit != 1<<28 {
		t.Errorf("a client of the running server read the store's limit as %v (%v); want the bound, %d", st.StoreLimit, err, 1<<28)
	}
	if err := p.Stop(); err != nil {
		t.Fatal(err)
	}
	limit := func() uint64 {
		st, err := ReadStatus(ctx, StreamSource{DataDir: cfg.DataDir, Prefix: cfg.Prefix}, cfg.Run)
		if err != nil {
			t.Fatal(err)
		}
		return uint64(st.StoreLimit)
	}
	if got := limit(); got != 1<<28 {
		t.Errorf("the stopped store read with a limit of %d; want the run's bound, %d", got, 1<<28)
	}
	cfg.MaxStoreGB = 0
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if got := limit(); got == 1<<28 || got == 0 {
		t.Errorf("after a run without a bound, the stopped store read with a limit of %d; want three quarters of the disk's room", got)
	}

	var out syncBuffer
	cfg.MaxStoreGB, cfg.Quiet, cfg.Out = 1<<20, false, &out // a PiB
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "--nats-max-store-gb 1048576 is more than the disk gives the store") {
		t.Errorf("a bound of a PiB was not pointed out:\n%s", out.String())
	}
}

// A store's use and limit come from the account, or, where an operator
// tiers its limits by replicas, from the tier of the stream's replicas:
// such an account reports no limit of its own (its writes are refused at
// the tier's). The replies are nats-server 2.15's, for an account with
// limits "" and R1.
func TestTheStoresLimitIsTheStreamsTiers(t *testing.T) {
	for _, tc := range []struct {
		name, reply string
		replicas    int
		used        uint64
		limit       int64
	}{
		{"no limit", `{"storage": 900, "limits": {"max_storage": -1}}`, 1, 900, 0},
		{"the account's", `{"storage": 900, "limits": {"max_storage": 1048576}, "tiers": {"": {"storage": 900}}}`, 1, 900, 1 << 20},
		{"R1's", `{"storage": 983540, "limits": {}, "tiers": {"R1": {"storage": 983540, "limits": {"max_storage": 1048576}}}}`, 1, 983540, 1 << 20},
		{"R3's", `{"storage": 5000, "limits": {}, "tiers": {"R1": {"storage": 2000, "limits": {"max_storage": 1048576}}, "R3": {"storage": 3000, "limits": {"max_storage": 4194304}}}}`, 3, 3000, 4 << 20},
		{"a tier the stream is not in", `{"storage": 5000, "limits": {}, "tiers": {"R1": {"storage": 5000, "limits": {"max_storage": 1048576}}}}`, 3, 5000, 0},
	} {
		var ai jetstream.AccountInfo
		if err := json.Unmarshal([]byte(tc.reply), &ai); err != nil {
			t.Fatal(err)
		}
		if used, limit := accountStore(&ai, tc.replicas); used != tc.used || limit != tc.limit {
			t.Errorf("%s: use %d of %d; want %d of %d", tc.name, used, limit, tc.used, tc.limit)
		}
	}
}

// fakeDisk stands for the embedded server's disk in diskRoom: its free
// room is what the test sets.
func fakeDisk(t *testing.T, free int64) *atomic.Int64 {
	var room atomic.Int64
	room.Store(free)
	before := diskRoom
	diskRoom = func(string) (int64, int64, error) { return room.Load(), 1 << 40, nil }
	t.Cleanup(func() { diskRoom = before })
	return &room
}

// The embedded server's store, given no bound, follows what its disk gives
// it: when other writers (a trainer's checkpoints) leave the disk little
// room, the store stops taking messages before the disk fills, and the run
// says so; once room is made there, it takes them again and the run goes
// on. nats-server's own limit is three quarters of the disk's free room at
// its start, for good: a run started on a disk short of room stayed full
// after room was made, until a restart (a rehearsal, seed 64), and one
// whose disk filled under it could not write its files.
func TestTheEmbeddedStoreFollowsItsDisk(t *testing.T) {
	defer func(store, follow time.Duration) { storeEvery, followEvery = store, follow }(storeEvery, followEvery)
	storeEvery, followEvery = 20*time.Millisecond, 20*time.Millisecond
	askForRoomOften(t)
	room := fakeDisk(t, 1<<30)
	cfg := testConfig(t)
	var out syncBuffer
	cfg.Source, cfg.Quiet, cfg.Out = SourceExternal, false, &out
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, nc, js := startClient(t, ctx, cfg)
	defer nc.Close()
	limitNow := func() (used uint64, limit int64) {
		ai, err := js.AccountInfo(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return ai.Store, ai.Limits.MaxStore
	}
	pol := sim.Policy{Run: "default", Tasks: 4, Groups: 4, GroupSize: 4}
	publishStep(t, ctx, js, pol, 0)
	fused := func(n int) func() bool {
		return func() bool { return len(scanAll(t, nc, "wmrl.default.update")) == n }
	}
	waitFor(t, 20*time.Second, fused(1))
	used, limit := limitNow()
	if want := (int64(1<<30) + int64(used)) / 4 * 3; limit < want-(1<<20) || limit > want+(1<<20) {
		t.Errorf("the store's limit with 1 GiB free: %d; want three quarters of that and what it holds (%d), %d", limit, used, want)
	}

	// Step 1's trajectories are stored; the disk then fills, and its
	// watermark is refused.
	trajs, wm := pol.Step(1)
	for _, tr := range trajs {
		b, _ := json.Marshal(tr)
		if _, err := js.Publish(ctx, "wmrl.default.traj", b); err != nil {
			t.Fatal(err)
		}
	}
	room.Store(0)
	waitFor(t, 20*time.Second, func() bool { return strings.Contains(out.String(), "Every stage waits for room") })
	if used, limit := limitNow(); limit >= int64(used) {
		t.Errorf("with the disk full, the store's limit is %d, holding %d; want it below", limit, used)
	}
	b, _ := json.Marshal(wm)
	if _, err := js.Publish(ctx, "wmrl.default.step", b); !natsjs.StoreFull(err) {
		t.Fatalf("a watermark sent with the disk full: %v; want it refused for want of room", err)
	}
	// The metrics are read on their own tick, after the limit follows.
	waitFor(t, 20*time.Second, func() bool {
		return testutil.ToFloat64(p.Metrics().StoreLimit) < testutil.ToFloat64(p.Metrics().StoreBytes)
	})

	room.Store(1 << 30)
	waitFor(t, 20*time.Second, func() bool {
		return strings.Contains(out.String(), "nats: room on the disk of the embedded server's store")
	})
	if _, err := js.Publish(ctx, "wmrl.default.step", b); err != nil {
		t.Fatalf("the watermark once room was made: %v", err)
	}
	waitFor(t, 20*time.Second, fused(2))
	u := decodeUpdates(t, scanAll(t, nc, "wmrl.default.update"))[1]
	if len(u.Items) != len(trajs) || u.Groups != pol.Groups {
		t.Errorf("step 1's update: %d items of %d groups; want its %d trajectories, %d groups", len(u.Items), u.Groups, len(trajs), pol.Groups)
	}
}

// A run whose embedded server can store nothing more until it is started
// again (a stream's write error, or JetStream off, after its disk filled)
// ends, saying so and what to do, where every write timed out for as long
// as it ran, room made or not.
func TestARunWhoseServerCanStoreNothingMoreEnds(t *testing.T) {
	defer func(every time.Duration) { followEvery = every }(followEvery)
	followEvery = 20 * time.Millisecond
	cfg := testConfig(t)
	cfg.Source = SourceExternal
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := started(t, ctx, cfg)
	time.Sleep(5 * followEvery) // not broken: the run goes on
	select {
	case <-p.done:
		t.Fatalf("the run ended on a server that stores: %v", p.Wait())
	default:
	}
	if err := p.tr.srv.NATS().DisableJetStream(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.done:
	case <-ctx.Done():
		t.Fatal("the run goes on with its server's JetStream off")
	}
	if err := p.Wait(); !errors.Is(err, ErrStoreBroken) || !strings.Contains(err.Error(), "JetStream is off") ||
		!strings.Contains(err.Error(), "start wmrl again on the same --data") {
		t.Errorf("the run ended with %v; want ErrStoreBroken, why, and what to do", err)
	}
}
