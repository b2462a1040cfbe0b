package pipeline

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// streamEvery is how often a process checks that its stream and its
// durable consumers are still on the server, and goneAgain how long after
// a first reading of one gone it reads again before it stops (each
// replaced by Config's, a test's, when set).
func (c *Config) streamEvery() time.Duration { return cmp.Or(c.streamCheck, 30*time.Second) }

func (c *Config) goneAgain() time.Duration { return cmp.Or(c.streamRecheck, 5*time.Second) }

// watchStream stops the process once its stream, or one of its stages'
// durable consumers, is no longer on the server: deleted by hand, or by a
// tool that cleans up streams. Its stages could not read on: they waited
// for messages for ever, saying only "stream not found (reading on)",
// and a stop said it had lost nothing. A second reading, goneAgain later,
// rides out a moment in which a cluster does not know.
func (p *Pipeline) watchStream(ctx context.Context) error {
	select {
	case <-ctx.Done():
		return nil
	case <-p.router.Running(): // the consumers are made as the router subscribes
	}
	t := time.NewTicker(p.cfg.streamEvery())
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		case <-p.streamLost:
		}
		if p.gone(ctx) == nil {
			p.notFoundTold.Clear()
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(p.cfg.goneAgain()):
		}
		if err := p.gone(ctx); err != nil {
			return err
		}
		p.notFoundTold.Clear()
	}
}

// gone says what of the process's stream and consumers the server no
// longer has; nil when it has them all, or does not answer.
func (p *Pipeline) gone(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	s, err := p.tr.js.Stream(ctx, p.tr.stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("pipeline: the stream %s is no longer on the NATS server at %s (deleted?): the messages it held are gone, "+
			"those of the steps not yet archived with them, and no stage can read on. Go on as a new run (--run NAME): this one's checkpoints "+
			"belong to the stream that is gone, and a trainer sends it the steps it has no update of (the archive keeps what it archived; wmrl replay reads it)", p.tr.stream, p.tr.url)
	}
	if err != nil {
		return nil
	}
	for _, name := range p.consumers {
		_, err := s.Consumer(ctx, name)
		if errors.Is(err, jetstream.ErrConsumerNotFound) {
			return fmt.Errorf("pipeline: the consumer %s of stream %s is no longer on the NATS server at %s (deleted?), and its stage reads nothing more. "+
				"Start the process again to make it anew: it then reads again every message of its subject that the stream keeps", name, p.tr.stream, p.tr.url)
		}
	}
	return nil
}

// lostStream has the stream and consumers checked at once, on an error
// that says one of them is not found; it says whether err did.
func (p *Pipeline) lostStream(err error) bool {
	// jetstream's sentinels match the server's codes (10059, 10014) as a
	// pull or a read answers them.
	if !errors.Is(err, jetstream.ErrStreamNotFound) && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return false
	}
	select {
	case p.streamLost <- struct{}{}:
	default:
	}
	return true
}
