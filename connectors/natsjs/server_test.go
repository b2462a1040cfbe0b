package natsjs

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestASecondServerOnAStoreIsRefused: two servers on one store would both
// write its files; the second is refused with the holder's process id, the
// first keeps its data, and the store is free again once it shuts down.
func TestASecondServerOnAStoreIsRefused(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	first, err := StartServer(ctx, ServerConfig{StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer first.Shutdown()
	nc := connect(t, first)
	defer nc.Close()
	js, _ := jetstream.New(nc)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "s", []byte("kept")); err != nil {
		t.Fatal(err)
	}

	_, err = StartServer(ctx, ServerConfig{StoreDir: dir})
	if !errors.Is(err, ErrStoreInUse) {
		t.Fatalf("second server on the store: %v; want ErrStoreInUse", err)
	}
	for _, want := range []string{dir, "process " + strconv.Itoa(os.Getpid()), "--nats"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the refusal %q does not name %q", err, want)
		}
	}
	if _, err := js.Publish(ctx, "s", []byte("after")); err != nil {
		t.Fatalf("the first server stopped working after the refusal: %v", err)
	}

	first.Shutdown()
	again, err := StartServer(ctx, ServerConfig{StoreDir: dir})
	if err != nil {
		t.Fatalf("the store is not free after Shutdown: %v", err)
	}
	defer again.Shutdown()
	nc2 := connect(t, again)
	defer nc2.Close()
	js2, _ := jetstream.New(nc2)
	s, err := js2.Stream(ctx, "S")
	if err != nil {
		t.Fatal(err)
	}
	if info, _ := s.Info(ctx); info == nil || info.State.Msgs != 2 {
		t.Fatalf("the store after a refused second server: %+v; want the 2 messages", info)
	}
}

// A stopped server releases its store even while a child process holds
// a copy of the lock's descriptor: one forked elsewhere in the process,
// not yet at its exec (here, one given the descriptor to keep). A close
// alone left the store locked until that child exec'd or ended, and a
// test reading the store after its run met "in use by another process".
func TestAStoppedServerReleasesItsStoreWhateverAChildHolds(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	srv, err := StartServer(ctx, ServerConfig{StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	child := exec.CommandContext(ctx, "sleep", "60")
	child.ExtraFiles = []*os.File{srv.lock}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { child.Process.Kill(); child.Wait() }()
	srv.Shutdown()
	again, err := StartServer(ctx, ServerConfig{StoreDir: dir})
	if err != nil {
		t.Fatalf("the store, once its server stopped, with a child holding the lock's descriptor: %v", err)
	}
	again.Shutdown()
}

// TestAKilledProcessLeavesNoStaleLock: the lock belongs to the holding
// process, across processes, and dies with it, so a run killed with
// SIGKILL can be started again without cleaning anything up.
func TestAKilledProcessLeavesNoStaleLock(t *testing.T) {
	if dir := os.Getenv("WMRL_TEST_HOLD_STORE"); dir != "" {
		srv, err := StartServer(context.Background(), ServerConfig{StoreDir: dir})
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		defer srv.Shutdown()
		fmt.Println("holding")
		time.Sleep(time.Minute) // until killed
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestAKilledProcessLeavesNoStaleLock$")
	cmd.Env = append(os.Environ(), "WMRL_TEST_HOLD_STORE="+dir)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || line != "holding\n" {
		t.Fatalf("the holding process said %q (%v)", line, err)
	}

	_, err = StartServer(ctx, ServerConfig{StoreDir: dir})
	if !errors.Is(err, ErrStoreInUse) || !strings.Contains(err.Error(), "process "+strconv.Itoa(cmd.Process.Pid)) {
		t.Fatalf("a store held by process %d: %v", cmd.Process.Pid, err)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	srv, err := StartServer(ctx, ServerConfig{StoreDir: dir})
	if err != nil {
		t.Fatalf("the store after its holder was killed: %v", err)
	}
	srv.Shutdown()
}

// TestHandedBackMessagesOutliveTheServer: a subscriber closed with messages
// in its handlers, or just nacked by them, hands them back so that the
// server, stopped right after and started again on its store (as the
// embedded one is with its process), redelivers them at once. With an
// AckWait of an hour nothing else could bring them back within the test:
// a plain Nak is kept only in the server's memory, and an acknowledgement
// still in the server's queue at its stop is dropped.
//
// Every message is handed out before the stop. What this does not cover:
// a message the server sends toward a subscriber as it unsubscribes is
// lost in between and waits for AckWait (README, Known limits).
func TestHandedBackMessagesOutliveTheServer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	const topic, n = "handback.t", 40
	newSub := func(nc *nats.Conn) *Subscriber {
		sub, err := NewSubscriber(SubscriberConfig{Conn: nc, ConsumerGroup: "g", AckWait: time.Hour, Logger: watermill.NopLogger{},
			NakDelay: func(uint64) time.Duration { return 2 * time.Second }}) // past the stop
		if err != nil {
			t.Fatal(err)
		}
		return sub
	}

	srv, err := StartServer(ctx, ServerConfig{StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	nc := connect(t, srv)
	sub := newSub(nc)
	if err := sub.SubscribeInitialize(topic); err != nil {
		t.Fatal(err)
	}
	pub, err := NewPublisher(PublisherConfig{Conn: nc})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < n; i++ {
		if err := pub.Publish(topic, message.NewMessage(fmt.Sprint(i), []byte("x"))); err != nil {
			t.Fatal(err)
		}
	}
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < n; i++ {
		m := <-msgs
		if i%2 == 0 {
			m.Nack() // a handler that failed, or returned when told to stop
		} // the others are still being handled at the stop
	}
	nc = restarted(t, ctx, dir, sub, nc, srv)
	sub = newSub(nc)
	defer sub.Close()
	msgs, err = sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for len(seen) < n {
		select {
		case m := <-msgs:
			seen[m.UUID] = true
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("%d of %d messages came back after the restart; the others wait for AckWait", len(seen), n)
		}
	}
}

// TestAcksOutliveTheServer: messages acknowledged just before a subscriber
// closes stay acknowledged when the server stops right after and starts
// again on its store: Close waits until the server has taken every
// acknowledgement in, so none comes back after AckWait.
func TestAcksOutliveTheServer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	const topic, n = "acks.t", 3000
	srv, err := StartServer(ctx, ServerConfig{StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	nc := connect(t, srv)
	sub, err := NewSubscriber(SubscriberConfig{Conn: nc, ConsumerGroup: "g", AckWait: time.Hour, Logger: watermill.NopLogger{}})
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.SubscribeInitialize(topic); err != nil {
		t.Fatal(err)
	}
	pub, err := NewPublisher(PublisherConfig{Conn: nc})
	if err != nil {
		t.Fatal(err)
	}
	batch := make([]*message.Message, n)
	for i := range batch {
		batch[i] = message.NewMessage(fmt.Sprint(i), []byte("x"))
	}
	if err := pub.Publish(topic, batch...); err != nil {
		t.Fatal(err)
	}
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < n; i++ {
		(<-msgs).Ack()
	}
	nc = restarted(t, ctx, dir, sub, nc, srv)
	js, _ := jetstream.New(nc)
	stream, err := js.Stream(ctx, SafeName(topic))
	if err != nil {
		t.Fatal(err)
	}
	cons, err := stream.Consumer(ctx, "g")
	if err != nil {
		t.Fatal(err)
	}
	info, err := cons.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.NumAckPending != 0 || info.AckFloor.Stream != n {
		t.Fatalf("after the restart %d messages are pending acknowledgement (ack floor %d of %d): acknowledgements were lost at the stop",
			info.NumAckPending, info.AckFloor.Stream, n)
	}
}

// restarted closes sub, its connection and the server, as a process that
// stops does, starts a server on the same store and returns a connection
// to it; both end with the test.
func restarted(t *testing.T, ctx context.Context, dir string, sub *Subscriber, nc *nats.Conn, srv *Server) *nats.Conn {
	t.Helper()
	sub.Close()
	nc.Close()
	srv.Shutdown()
	srv, err := StartServer(ctx, ServerConfig{StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	nc = connect(t, srv)
	t.Cleanup(nc.Close)
	return nc
}

// An address another process listens on is refused at once, naming it,
// not after the wait for a server that never binds it.
func TestAnAddressInUseIsRefusedAtOnce(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, err = StartServer(context.Background(), ServerConfig{StoreDir: t.TempDir(), Listen: l.Addr().String()})
	if err == nil || !strings.Contains(err.Error(), "cannot listen on "+l.Addr().String()) || !strings.Contains(err.Error(), "address already in use") {
		t.Fatalf("start on a busy address: %v, want it to name the address in use", err)
	}
}
