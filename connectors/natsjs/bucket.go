package natsjs

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// bucketGoneAgain is how long a bucket must read as gone, from its first
// such reading, before a process makes it anew: a cluster that has just
// started, or is electing a leader, may not know a stream for a moment.
const bucketGoneAgain = 2 * time.Second

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

	// marked, if set, is called once the bucket is made anew, before
	// cfg.Remade: what its user writes to it at once. whileFull says that
	// a remake of this process was refused for a full store meanwhile.
	marked func(ctx context.Context, whileFull bool)

	mu        sync.Mutex   // one check or remake at a time
	goneSince atomic.Int64 // Unix ns of the first reading as gone since it was last there; 0 while it is
	// backAt is when the bucket answered again after it had read as gone
	// (Unix ns; 0: never), made anew by another of its users.
	backAt atomic.Int64
	// remakeSent: this process asked to make the bucket anew and had no
	// answer, or a refusal; the server may make it all the same.
	remakeSent atomic.Bool
	// remakeFull: such a refusal was for a full store, which refuses the
	// bucket's other users too.
	remakeFull atomic.Bool
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
	if answered(err) {
		b.there(ctx)
		return false
	}
	if b.js == nil || after <= 0 || ctx.Err() != nil || !b.js.Conn().IsConnected() || // an outage, not a bucket gone
		!errors.Is(err, jetstream.ErrNoStreamResponse) && !errors.Is(err, nats.ErrNoResponders) && !errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, requestAttempt)
	defer cancel()
	_, err = b.js.KeyValue(ctx, b.cfg.Bucket)
	switch since := b.goneSince.Load(); {
	case err == nil: // there (made anew by another of its users, or the server was away)
		b.there(ctx)
		return false
	case !errors.Is(err, jetstream.ErrBucketNotFound):
		return false
	case since == 0:
		b.goneSince.Store(time.Now().UnixNano())
		return false
	case time.Since(time.Unix(0, since)) < after:
		return false
	}
	if _, err := openKV(ctx, b.js, b.cfg); err != nil {
		// Asked again with the next request. A cluster may make it all
		// the same, its answer lost (seed 34 of the rehearsal: nobody
		// said the bucket was made anew): found there, it is this
		// process's.
		b.remakeSent.Store(true)
		if StoreFull(err) {
			b.remakeFull.Store(true)
		}
		return false
	}
	b.goneSince.Store(0)
	b.remakeSent.Store(false)
	b.remade(ctx)
	return true
}

// remade tells the bucket's user, and cfg.Remade, that this process made
// the bucket anew.
func (b *kvBucket) remade(ctx context.Context) {
	if b.marked != nil {
		ctx, cancel := context.WithTimeout(ctx, requestAttempt)
		defer cancel()
		b.marked(ctx, b.remakeFull.Swap(false))
	}
	if b.cfg.Remade != nil {
		b.cfg.Remade(b.cfg.Bucket)
	}
}

// there notes the bucket answering. An earlier absence, made good since,
// is not a later one's start (a stale start made a later deletion's first
// reading seem long, and the bucket was made anew at once); and a bucket
// that had read as gone is back: made anew here, if this process asked
// for it, else by another of its users.
func (b *kvBucket) there(ctx context.Context) {
	if b.goneSince.Swap(0) == 0 {
		return
	}
	if b.remakeSent.Swap(false) {
		b.remade(ctx)
		return
	}
	b.remakeFull.Store(false)
	b.backAt.Store(time.Now().UnixNano())
}

// back is when the bucket last answered again after reading as gone, if
// it did within d; zero otherwise.
func (b *kvBucket) back(d time.Duration) time.Time {
	at := b.backAt.Load()
	if at == 0 || time.Since(time.Unix(0, at)) >= d {
		return time.Time{}
	}
	return time.Unix(0, at)
}

// answered: the bucket's stream answered the request (a bucket that is
// gone answers none): it stored or read it, or refused it for what it
// holds or for lack of room.
func answered(err error) bool {
	return err == nil || errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted) ||
		errors.Is(err, jetstream.ErrKeyExists) || wrongLastSeq(err) || StoreFull(err)
}
