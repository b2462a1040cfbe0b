package route

import (
	"fmt"
	"reflect"
	"slices"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/stepset"
)

// Assembly gathers a run's trajectories into groups and steps. A step is
// ready when its watermark has arrived and every declared group is
// complete, or when StepTimeout has passed since the watermark (incomplete
// groups are then used as they are). Pure: time comes in as arguments. Not
// safe for concurrent use.
type Assembly struct {
	StepTimeout time.Duration
	steps       map[int64]*stepState
	closed      stepset.Set
	newest      int64 // the newest step closed, -1 before any
}

type stepState struct {
	groups      map[string]*groupState
	groupOf     map[string]string // trajectory id -> its group
	watermark   *schemas.StepClose
	watermarkAt time.Time
}

type groupState struct {
	taskID string
	want   int
	trajs  []schemas.Trajectory
}

// NewAssembly returns an empty assembly.
func NewAssembly(stepTimeout time.Duration) *Assembly {
	return &Assembly{StepTimeout: stepTimeout, steps: map[int64]*stepState{}, newest: -1}
}

// MarkClosed records a step planned earlier (before a restart): its
// trajectories are late from now on.
func (a *Assembly) MarkClosed(step int64) {
	a.closed.Add(step)
	a.newest = max(a.newest, step)
}

// IsClosed reports whether a step was planned already.
func (a *Assembly) IsClosed(step int64) bool { return a.closed.Has(step) }

func (a *Assembly) step(n int64) *stepState {
	s := a.steps[n]
	if s == nil {
		s = &stepState{groups: map[string]*groupState{}, groupOf: map[string]string{}}
		a.steps[n] = s
	}
	return s
}

// Has reports whether an open step holds a trajectory of this id.
func (a *Assembly) Has(step int64, trajID string) bool {
	s := a.steps[step]
	if s == nil {
		return false
	}
	_, ok := s.groupOf[trajID]
	return ok
}

// AddTraj adds a trajectory. A redelivered one (same traj_id, group and
// content) is ignored. It fails, with schemas.ErrInvalid, for a step
// already closed, a trajectory id another group of the step has (the
// update's items are told apart by it), one that came with other content,
// or a group whose declared size or task disagrees with earlier
// trajectories.
func (a *Assembly) AddTraj(t schemas.Trajectory) error {
	if a.closed.Has(t.Step) {
		return fmt.Errorf("%w: late trajectory %s: step %d was already closed (a trainer resumed from a checkpoint numbers its steps on from the run's newest: wmrl status says it)",
			schemas.ErrInvalid, t.TrajID, t.Step)
	}
	s := a.step(t.Step)
	if other, ok := s.groupOf[t.TrajID]; ok {
		if other != t.GroupID {
			return schemas.TrajIDTaken(t.TrajID, t.GroupID, other, t.Step)
		}
		if i := slices.IndexFunc(s.groups[other].trajs, func(p schemas.Trajectory) bool { return p.TrajID == t.TrajID }); !reflect.DeepEqual(s.groups[other].trajs[i], t) {
			return schemas.TrajIDReused(t)
		}
		return nil // a redelivery
	}
	g := s.groups[t.GroupID]
	if g == nil {
		g = &groupState{taskID: t.TaskID, want: t.GroupSize}
		s.groups[t.GroupID] = g
	}
	switch {
	case t.GroupSize != g.want:
		return fmt.Errorf("%w: trajectory %s declares group_size %d, group %s has %d", schemas.ErrInvalid, t.TrajID, t.GroupSize, t.GroupID, g.want)
	case t.TaskID != g.taskID:
		return fmt.Errorf("%w: trajectory %s has task %s, group %s answers task %s", schemas.ErrInvalid, t.TrajID, t.TaskID, t.GroupID, g.taskID)
	case len(g.trajs) >= g.want:
		return fmt.Errorf("%w: trajectory %s: group %s already has its %d trajectories", schemas.ErrInvalid, t.TrajID, t.GroupID, g.want)
	}
	s.groupOf[t.TrajID] = t.GroupID
	g.trajs = append(g.trajs, t)
	return nil
}

// AddWatermark records a step's watermark, received at now. A second one
// for the same step is ignored unless it disagrees (then it is invalid).
func (a *Assembly) AddWatermark(w schemas.StepClose, now time.Time) error {
	if a.closed.Has(w.Step) {
		return nil // redelivered after the step was planned
	}
	s := a.step(w.Step)
	if s.watermark != nil {
		if s.watermark.Groups != w.Groups {
			return fmt.Errorf("%w: step %d closed twice, with %d and %d groups", schemas.ErrInvalid, w.Step, s.watermark.Groups, w.Groups)
		}
		return nil
	}
	s.watermark, s.watermarkAt = &w, now
	return nil
}

// Ready lists the steps that can be planned now, in step order.
func (a *Assembly) Ready(now time.Time) []int64 {
	var out []int64
	for n, s := range a.steps {
		if s.watermark == nil {
			continue
		}
		if !s.short() || now.Sub(s.watermarkAt) >= a.StepTimeout {
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out
}

// Short reports whether step n, whose watermark came, lacks groups it
// declared or trajectories of a group's size: it is ready only on its
// timeout.
func (a *Assembly) Short(n int64) bool {
	s := a.steps[n]
	return s != nil && s.watermark != nil && s.short()
}

func (s *stepState) short() bool {
	complete := 0
	for _, g := range s.groups {
		if len(g.trajs) == g.want {
			complete++
		}
	}
	return complete < len(s.groups) || len(s.groups) < s.watermark.Groups
}

// Plan builds step n's groups and plan with sched's anchor choice, or with
// exactly the anchors sent when sent is not nil (Selection.Keep); the step
// stays open until Close (so a failed publish can be retried).
func (a *Assembly) Plan(run string, n int64, sched *Scheduler, inFlight int, sent []string, now time.Time) (schemas.Plan, []schemas.Group) {
	s := a.steps[n]
	ids := make([]string, 0, len(s.groups))
	for id := range s.groups {
		ids = append(ids, id)
	}
	sel := sched.Select(run, n, ids, inFlight)
	if sent != nil {
		sel = sel.Keep(sent)
	}
	plan := schemas.Plan{Schema: schemas.Version, Run: run, Step: n, ClosedAt: now, Anchors: sel.Chosen}
	groups := make([]schemas.Group, 0, len(ids))
	for _, d := range sel.Decisions { // sorted by group ID
		g := s.groups[d.GroupID]
		trajs := slices.Clone(g.trajs)
		slices.SortFunc(trajs, func(x, y schemas.Trajectory) int {
			switch {
			case x.TrajID < y.TrajID:
				return -1
			case x.TrajID > y.TrajID:
				return 1
			}
			return 0
		})
		pg := schemas.PlanGroup{GroupID: d.GroupID, Anchor: d.Anchor, Want: g.want, TaskID: g.taskID}
		for _, t := range trajs {
			pg.TrajIDs = append(pg.TrajIDs, t.TrajID)
			pg.PolicyVersions = append(pg.PolicyVersions, t.PolicyVersion)
		}
		plan.Groups = append(plan.Groups, pg)
		plan.Decisions = append(plan.Decisions, schemas.PlanDecision{GroupID: d.GroupID, Anchor: d.Anchor, Reason: d.Reason})
		groups = append(groups, schemas.Group{
			Schema: schemas.Version, Run: run, Step: n, GroupID: d.GroupID, TaskID: g.taskID,
			Anchor: d.Anchor, Trajectories: trajs,
		})
	}
	return plan, groups
}

// Close forgets step n's trajectories and marks it closed.
// Received is how many trajectories, in how many groups, step n holds.
func (a *Assembly) Received(n int64) (trajectories, groups int) {
	if s := a.steps[n]; s != nil {
		for _, g := range s.groups {
			trajectories += len(g.trajs)
		}
		groups = len(s.groups)
	}
	return trajectories, groups
}

// Declared is the number of groups step n's watermark declared, and when
// it came (zero before it has).
func (a *Assembly) Declared(n int64) (groups int, at time.Time) {
	if s := a.steps[n]; s != nil && s.watermark != nil {
		return s.watermark.Groups, s.watermarkAt
	}
	return 0, time.Time{}
}

// Close forgets step n's trajectories once it is planned: they are late
// from now on.
func (a *Assembly) Close(n int64) {
	delete(a.steps, n)
	a.closed.Add(n)
	a.newest = max(a.newest, n)
}

// NewestClosed is the newest step planned (-1: none).
func (a *Assembly) NewestClosed() int64 { return a.newest }

// Open is the number of steps being assembled.
func (a *Assembly) Open() int { return len(a.steps) }
