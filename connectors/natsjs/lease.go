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

	"github.com/nats-io/nats.go"
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
	// onEnded, if set, hears of a lease taken from a holder that no
	// longer runs (Holder.Ended), or went silent, and how it was told.
	onEnded func(key string, h Holder, how string)

	// nc answers requests on answers for this process's holders (""
	// when it cannot); a holder silent for silentAfter is gone (silent).
	nc          *nats.Conn
	answers     string
	silentAfter time.Duration
}

// Holder says who holds a lease. ID tells apart two leases taken on one
// host, or by one process (a restart in place). PIDSpace is where PID is
// a process's (the kernel's boot and pid namespace; empty off Linux):
// a process there can tell whether the holder still runs.
type Holder struct {
	Host     string    `json:"host"`
	PID      int       `json:"pid"`
	PIDSpace string    `json:"pid_space,omitempty"`
	Since    time.Time `json:"since"`
	ID       string    `json:"id"`
	// Answers is a subject the holder's process answers requests on while
	// it runs (empty: it does not), for a process of another machine to
	// tell whether it still runs.
	Answers string `json:"answers,omitempty"`

	// lapsedFull is when a take of the lease, lapsed while the store was
	// full, was refused for it (zero: the holder wrote it).
	lapsedFull time.Time
}

// MachineEnv, set, splits a machine's pid space: processes whose values
// differ take each other for processes of other machines, whose pids they
// cannot judge (it never makes two machines one). The rehearsal
// (deploy/chaos) runs each stage's two processes as on machines of
// their own with it.
const MachineEnv = "WMRL_MACHINE"

// NewHolder names this process as a lease's holder.
func NewHolder() Holder {
	host, _ := os.Hostname()
	var id [8]byte
	_, _ = rand.Read(id[:])
	return Holder{Host: host, PID: os.Getpid(), PIDSpace: pidSpace(), Since: time.Now().UTC(), ID: hex.EncodeToString(id[:])}
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
		s += fmt.Sprintf(", whose lease lapsed while the NATS store was full (a write refused at %s) and which writes it again once there is room, within the TTL",
			h.lapsedFull.Format(time.RFC3339))
	}
	return s
}

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
	l := &Leases{b: b, ttl: ttl, poll: min(ttl/4, time.Second), nc: js.Conn(), silentAfter: SilentAfter(ttl)}
	l.answers = answer(ctx, l.nc)
	b.marked = l.writeMark
	return l, nil
}

// OnEnded has f hear of each lease this process takes from a holder
// that no longer runs on its own machine, or has gone silent (answers.go),
// without waiting for the lease to lapse, and how that was told. Call it
// before the leases are used.
func (l *Leases) OnEnded(f func(key string, h Holder, how string)) { l.onEnded = f }

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
// by another is still that holder's (lapsedHolder). A lease held by a
// process that no longer runs on this machine, or went silent
// (answers.go), is taken at once.
func (l *Leases) TryAcquire(ctx context.Context, key string, me Holder) (*Lease, *Holder, error) {
	if me.Answers == "" {
		me.Answers = l.answers
	}
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
		mark = l.lapsedHolder(ctx, key)
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
// one that lapsed while the store was full (lapsedHolder). A holder of
// this machine that no longer runs holds nothing, nor does one whose
// renewals are overdue and who went silent.
func (l *Leases) Wait(ctx context.Context, key string) error {
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(l.poll):
		}
		h, e, err := l.entry(ctx, key, l.ttl)
		if err != nil {
			return err
		}
		if h != nil {
			if h.Ended() {
				return nil // TryAcquire drops it
			}
			l.saw(key, *h, e.Revision())
			if l.overdue(key) {
				l.probeRoom(ctx, key)
				if l.silent(key) {
					return nil // TryAcquire drops it
				}
			}
			continue
		}
		if h, err = l.markOf(ctx, l.ttl); err != nil {
			return err
		}
		if h == nil && l.backHolder() == nil && l.lapsedHolder(ctx, key) == nil {
			return nil
		}
	}
}

// takeTries bounds how often take asks again when the create is refused
// as the key exists and the read finds it free: on a cluster the read may
// be a follower's (a key-value bucket allows direct gets), a moment behind
// the stream's leader, and each replica ages a lapsed lease out by its own
// clock. take pauses l.poll/5 before each retry.
const takeTries = 10

// take creates key for me. It returns the revision me holds it at, or who
// else holds it, or, for a lease nobody holds, the full store's refusal.
// A create whose reply was lost finds me as the holder.
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
		// A cluster refuses a write to a full store before it looks at the
		// key, so a create may be refused for that while the lease is held.
		full := StoreFull(err)
		if !full && !errors.Is(err, jetstream.ErrKeyExists) && !wrongLastSeq(err) {
			return 0, nil, fmt.Errorf("natsjs: lease %s: %w", key, err)
		}
		h, e, rerr := l.entry(ctx, key, bucketGoneAgain)
		switch {
		case rerr != nil:
			return 0, nil, rerr
		case h == nil && full:
			l.refusedFull(key)
			return 0, nil, fmt.Errorf("natsjs: lease %s: %w", key, err)
		case h == nil: // lapsed or released since: ask again
			continue
		case h.ID == me.ID:
			l.taken(key)
			return e.Revision(), nil, nil
		case h.Ended():
			if err := l.drop(ctx, key, *h, e.Revision(), "no longer runs on this machine"); err != nil {
				return 0, nil, err
			}
			continue
		case l.judgedSilent(key, *h, e.Revision()):
			how := fmt.Sprintf("has neither answered nor renewed its lease for %v", l.silentAfter)
			if err := l.drop(ctx, key, *h, e.Revision(), how); err != nil {
				return 0, nil, err
			}
			continue
		}
		l.saw(key, *h, e.Revision())
		return 0, h, nil
	}
	return 0, nil, fmt.Errorf("natsjs: lease %s: the server refused to create it as it exists, and read it back as free, %d times in a row", key, takeTries)
}

// drop deletes key, held by h, which no longer runs (how tells how that
// was found), at the revision read: if anyone wrote it since, the delete
// is refused and the lease read again.
func (l *Leases) drop(ctx context.Context, key string, h Holder, rev uint64, how string) error {
	err := l.b.do(ctx, bucketGoneAgain, func(ctx context.Context) error {
		return l.b.kv.Delete(ctx, key, jetstream.LastRevision(rev))
	})
	switch {
	case err == nil:
		if l.onEnded != nil {
			l.onEnded(key, h, how)
		}
		return nil
	case errors.Is(err, jetstream.ErrKeyNotFound) || wrongLastSeq(err):
		return nil
	}
	return fmt.Errorf("natsjs: lease %s, held by %s, which %s: %w", key, h, how, err)
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
