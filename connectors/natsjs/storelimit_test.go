package natsjs

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// serverWithAStream starts a server without a bound on a store in dir,
// with a stream S of subject s; both go when the test ends.
func serverWithAStream(t *testing.T, ctx context.Context, dir string) (*Server, jetstream.JetStream) {
	t.Helper()
	srv, err := StartServer(ctx, ServerConfig{StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	nc := connect(t, srv)
	t.Cleanup(nc.Close)
	js, _ := jetstream.New(nc)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s"}}); err != nil {
		t.Fatal(err)
	}
	return srv, js
}

// A server started without a bound takes three quarters of its disk's free
// room as its store's limit, as nats-server does, but as the account's,
// which FollowDisk moves: down below what the store holds when the disk
// has no room (writes refused for want of room), up again when it has. A
// client reads it in its account's info. A server started with a bound
// keeps it.
func TestAStoreWithoutABoundFollowsItsDisk(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	srv, js := serverWithAStream(t, ctx, dir)
	limit := func() (used uint64, limit int64) {
		ai, err := js.AccountInfo(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return ai.Store, ai.Limits.MaxStore
	}

	free, _, err := DiskRoom(dir)
	if err != nil {
		t.Fatal(err)
	}
	// The machine is shared: others write to the disk meanwhile.
	if _, got := limit(); got != srv.StoreLimit() || got < free/4*3*95/100 || got > free/4*3*105/100 {
		t.Errorf("a client reads the store's limit as %d, the server says %d; want both three quarters of the disk's %d free", got, srv.StoreLimit(), free)
	}
	for range 10 {
		if _, err := js.Publish(ctx, "s", make([]byte, 10<<10)); err != nil {
			t.Fatal(err)
		}
	}

	now, before, err := srv.FollowDisk(0)
	used, got := limit()
	if err != nil || now != got || before == now || got >= int64(used) || got < int64(used)/4*3-(1<<10) {
		t.Fatalf("FollowDisk with no room on the disk: %d (before %d, %v); a client reads %d, holding %d; want three quarters of that", now, before, err, got, used)
	}
	if _, err := js.Publish(ctx, "s", make([]byte, 10<<10)); !StoreFull(err) {
		t.Fatalf("a write with no room on the disk: %v; want it refused for want of room", err)
	}
	if now, _, err = srv.FollowDisk(1 << 30); err != nil || now < 3<<28 {
		t.Fatalf("FollowDisk with 1 GiB free: %d (%v); want three quarters of that and what the store holds", now, err)
	}
	if _, err := js.Publish(ctx, "s", make([]byte, 10<<10)); err != nil {
		t.Fatalf("a write once room was made on the disk: %v", err)
	}

	bounded, err := StartServer(ctx, ServerConfig{StoreDir: t.TempDir(), MaxStore: 64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer bounded.Shutdown()
	if now, before, err := bounded.FollowDisk(0); err != nil || now != 64<<20 || before != 64<<20 || bounded.StoreLimit() != 64<<20 {
		t.Errorf("FollowDisk on a server bounded at 64 MiB: %d (before %d, %v), its limit %d; want the bound kept", now, before, err, bounded.StoreLimit())
	}
}

// A server says it can store nothing more once JetStream is off (a
// cluster node's answer to a full disk; a single node's, a stream's write
// error, is tried on a small disk in the README), and nothing before.
func TestABrokenServerSaysWhy(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv, _ := serverWithAStream(t, ctx, t.TempDir())
	if why := srv.Broken(); why != "" {
		t.Fatalf("a server that stores says it is broken: %s", why)
	}
	if err := srv.NATS().DisableJetStream(); err != nil {
		t.Fatal(err)
	}
	if why := srv.Broken(); why != "JetStream is off" {
		t.Errorf("a server with JetStream off says %q", why)
	}
}
