package natsjs

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// ExpirePending has the server give again at once the messages the chosen
// consumers of stream delivered and that were never settled: those a
// process that died without handing them back (SIGKILL, the OOM killer, a
// lost node) held, which the server gives again only after each consumer's
// AckWait (30 s, or the hour a long handler may set). It shortens each
// such consumer's AckWait for settle, which has the server count those
// messages expired, then restores it; it returns how many messages were
// pending on them.
//
// It is for a start on a server that nobody consumes from yet, as the
// embedded one is right after it starts on its store: a message a live
// consumer is still handling would be given to another as well, as after
// a handler that outlives AckWait.
func ExpirePending(ctx context.Context, js jetstream.JetStream, stream string, chosen func(consumer string) bool, settle time.Duration) (int, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return 0, fmt.Errorf("natsjs: expire pending on %s: %w", stream, err)
	}
	var held []jetstream.ConsumerConfig
	pending := 0
	list := s.ListConsumers(ctx)
	for info := range list.Info() {
		if info.NumAckPending > 0 && chosen(info.Name) {
			held = append(held, info.Config)
			pending += info.NumAckPending
		}
	}
	if err := list.Err(); err != nil {
		return 0, fmt.Errorf("natsjs: expire pending on %s: %w", stream, err)
	}
	if len(held) == 0 {
		return 0, nil
	}
	for _, cfg := range held {
		short := cfg
		short.AckWait = time.Millisecond
		if _, err := s.UpdateConsumer(ctx, short); err != nil {
			return 0, fmt.Errorf("natsjs: expire pending on consumer %s: %w", cfg.Durable, err)
		}
	}
	// The server looks at a consumer's pending messages 100 ms after its
	// AckWait changes.
	select {
	case <-time.After(settle):
	case <-ctx.Done():
	}
	for _, cfg := range held {
		// Restored even when ctx ended: a consumer left at 1 ms would
		// give every message again and again.
		if _, err := s.UpdateConsumer(context.WithoutCancel(ctx), cfg); err != nil {
			return 0, fmt.Errorf("natsjs: restore the ack wait of consumer %s: %w", cfg.Durable, err)
		}
	}
	return pending, ctx.Err()
}
