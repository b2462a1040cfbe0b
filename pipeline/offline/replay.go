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
	var sum ReplaySummary
	steps := map[int64]*stepRows{}
	groups := map[groupKey]*absorption{} // anchor groups with a seq
	read := 0
	err := src(planColumns, func(rows []archive.Row) error {
		for i := range rows {
			r := &rows[i]
			if read == 0 {
				sum.Run = r.Run
			}
			read++
			if r.Run != sum.Run {
				return fmt.Errorf("replay: rows of two runs (%s, %s): replay one run at a time", sum.Run, r.Run)
			}
			// Anchor groups absorbed in time (used, or executed with too few
			// scores and fused on the world model) and late ones' pairs.
			if r.AbsorbedSeq > 0 && (r.IsAnchor || r.Source == archive.SourceLateAnchor) {
				key := groupKey{r.Step, r.GroupID}
				a := groups[key]
				if a == nil {
					a = &absorption{seq: r.AbsorbedSeq, step: r.Step, group: r.GroupID}
					groups[key] = a
				}
				// Copies: a row's scores point into its row group's column.
				a.items = append(a.items, pairItem{traj: r.TrajID, predicted: archive.Detach(r.Predicted), trueScore: archive.Detach(r.TrueScore)})
			}
			if r.Source == archive.SourceLateAnchor {
				if r.Predicted != nil && r.TrueScore != nil { // a pair, not an ungraded trajectory's execution
					sum.LatePairs++
				}
				continue
			}
			s := steps[r.Step]
			if s == nil {
				s = &stepRows{step: r.Step, cseq: r.CalibrationSeq, ts: r.TS}
				steps[r.Step] = s
			}
			s.n++
			sum.Rows++
		}
		return nil
	})
	if err != nil {
		return sum, err
	}
	if read == 0 {
		return sum, fmt.Errorf("replay: no rows")
	}
	recorded := opt.Settings.AnchorFraction
	keep := func(step int64, group string) bool {
		if opt.AnchorFraction <= 0 || recorded <= 0 || opt.AnchorFraction >= recorded {
			return true
		}
		h := fnv.New64a()
		fmt.Fprintf(h, "%s/%d/%s", sum.Run, step, group)
		return float64(h.Sum64()>>11)/(1<<53) < opt.AnchorFraction/recorded
	}
	var events []*absorption
	for _, a := range groups {
		events = append(events, a)
	}
	slices.SortFunc(events, func(x, y *absorption) int { return cmp.Compare(x.seq, y.seq) })
	for i, a := range events {
		if i > 0 && a.seq == events[i-1].seq {
			return sum, fmt.Errorf("replay: groups %d/%s and %d/%s both absorbed at seq %d", a.step, a.group, events[i-1].step, events[i-1].group, a.seq)
		}
		for gap := int64(1); i == 0 && gap < a.seq || i > 0 && events[i-1].seq+gap < a.seq; gap++ {
			prev := int64(0)
			if i > 0 {
				prev = events[i-1].seq
			}
			sum.Gaps = append(sum.Gaps, prev+gap)
		}
	}
	order := make([]*stepRows, 0, len(steps))
	for _, s := range steps {
		order = append(order, s)
	}
	slices.SortFunc(order, func(x, y *stepRows) int {
		return cmp.Or(cmp.Compare(x.cseq, y.cseq), cmp.Compare(x.step, y.step))
	})

	deb, err := calibrate.NewDebiaser(opt.Settings.Debiaser)
	if err != nil {
		return sum, fmt.Errorf("replay: %w", err)
	}
	cal := &calibrate.Stage{RunID: sum.Run, Deb: deb}
	asm, err := fuse.NewSteps(fuse.StepsConfig{Run: sum.Run, Debias: opt.Settings.Debias, Denoiser: opt.Settings.Denoiser, AnchorDeadline: time.Hour})
	if err != nil {
		return sum, fmt.Errorf("replay: %w", err)
	}
	absorb := func(a *absorption) error {
		if !keep(a.step, a.group) {
			sum.DroppedAnchors++
			return nil
		}
		sum.AnchorGroups++
		p := schemas.Prediction{Schema: schemas.Version, Run: sum.Run, Step: a.step, GroupID: a.group, Anchor: true}
		e := schemas.Execution{Schema: schemas.Version, Run: sum.Run, Step: a.step, GroupID: a.group}
		for _, it := range a.items {
			p.Items = append(p.Items, schemas.PredItem{TrajID: it.traj, Score: it.predicted})
			e.Items = append(e.Items, schemas.ExecItem{TrajID: it.traj, Score: it.trueScore})
		}
		data, err := json.Marshal(pair.Pairs(p, e))
		if err != nil {
			return err
		}
		c, err := cal.Absorb(data)
		if err != nil || c == nil {
			return fmt.Errorf("replay: absorb %d/%s: %v", a.step, a.group, err)
		}
		return asm.AddCalibration(*c)
	}
	next, nextEvent := 0, 0
	var agree, total int
	// replayReady replays, in order, the steps whose rows have all come.
	replayReady := func() error {
		for ; next < len(order) && len(order[next].rows) == order[next].n; next++ {
			s := order[next]
			for nextEvent < len(events) && events[nextEvent].seq <= s.cseq {
				if err := absorb(events[nextEvent]); err != nil {
					return err
				}
				nextEvent++
			}
			rep := replayStep(asm, sum.Run, s, keep)
			s.rows, s.done = nil, true
			for _, it := range rep.Items {
				if math.Signbit(it.FusedAdvantage) == math.Signbit(it.Row.FusedAdvantage) || it.FusedAdvantage == it.Row.FusedAdvantage {
					agree++
				}
				total++
			}
			sum.MaxFusedDiff = max(sum.MaxFusedDiff, rep.MaxFusedDiff)
			sum.MaxCalibratedDiff = max(sum.MaxCalibratedDiff, rep.MaxCalibratedDiff)
			sum.Steps++
			if report != nil {
				report(rep)
			}
		}
		return nil
	}
	changed := func(step int64) error {
		return fmt.Errorf("replay: the rows changed between the two reads (step %d's): was the archive written to meanwhile?", step)
	}
	err = src(nil, func(rows []archive.Row) error {
		for _, r := range rows {
			if r.Source == archive.SourceLateAnchor {
				continue
			}
			s := steps[r.Step]
			if s == nil || s.done || len(s.rows) == s.n {
				return changed(r.Step)
			}
			if s.rows == nil {
				s.rows = make([]archive.Row, 0, s.n)
			}
			s.rows = append(s.rows, r)
		}
		return replayReady()
	})
	if err != nil {
		return sum, err
	}
	if next < len(order) {
		return sum, changed(order[next].step)
	}
	for ; nextEvent < len(events); nextEvent++ {
		if err := absorb(events[nextEvent]); err != nil {
			return sum, err
		}
	}
	if total > 0 {
		sum.SignAgreement = float64(agree) / float64(total)
	}
	return sum, nil
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
