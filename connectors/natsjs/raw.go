package natsjs

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// RawThroughput measures plain nats.go JetStream on nc: n messages of size
// bytes published asynchronously to a fresh file-backed stream while a pull
// consumer acknowledges them, and returns messages per second (publish and
// consume overlapping, first publish to last ack). It is the baseline the
// adapter and the pipeline are compared with.
func RawThroughput(ctx context.Context, nc *nats.Conn, n, size int) (float64, error) {
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(4096))
	if err != nil {
		return 0, err
	}
	name := fmt.Sprintf("RAW_%d", time.Now().UnixNano())
	subject := "raw." + name
	st, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subject}, Storage: jetstream.FileStorage})
	if err != nil {
		return 0, err
	}
	defer js.DeleteStream(context.Background(), name)
	cons, err := st.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "raw", AckPolicy: jetstream.AckExplicitPolicy, MaxAckPending: 65536})
	if err != nil {
		return 0, err
	}
	got := make(chan struct{})
	count := 0
	cc, err := cons.Consume(func(m jetstream.Msg) {
		_ = m.Ack()
		if count++; count == n {
			close(got)
		}
	}, jetstream.PullMaxMessages(1024))
	if err != nil {
		return 0, err
	}
	defer cc.Stop()
	payload := make([]byte, size)
	start := time.Now()
	for i := 0; i < n; i++ {
		if _, err := js.PublishAsync(subject, payload); err != nil {
			return 0, err
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	select {
	case <-got:
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	return float64(n) / time.Since(start).Seconds(), nil
}
