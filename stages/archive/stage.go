package archive

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/fuse"
)

// Stage is the archive stage. It reads the run's updates and calibrations
// and holds each input until the file holding its rows is durable. An
// update becomes a row per item. A calibration becomes rows only when its
// anchor group was late for its step (the step's update says so), so a
// calibration is held until its step's update is archived: it may be
// stored before it. With CodeWait, an anchor group's trajectories
// (HandleExec) are held too, and their prompts and responses go into the
// rows of their step's update. One archive stage per run.
type Stage struct {
	Run string
	W   *Writer
	Now func() time.Time
	// OnArchived, if set, sees every update whose rows are durable, and
	// every late anchor group's (with late true).
	OnArchived func(step int64, late bool)
	// CodeWait is how long an update waits for the trajectories of its
	// anchor groups that have not come (they come before it but for a
	// restart's redeliveries) before its rows are archived without
	// them, which OnNoCode, if set, hears. 0 archives no code. Once a
	// wait has run out with no trajectories come at all since the stage
	// started (nothing sends them where it reads), updates wait no more
	// until some come.
	CodeWait time.Duration
	OnNoCode func(step int64, groups []string)
	// OnOtherAdvantages, if set, hears of an update whose advantages were
	// formed otherwise (its advantage_norm) than the files record (the
	// writer's Settings.AdvantageNorm, this process's --advantage-norm):
	// the fuse stage of another process was given another one, and a
	// replay on the files' settings will not reproduce the run. The rows
	// are archived all the same.
	OnOtherAdvantages func(step int64, fused, recorded fuse.Normalization)
	// Outcome, if set, reads an anchor trajectory's execution (the
	// outcome execute stored) by its step, group and ID: a late
	// anchor group's rows take its status, seconds, detail and the
	// trajectory it copied from there, as a calibration carries only the
	// scores, and its trajectories without a pair (the world model did
	// not grade them, or their execution gave no score) get rows from
	// there alone (see FromLate). Late executions are the slow ones,
	// timeouts among them: without their status and seconds the
	// archive's record of how executions end stops at the deadline. A
	// miss leaves them null; an error too, and OnOutcomeError, if set,
	// hears it.
	Outcome        func(ctx context.Context, step int64, group, traj string) (schemas.ExecItem, bool, error)
	OnOutcomeError func(error)
	// Stored, if set, says when a received message was stored (zero: not
	// known). A late group's rows are stamped (ts) with when its
	// calibration was stored, not with when this stage came to it, which
	// behind a backlog or a restart is later: the audit sets that time
	// against its step's update. Unset, or not known, they take Now.
	Stored func(*message.Message) time.Time

	mu      sync.Mutex
	waiting map[int64]chan struct{} // steps whose update calibrations wait for
	code    map[groupKey]*groupCode // anchor groups' trajectories, until their step is archived
	sawCode bool                    // some trajectories have come
	noCode  bool                    // a wait ran out before any came
}

type groupKey struct {
	step  int64
	group string
}

// groupCode is an anchor group's trajectories, once arrived is closed.
type groupCode struct {
	arrived chan struct{}
	trajs   map[string]schemas.Trajectory
}

// NewStage builds the stage on an open writer.
func NewStage(run string, w *Writer) *Stage {
	return &Stage{Run: run, W: w, Now: time.Now, waiting: map[int64]chan struct{}{}, code: map[groupKey]*groupCode{}}
}

// HandleUpdate archives an update's rows.
func (s *Stage) HandleUpdate(msg *message.Message) error {
	var u schemas.Update
	if err := schemas.Decode(msg.Payload, s.Run, &u); err != nil {
		return fmt.Errorf("archive: %w", err)
	}
	if s.OnOtherAdvantages != nil {
		fused, recorded := fuse.Normalization(u.AdvantageNorm).Effective(), s.W.cfg.Settings.AdvantageNorm.Effective()
		if fused != recorded {
			s.OnOtherAdvantages(u.Step, fused, recorded)
		}
	}
	rows, late := FromUpdate(u)
	if s.CodeWait > 0 && s.W.Has(UpdateKey(u.Step)) == nil { // a redelivery of an archived one needs none
		s.addCode(msg.Context(), u.Step, rows)
	}
	c, err := s.W.Add(UpdateKey(u.Step), rows, late)
	if err != nil {
		return outage(err)
	}
	s.release(u.Step)
	if err := wait(msg.Context(), c); err != nil {
		return err
	}
	if s.OnArchived != nil {
		s.OnArchived(u.Step, false)
	}
	return nil
}

// HandleCalibration archives the pairs of an anchor group that was late
// for its step, and acknowledges every other calibration once its step's
// update is archived.
func (s *Stage) HandleCalibration(msg *message.Message) error {
	var c schemas.Calibration
	if err := schemas.Decode(msg.Payload, s.Run, &c); err != nil {
		return fmt.Errorf("archive: %w", err)
	}
	ctx := msg.Context()
	for {
		if done := s.W.Has(LateKey(c.Step, c.GroupID)); done != nil {
			return wait(ctx, done)
		}
		// One look at both: the update added between a look for its late
		// group and one for the update would leave a late group's rows
		// unwritten and its calibration acknowledged.
		g, update, late := s.W.Late(c.Step, c.GroupID)
		if late {
			rows := FromLate(c, g, s.outcomesOf(ctx, c, g), s.madeAt(msg))
			commit, err := s.W.Add(LateKey(c.Step, c.GroupID), rows, nil)
			if err != nil {
				return outage(err)
			}
			if err := wait(ctx, commit); err != nil {
				return err
			}
			if s.OnArchived != nil {
				s.OnArchived(c.Step, true)
			}
			return nil
		}
		if update != nil {
			return wait(ctx, update) // in time for its step: no rows
		}
		select {
		case <-s.updateOf(c.Step):
		case <-ctx.Done():
			return fmt.Errorf("archive: gave up waiting for the update of step %d: %w", c.Step, ctx.Err())
		}
	}
}

// madeAt is when msg was stored, or else now.
func (s *Stage) madeAt(msg *message.Message) time.Time {
	if s.Stored != nil {
		if at := s.Stored(msg); !at.IsZero() {
			return at
		}
	}
	return s.Now()
}

// outcomeWait bounds the reads of a late group's outcomes: a store that
// does not answer costs the rows their seconds, never a stalled archive.
const outcomeWait = 10 * time.Second

// outcomesOf reads from Outcome the executions of a late group's
// trajectories: its pairs', then the others' (see FromLate), by
// trajectory ID. The first error ends the reads.
func (s *Stage) outcomesOf(ctx context.Context, c schemas.Calibration, g LateGroup) map[string]schemas.ExecItem {
	if s.Outcome == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, outcomeWait)
	defer cancel()
	others := g.others(c)
	trajs := make([]string, 0, len(c.Pairs)+len(others))
	for _, p := range c.Pairs {
		trajs = append(trajs, p.TrajID)
	}
	for _, o := range others {
		trajs = append(trajs, o.TrajID)
	}
	out := make(map[string]schemas.ExecItem, len(trajs))
	for _, traj := range trajs {
		it, ok, err := s.Outcome(ctx, c.Step, c.GroupID, traj)
		if err != nil {
			if s.OnOutcomeError != nil {
				s.OnOutcomeError(fmt.Errorf("archive: the execution of late anchor %s of step %d: %w (its row, and those after it in its group, are archived without their execution's status and seconds, and its trajectories without a pair without rows)", traj, c.Step, err))
			}
			break
		}
		if ok {
			out[traj] = it
		}
	}
	return out
}

// HandleExec takes an anchor group's trajectories (what route sends the
// executor) and holds them until their step's update is archived with
// their prompts and responses in its rows.
func (s *Stage) HandleExec(msg *message.Message) error {
	var g schemas.Group
	if err := schemas.Decode(msg.Payload, s.Run, &g); err != nil {
		return fmt.Errorf("archive: %w", err)
	}
	ctx := msg.Context()
	if done := s.W.Has(UpdateKey(g.Step)); done != nil {
		return wait(ctx, done) // its step is archived (a redelivery): nothing to add
	}
	k := groupKey{g.Step, g.GroupID}
	s.mu.Lock()
	s.sawCode, s.noCode = true, false
	c := s.codeSlot(k)
	if c.trajs == nil {
		c.trajs = make(map[string]schemas.Trajectory, len(g.Trajectories))
		for _, t := range g.Trajectories {
			c.trajs[t.TrajID] = t
		}
		close(c.arrived)
	}
	s.mu.Unlock()
	for {
		if done := s.W.Has(UpdateKey(g.Step)); done != nil {
			err := wait(ctx, done)
			if err == nil {
				s.mu.Lock()
				delete(s.code, k)
				s.mu.Unlock()
			}
			return err
		}
		select {
		case <-s.updateOf(g.Step):
		case <-ctx.Done():
			return fmt.Errorf("archive: gave up waiting for the update of step %d: %w", g.Step, ctx.Err())
		}
	}
}

// codeSlot is an anchor group's place for its trajectories. Callers hold
// s.mu.
func (s *Stage) codeSlot(k groupKey) *groupCode {
	c := s.code[k]
	if c == nil {
		c = &groupCode{arrived: make(chan struct{})}
		s.code[k] = c
	}
	return c
}

// addCode puts the prompts and responses of the anchor groups' rows into
// them, waiting up to CodeWait for those that have not come.
func (s *Stage) addCode(ctx context.Context, step int64, rows []Row) {
	var groups []string
	slots := map[string]*groupCode{}
	s.mu.Lock()
	for _, r := range rows {
		if r.IsAnchor && slots[r.GroupID] == nil {
			slots[r.GroupID] = s.codeSlot(groupKey{step, r.GroupID})
			groups = append(groups, r.GroupID)
		}
	}
	patience := s.CodeWait
	if s.noCode {
		patience = 0 // nothing sends them: take what is here
	}
	s.mu.Unlock()
	timeout := time.NewTimer(patience)
	defer timeout.Stop()
arrival:
	for _, g := range groups {
		select {
		case <-slots[g].arrived:
		case <-timeout.C:
			break arrival
		case <-ctx.Done():
			break arrival
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range rows {
		c := slots[rows[i].GroupID]
		if c == nil || c.trajs == nil {
			continue
		}
		if t, ok := c.trajs[rows[i].TrajID]; ok {
			n := int64(len(t.Response))
			rows[i].Prompt, rows[i].Response, rows[i].ResponseBytes = &t.Prompt, &t.Response, &n
		}
	}
	var missing []string
	for _, g := range groups {
		if slots[g].trajs == nil {
			missing = append(missing, g)
			delete(s.code, groupKey{step, g}) // a later HandleExec finds the step archived
		}
	}
	if len(missing) > 0 && !s.sawCode {
		s.noCode = true
	}
	if len(missing) > 0 && s.OnNoCode != nil {
		s.OnNoCode(step, missing)
	}
}

func (s *Stage) updateOf(step int64) <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	ch := s.waiting[step]
	if ch == nil {
		ch = make(chan struct{})
		s.waiting[step] = ch
	}
	if s.W.Has(UpdateKey(step)) != nil { // archived while we were making ch
		close(ch)
		delete(s.waiting, step)
	}
	return ch
}

func (s *Stage) release(step int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ch := s.waiting[step]; ch != nil {
		close(ch)
		delete(s.waiting, step)
	}
}

// outage marks the writer's errors (a disk full, missing or refusing) as
// outages: the input is retried until the disk is back, never dead-lettered,
// so the archive has no holes once it is over.
func outage(err error) error { return fmt.Errorf("%w (%w)", err, schemas.ErrOutage) }

func wait(ctx context.Context, c *Commit) error {
	select {
	case <-c.Done():
		if err := c.Err(); err != nil {
			return outage(err)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("archive: gave up waiting for the file to close: %w", ctx.Err())
	}
}
