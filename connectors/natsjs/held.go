package natsjs

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Lease is a key held: renewed every TTL/6 until Release, or until it is
// lost.
type Lease struct {
	l     *Leases
	key   string
	me    Holder
	value []byte

	mu   sync.Mutex
	rev  uint64
	err  error
	lost chan struct{}
	stop context.CancelFunc // ends the renewals, one under way too
	done chan struct{}
}

// Lost is closed once the lease is lost; Err says why.
func (le *Lease) Lost() <-chan struct{} { return le.lost }

// Err is why the lease was lost (nil while held).
func (le *Lease) Err() error {
	le.mu.Lock()
	defer le.mu.Unlock()
	return le.err
}

// Holder is who holds the lease: this process.
func (le *Lease) Holder() Holder { return le.me }

// renew keeps the lease until Release or its loss. A renewal the server
// cannot answer is tried again at the next tick, however long that takes:
// a holder that cannot reach the server cannot take messages from it
// either, and once it can again, its renewal finds the lease still its
// own, or lapsed and free (and takes it again), or taken by another
// process after the TTL, and only then is it lost. A server restarted
// after an outage longer than the TTL thus hands the lease to a process
// waiting for it, if there is one; the holder stops at its next renewal.
//
// A renewal that failed is tried again after a quarter of the waiters'
// poll, not a sixth of the TTL: a full store refuses every renewal, the
// lease lapses after its TTL, and once room is made the holder and a
// waiting process race to write it. At the renewals' pace the waiter won
// most stages (4 of 5 in a rehearsal), and each holder stopped.
func (le *Lease) renew(stop context.Context) {
	defer close(le.done)
	defer le.l.holding.Add(-1)
	every := le.l.ttl / 6
	wait := every
	for {
		select {
		case <-stop.Done():
			return
		case <-time.After(wait):
		}
		err := le.renewOnce(stop, every)
		if errors.Is(err, ErrLeaseLost) && stop.Err() == nil {
			le.lose(err)
			return
		}
		wait = every
		if err != nil {
			wait = min(every, le.l.poll/4)
		}
	}
}

// renewOnce writes the lease again at its revision. Written since by
// someone else, it is lost; lapsed or deleted meanwhile, or its bucket
// deleted and made anew, it is taken again if nobody else has; written by
// a renewal whose reply was lost, it is still held. Each request has
// within to answer, and stop ends them.
func (le *Lease) renewOnce(stop context.Context, within time.Duration) error {
	le.mu.Lock()
	rev := le.rev
	le.mu.Unlock()
	ctx, cancel := context.WithTimeout(stop, within)
	next, err := le.l.b.kv.Update(ctx, le.key, le.value, rev)
	cancel()
	if wrongLastSeq(err) || errors.Is(err, jetstream.ErrKeyNotFound) || le.l.b.lost(stop, bucketGoneAgain, err) {
		ctx, cancel := context.WithTimeout(stop, within)
		defer cancel()
		var other *Holder
		next, other, err = le.l.take(ctx, le.key, le.me, le.value)
		if err == nil && other != nil {
			return fmt.Errorf("%w: %s is held by %s", ErrLeaseLost, le.key, other)
		}
	}
	if err != nil {
		return err
	}
	le.mu.Lock()
	le.rev = next
	le.mu.Unlock()
	return nil
}

func (le *Lease) lose(err error) {
	le.mu.Lock()
	le.err = err
	le.mu.Unlock()
	close(le.lost)
}

// Release stops renewing and frees the lease, unless it was lost: the next
// process waiting for it takes it at once.
func (le *Lease) Release(ctx context.Context) error {
	le.Abandon()
	if le.Err() != nil {
		return nil
	}
	le.mu.Lock()
	rev := le.rev
	le.mu.Unlock()
	err := le.l.b.do(ctx, 0, func(ctx context.Context) error {
		return le.l.b.kv.Delete(ctx, le.key, jetstream.LastRevision(rev))
	})
	if err != nil && !wrongLastSeq(err) { // another holds it now: theirs to free
		return fmt.Errorf("natsjs: release lease %s: %w", le.key, err)
	}
	return nil
}

// Abandon stops renewing without freeing the lease, which lapses TTL
// after its last renewal: for a holder that cannot reach the server.
func (le *Lease) Abandon() {
	le.stop()
	<-le.done
}
