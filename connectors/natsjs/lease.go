package natsjs

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Leases hands out leases: keys of a key-value bucket that one process at a
// time holds, for as long as it renews them. The bucket ages every value
// out TTL after it was written, so a lease whose holder died (or lost the
// server) lapses TTL after its last renewal, and another process may take
// it; one released on a clean stop is free at once.
type Leases struct {
	b       *kvBucket
	holding atomic.Int32 // leases this process holds
	ttl     time.Duration
	// poll is how often a process waiting for a lease asks again.
	poll time.Duration

	mu sync.Mutex
	// seen is, for each lease this process saw another hold, that holder,
	// and when a take of it was last refused for a full store since.
	seen map[string]seenHolder
}

// seenHolder is a lease's holder as a process waiting for it last saw it.
type seenHolder struct {
	h Holder
	// fullAt is when this process's last take of the lease was refused
	// for a full store, the lease having lapsed (zero: none was).
	fullAt time.Time
}

// Holder says who holds a lease. ID tells apart two leases taken on one
// host, or by one process (a restart in place).
type Holder struct {
	Host  string    `json:"host"`
	PID   int       `json:"pid"`
	Since time.Time `json:"since"`
	ID    string    `json:"id"`

	// lapsedFull is when a take of the lease, lapsed while the store was
	// full, was refused for it (zero: the holder wrote it).
	lapsedFull time.Time
}

// NewHolder names this process as a lease's holder.
func NewHolder() Holder {
	host, _ := os.Hostname()
	var id [8]byte
	_, _ = rand.Read(id[:])
	return Holder{Host: host, PID: os.Getpid(), Since: time.Now().UTC(), ID: hex.EncodeToString(id[:])}
}

func (h Holder) String() string {
	switch h.ID {
	case remadeID:
		return fmt.Sprintf("a process not known yet: the lease bucket was deleted and made anew at %s by host %s, pid %d, and a process that held the lease writes it again within the TTL",
			h.Since.Format(time.RFC3339), h.Host, h.PID)
	case backID:
		return fmt.Sprintf("a process not known yet: the lease bucket was gone, and back at %s (deleted and made anew), and a process that held the lease writes it again within the TTL",
			h.Since.Format(time.RFC3339))
	}
	s := fmt.Sprintf("host %s, pid %d, since %s", h.Host, h.PID, h.Since.Format(time.RFC3339))
	if !h.lapsedFull.IsZero() {
		s += fmt.Sprintf(", whose lease lapsed while the NATS store was full (a write of it refused at %s) and which writes it again once there is room, within the TTL",
			h.lapsedFull.Format(time.RFC3339))
	}
	return s
}

// remadeKey marks a lease bucket that a holder made anew after it was
// deleted. Until the mark ages out, TTL after, a lease missing from the
// bucket may still be held: each holder writes its own again at its next
// renewal, and until then another process must not take it. Without the
// mark, a standby of one stage took its lease as soon as the holder of
// another stage had made the bucket anew, and the stage's holder stopped
// at its next renewal, its lease lost (a rehearsal, seed 30).
const remadeKey = "_remade"

// remadeID is the ID of the mark's Holder: who made the bucket anew.
const remadeID = "remade"

// backID is the ID of the Holder of a lease missing from a bucket that
// this process read as gone and then back, within the TTL: as under the
// mark, whoever held it writes it again. The mark is written once the
// bucket is made anew, so a process that read in between found neither
// lease nor mark, and took the lease from a living holder (a rehearsal on
// a cluster, seed 34, where the bucket took seconds to make, with a node
// just restarted); a process that waited through the deletion knows.
const backID = "back"

// ErrLeaseLost: the lease passed to another holder.
var ErrLeaseLost = errors.New("natsjs: lease lost")

// OpenLeases opens bucket (creating it) with leases that lapse ttl after
// their last renewal, on replicas servers of a cluster. remade, if set,
// hears that the bucket was deleted while the process ran and was made
// anew: by a holder, which writes its leases again at once, or by a
// process waiting for a lease, after ttl (no holder made it anew, so none
// is left).
func OpenLeases(ctx context.Context, js jetstream.JetStream, bucket string, replicas int, ttl time.Duration, remade func(bucket string)) (*Leases, error) {
	if ttl < time.Second {
		return nil, fmt.Errorf("natsjs: lease TTL %v: at least 1s (the server ages values out by the second)", ttl)
	}
	b, err := openBucket(ctx, js, StoreConfig{Bucket: bucket, Description: "wmrl leases: which process runs a stage that must run once",
		Replicas: replicas, TTL: ttl, Remade: remade})
	if err != nil {
		return nil, err
	}
	l := &Leases{b: b, ttl: ttl, poll: min(ttl/4, time.Second)}
	b.marked = l.writeMark
	return l, nil
}

// writeMark writes remadeKey into the bucket just made anew, if this
// process holds leases: a process that waited for one makes the bucket
// anew only once it has been gone for the TTL, when no holder is left.
func (l *Leases) writeMark(ctx context.Context) {
	if l.holding.Load() == 0 {
		return
	}
	l.MarkRemade(ctx)
}

// MarkRemade marks the bucket as made anew, as its holder does, for a
// process that made it as it started, while other processes of the run
// were running: their leases are missing from it until they write them
// again. This process's own waiters leave missing leases to their holders
// whether or not the mark is written.
func (l *Leases) MarkRemade(ctx context.Context) {
	l.b.backAt.Store(time.Now().UnixNano())
	h := NewHolder()
	h.ID = remadeID
	value, _ := json.Marshal(h)
	_, _ = l.b.kv.Put(ctx, remadeKey, value) // unwritten, the leases are as free to others as before the mark
}

// TTL is how long a lease outlives its last renewal.
func (l *Leases) TTL() time.Duration { return l.ttl }

// Acquire takes key for me, waiting while another holds it: busy, if set,
// hears who does, once for each holder met. It returns the lease once me
// holds it, or ctx's error.
func (l *Leases) Acquire(ctx context.Context, key string, me Holder, busy func(Holder)) (*Lease, error) {
	var told string
	for {
		le, other, err := l.TryAcquire(ctx, key, me)
		if err != nil || le != nil {
			return le, err
		}
		if busy != nil && other.ID != told {
			busy(*other)
			told = other.ID
		}
		if err := l.Wait(ctx, key); err != nil {
			return nil, err
		}
	}
}

// TryAcquire takes key for me if nobody holds it, and says who does
// otherwise: while the bucket's mark of being made anew lasts, or for the
// TTL after this process read it back from being gone, a lease missing
// from it is held by a process not known yet; and for the TTL after a
// take of it was refused for a full store, a lease this process saw held
// by another is still that holder's (lapsedHolder).
func (l *Leases) TryAcquire(ctx context.Context, key string, me Holder) (*Lease, *Holder, error) {
	value, err := json.Marshal(me)
	if err != nil {
		return nil, nil, err
	}
	mark, err := l.markOf(ctx, bucketGoneAgain)
	if err != nil {
		return nil, nil, err
	}
	if mark == nil {
		mark = l.backHolder()
	}
	if mark == nil {
		mark = l.lapsedHolder(key)
	}
	if mark != nil {
		h, _, err := l.entry(ctx, key, bucketGoneAgain)
		if err != nil || h == nil {
			return nil, mark, err
		}
	}
	rev, other, err := l.take(ctx, key, me, value)
	if err != nil || other != nil {
		return nil, other, err
	}
	l.holding.Add(1)
	le := &Lease{l: l, key: key, me: me, value: value, rev: rev, lost: make(chan struct{}), done: make(chan struct{})}
	var stop context.Context
	stop, le.stop = context.WithCancel(context.Background())
	go le.renew(stop)
	return le, nil, nil
}

// Wait returns once nobody holds key (released, or lapsed), asking every
// poll interval, or with ctx's error. A bucket deleted meanwhile is left
// for a holder to make anew (and write its lease again), and made anew
// here only once it has been gone for the TTL: then no holder is left.
// Back, a lease missing from it is left to its holder for the TTL, as is
// one that lapsed while the store was full (lapsedHolder).
func (l *Leases) Wait(ctx context.Context, key string) error {
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(l.poll):
		}
		h, _, err := l.entry(ctx, key, l.ttl)
		if err != nil {
			return err
		}
		if h != nil {
			l.saw(key, *h)
			continue
		}
		if h, err = l.markOf(ctx, l.ttl); err != nil {
			return err
		}
		if h == nil && l.backHolder() == nil && l.lapsedHolder(key) == nil {
			return nil
		}
	}
}

// saw notes h holding key, as a process waiting for it read it.
func (l *Leases) saw(key string, h Holder) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.seen == nil {
		l.seen = map[string]seenHolder{}
	}
	l.seen[key] = seenHolder{h: h}
}

// refusedFull notes a take of key refused for a full store: if this
// process saw another hold it, its holder could not renew it either, and
// the lease lapsed under it.
func (l *Leases) refusedFull(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if s, ok := l.seen[key]; ok {
		s.fullAt = time.Now()
		l.seen[key] = s
	}
}

// lapsedHolder is who still holds key, missing from the bucket, for the
// TTL after this process's take of it was refused for a full store: the
// holder it saw before, which could not renew the lease while the store
// was full and writes it again once there is room (its refused renewals
// are tried again every quarter of the poll). Without it, a process
// waiting for a stage took it as room came back, if it asked first, and
// the stage's holder stopped ("lease lost"). A process that never saw
// the lease held (one started on the full store) takes it at once.
func (l *Leases) lapsedHolder(key string) *Holder {
	l.mu.Lock()
	defer l.mu.Unlock()
	s, ok := l.seen[key]
	if !ok || s.fullAt.IsZero() || time.Since(s.fullAt) >= l.ttl {
		return nil
	}
	h := s.h
	h.lapsedFull = s.fullAt.UTC()
	return &h
}

// backHolder is who holds a lease missing from the bucket while it is
// back within the TTL (nil: it is not).
func (l *Leases) backHolder() *Holder {
	at := l.b.back(l.ttl)
	if at.IsZero() {
		return nil
	}
	return &Holder{Host: "?", Since: at.UTC(), ID: backID}
}

// markOf is the bucket's mark of being made anew while it lasts, its
// Holder naming who made it (nil: no mark). remakeAfter is entry's.
func (l *Leases) markOf(ctx context.Context, remakeAfter time.Duration) (*Holder, error) {
	h, _, err := l.entry(ctx, remadeKey, remakeAfter)
	return h, err
}

// takeTries bounds how often take asks again when the create is refused
// as the key exists and the read finds it free: on a cluster the read may
// be a follower's (a key-value bucket allows direct gets), a moment behind
// the stream's leader, and each replica ages a lapsed lease out by its own
// clock. take pauses l.poll/5 before each retry.
const takeTries = 10

// take creates key for me. It returns the revision me holds it at, or who
// else holds it. A create whose reply was lost finds me as the holder.
func (l *Leases) take(ctx context.Context, key string, me Holder, value []byte) (uint64, *Holder, error) {
	for try := range takeTries {
		if try > 0 {
			select {
			case <-ctx.Done():
				return 0, nil, ctx.Err()
			case <-time.After(l.poll / 5):
			}
		}
		var rev uint64
		err := l.b.do(ctx, bucketGoneAgain, func(ctx context.Context) (err error) {
			rev, err = l.b.kv.Create(ctx, key, value)
			return err
		})
		if err == nil {
			l.taken(key)
			return rev, nil, nil
		}
		if StoreFull(err) {
			l.refusedFull(key)
		}
		if !errors.Is(err, jetstream.ErrKeyExists) && !wrongLastSeq(err) {
			return 0, nil, fmt.Errorf("natsjs: lease %s: %w", key, err)
		}
		h, e, err := l.entry(ctx, key, bucketGoneAgain)
		switch {
		case err != nil:
			return 0, nil, err
		case h == nil: // lapsed or released since: ask again
			continue
		case h.ID == me.ID:
			l.taken(key)
			return e.Revision(), nil, nil
		}
		l.saw(key, *h)
		return 0, h, nil
	}
	return 0, nil, fmt.Errorf("natsjs: lease %s: the server refused to create it as it exists, and read it back as free, %d times in a row", key, takeTries)
}

// taken forgets what this process saw of key's holders: it holds it.
func (l *Leases) taken(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.seen, key)
}

// wrongLastSeq: a write at a revision the key is no longer at (10071, or
// 10164 from a replicated bucket).
func wrongLastSeq(err error) bool {
	apiErr, ok := errors.AsType[*jetstream.APIError](err)
	return ok && (apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence || apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant)
}

// ReadLeases opens bucket to read who holds its leases, without making
// it: nil, and no error, when there is none.
func ReadLeases(ctx context.Context, js jetstream.JetStream, bucket string) (*Leases, error) {
	kv, err := js.KeyValue(ctx, bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("natsjs: bucket %s: %w", bucket, err)
	}
	return &Leases{b: &kvBucket{kv: kv}}, nil // to read: no TTL or poll needed, never made anew
}

// Held says who holds key (nil: nobody) and when they last renewed it.
func (l *Leases) Held(ctx context.Context, key string) (*Holder, time.Time, error) {
	h, e, err := l.entry(ctx, key, 0)
	if h == nil {
		return nil, time.Time{}, err
	}
	return h, e.Created(), nil
}

// entry reads who holds key (nil: nobody) and the value's entry, making
// the bucket anew once it has been gone for remakeAfter (0: never).
func (l *Leases) entry(ctx context.Context, key string, remakeAfter time.Duration) (*Holder, jetstream.KeyValueEntry, error) {
	var e jetstream.KeyValueEntry
	err := l.b.do(ctx, remakeAfter, func(ctx context.Context) (err error) {
		e, err = l.b.kv.Get(ctx, key)
		return err
	})
	if errors.Is(err, jetstream.ErrKeyNotFound) || errors.Is(err, jetstream.ErrKeyDeleted) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("natsjs: lease %s: %w", key, err)
	}
	var h Holder
	if err := json.Unmarshal(e.Value(), &h); err != nil {
		h = Holder{Host: "?", ID: "unreadable " + string(e.Value())}
	}
	return &h, e, nil
}

// Free drops key's lease whoever holds it: for a holder known to be gone
// (the embedded server's store, reopened, was that of the process before).
func (l *Leases) Free(ctx context.Context, key string) error {
	err := l.b.do(ctx, bucketGoneAgain, func(ctx context.Context) error { return l.b.kv.Delete(ctx, key) })
	if err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) {
		return fmt.Errorf("natsjs: free lease %s: %w", key, err)
	}
	return nil
}

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
