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
			after: func(ctx context.Context, seq uint64, fn func(natsjs.Record) error) error {
				return natsjs.ScanAfter(ctx, p.tr.js, p.tr.stream, subject, seq, true, fn)
			},
		}
	})
	return p.pairs.stored(ctx, natsjs.StreamSeq(side), id)
}

// errEnough ends a read that has what it looked for.
var errEnough = errors.New("read enough")

// pairsIndex holds the IDs of the pairs stored after a stream sequence,
// read from the stream once however many sides ask. A group's pairs are
// stored after both its sides, so a side asks about those stored after
// its own sequence. After a restart every side the stopped process held
// comes again at once: read for each, the stream after the oldest one was
// read once a side (the server reads every message of the span to find
// those on the subject). The index reads what it lacks, back to the oldest
// side asking and on from the newest pairs it read, and lets go of the IDs
// once no side has asked for idle. (It read from each side's time, a
// minute back for the clocks of a cluster's nodes, until a restart at
// full speed spent 2.3 s reading a minute of the stream.)
type pairsIndex struct {
	// after reads the IDs stored after a stream sequence (0: from the
	// first), in order, until fn returns an error.
	after func(ctx context.Context, seq uint64, fn func(natsjs.Record) error) error
	idle  time.Duration

	mu sync.Mutex
	// ids: every ID stored after sequence from, up to last, the newest
	// read (from, when none was); nil: none asked for.
	ids        map[string]bool
	from, last uint64
	asked      time.Time
}

// stored says whether id was stored after stream sequence seq (0: from the
// first), or at all before it as far as read: a group's pairs are stored
// once, after both its sides.
func (x *pairsIndex) stored(ctx context.Context, seq uint64, id string) (bool, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	now := time.Now()
	if x.ids == nil || now.Sub(x.asked) > x.idle {
		x.ids, x.from, x.last = map[string]bool{}, seq, seq
		if err := x.after(ctx, seq, x.add); err != nil {
			x.ids = nil
			return false, err
		}
	}
	x.asked = now
	if seq < x.from { // back to seq, up to what is held
		var read []natsjs.Record // kept once read up to there: what is held has no gap
		err := x.after(ctx, seq, func(r natsjs.Record) error {
			if r.Seq > x.from {
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
		x.from = seq
	}
	if x.ids[id] {
		return true, nil
	}
	err := x.after(ctx, x.last, x.add)
	return x.ids[id], err
}

func (x *pairsIndex) add(r natsjs.Record) error {
	x.ids[r.MsgID] = true
	x.last = max(x.last, r.Seq)
	return nil
}
