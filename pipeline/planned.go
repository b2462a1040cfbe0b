package pipeline

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// plannedBefore says whether the stored plan of t's step took t: route
// asks it of a trajectory delivered as new of a step whose plan it does
// not hold (planned before it started, or long ago), which a server that
// crashed with its process delivers when it lost its count of deliveries
// and acknowledgements.
func (p *Pipeline) plannedBefore(msg *message.Message, t schemas.Trajectory) (bool, error) {
	p.plansOnce.Do(func() {
		subject := p.topo.Out(StageRoute, schemas.KindPlan)
		p.plans = &plans{run: p.cfg.Run, keep: keepPlans,
			since: func(ctx context.Context, since time.Time, fn func(natsjs.Record) error) error {
				return natsjs.ScanSince(ctx, p.tr.js, p.tr.stream, subject, since, false, fn)
			}}
	})
	return p.plans.took(msg.Context(), natsjs.Stored(msg), t)
}

// keepPlans is how many steps' plans route keeps read: those asked about
// come in bursts of a few steps (what a crash left unacknowledged), or in
// the stream's order (a consumer deleted).
const keepPlans = 256

// plans holds the trajectories of the steps' plans read last, each read
// from the time of a trajectory asked about (plans are stored after their
// trajectories), with the plans that came before it on the way.
type plans struct {
	run   string
	keep  int
	since func(ctx context.Context, since time.Time, fn func(natsjs.Record) error) error

	mu    sync.Mutex
	steps map[int64]map[string]bool // step: "group/traj" of its plan
	order []int64                   // steps in the order read, the oldest first
}

// took says whether the plan of t's step, stored after since, took t.
func (x *plans) took(ctx context.Context, since time.Time, t schemas.Trajectory) (bool, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.steps == nil {
		x.steps = map[int64]map[string]bool{}
	}
	if _, ok := x.steps[t.Step]; !ok {
		if !since.IsZero() {
			since = since.Add(-clockSkew)
		}
		err := x.since(ctx, since, func(r natsjs.Record) error {
			var plan schemas.Plan
			if err := schemas.Decode(r.Data, x.run, &plan); err != nil {
				return nil // not route's to judge here: fuse dead-letters it
			}
			x.add(plan)
			if plan.Step == t.Step {
				return errEnough
			}
			return nil
		})
		if err != nil && !errors.Is(err, errEnough) {
			return false, err
		}
	}
	return x.steps[t.Step][t.GroupID+"/"+t.TrajID], nil
}

// add keeps plan's trajectories, letting go of the oldest step's beyond
// keep.
func (x *plans) add(plan schemas.Plan) {
	if _, ok := x.steps[plan.Step]; ok {
		return
	}
	took := map[string]bool{}
	for _, g := range plan.Groups {
		for _, id := range g.TrajIDs {
			took[fmt.Sprintf("%s/%s", g.GroupID, id)] = true
		}
	}
	x.steps[plan.Step] = took
	x.order = append(x.order, plan.Step)
	if len(x.order) > x.keep {
		delete(x.steps, x.order[0])
		x.order = x.order[1:]
	}
}
