package natsjs

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/nats-io/nats.go"
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
