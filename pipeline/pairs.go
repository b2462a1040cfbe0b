package pipeline

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// errFound ends a read once what it looked for is found.
var errFound = errors.New("found")

// pairsStored says whether the pairs of de-duplication ID id were stored
// on the pair stage's output since side was: the pair stage asks it of a
// side that comes again, or that waited --pair-wait, before it waits for
// or dead-letters a side whose other was already paired and acknowledged.
// It reads the message IDs stored since then, one read at a time: after a
// restart every side the stopped process held comes again at once.
func (p *Pipeline) pairsStored(ctx context.Context, side *message.Message, id string) (bool, error) {
	since := natsjs.Stored(side)
	if !since.IsZero() {
		since = since.Add(-time.Minute) // a cluster's stream leader, whose clock stamps messages, may have changed since
	}
	p.pairsRead.Lock()
	defer p.pairsRead.Unlock()
	err := natsjs.ScanSince(ctx, p.tr.js, p.tr.stream, p.topo.Out(StagePair, schemas.KindPairs), since, true, func(r natsjs.Record) error {
		if r.MsgID == id {
			return errFound
		}
		return nil
	})
	if errors.Is(err, errFound) {
		return true, nil
	}
	return false, err
}
