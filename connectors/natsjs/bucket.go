package natsjs

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// bucketGoneAgain is how long a bucket must read as gone, from its first
// such reading, before a process makes it anew: a cluster that has just
// started, or is electing a leader, may not know a stream for a moment
// (a variable for tests).
var bucketGoneAgain = 2 * time.Second

// kvBucket is a key-value bucket a process keeps for as long as it runs.
// Deleted from under it (by hand, or by a tool that cleans up streams),
// every request to it went unanswered for ever: a stage's checkpoint was
// waited for without a word, and a lease was neither renewed nor lost, so
// that the one-per-run guard was gone. Found gone, it is made anew with
// its config, and cfg.Remade hears it.
type kvBucket struct {
	js  jetstream.JetStream // nil: never made anew (a reader's)
	cfg StoreConfig
	kv  jetstream.KeyValue

	mu        sync.Mutex
	goneSince time.Time // the first reading of the bucket as gone; zero while it is there
}

// openBucket opens cfg's bucket, creating it if it does not exist.
func openBucket(ctx context.Context, js jetstream.JetStream, cfg StoreConfig) (*kvBucket, error) {
	kv, err := openKV(ctx, js, cfg)
	if err != nil {
		return nil, err
	}
	return &kvBucket{js: js, cfg: cfg, kv: kv}, nil
}

// do runs op until it is answered (UntilAnswered), making the bucket anew
// once it has been gone for after (0: never; a request on the way out
// need not bring back a bucket deleted on purpose).
func (b *kvBucket) do(ctx context.Context, after time.Duration, op func(context.Context) error) error {
	return UntilAnswered(ctx, func(actx context.Context) error {
		err := op(actx)
		b.lost(ctx, after, err)
		return err
	}, nil)
}

// lost makes the bucket anew if err is a request nobody answered and the
// bucket has read as gone for after, since its first reading as gone. It
// says whether it made it. A write to a bucket that is gone is asked
// again by the client until its context ends, so a deadline is a request
// nobody answered too; ctx is the caller's, not the spent request's.
func (b *kvBucket) lost(ctx context.Context, after time.Duration, err error) bool {
	if b.js == nil || after <= 0 || ctx.Err() != nil || !b.js.Conn().IsConnected() || // an outage, not a bucket gone
		!errors.Is(err, jetstream.ErrNoStreamResponse) && !errors.Is(err, nats.ErrNoResponders) && !errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, requestAttempt)
	defer cancel()
	_, err = b.js.KeyValue(ctx, b.cfg.Bucket)
	switch {
	case err == nil: // there (made anew by another of its users, or the server was away)
		b.goneSince = time.Time{}
		return false
	case !errors.Is(err, jetstream.ErrBucketNotFound):
		return false
	case b.goneSince.IsZero():
		b.goneSince = time.Now()
		return false
	case time.Since(b.goneSince) < after:
		return false
	}
	if _, err := openKV(ctx, b.js, b.cfg); err != nil {
		return false // asked again with the next request
	}
	b.goneSince = time.Time{}
	if b.cfg.Remade != nil {
		b.cfg.Remade(b.cfg.Bucket)
	}
	return true
}
