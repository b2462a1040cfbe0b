package natsjs

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"
)

// TestExpirePendingGivesACrashedProcesssMessagesAtOnce: two consumers
// hold every message of a topic, unsettled, when their process dies with
// its server (nothing handed back). On the server started again, the
// chosen consumer's messages come at once, though its AckWait is an hour;
// the other's stay pending; both keep their AckWait.
func TestExpirePendingGivesACrashedProcesssMessagesAtOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	const topic, n = "crash.t", 50
	newSub := func(srv *Server, group string) *Subscriber {
		t.Helper()
		sub, err := NewSubscriber(SubscriberConfig{Conn: connect(t, srv), ConsumerGroup: group, AckWait: time.Hour, Logger: watermill.NopLogger{}})
		if err != nil {
			t.Fatal(err)
		}
		return sub
	}
	srv, err := StartServer(ctx, ServerConfig{StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	chosen, other := newSub(srv, "chosen"), newSub(srv, "other")
	pub, err := NewPublisher(PublisherConfig{Conn: connect(t, srv)})
	if err != nil {
		t.Fatal(err)
	}
	for _, sub := range []*Subscriber{chosen, other} {
		if err := sub.SubscribeInitialize(topic); err != nil {
			t.Fatal(err)
		}
	}
	for i := range n {
		if err := pub.Publish(topic, message.NewMessage(fmt.Sprint(i), []byte("x"))); err != nil {
			t.Fatal(err)
		}
	}
	for _, sub := range []*Subscriber{chosen, other} {
		msgs, err := sub.Subscribe(ctx, topic)
		if err != nil {
			t.Fatal(err)
		}
		for range n {
			<-msgs // taken, never settled
		}
	}
	srv.Shutdown() // the process dies: its connections with it, nothing handed back

	srv, err = StartServer(ctx, ServerConfig{StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	js, _ := jetstream.New(connect(t, srv))
	// What the restarted server holds pending: the n delivered, unless it
	// did not write all of a consumer's deliveries to its store before it
	// stopped (seen once, under a loaded CI: 2 of 50). A message whose
	// delivery it forgot is not pending, and goes out as new.
	pendingOn := func(name string) (time.Duration, int) {
		t.Helper()
		c, err := js.Consumer(ctx, SafeName(topic), name)
		if err != nil {
			t.Fatal(err)
		}
		info := c.CachedInfo()
		return info.Config.AckWait, info.NumAckPending
	}
	before := map[string]int{}
	for _, name := range []string{"chosen", "other"} {
		if _, before[name] = pendingOn(name); before[name] != n {
			t.Logf("consumer %s: %d of the %d delivered pending after the restart", name, before[name], n)
		}
	}
	got, err := ExpirePending(ctx, js, SafeName(topic), func(c string) bool { return c == "chosen" }, 300*time.Millisecond)
	if err != nil || got != before["chosen"] || got == 0 {
		t.Fatalf("ExpirePending: %d, %v; want the %d messages pending on the chosen consumer", got, err, before["chosen"])
	}
	for _, name := range []string{"chosen", "other"} {
		if ackWait, pending := pendingOn(name); ackWait != time.Hour || pending != before[name] {
			t.Fatalf("consumer %s: AckWait %v, %d pending; want its hour back and the %d still pending until handled", name, ackWait, pending, before[name])
		}
	}

	sub := newSub(srv, "chosen")
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	wait := time.After(15 * time.Second)
	for len(seen) < n {
		select {
		case m := <-msgs:
			seen[m.UUID] = true
			m.Ack()
		case <-wait:
			t.Fatalf("%d of %d messages came back after the restart; the others wait for the hour of AckWait", len(seen), n)
		}
	}
	o, _ := js.Consumer(ctx, SafeName(topic), "other")
	if info, err := o.Info(ctx); err != nil || info.NumAckPending != n || info.NumRedelivered != 0 {
		t.Fatalf("the consumer not chosen: %+v, %v; want its %d messages pending, none given again", info, err, n)
	}
}
