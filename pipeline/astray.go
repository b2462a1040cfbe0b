package pipeline

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/route"
)

// Inputs astray: a message the server delivered that no process holds or
// acknowledged, lost on its way at a server's failover or held by a
// process that ended, comes again only after the consumer's AckWait
// (30 s), which is --step-timeout's default too. Route, whose steps close
// on that timeout, asks for them (route.Config.Astray) before it closes a
// step short, so that a group on its way again is not dead-lettered as
// late (a rehearsal on a cluster lost 7 groups of a step so: a server
// stopped, and route's step timed out 4 ms before their redelivery).

// disruption marks now as the last time this process may have had route's
// inputs go astray: its connection to the server lost or back, a consumer
// read failing (its leader lost), a route stage started (the process
// before it may have ended holding some).
func (p *Pipeline) disruption() { p.disrupted.Store(time.Now().UnixNano()) }

// inputsAstray counts route's inputs delivered and neither acknowledged
// nor held by this process: its consumers' messages pending an
// acknowledgement, less those its subscribers hold. Within the consumers'
// AckWait and the wait for them after a disruption only: else whatever
// was astray then came again since, and the count, which messages on
// their way to this process or whose acknowledgement is on its way to the
// server swell, would hold short steps for nothing.
func (p *Pipeline) inputsAstray(ctx context.Context, subs []*natsjs.Subscriber, kinds []schemas.Kind) (int, error) {
	if time.Since(time.Unix(0, p.disrupted.Load())) > p.ackWait()+astrayWait {
		return 0, nil
	}
	pending := 0
	for _, kind := range kinds {
		name := consumerName(StageRoute, p.cfg.Run, kind)
		cons, err := p.tr.js.Consumer(ctx, p.tr.stream, name)
		if errors.Is(err, jetstream.ErrConsumerNotFound) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("consumer %s: %w", name, err)
		}
		info, err := cons.Info(ctx)
		if err != nil {
			return 0, fmt.Errorf("consumer %s: %w", name, err)
		}
		pending += info.NumAckPending
	}
	for _, s := range subs {
		pending -= int(s.Held())
	}
	return max(pending, 0), nil
}

// astrayWait is how long past its timeout a step waits for route's inputs
// astray: the server delivers them again within its AckWait.
const astrayWait = time.Minute

// ackWait is the consumers' AckWait.
func (p *Pipeline) ackWait() time.Duration {
	if p.cfg.ackWait > 0 {
		return p.cfg.ackWait
	}
	return 30 * time.Second
}

// waitsForAstray says that a step waits for route's inputs astray.
func (p *Pipeline) waitsForAstray(a route.Astray) {
	p.metrics.AstraySteps.Inc()
	what := fmt.Sprintf("%d of route's inputs were delivered and not acknowledged outside this process (lost on their way at a server's failover, or held by a process that ended)", a.Inputs)
	if a.Err != nil {
		what = fmt.Sprintf("route could not count its inputs delivered elsewhere (%v)", a.Err)
	}
	p.notef("route: step %d's --step-timeout came while it lacks groups, and %s: it waits up to %s more for them to be delivered again, rather than be planned without them",
		a.Step, what, a.Upto.Round(time.Second))
}
