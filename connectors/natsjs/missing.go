package natsjs

// A lease missing from its bucket may still be held: the bucket was
// deleted and made anew, or the lease lapsed while the store was full,
// and its holder writes it again within the TTL. What a process knows of
// such a holder is here; until the TTL is out, it leaves the lease to it.

import (
	"context"
	"encoding/json"
	"time"
)

// seenHolder is a lease's holder as a process waiting for it last saw it.
type seenHolder struct {
	h Holder
	// rev is the lease's revision as last read, first read at revAt (this
	// process's clock): a holder renews it every TTL/6.
	rev   uint64
	revAt time.Time
	// fullAt is when a write of this process (a take of the lease, the
	// lease having lapsed, or a probe of roomKey) was last refused for a
	// full store (zero: none was).
	fullAt time.Time
	// roomAt is when a probe first found room again since fullAt (zero:
	// not yet).
	roomAt time.Time
	// silentSince is when a request to the holder (silent) was first
	// answered "no responders" at this revision, and pings how many have
	// been since, that one included; reconnects is this process's count
	// of reconnections then (another restarts the count: the silence may
	// have been this process's).
	silentSince time.Time
	pings       int
	reconnects  uint64
}

// roomKey is what a process waiting for a lease writes (probeRoom) at
// each look while the holder's renewals are overdue, or while it leaves a
// lapsed lease to its holder, to learn whether the store is full, and
// when it has room again: from then on the holder has the TTL to write
// its lease. A waiter that left it for the TTL after its refused take
// took the stage if room came back just as that ran out, before the
// holder's renewal (a rehearsal on a cluster, seed 41).
const roomKey = "_room"

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

// writeMark writes remadeKey into the bucket just made anew, if this
// process holds leases: a process that waited for one makes the bucket
// anew only once it has been gone for the TTL, when no holder is left;
// unless its remake was refused for a full store meanwhile (whileFull),
// as the holders' were. The waiter made it first once there was room,
// and took a stage from its living holder (a rehearsal on a cluster,
// seed 41: the lease bucket deleted, and the store full 7 s later).
func (l *Leases) writeMark(ctx context.Context, whileFull bool) {
	if l.holding.Load() == 0 && !whileFull {
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

// saw notes h holding key at revision rev, as a process waiting for it
// read it. A revision read before keeps what was learnt of the store
// since; a new one (the holder renewed it) starts afresh.
func (l *Leases) saw(key string, h Holder, rev uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.seen == nil {
		l.seen = map[string]seenHolder{}
	}
	if cur, ok := l.seen[key]; ok && cur.h.ID == h.ID && cur.rev == rev {
		return
	}
	l.seen[key] = seenHolder{h: h, rev: rev, revAt: time.Now()}
}

// overdue says whether key's holder, as last seen, has not renewed it for
// longer than it renews (TTL/6) and a poll: it died, or cannot write.
func (l *Leases) overdue(key string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	s, ok := l.seen[key]
	return ok && time.Since(s.revAt) > l.ttl/6+l.poll
}

// probeRoom writes roomKey, for key's holder as last seen, to learn
// whether the store has room: refused for a full store, that holder
// cannot renew its lease either (fullAt); taken after such a refusal,
// room is back (roomAt). Its holder's renewals overdue, a process waiting
// for a lease asks at each look, so that a lease lapsing on a full store
// is known as such; a waiter that first tried to take it once it had
// lapsed found room back by then (the full store ended just as the lease
// lapsed) and took it from its holder (a rehearsal on a cluster, seed 41).
func (l *Leases) probeRoom(ctx context.Context, key string) {
	ctx, cancel := context.WithTimeout(ctx, requestAttempt)
	_, err := l.b.kv.Put(ctx, roomKey, nil)
	cancel()
	l.mu.Lock()
	defer l.mu.Unlock()
	cur, ok := l.seen[key]
	switch {
	case !ok:
	case StoreFull(err):
		cur.fullAt, cur.roomAt = time.Now(), time.Time{}
	case err == nil && !cur.fullAt.IsZero() && cur.roomAt.IsZero():
		cur.roomAt = time.Now()
	}
	if ok {
		l.seen[key] = cur
	}
}

// refusedFull notes a take of key refused for a full store: if this
// process saw another hold it, its holder could not renew it either, and
// the lease lapsed under it.
func (l *Leases) refusedFull(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if s, ok := l.seen[key]; ok {
		s.fullAt, s.roomAt = time.Now(), time.Time{}
		l.seen[key] = s
	}
}

// lapsedHolder is who still holds key, missing from the bucket, once
// this process found the store full (a take of the lapsed lease refused,
// or probeRoom): the holder it saw before, which could not renew the
// lease while the store was full and writes it again once there is room
// (its refused renewals are tried again every quarter of the poll). It
// holds it while the store stays full, as probeRoom finds at each look,
// and for the TTL after room is found (or after the last refusal, if no
// write is answered either way). Without it, a process waiting for a
// stage took it as room came back, if it asked first, and the stage's
// holder stopped ("lease lost"). A process that never saw the lease held
// (one started after it lapsed) takes it at once, as does one that sees
// the holder no longer runs on its machine, or has gone silent.
func (l *Leases) lapsedHolder(ctx context.Context, key string) *Holder {
	l.mu.Lock()
	s, ok := l.seen[key]
	l.mu.Unlock()
	if !ok || s.fullAt.IsZero() || s.h.Ended() || l.silent(key) {
		return nil
	}
	if s.roomAt.IsZero() {
		l.probeRoom(ctx, key)
		l.mu.Lock()
		s = l.seen[key]
		l.mu.Unlock()
	}
	since := s.fullAt
	if !s.roomAt.IsZero() {
		since = s.roomAt
	}
	if time.Since(since) >= l.ttl {
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

// taken forgets what this process saw of key's holders: it holds it.
func (l *Leases) taken(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.seen, key)
}
