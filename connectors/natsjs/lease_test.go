package natsjs

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
)

// leases opens a lease bucket on a fresh embedded server, once for each of
// n processes (each with its own connection).
func leases(t *testing.T, ctx context.Context, ttl time.Duration, n int) []*Leases {
	t.Helper()
	return leasesOn(t, ctx, testServer(t, ctx), ttl, n)
}

// testServer starts an embedded server for the test.
func testServer(t *testing.T, ctx context.Context) *Server {
	t.Helper()
	srv, err := StartServer(ctx, ServerConfig{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	return srv
}

// jsOn connects to srv as name, for the test.
func jsOn(t *testing.T, srv *Server, name string) jetstream.JetStream {
	t.Helper()
	nc, err := srv.Connect(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// leasesOn opens the lease bucket on srv for each of n processes.
func leasesOn(t *testing.T, ctx context.Context, srv *Server, ttl time.Duration, n int) []*Leases {
	t.Helper()
	var out []*Leases
	for range n {
		l, err := OpenLeases(ctx, jsOn(t, srv, "lease-test"), "TEST_LEASES", 1, ttl, nil)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, l)
	}
	return out
}

// acquireAsync takes key in the background, telling whom it waited for.
func acquireAsync(ctx context.Context, l *Leases, key string, me Holder) (<-chan *Lease, <-chan Holder) {
	got, busy := make(chan *Lease, 1), make(chan Holder, 4)
	go func() {
		le, err := l.Acquire(ctx, key, me, func(h Holder) { busy <- h })
		if err == nil {
			got <- le
		}
		close(got)
	}()
	return got, busy
}

// A second process waits while the first holds the lease, hears who holds
// it, and takes it as soon as the first releases it; the first did not
// lose it meanwhile.
func TestALeaseIsHeldByOneProcessAtATime(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ls := leases(t, ctx, time.Second, 2)
	a, b := NewHolder(), NewHolder()
	first, err := ls[0].Acquire(ctx, "run.fuse", a, nil)
	if err != nil {
		t.Fatal(err)
	}
	got, busy := acquireAsync(ctx, ls[1], "run.fuse", b)
	if h := <-busy; h.ID != a.ID || h.PID != a.PID {
		t.Fatalf("the second was told %+v holds the lease, want %+v", h, a)
	}
	// Several TTLs: the first keeps it by renewing.
	select {
	case le := <-got:
		t.Fatalf("the second took the lease the first holds and renews: %+v", le.Holder())
	case <-first.Lost():
		t.Fatalf("the first lost its lease while renewing it: %v", first.Err())
	case <-time.After(3 * ls[0].TTL()):
	}
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	second := <-got
	if second == nil {
		t.Fatal("the second never took the released lease")
	}
	if second.Holder().ID != b.ID {
		t.Fatalf("the lease went to %+v", second.Holder())
	}
	if err := first.Err(); err != nil {
		t.Fatalf("a released lease says it was lost: %v", err)
	}
	if err := second.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// A holder that stops renewing without releasing (a killed process) lets
// the lease lapse: the next takes it after the TTL.
func TestALeaseNotRenewedLapses(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ls := leases(t, ctx, time.Second, 2)
	first, err := ls[0].Acquire(ctx, "run.route", NewHolder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	first.Abandon() // dies: no more renewals, no release
	got, busy := acquireAsync(ctx, ls[1], "run.route", NewHolder())
	select {
	case h := <-busy:
		if h.ID != first.Holder().ID {
			t.Fatalf("waited for %+v, want the dead holder %+v", h, first.Holder())
		}
	case <-got:
		t.Fatal("the lease was taken at once from a holder that renewed it just now")
	}
	if second := <-got; second == nil {
		t.Fatal("the lapsed lease was never taken")
	}
}

// A lease taken by another (freed by hand, as for a holder known to be
// gone) is lost to its old holder at its next renewal, naming the new one.
func TestALeaseTakenByAnotherIsLost(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ls := leases(t, ctx, 2*time.Second, 2)
	first, err := ls[0].Acquire(ctx, "run.pair", NewHolder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ls[1].Free(ctx, "run.pair"); err != nil {
		t.Fatal(err)
	}
	b := NewHolder()
	b.Host = "other-host"
	second, err := ls[1].Acquire(ctx, "run.pair", b, nil)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-first.Lost():
	case <-ctx.Done():
		t.Fatal("the old holder never noticed its lease was taken")
	}
	if err := first.Err(); !errors.Is(err, ErrLeaseLost) || !strings.Contains(err.Error(), "other-host") {
		t.Fatalf("lost with %v, want ErrLeaseLost naming the new holder", err)
	}
	select {
	case <-second.Lost():
		t.Fatalf("the new holder lost it too: %v", second.Err())
	case <-time.After(ls[1].TTL()):
	}
	// Releasing a lost lease leaves the new holder's alone.
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if h, _, err := ls[0].Held(ctx, "run.pair"); err != nil || h == nil || h.ID != b.ID {
		t.Fatalf("after the old holder's release the lease is %+v (%v), want the new holder's", h, err)
	}
}

// A lease whose key expired without anyone taking it (its holder could not
// reach the server for a while) is taken back by its holder, not lost.
func TestALapsedLeaseNobodyTookIsKept(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ls := leases(t, ctx, 2*time.Second, 1)
	le, err := ls[0].Acquire(ctx, "run.archive", NewHolder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ls[0].Free(ctx, "run.archive"); err != nil { // as if aged out
		t.Fatal(err)
	}
	if err := le.renewOnce(ctx, 5*time.Second); err != nil {
		t.Fatalf("renewing a lapsed lease nobody took: %v", err)
	}
	if h, _, err := ls[0].Held(ctx, "run.archive"); err != nil || h == nil || h.ID != le.Holder().ID {
		t.Fatalf("the lease is %+v (%v), want its holder's again", h, err)
	}
	// A create whose reply was lost: asked again, the holder finds itself.
	if _, other, err := ls[0].take(ctx, "run.archive", le.Holder(), le.value); err != nil || other != nil {
		t.Fatalf("taking a lease it holds: held by %+v, %v", other, err)
	}
	if err := le.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if h, _, err := ls[0].Held(ctx, "run.archive"); err != nil || h != nil {
		t.Fatalf("after release the lease is held by %+v (%v)", h, err)
	}
}

// A server down for longer than the TTL, with nobody waiting for the
// lease: its holder, reconnected, takes it again and does not lose it (it
// could not take messages while the server was away either).
func TestALeaseOutlivesAnOutageOfTheServer(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir, addr := t.TempDir(), fmt.Sprintf("127.0.0.1:%d", natstest.FreePort(t))
	start := func() *Server {
		srv, err := StartServer(ctx, ServerConfig{StoreDir: dir, Listen: addr})
		if err != nil {
			t.Fatal(err)
		}
		return srv
	}
	srv := start()
	nc, err := nats.Connect("nats://"+addr, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ls, err := OpenLeases(ctx, js, "TEST_LEASES", 1, time.Second, nil)
	if err != nil {
		t.Fatal(err)
	}
	le, err := ls.Acquire(ctx, "run.fuse", NewHolder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	srv.Shutdown()
	time.Sleep(3 * ls.TTL()) // renewals fail; the value ages out
	srv = start()
	defer srv.Shutdown()
	waitUntil(t, ctx, nc.IsConnected)
	time.Sleep(ls.TTL()) // six renewals
	select {
	case <-le.Lost():
		t.Fatalf("lost over an outage nobody took it during: %v", le.Err())
	default:
	}
	if h, _, err := ls.Held(ctx, "run.fuse"); err != nil || h == nil || h.ID != le.Holder().ID {
		t.Fatalf("after the outage the lease is held by %+v (%v), want its holder again", h, err)
	}
}

func waitUntil(t *testing.T, ctx context.Context, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatal("condition not met")
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// staleKV reads a key as missing its first stale times: a follower of a
// replicated bucket that has not yet applied the create (direct gets may
// be answered by any replica).
type staleKV struct {
	jetstream.KeyValue
	stale int
}

func (s *staleKV) Get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	if s.stale > 0 {
		s.stale--
		return nil, jetstream.ErrKeyNotFound
	}
	return s.KeyValue.Get(ctx, key)
}

// A process whose reads lag the creates (a cluster's follower) hears who
// holds the lease once its reads catch up, rather than failing: it took
// three contradictions for an error before, and a standby ended on it.
func TestAStaleReadOfAHeldLeaseIsAskedAgain(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ls := leases(t, ctx, time.Second, 2)
	a := NewHolder()
	first, err := ls[0].Acquire(ctx, "run.fuse", a, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Release(ctx)
	lagging := &Leases{b: &kvBucket{kv: &staleKV{KeyValue: ls[1].b.kv, stale: 5}}, ttl: ls[1].ttl, poll: ls[1].poll}
	le, other, err := lagging.TryAcquire(ctx, "run.fuse", NewHolder())
	if err != nil || le != nil || other == nil || other.ID != a.ID {
		t.Fatalf("a lagging reader's TryAcquire: lease %v, holder %+v, error %v; want the holder %+v", le, other, err, a)
	}
	// Reads that never catch up end in an error that says so.
	lagging.b = &kvBucket{kv: &staleKV{KeyValue: ls[1].b.kv, stale: 1 << 30}}
	if _, _, err := lagging.TryAcquire(ctx, "run.fuse", NewHolder()); err == nil || !strings.Contains(err.Error(), "read it back as free, 10 times in a row") {
		t.Fatalf("reads that never catch up: %v", err)
	}
}

// A renewal refused (a full store) is tried again soon, not a sixth of the
// TTL later: once room is made, the holder writes its lease again before
// a waiting process, which asks every second, is likely to take it (after
// a store full for longer than the TTL, the waiters took 4 of 5 stages
// in a rehearsal, and each holder stopped).
func TestARefusedRenewalIsTriedAgainSoon(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv := testServer(t, ctx)
	l := leasesOn(t, ctx, srv, 12*time.Second, 1)[0] // renewed every 2 s
	le, err := l.Acquire(ctx, "run.fuse", NewHolder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.LimitAccountStore(1); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2500 * time.Millisecond) // a renewal or two refused
	room := time.Now()
	if err := srv.LimitAccountStore(srv.StoreLimit()); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	h, renewed, err := l.Held(ctx, "run.fuse")
	if err != nil || h == nil || h.ID != le.Holder().ID {
		t.Fatalf("the lease is held by %+v (%v); want its holder", h, err)
	}
	if renewed.Before(room) {
		t.Errorf("the lease was last renewed %v before room was made, and not since within 500 ms; want its refused renewal tried again within 250 ms",
			room.Sub(renewed).Round(time.Millisecond))
	}
	select {
	case <-le.Lost():
		t.Fatalf("the lease was lost: %v", le.Err())
	default:
	}
	if err := le.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// A lease that lapses while the store is full stays its holder's as room
// comes back. A process that saw it held, and whose take of it was refused
// for the full store, leaves it to that holder for the TTL after, in which
// the holder writes it again; it takes one whose holder is gone after that
// TTL. A process that never saw a lease held takes it at once.
func TestALeaseThatLapsedWhileTheStoreWasFullStaysItsHolders(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv := testServer(t, ctx)
	ttl := 4 * time.Second
	ls := leasesOn(t, ctx, srv, ttl, 3)
	holder, waiter, fresh := ls[0], ls[1], ls[2]
	le, err := holder.Acquire(ctx, "run.fuse", NewHolder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	gone, err := holder.Acquire(ctx, "run.pair", NewHolder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	gone.Abandon() // its holder died
	me := NewHolder()
	for _, key := range []string{"run.fuse", "run.pair"} {
		if got, other, err := waiter.TryAcquire(ctx, key, me); err != nil || got != nil || other == nil {
			t.Fatalf("%s: took %v, other %v, %v; want it held", key, got != nil, other, err)
		}
	}

	if err := srv.LimitAccountStore(1); err != nil {
		t.Fatal(err)
	}
	waitLapsed(t, ctx, waiter, "run.fuse") // both lapse, the renewals refused
	waitLapsed(t, ctx, waiter, "run.pair")
	for _, key := range []string{"run.fuse", "run.pair"} {
		if _, _, err := waiter.TryAcquire(ctx, key, me); !StoreFull(err) {
			t.Fatalf("%s on a full store: %v; want it refused as a full store refuses it", key, err)
		}
	}
	if _, _, err := fresh.TryAcquire(ctx, "run.route", NewHolder()); !StoreFull(err) {
		t.Fatalf("run.route on a full store: %v; want it refused as a full store refuses it", err)
	}
	if err := srv.LimitAccountStore(srv.StoreLimit()); err != nil {
		t.Fatal(err)
	}

	got, other, err := waiter.TryAcquire(ctx, "run.fuse", me)
	switch {
	case err != nil:
		t.Fatal(err)
	case got != nil:
		t.Fatal("the waiting process took the lease as room came back, its holder alive")
	case other.ID != le.Holder().ID:
		t.Fatalf("the lease is said to be held by %s; want its holder", other)
	}
	got, other, err = waiter.TryAcquire(ctx, "run.pair", me)
	if err != nil || got != nil || other.ID != gone.Holder().ID || !strings.Contains(other.String(), "lapsed while the NATS store was full") {
		t.Fatalf("a lapsed lease whose holder is gone: took %v, held by %v, %v; want it left to that holder for the TTL, saying why", got != nil, other, err)
	}
	if got, _, err := fresh.TryAcquire(ctx, "run.route", NewHolder()); err != nil || got == nil {
		t.Fatalf("a process that never saw run.route held: took %v, %v; want it taken at once", got != nil, err)
	}

	waited, stop := context.WithTimeout(ctx, ttl+2*time.Second)
	defer stop()
	if err := waiter.Wait(waited, "run.pair"); err != nil {
		t.Fatalf("waiting for the lease whose holder is gone: %v; want it free within the TTL", err)
	}
	if got, other, err := waiter.TryAcquire(ctx, "run.pair", me); err != nil || got == nil {
		t.Fatalf("the lease whose holder is gone, after the TTL: held by %v, %v; want it taken", other, err)
	}
	if h, _, err := holder.Held(ctx, "run.fuse"); err != nil || h == nil || h.ID != le.Holder().ID {
		t.Fatalf("run.fuse is held by %v (%v); want its holder, which wrote it again", h, err)
	}
	select {
	case <-le.Lost():
		t.Fatalf("the holder lost its lease: %v", le.Err())
	default:
	}
}

// heldAndSeen starts a server with two processes' leases of ttl: the
// first holds run.fuse, and the second has seen it held.
func heldAndSeen(t *testing.T, ctx context.Context, ttl time.Duration) (srv *Server, holder, waiter *Leases, le *Lease) {
	t.Helper()
	srv = testServer(t, ctx)
	ls := leasesOn(t, ctx, srv, ttl, 2)
	holder, waiter = ls[0], ls[1]
	le, err := holder.Acquire(ctx, "run.fuse", NewHolder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, other, err := waiter.TryAcquire(ctx, "run.fuse", NewHolder()); err != nil || got != nil || other == nil {
		t.Fatalf("took %v, other %v, %v; want it held", got != nil, other, err)
	}
	return srv, holder, waiter, le
}

// waitLapsed waits until l reads key as held by nobody.
func waitLapsed(t *testing.T, ctx context.Context, l *Leases, key string) {
	t.Helper()
	waitUntil(t, ctx, func() bool {
		h, _, err := l.Held(ctx, key)
		return h == nil && err == nil
	})
}

// keptByItsHolder waits until l reads run.fuse as le's, written again,
// and checks that le was not lost meanwhile.
func keptByItsHolder(t *testing.T, ctx context.Context, l *Leases, le *Lease) {
	t.Helper()
	waitUntil(t, ctx, func() bool {
		h, _, err := l.Held(ctx, "run.fuse")
		return err == nil && h != nil && h.ID == le.Holder().ID
	})
	select {
	case <-le.Lost():
		t.Fatalf("the holder lost its lease: %v", le.Err())
	default:
	}
}

// fullClusterKV refuses every create while full is set as a cluster whose
// account is at its store limit does: for the full store, before it looks
// at the key (a single server answers that the key exists first).
type fullClusterKV struct {
	jetstream.KeyValue
	full bool
}

func (f *fullClusterKV) Create(ctx context.Context, key string, value []byte, opts ...jetstream.KVCreateOpt) (uint64, error) {
	if f.full {
		return 0, &jetstream.APIError{Code: 400, ErrorCode: errAccountExceeded, Description: "resource limits exceeded for account"}
	}
	return f.KeyValue.Create(ctx, key, value, opts...)
}

// A process that starts on a cluster's full store, its lease held, hears
// who holds it, rather than only that the store is full; and so, once the
// lease has lapsed on the full store, it leaves it to that holder as a
// standby that saw it does.
func TestAProcessStartedOnAFullClusterHearsWhoHoldsItsLease(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ls := leases(t, ctx, 4*time.Second, 2)
	first, err := ls[0].Acquire(ctx, "run.fuse", NewHolder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	kv := &fullClusterKV{KeyValue: ls[1].b.kv, full: true}
	started := &Leases{b: &kvBucket{kv: kv}, ttl: ls[1].ttl, poll: ls[1].poll}
	me := NewHolder()
	le, other, err := started.TryAcquire(ctx, "run.fuse", me)
	if err != nil || le != nil || other == nil || other.ID != first.Holder().ID {
		t.Fatalf("TryAcquire on a full cluster, the lease held: lease %v, holder %v, error %v; want its holder", le != nil, other, err)
	}

	first.Abandon() // its renewals refused too: it lapses
	waitLapsed(t, ctx, started, "run.fuse")
	if _, _, err := started.TryAcquire(ctx, "run.fuse", me); !StoreFull(err) {
		t.Fatalf("TryAcquire of the lapsed lease on a full cluster: %v; want the full store's refusal", err)
	}
	kv.full = false // room again
	le, other, err = started.TryAcquire(ctx, "run.fuse", me)
	if err != nil || le != nil || other == nil || other.ID != first.Holder().ID {
		t.Fatalf("TryAcquire once there is room: lease %v, holder %v, error %v; want it left to the holder it saw, for the TTL", le != nil, other, err)
	}
}

// A lease that lapsed on a store that stays full for longer than the TTL
// after the waiter's refused take is still left to its holder: the waiter
// leaves it while the store is full, and for the TTL after it finds room.
// It left it for the TTL after its refused take before, and took it when
// room came back just as that ran out (a rehearsal on a cluster, seed 41).
func TestALeaseIsLeftToItsHolderForAsLongAsTheStoreIsFull(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ttl := 4 * time.Second
	srv, _, waiter, le := heldAndSeen(t, ctx, ttl)
	me := NewHolder()
	if err := srv.LimitAccountStore(1); err != nil {
		t.Fatal(err)
	}
	waitLapsed(t, ctx, waiter, "run.fuse")
	if _, _, err := waiter.TryAcquire(ctx, "run.fuse", me); !StoreFull(err) {
		t.Fatalf("a take on a full store: %v; want it refused as a full store refuses it", err)
	}
	waited, stop := context.WithTimeout(ctx, ttl+2*time.Second) // the store full all along
	defer stop()
	if err := waiter.Wait(waited, "run.fuse"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("waiting, the store full for longer than the TTL: %v; want the lease left to its holder as long as it is full", err)
	}
	if err := srv.LimitAccountStore(srv.StoreLimit()); err != nil {
		t.Fatal(err)
	}
	got, other, err := waiter.TryAcquire(ctx, "run.fuse", me)
	if err != nil || got != nil || other == nil || other.ID != le.Holder().ID {
		t.Fatalf("as room came back: took %v, held by %v, %v; want it left to its holder", got != nil, other, err)
	}
	keptByItsHolder(t, ctx, waiter, le)
}

// A process waiting for a lease whose holder's renewals stop while the
// store is full knows the lease lapsed for that, before it has tried to
// take it: it leaves it to its holder, which writes it again once there
// is room. It waited for the lapse and took the lease if room came back
// first (a rehearsal on a cluster, seed 41: the store full for 31 s, the
// lease lapsing as room came back).
func TestAWaiterKnowsALeaseLapsedOnAFullStoreBeforeItTakesIt(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv, holder, waiter, le := heldAndSeen(t, ctx, 4*time.Second)
	waiting, stop := context.WithCancel(ctx)
	defer stop()
	waited := make(chan error, 1)
	go func() { waited <- waiter.Wait(waiting, "run.fuse") }()

	if err := srv.LimitAccountStore(1); err != nil {
		t.Fatal(err)
	}
	waitLapsed(t, ctx, holder, "run.fuse") // the renewals refused
	select {
	case err := <-waited:
		t.Fatalf("the waiter's wait ended (%v) as the lease lapsed on the full store; want it left to its holder", err)
	case <-time.After(2 * time.Second): // the waiter looks twice
	}
	if err := srv.LimitAccountStore(srv.StoreLimit()); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, ctx, func() bool {
		h, _, err := holder.Held(ctx, "run.fuse")
		return err == nil && h != nil && h.ID == le.Holder().ID
	})
	select {
	case err := <-waited:
		t.Fatalf("the waiter's wait ended (%v) as room came back; want it left to its holder", err)
	case <-le.Lost():
		t.Fatalf("the holder lost its lease: %v", le.Err())
	default:
	}
}
