package natsjs

// A holder on another machine cannot be looked up by its pid (Ended), so
// a process waiting for its lease asks it instead: each process that
// opens leases answers requests on a subject of its connection's inbox
// (Holder.Answers) for as long as it runs and is connected. A request
// there that the server answers "no responders" says that no process
// subscribes to it. A holder that, for silentAfter, neither answered nor
// renewed its lease, while this process stayed connected and asked at
// least silentPings times, is taken for gone: killed, or cut off from
// the server for longer than a reconnect takes. Its lease is dropped
// and taken at once, instead of TTL after its last renewal, and what it
// held is given again. If it was only cut off, its next renewal finds
// the lease taken and it stops the stage (ErrLeaseLost), as it would
// have after the TTL.

import (
	"context"
	"errors"
	"time"

	"github.com/nats-io/nats.go"
)

// silentPings is how many unanswered requests, at least, make a holder
// silent, besides silentAfter of them.
const silentPings = 3

// answer subscribes to a subject of nc's inbox that answers every
// request, and checks that a request to it is answered (a subject the
// account may not subscribe to is refused asynchronously, and would
// read as a holder gone): the subject, or "" when it is not answered.
func answer(ctx context.Context, nc *nats.Conn) string {
	subject := nc.NewInbox()
	sub, err := nc.Subscribe(subject, func(m *nats.Msg) { _ = m.Respond(nil) })
	if err != nil {
		return ""
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := nc.RequestWithContext(ctx, subject, nil); err != nil {
		_ = sub.Unsubscribe()
		return ""
	}
	return subject
}

// SilentAfter is how long a holder of leases with ttl must neither answer
// nor renew its lease to be taken for gone: two of its renewals.
func SilentAfter(ttl time.Duration) time.Duration { return ttl / 3 }

// Unanswered reports whether h's process answers no request now: the
// server has no subscriber for its Answers subject, as for a process
// killed, or cut off from the server for the moment. False when it
// answers, names no subject, or the request fails otherwise.
func Unanswered(nc *nats.Conn, h Holder) bool {
	if h.Answers == "" || !nc.IsConnected() {
		return false
	}
	_, err := nc.Request(h.Answers, nil, time.Second)
	return errors.Is(err, nats.ErrNoResponders)
}

// silent asks key's holder, as last seen (saw), whether it runs, and says
// whether it has been silent long enough to be taken for gone.
func (l *Leases) silent(key string) bool {
	l.mu.Lock()
	s, ok := l.seen[key]
	l.mu.Unlock()
	if !ok || s.h.Answers == "" || l.nc == nil {
		return false
	}
	unanswered := Unanswered(l.nc, s.h)
	reconnects := l.nc.Stats().Reconnects
	l.mu.Lock()
	defer l.mu.Unlock()
	cur, ok := l.seen[key]
	if !ok || cur.h.ID != s.h.ID || cur.rev != s.rev {
		return false // renewed or taken meanwhile
	}
	switch {
	case !unanswered:
		cur.silentSince, cur.pings = time.Time{}, 0 // answered, or no answer either way
	case cur.silentSince.IsZero() || cur.reconnects != reconnects:
		cur.silentSince, cur.pings, cur.reconnects = time.Now(), 1, reconnects
	default:
		cur.pings++
	}
	l.seen[key] = cur
	return cur.wentSilent(l.silentAfter)
}

// wentSilent says whether the holder has neither answered nor renewed
// the lease for after, through at least silentPings requests.
func (s seenHolder) wentSilent(after time.Duration) bool {
	return s.pings >= silentPings && time.Since(s.silentSince) >= after && time.Since(s.revAt) >= after
}

// judgedSilent says whether h, holding key at rev, was found silent
// (without asking again).
func (l *Leases) judgedSilent(key string, h Holder, rev uint64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	s, ok := l.seen[key]
	return ok && s.h.ID == h.ID && s.rev == rev && s.wentSilent(l.silentAfter)
}
