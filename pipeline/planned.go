package pipeline

import (
	"context"
	"errors"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/recent"
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
			after: func(ctx context.Context, seq uint64, fn func(natsjs.Record) error) error {
				return natsjs.ScanAfter(ctx, p.tr.js, p.tr.stream, subject, seq, false, fn)
			}}
	})
	return p.plans.took(msg.Context(), natsjs.StreamSeq(msg), t)
}

// keepPlans is how many steps' plans route keeps read: those asked about
// come in bursts of a few steps (what a crash left unacknowledged), or in
// the stream's order (a consumer deleted).
const keepPlans = 256

// plans holds the trajectories of the steps' plans read last, each read
// from the stream sequence of a trajectory asked about: a step's plan is
// stored after its trajectories, so the read is of the plans stored since
// the trajectory, up to its step's, whatever the servers' clocks say. (A
// read from the trajectory's time, a minute back for the clocks of a
// cluster's nodes, read a minute of the stream for each step asked about:
// 4.6 s of a restart at full speed, three steps asked.) A trajectory
// stored after its step's plan, sent again once the stream's
// de-duplication window had passed, is not a copy of one planned: it is
// late.
type plans struct {
	run   string
	keep  int
	after func(ctx context.Context, seq uint64, fn func(natsjs.Record) error) error

	mu    sync.Mutex
	steps *recent.Map[int64, map[string]bool] // step: "group/traj" of its plan
}

// took says whether the plan of t's step, stored after stream sequence
// seq (t's; 0: from the first), took t.
func (x *plans) took(ctx context.Context, seq uint64, t schemas.Trajectory) (bool, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.steps == nil {
		x.steps = recent.New[int64, map[string]bool](x.keep)
	}
	if !x.steps.Has(t.Step) {
		err := x.after(ctx, seq, func(r natsjs.Record) error {
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
	took, _ := x.steps.Get(t.Step)
	return took[planKey(t.GroupID, t.TrajID)], nil
}

// planKey is a trajectory's key among its plan's.
func planKey(group, traj string) string { return group + "/" + traj }

// add keeps plan's trajectories, letting go of the oldest step's beyond
// keep.
func (x *plans) add(plan schemas.Plan) {
	if x.steps.Has(plan.Step) {
		return
	}
	took := map[string]bool{}
	for _, g := range plan.Groups {
		for _, id := range g.TrajIDs {
			took[planKey(g.GroupID, id)] = true
		}
	}
	x.steps.Put(plan.Step, took)
}
