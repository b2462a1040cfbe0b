package main

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
)

// The rehearsal's own nats-server gives its user an account whose store
// limit a reload lowers to nothing and lifts again: every write refused
// as a full store refuses it, then taken again.
func TestARehearsalsServerIsHeldFullAndLiftedByAReload(t *testing.T) {
	o := options{dir: t.TempDir(), cluster: 1, natsServer: natstest.Binary(t)}
	acct, err := newAccountFile(o.dir)
	if err != nil {
		t.Fatal(err)
	}
	nodes, url, err := serverArgs(o, acct)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(url, "nats://"+chaosUser+":") {
		t.Fatalf("the client URL %s does not name the account's user", natsjs.Redact(url))
	}
	cmd := exec.Command(nodes[0].args[0], nodes[0].args[1:]...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	nc, err := nats.Connect(url, nats.RetryOnFailedConnect(true), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	var s jetstream.Stream
	until(t, ctx, "the stream is made", func() bool {
		s, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "T", Subjects: []string{"t"}})
		return err == nil
	})
	until(t, ctx, "the server writes its pid file", func() bool {
		_, err := os.Stat(acct.pidFiles[0])
		return err == nil
	})
	publish := func() error {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err := js.Publish(pctx, "t", []byte("x"))
		return err
	}
	if err := publish(); err != nil {
		t.Fatalf("before the hold: %v", err)
	}

	if err := acct.hold(); err != nil {
		t.Fatal(err)
	}
	var refused error
	until(t, ctx, "a write is refused as a full store refuses it", func() bool {
		refused = publish()
		return natsjs.StoreFull(refused)
	})
	if err := acct.lift(); err != nil {
		t.Fatal(err)
	}
	until(t, ctx, "a write is taken again", func() bool { return publish() == nil })

	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs < 2 {
		t.Fatalf("the stream holds %d messages, want the one before the hold and the one after", info.State.Msgs)
	}
	t.Logf("held: %v", refused)

	// A pid file left by a node killed names a process gone (or another
	// one by now): it is passed over, the file written all the same for
	// the node's next start.
	if err := os.WriteFile(acct.pidFiles[0], []byte("999999999\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := acct.hold(); err != nil {
		t.Fatalf("a stale pid file: %v", err)
	}
	if b, _ := os.ReadFile(acct.path); !strings.Contains(string(b), "max_file: 1,") {
		t.Fatalf("the account file after a hold:\n%s", b)
	}
}

// until polls cond every 50 ms until it holds, failing the test at ctx's end.
func until(t *testing.T, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("waiting until %s: %v", what, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}
