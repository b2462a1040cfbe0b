package pipeline

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// pairsStored says whether the pairs of de-duplication ID id were stored
// on the pair stage's output since side was: the pair stage asks it of a
// side that comes again, or that waited --pair-wait, before it waits for
// or dead-letters a side whose other was already paired and acknowledged.
func (p *Pipeline) pairsStored(ctx context.Context, side *message.Message, id string) (bool, error) {
	p.pairsOnce.Do(func() {
		subject := p.topo.Out(StagePair, schemas.KindPairs)
		p.pairs = &pairsIndex{
			idle: 10 * time.Minute,
			since: func(ctx context.Context, since time.Time, fn func(natsjs.Record) error) error {
				return natsjs.ScanSince(ctx, p.tr.js, p.tr.stream, subject, since, true, fn)
			},
			after: func(ctx context.Context, seq uint64, fn func(natsjs.Record) error) error {
				return natsjs.ScanAfter(ctx, p.tr.js, p.tr.stream, subject, seq, true, fn)
			},
		}
	})
	return p.pairs.stored(ctx, natsjs.Stored(side), id)
}

// clockSkew is how far a stored message's time may be behind one stored
// before it: a cluster's stream leader, whose clock stamps messages, may
// change between the two.
const clockSkew = time.Minute

// errEnough ends a read that has what it looked for.
var errEnough = errors.New("read enough")

// pairsIndex holds the IDs of the pairs stored from a time on, read from
// the stream once however many sides ask. After a restart every side the
// stopped process held comes again at once, each asking since its own
// time: read for each, the stream from the oldest one's time on was read
// once a side (the server reads every message of the span to find those
// on the subject). The index reads what it lacks, back to the oldest time
// asked and on from the newest pairs it read, and lets go of the IDs once
// no side has asked for idle.
type pairsIndex struct {
	// since reads the IDs stored at or after a time, and after those
	// stored after a stream sequence: in order, until fn returns an error.
	since func(ctx context.Context, since time.Time, fn func(natsjs.Record) error) error
	after func(ctx context.Context, seq uint64, fn func(natsjs.Record) error) error
	idle  time.Duration

	mu sync.Mutex
	// ids: every ID stored from from on, of sequences first to last (0
	// when none was read); nil: none asked for.
	ids         map[string]bool
	from        time.Time
	first, last uint64
	asked       time.Time
}

// stored says whether id was stored since since (from the first message
// when since is zero), or at all before it as far as read: a group's
// pairs are stored once, after both its sides.
func (x *pairsIndex) stored(ctx context.Context, since time.Time, id string) (bool, error) {
	if !since.IsZero() {
		since = since.Add(-clockSkew)
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	now := time.Now()
	if x.ids == nil || now.Sub(x.asked) > x.idle {
		x.ids, x.from, x.first, x.last = map[string]bool{}, since, 0, 0
		if err := x.since(ctx, since, x.add); err != nil {
			x.ids = nil
			return false, err
		}
	}
	x.asked = now
	if since.Before(x.from) { // back to since, up to what is read
		var read []natsjs.Record // kept once read up to there: what is held has no gap
		err := x.since(ctx, since, func(r natsjs.Record) error {
			if x.first > 0 && r.Seq >= x.first {
				return errEnough
			}
			read = append(read, r)
			return nil
		})
		if err != nil && !errors.Is(err, errEnough) {
			return false, err
		}
		for _, r := range read {
			x.add(r)
		}
		x.from = since
	}
	if x.ids[id] {
		return true, nil
	}
	var err error
	if x.last == 0 { // none stored from x.from on, when last read
		err = x.since(ctx, x.from, x.add)
	} else {
		err = x.after(ctx, x.last, x.add)
	}
	return x.ids[id], err
}

func (x *pairsIndex) add(r natsjs.Record) error {
	x.ids[r.MsgID] = true
	if x.first == 0 || r.Seq < x.first {
		x.first = r.Seq
	}
	x.last = max(x.last, r.Seq)
	return nil
}
