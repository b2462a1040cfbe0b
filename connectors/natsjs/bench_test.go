package natsjs

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// BenchmarkHop relays b.N 200-byte messages through one watermill hop on the
// project's adapter (publish with PubAcks, router handler, ack), and reports
// msgs/s beside plain nats.go publish+consume measured in the same run on
// the same server. The target: hop/raw >= 0.5.
func BenchmarkHop(b *testing.B) {
	for _, size := range []int{200, 1600} { // one trajectory; an 8-item group
		b.Run(fmt.Sprintf("bytes=%d", size), func(b *testing.B) { benchHop(b, size) })
	}
}

func benchHop(b *testing.B, size int) {
	srv := startServer(b)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	raw, err := RawThroughput(ctx, connect(b, srv), max(b.N, 20000), size)
	if err != nil {
		b.Fatal(err)
	}
	pub, err := NewPublisher(PublisherConfig{Conn: connect(b, srv), CloseConn: true})
	if err != nil {
		b.Fatal(err)
	}
	defer pub.Close()
	sub, err := NewSubscriber(SubscriberConfig{Conn: connect(b, srv), CloseConn: true, MaxAckPending: 8192, Prefetch: 1024})
	if err != nil {
		b.Fatal(err)
	}
	topic := fmt.Sprintf("hop.%d", time.Now().UnixNano())
	if err := sub.SubscribeInitialize(topic); err != nil {
		b.Fatal(err)
	}
	router, _ := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	var n atomic.Int64
	done := make(chan struct{})
	total := int64(b.N)
	router.AddNoPublisherHandler("count", topic, sub, func(*message.Message) error {
		if n.Add(1) == total {
			close(done)
		}
		return nil
	})
	go router.Run(ctx)
	<-router.Running()
	defer router.Close()
	payload := make([]byte, size)
	b.ResetTimer()
	start := time.Now()
	const batch = 256
	for i := 0; i < b.N; i += batch {
		msgs := make([]*message.Message, 0, batch)
		for j := i; j < min(i+batch, b.N); j++ {
			msgs = append(msgs, message.NewMessage(watermill.NewUUID(), payload))
		}
		if err := pub.Publish(topic, msgs...); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-done:
	case <-ctx.Done():
		b.Fatalf("%d of %d messages arrived", n.Load(), b.N)
	}
	hop := float64(b.N) / time.Since(start).Seconds()
	b.ReportMetric(hop, "msgs/s")
	b.ReportMetric(raw, "raw_msgs/s")
	b.ReportMetric(hop/raw, "x_raw")
}
