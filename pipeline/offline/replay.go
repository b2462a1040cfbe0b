// Package offline re-runs and inspects an archive without a stream: replay
// recomputes calibration and fusion over the archived rows, audit measures
// the world model's bias.
package offline

import (
	"cmp"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/pair"
)

// ReplayOptions are the settings of a replay. AnchorFraction below the
// recorded one keeps each anchor group with probability
// AnchorFraction/recorded (a hash of the run, step and group, so the same
// groups every time); the others become world-model groups.
type ReplayOptions struct {
	Settings       archive.Settings
	AnchorFraction float64 // 0: the recorded one
}

// Replayed is one trajectory's replayed numbers beside the archived row.
type Replayed struct {
	Row                                    archive.Row
	Calibrated, Reward                     *float64
	Advantage, Weight, FusedAdvantage, Rho float64
	CalibrationVersion                     int64
	Anchor                                 bool
}

// StepReport compares a replayed step with the archive.
type StepReport struct {
	Step              int64
	Rho, RecordedRho  float64
	Anchors           int
	MaxFusedDiff      float64 // max |replayed - archived| fused advantage
	MaxCalibratedDiff float64 // over rows with both calibrated values
	SignAgreement     float64 // share of rows whose fused advantage keeps its sign
	Items             []Replayed
}

// ReplaySummary is the whole replay.
type ReplaySummary struct {
	Run                             string
	Steps, Rows, LatePairs          int
	AnchorGroups, DroppedAnchors    int
	MaxFusedDiff, MaxCalibratedDiff float64
	SignAgreement                   float64
	// Gaps lists calibration seqs the archive holds no group for: with
	// any, the recorded settings cannot be reproduced exactly.
	Gaps []int64
}

// stepRows is a step to replay: what the plan pass learned of it, and in
// the replay pass its rows as they come.
type stepRows struct {
	step int64
	cseq int64
	ts   time.Time
	n    int           // rows the plan pass counted
	rows []archive.Row // read so far by the replay pass
	done bool          // replayed, its rows let go
}

// absorption is an anchor group's pairs, absorbed at seq.
type absorption struct {
	seq   int64
	step  int64
	group string
	items []pairItem
}

type pairItem struct {
	traj                 string
	predicted, trueScore *float64
}

type groupKey struct {
	step  int64
	group string
}

// Rows gives a run's rows to fn in batches, the same rows in the same
// order each time it is called; fn may keep a batch. columns, if any,
// are the only ones (by their Parquet names) the call reads: a source may
// leave the others out, and a pass that needs a few reads faster.
type Rows func(columns []string, fn func([]archive.Row) error) error

// InMemory is Rows over rows already read.
func InMemory(rows []archive.Row) Rows {
	return func(_ []string, fn func([]archive.Row) error) error { return fn(rows) }
}

// planColumns are what a replay's first read needs.
var planColumns = []string{"step", "group_id", "traj_id", "predicted", "true_score", "is_anchor", "source", "absorbed_seq", "calibration_seq", "ts"}

// Replay re-runs calibration and fusion over a run's rows with the
// project's own calibrate, pair and fuse code, in the order the live
// pipeline ran them: anchor groups are absorbed in their recorded seq
// order and each step is fused once the calibration it used (its
// calibration_seq) is reached. report sees every step in that order.
func Replay(rows []archive.Row, opt ReplayOptions, report func(StepReport)) (ReplaySummary, error) {
	return ReplayRows(InMemory(rows), opt, report)
}

// ReplayRows is Replay over rows read twice: once to plan (each step's
// calibration seq and row count, the anchor groups' pairs in their seq
// order), once to replay, holding the rows of the steps read and not yet
// replayed, which in an archive written as the run went are those of the
// batch src gave last.
// Its memory is the plan's (tens of bytes a step, and the anchor pairs),
// not the archive's: over an archive read whole, a replay held about
// 1.4 kB a row.
func ReplayRows(src Rows, opt ReplayOptions, report func(StepReport)) (ReplaySummary, error) {
	r := &replayer{opt: opt, report: report, steps: map[int64]*stepRows{}, groups: map[groupKey]*absorption{}}
	if err := src(planColumns, r.plan); err != nil {
		return r.sum, err
	}
	if r.read == 0 {
		return r.sum, fmt.Errorf("replay: no rows")
	}
	if err := r.sequence(); err != nil {
		return r.sum, err
	}
	deb, err := calibrate.NewDebiaser(opt.Settings.Debiaser)
	if err != nil {
		return r.sum, fmt.Errorf("replay: %w", err)
	}
	r.cal = &calibrate.Stage{RunID: r.sum.Run, Deb: deb}
	r.asm, err = fuse.NewSteps(fuse.StepsConfig{Run: r.sum.Run, Debias: opt.Settings.Debias, Denoiser: opt.Settings.Denoiser, Norm: opt.Settings.AdvantageNorm, AnchorDeadline: time.Hour})
	if err != nil {
		return r.sum, fmt.Errorf("replay: %w", err)
	}
	if err := src(nil, r.take); err != nil {
		return r.sum, err
	}
	if r.next < len(r.order) {
		return r.sum, r.changed(r.order[r.next].step)
	}
	for ; r.nextEvent < len(r.events); r.nextEvent++ {
		if err := r.absorb(r.events[r.nextEvent]); err != nil {
			return r.sum, err
		}
	}
	if r.total > 0 {
		r.sum.SignAgreement = float64(r.agree) / float64(r.total)
	}
	return r.sum, nil
}

// replayer is one replay: the plan its first read makes, and the
// calibration and fusion its second read drives.
type replayer struct {
	opt    ReplayOptions
	report func(StepReport)
	sum    ReplaySummary
	read   int                      // rows the plan read
	steps  map[int64]*stepRows      // by step
	groups map[groupKey]*absorption // anchor groups with a seq
	events []*absorption            // those groups in the order the run absorbed them
	order  []*stepRows              // the steps in the order the run fused them
	cal    *calibrate.Stage
	asm    *fuse.Steps
	// next is the next step of order to replay, nextEvent the next group
	// of events to absorb; agree of total fused advantages kept their sign.
	next, nextEvent int
	agree, total    int
}

// plan is the first read: each step's calibration seq and row count, and
// the anchor groups' pairs.
func (r *replayer) plan(rows []archive.Row) error {
	for i := range rows {
		row := &rows[i]
		if r.read == 0 {
			r.sum.Run = row.Run
		}
		r.read++
		if row.Run != r.sum.Run {
			return fmt.Errorf("replay: rows of two runs (%s, %s): replay one run at a time", r.sum.Run, row.Run)
		}
		// Anchor groups absorbed in time (used, or executed with too few
		// scores and fused on the world model) and late ones' pairs.
		if row.AbsorbedSeq > 0 && (row.IsAnchor || row.Source == archive.SourceLateAnchor) {
			key := groupKey{row.Step, row.GroupID}
			a := r.groups[key]
			if a == nil {
				a = &absorption{seq: row.AbsorbedSeq, step: row.Step, group: row.GroupID}
				r.groups[key] = a
			}
			// Copies: a row's scores point into its row group's column.
			a.items = append(a.items, pairItem{traj: row.TrajID, predicted: archive.Detach(row.Predicted), trueScore: archive.Detach(row.TrueScore)})
		}
		if row.Source == archive.SourceLateAnchor {
			if row.Predicted != nil && row.TrueScore != nil { // a pair, not an ungraded trajectory's execution
				r.sum.LatePairs++
			}
			continue
		}
		s := r.steps[row.Step]
		if s == nil {
			s = &stepRows{step: row.Step, cseq: row.CalibrationSeq, ts: row.TS}
			r.steps[row.Step] = s
		}
		s.n++
		r.sum.Rows++
	}
	return nil
}

// sequence puts the anchor groups in the order the run absorbed them,
// noting the seqs missing between them, and the steps in the order it
// fused them.
func (r *replayer) sequence() error {
	for _, a := range r.groups {
		r.events = append(r.events, a)
	}
	slices.SortFunc(r.events, func(x, y *absorption) int { return cmp.Compare(x.seq, y.seq) })
	for i, a := range r.events {
		if i > 0 && a.seq == r.events[i-1].seq {
			return fmt.Errorf("replay: groups %d/%s and %d/%s both absorbed at seq %d", a.step, a.group, r.events[i-1].step, r.events[i-1].group, a.seq)
		}
		for gap := int64(1); i == 0 && gap < a.seq || i > 0 && r.events[i-1].seq+gap < a.seq; gap++ {
			prev := int64(0)
			if i > 0 {
				prev = r.events[i-1].seq
			}
			r.sum.Gaps = append(r.sum.Gaps, prev+gap)
		}
	}
	r.order = make([]*stepRows, 0, len(r.steps))
	for _, s := range r.steps {
		r.order = append(r.order, s)
	}
	slices.SortFunc(r.order, func(x, y *stepRows) int {
		return cmp.Or(cmp.Compare(x.cseq, y.cseq), cmp.Compare(x.step, y.step))
	})
	return nil
}

// keep says whether an anchor group stays one: all of them, unless
// AnchorFraction keeps fewer than were recorded.
func (r *replayer) keep(step int64, group string) bool {
	recorded := r.opt.Settings.AnchorFraction
	if r.opt.AnchorFraction <= 0 || recorded <= 0 || r.opt.AnchorFraction >= recorded {
		return true
	}
	h := fnv.New64a()
	fmt.Fprintf(h, "%s/%d/%s", r.sum.Run, step, group)
	return float64(h.Sum64()>>11)/(1<<53) < r.opt.AnchorFraction/recorded
}

// absorb gives an anchor group's pairs to the calibration, as pair made
// them, and its calibration to fusion.
func (r *replayer) absorb(a *absorption) error {
	if !r.keep(a.step, a.group) {
		r.sum.DroppedAnchors++
		return nil
	}
	r.sum.AnchorGroups++
	p := schemas.Prediction{Schema: schemas.Version, Run: r.sum.Run, Step: a.step, GroupID: a.group, Anchor: true}
	e := schemas.Execution{Schema: schemas.Version, Run: r.sum.Run, Step: a.step, GroupID: a.group}
	for _, it := range a.items {
		p.Items = append(p.Items, schemas.PredItem{TrajID: it.traj, Score: it.predicted})
		e.Items = append(e.Items, schemas.ExecItem{TrajID: it.traj, Score: it.trueScore})
	}
	data, err := json.Marshal(pair.Pairs(p, e))
	if err != nil {
		return err
	}
	c, err := r.cal.Absorb(data)
	if err != nil || c == nil {
		return fmt.Errorf("replay: absorb %d/%s: %v", a.step, a.group, err)
	}
	return r.asm.AddCalibration(*c)
}

// take is the second read: it holds each step's rows until they have all
// come, then replays the steps ready.
func (r *replayer) take(rows []archive.Row) error {
	for _, row := range rows {
		if row.Source == archive.SourceLateAnchor {
			continue
		}
		s := r.steps[row.Step]
		if s == nil || s.done || len(s.rows) == s.n {
			return r.changed(row.Step)
		}
		if s.rows == nil {
			s.rows = make([]archive.Row, 0, s.n)
		}
		s.rows = append(s.rows, row)
	}
	return r.replayReady()
}

// replayReady replays, in order, the steps whose rows have all come, each
// once the groups absorbed before its calibration are.
func (r *replayer) replayReady() error {
	for ; r.next < len(r.order) && len(r.order[r.next].rows) == r.order[r.next].n; r.next++ {
		s := r.order[r.next]
		for r.nextEvent < len(r.events) && r.events[r.nextEvent].seq <= s.cseq {
			if err := r.absorb(r.events[r.nextEvent]); err != nil {
				return err
			}
			r.nextEvent++
		}
		rep := replayStep(r.asm, r.sum.Run, s, r.keep)
		s.rows, s.done = nil, true
		for _, it := range rep.Items {
			if math.Signbit(it.FusedAdvantage) == math.Signbit(it.Row.FusedAdvantage) || it.FusedAdvantage == it.Row.FusedAdvantage {
				r.agree++
			}
			r.total++
		}
		r.sum.MaxFusedDiff = max(r.sum.MaxFusedDiff, rep.MaxFusedDiff)
		r.sum.MaxCalibratedDiff = max(r.sum.MaxCalibratedDiff, rep.MaxCalibratedDiff)
		r.sum.Steps++
		if r.report != nil {
			r.report(rep)
		}
	}
	return nil
}

func (r *replayer) changed(step int64) error {
	return fmt.Errorf("replay: the rows changed between the two reads (step %d's): was the archive written to meanwhile?", step)
}

// replayStep rebuilds a step's plan, predictions and executions from its
// rows and fuses it.
func replayStep(asm *fuse.Steps, run string, s *stepRows, keep func(int64, string) bool) StepReport {
	plan := schemas.Plan{Schema: schemas.Version, Run: run, Step: s.step}
	byGroup := map[string]int{}
	preds := map[string]*schemas.Prediction{}
	execs := map[string]*schemas.Execution{}
	for _, r := range s.rows {
		i, ok := byGroup[r.GroupID]
		if !ok {
			i = len(plan.Groups)
			byGroup[r.GroupID] = i
			anchor := r.IsAnchor && keep(r.Step, r.GroupID)
			plan.Groups = append(plan.Groups, schemas.PlanGroup{GroupID: r.GroupID, Anchor: anchor, TaskID: r.TaskID})
			preds[r.GroupID] = &schemas.Prediction{Schema: schemas.Version, Run: run, Step: s.step, GroupID: r.GroupID, Anchor: anchor}
			if anchor && r.Source == archive.SourceAnchor {
				execs[r.GroupID] = &schemas.Execution{Schema: schemas.Version, Run: run, Step: s.step, GroupID: r.GroupID}
			}
		}
		g := &plan.Groups[i]
		g.TrajIDs = append(g.TrajIDs, r.TrajID)
		g.PolicyVersions = append(g.PolicyVersions, r.PolicyVersion)
		preds[r.GroupID].Items = append(preds[r.GroupID].Items, schemas.PredItem{TrajID: r.TrajID, Score: r.Predicted, Status: r.WMStatus})
		if e := execs[r.GroupID]; e != nil {
			it := schemas.ExecItem{TrajID: r.TrajID, Score: r.TrueScore}
			if r.ExecStatus != nil {
				it.Status = *r.ExecStatus
			}
			if r.ExecSeconds != nil {
				it.Seconds = *r.ExecSeconds
			}
			if r.ExecDetail != nil {
				it.Detail = *r.ExecDetail
			}
			e.Items = append(e.Items, it)
		}
	}
	asm.AddPlan(plan, s.ts)
	for _, p := range preds {
		asm.AddPrediction(*p)
	}
	for _, e := range execs {
		asm.AddExecution(*e)
	}
	u := asm.Fuse(s.step, s.ts)
	asm.Close(s.step)
	rep := StepReport{Step: s.step, Rho: u.Rho, Anchors: u.Anchors, Items: make([]Replayed, len(s.rows))}
	if len(s.rows) > 0 {
		rep.RecordedRho = s.rows[0].Rho
	}
	byTraj := make(map[string]schemas.UpdateItem, len(u.Items))
	for _, it := range u.Items {
		byTraj[it.TrajID] = it
	}
	agree := 0
	for i, r := range s.rows {
		it := byTraj[r.TrajID]
		rp := Replayed{Row: r, Calibrated: it.Calibrated, Reward: it.Reward, Advantage: it.Advantage, Weight: it.Weight,
			FusedAdvantage: it.FusedAdvantage, Rho: u.Rho, CalibrationVersion: u.CalibrationVersion, Anchor: it.Source == archive.SourceAnchor}
		rep.Items[i] = rp
		rep.MaxFusedDiff = max(rep.MaxFusedDiff, math.Abs(it.FusedAdvantage-r.FusedAdvantage))
		if it.Calibrated != nil && r.Calibrated != nil {
			rep.MaxCalibratedDiff = max(rep.MaxCalibratedDiff, math.Abs(*it.Calibrated-*r.Calibrated))
		} else if (it.Calibrated == nil) != (r.Calibrated == nil) {
			rep.MaxCalibratedDiff = math.Inf(1)
		}
		if math.Signbit(it.FusedAdvantage) == math.Signbit(r.FusedAdvantage) {
			agree++
		}
	}
	if len(s.rows) > 0 {
		rep.SignAgreement = float64(agree) / float64(len(s.rows))
	}
	return rep
}

// Rows turns a replayed step into archive rows with the replayed numbers.
func (r StepReport) Rows() []archive.Row {
	out := make([]archive.Row, len(r.Items))
	for i, it := range r.Items {
		row := it.Row
		row.Calibrated, row.Reward = it.Calibrated, it.Reward
		row.Advantage, row.Weight, row.FusedAdvantage, row.Rho = it.Advantage, it.Weight, it.FusedAdvantage, it.Rho
		row.CalibrationVersion = it.CalibrationVersion
		if !it.Anchor && row.Source == archive.SourceAnchor {
			row.Source, row.IsAnchor = archive.SourceWorldModel, false // dropped by a lower anchor fraction
		}
		out[i] = row
	}
	return out
}
