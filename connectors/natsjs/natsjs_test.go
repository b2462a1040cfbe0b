package natsjs

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// startServer runs an embedded JetStream server for one test.
func startServer(t testing.TB) *Server {
	t.Helper()
	srv, err := StartServer(context.Background(), ServerConfig{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	return srv
}

func connect(t testing.TB, srv *Server) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	return nc
}

// streamS starts a server with a stream S of subjects s.>, for one test.
func streamS(t *testing.T, ctx context.Context) (jetstream.JetStream, jetstream.Stream) {
	t.Helper()
	nc := connect(t, startServer(t))
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	st, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}})
	if err != nil {
		t.Fatal(err)
	}
	return js, st
}

func newPubSub(t *testing.T, srv *Server, group string) (message.Publisher, message.Subscriber) {
	pub, err := NewPublisher(PublisherConfig{Conn: connect(t, srv), CloseConn: true})
	if err != nil {
		t.Fatal(err)
	}
	sub, err := NewSubscriber(SubscriberConfig{
		Conn:          connect(t, srv),
		CloseConn:     true,
		ConsumerGroup: group,
		AckWait:       5 * time.Second,
		NakDelay:      func(uint64) time.Duration { return 10 * time.Millisecond },
		Logger:        watermill.NopLogger{},
	})
	if err != nil {
		t.Fatal(err)
	}
	return pub, sub
}

// TestPubSub runs watermill's universal Pub/Sub suite against the adapter on
// a real embedded JetStream server.
func TestPubSub(t *testing.T) {
	srv := startServer(t)
	tests.TestPubSub(t,
		tests.Features{
			ConsumerGroups:                      true,
			ExactlyOnceDelivery:                 false,
			GuaranteedOrder:                     false, // messages are handled concurrently
			GuaranteedOrderWithSingleSubscriber: false,
			Persistent:                          true,
			NewSubscriberReceivesOldMessages:    false,
		},
		func(t *testing.T) (message.Publisher, message.Subscriber) { return newPubSub(t, srv, "") },
		func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
			return newPubSub(t, srv, group)
		},
	)
}

// TestScansLeaveNoConsumerBehind: a scan's ordered consumer is deleted when
// it ends, so that polling a subject (as tests and restarts do) does not
// pile consumers up until the server's inactivity threshold.
func TestScansLeaveNoConsumerBehind(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, st := streamS(t, ctx)
	for i := range 3 {
		if _, err := js.Publish(ctx, "s.a", []byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
	}
	for range 20 {
		n := 0
		if err := Scan(ctx, js, "S", "s.a", false, func(Record) error { n++; return nil }); err != nil || n != 3 {
			t.Fatalf("scan: %d records, %v", n, err)
		}
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Consumers != 0 {
		t.Fatalf("%d consumers left on the stream after 20 scans; want 0", info.State.Consumers)
	}
}

// A received message says where and when it was stored: its subject,
// stream sequence, deliveries, and the time the stream stored it
// (Stored), which a stage stamps what it derives with rather than the
// time it came to the message (later, behind a backlog).
func TestAReceivedMessageSaysWhenItWasStored(t *testing.T) {
	srv := startServer(t)
	pub, sub := newPubSub(t, srv, "meta")
	defer sub.Close()
	defer pub.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, "meta_test")
	if err != nil {
		t.Fatal(err)
	}
	before := time.Now()
	if err := pub.Publish("meta_test", message.NewMessage(watermill.NewUUID(), []byte("x"))); err != nil {
		t.Fatal(err)
	}
	after := time.Now()
	time.Sleep(50 * time.Millisecond) // received later than stored
	select {
	case m := <-msgs:
		m.Ack()
		if at := Stored(m); at.Before(before.Add(-time.Millisecond)) || at.After(after.Add(time.Millisecond)) {
			t.Errorf("stored at %v; published between %v and %v", at, before, after)
		}
		if StreamSeq(m) != 1 || m.Metadata.Get(MetaSubject) != "meta_test" || m.Metadata.Get(MetaDeliveries) != "1" {
			t.Errorf("metadata %v", m.Metadata)
		}
	case <-ctx.Done():
		t.Fatal("nothing received")
	}
	if at := Stored(message.NewMessage("u", nil)); !at.IsZero() {
		t.Errorf("a message never stored says %v", at)
	}
}
