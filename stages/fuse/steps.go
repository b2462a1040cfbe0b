package fuse

import (
	"cmp"
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/stepset"
)

// Steps assembles a run's steps from their plan, predictions, executions
// and the calibration stream, and fuses each into an Update. Pure: time
// comes in as arguments. Not safe for concurrent use.
type Steps struct {
	run      string
	debias   bool
	norm     Normalization
	deadline time.Duration
	den      *Denoiser

	open      map[int64]*stepAsm
	published stepset.Set
	absorbed  map[anchorGroup]absorbed // the anchor groups calibrated, of steps not published
	cal       *calibrate.Isotonic
	version   int64
	pairs     int64
	seq       int64
	restored  int64 // calibrations up to this Seq are in the restored checkpoint
}

// Checkpoint is the state the calibration stream builds, once every
// Calibration up to Seq is absorbed: the map in force and the denoiser.
// Restored, it stands for those calibrations, so a restart needs only the
// ones after it (those before may have aged out of the stream).
type Checkpoint struct {
	// StreamSeq is the stream sequence of the last calibration read,
	// valid or not (0 in a checkpoint from before it was kept).
	StreamSeq  uint64              `json:"stream_seq,omitempty"`
	Debias     bool                `json:"debias"`
	Seq        int64               `json:"seq"`
	Version    int64               `json:"version"`
	PairsTotal int64               `json:"pairs_total"`
	Map        *schemas.Thresholds `json:"map"`
	Denoiser   DenoiserState       `json:"denoiser"`
	// Absorbed are the calibrations of the anchor groups of the steps
	// not published when it was made. With them (AbsorbedKept; false in
	// a checkpoint from before they were kept), a restart reads only the
	// calibrations after StreamSeq; without, it reads every retained one
	// to find those steps' (the stream interleaves them with everything
	// else, so that read grows with the run).
	Absorbed     []AbsorbedGroup `json:"absorbed,omitempty"`
	AbsorbedKept bool            `json:"absorbed_kept,omitempty"`
}

// AbsorbedGroup is an anchor group's calibration as a step not yet
// published holds it: its Seq, and its pairs' out-of-sample calibrated
// predictions by trajectory.
type AbsorbedGroup struct {
	Step    int64              `json:"step"`
	GroupID string             `json:"group_id"`
	Seq     int64              `json:"seq"`
	Before  map[string]float64 `json:"before"`
}

// anchorGroup names an anchor group within the run.
type anchorGroup struct {
	step  int64
	group string
}

// absorbed is an anchor group's calibration: its seq and its pairs'
// out-of-sample calibrated predictions.
type absorbed struct {
	seq    int64
	before map[string]float64
}

type stepAsm struct {
	plan   *schemas.Plan
	planAt time.Time
	preds  map[string]*schemas.Prediction
	execs  map[string]*schemas.Execution
}

// StepsConfig configures Steps.
type StepsConfig struct {
	Run string
	// Debias applies the calibration map to world-model scores; off, they
	// are used raw.
	Debias   bool
	Denoiser DenoiserConfig
	Norm     Normalization
	// AnchorDeadline: anchor groups not executed and calibrated this long
	// after the plan arrived fall back to world-model rewards for the step.
	AnchorDeadline time.Duration
}

// NewSteps builds an empty assembler.
func NewSteps(cfg StepsConfig) (*Steps, error) {
	den, err := NewDenoiser(cfg.Denoiser)
	if err != nil {
		return nil, err
	}
	if cfg.Norm, err = ParseNormalization(string(cfg.Norm)); err != nil {
		return nil, err
	}
	if cfg.AnchorDeadline <= 0 {
		return nil, fmt.Errorf("%w: anchor deadline %v must be > 0", ErrConfig, cfg.AnchorDeadline)
	}
	return &Steps{
		run: cfg.Run, debias: cfg.Debias, norm: cfg.Norm, deadline: cfg.AnchorDeadline, den: den,
		open: map[int64]*stepAsm{}, absorbed: map[anchorGroup]absorbed{},
	}, nil
}

// Checkpoint copies the state the calibrations built.
func (s *Steps) Checkpoint() Checkpoint {
	c := Checkpoint{Debias: s.debias, Seq: s.seq, Version: s.version, PairsTotal: s.pairs, Denoiser: s.den.Snapshot(), AbsorbedKept: true}
	if s.cal != nil {
		x, y := s.cal.Thresholds()
		c.Map = &schemas.Thresholds{X: x, Y: y}
	}
	for k, a := range s.absorbed {
		c.Absorbed = append(c.Absorbed, AbsorbedGroup{Step: k.step, GroupID: k.group, Seq: a.seq, Before: a.before})
	}
	slices.SortFunc(c.Absorbed, func(a, b AbsorbedGroup) int {
		return cmp.Or(cmp.Compare(a.Seq, b.Seq), cmp.Compare(a.Step, b.Step), cmp.Compare(a.GroupID, b.GroupID))
	})
	return c
}

// Restore starts from a checkpoint: calibrations up to its Seq that arrive
// afterwards only tell which anchor groups are calibrated. A checkpoint
// made with other settings (debias, or the denoiser's) is refused and
// changes nothing: its rho was built from other numbers.
func (s *Steps) Restore(c Checkpoint) error {
	if c.Debias != s.debias || !reflect.DeepEqual(c.Denoiser.Config, s.den.Config()) {
		was, _ := json.Marshal(c.Denoiser.Config)
		now, _ := json.Marshal(s.den.Config())
		return fmt.Errorf("%w (debias %v, denoiser %s; now debias %v, denoiser %s)",
			ErrOtherSettings, c.Debias, was, s.debias, now)
	}
	den, err := RestoreDenoiser(c.Denoiser)
	if err != nil {
		return fmt.Errorf("fuse: checkpoint: %w", err)
	}
	var m *calibrate.Isotonic
	if c.Map != nil {
		if m, err = calibrate.NewIsotonic(c.Map.X, c.Map.Y); err != nil {
			return fmt.Errorf("fuse: checkpoint map: %w", err)
		}
	}
	s.den, s.cal, s.version, s.pairs, s.seq, s.restored = den, m, c.Version, c.PairsTotal, c.Seq, c.Seq
	for _, a := range c.Absorbed {
		s.markAbsorbed(anchorGroup{a.Step, a.GroupID}, absorbed{seq: a.Seq, before: a.Before})
	}
	return nil
}

// Denoiser exposes the rho estimator's state.
func (s *Steps) Denoiser() *Denoiser { return s.den }

// MarkPublished records a step whose update is stored already.
func (s *Steps) MarkPublished(step int64) { s.Close(step) }

// Published reports whether a step's update is stored.
func (s *Steps) Published(step int64) bool { return s.published.Has(step) }

func (s *Steps) step(n int64) *stepAsm {
	a := s.open[n]
	if a == nil {
		a = &stepAsm{preds: map[string]*schemas.Prediction{}, execs: map[string]*schemas.Execution{}}
		s.open[n] = a
	}
	return a
}

// AddPlan records a step's plan, received at now.
func (s *Steps) AddPlan(p schemas.Plan, now time.Time) {
	if s.published.Has(p.Step) {
		return
	}
	a := s.step(p.Step)
	if a.plan == nil {
		a.plan, a.planAt = &p, now
	}
}

// AddPrediction records a group's prediction.
func (s *Steps) AddPrediction(p schemas.Prediction) {
	if !s.published.Has(p.Step) {
		s.step(p.Step).preds[p.GroupID] = &p
	}
}

// AddExecution records an anchor group's execution. It reports false when
// the step was published already (the execution came too late for it).
func (s *Steps) AddExecution(e schemas.Execution) bool {
	if s.published.Has(e.Step) {
		return false
	}
	s.step(e.Step).execs[e.GroupID] = &e
	return true
}

// AddCalibration absorbs one Calibration, in stream order: the map in force
// and the anchor group's contribution to rho.
func (s *Steps) AddCalibration(c schemas.Calibration) error {
	if c.Seq <= s.restored {
		s.markCalibrated(c)
		return nil
	}
	if c.Map != nil {
		m, err := calibrate.NewIsotonic(c.Map.X, c.Map.Y)
		if err != nil { // from a stage that replaced calibrate
			return fmt.Errorf("%w: calibration %d (step %d, group %s): its map: %w", schemas.ErrInvalid, c.Seq, c.Step, c.GroupID, err)
		}
		s.cal = m
	} else {
		s.cal = nil
	}
	s.version, s.pairs, s.seq = c.Version, c.PairsTotal, c.Seq
	cal, truth := make([]float64, len(c.Pairs)), make([]float64, len(c.Pairs))
	for i, p := range c.Pairs {
		truth[i] = p.True
		switch {
		case !s.debias:
			cal[i] = p.Predicted
		case s.den.Config().InSample():
			cal[i] = p.After
		default:
			cal[i] = p.Before
		}
	}
	s.den.Observe(cal, truth)
	s.markCalibrated(c)
	return nil
}

// markCalibrated records an anchor group's calibration for its step.
func (s *Steps) markCalibrated(c schemas.Calibration) {
	before := make(map[string]float64, len(c.Pairs))
	for _, p := range c.Pairs {
		before[p.TrajID] = p.Before
	}
	s.markAbsorbed(anchorGroup{c.Step, c.GroupID}, absorbed{seq: c.Seq, before: before})
}

// markAbsorbed records an anchor group's calibration, unless its step is
// published already.
func (s *Steps) markAbsorbed(g anchorGroup, a absorbed) {
	if !s.published.Has(g.step) {
		s.absorbed[g] = a
	}
}

// Waiting is a planned step that still lacks some of its groups'
// predictions: Missing, of its Groups, since its plan came At.
type Waiting struct {
	Step    int64
	Missing []string
	Groups  int
	At      time.Time
}

// Waiting lists, in step order, the planned steps still missing a group's
// prediction whose plan came before since. A prediction has no deadline
// (an anchor group's execution has): a step waits for each of its groups,
// so one that no stage will ever predict (an outside stage between
// predict and fuse dead-lettered it) holds its step for good.
func (s *Steps) Waiting(since time.Time) []Waiting {
	var out []Waiting
	for n, a := range s.open {
		if a.plan == nil || !a.planAt.Before(since) {
			continue
		}
		var missing []string
		for _, g := range a.plan.Groups {
			if g.Dropped == "" && a.preds[g.GroupID] == nil {
				missing = append(missing, g.GroupID)
			}
		}
		if len(missing) > 0 {
			out = append(out, Waiting{Step: n, Missing: missing, Groups: len(a.plan.Groups), At: a.planAt})
		}
	}
	slices.SortFunc(out, func(a, b Waiting) int { return cmp.Compare(a.Step, b.Step) })
	return out
}

// Ready lists the steps that can be fused now, in step order: plan in,
// every group predicted, and every anchor group executed and calibrated or
// past its deadline.
func (s *Steps) Ready(now time.Time) []int64 {
	var out []int64
	for n, a := range s.open {
		if a.plan == nil {
			continue
		}
		ok := true
		late := now.Sub(a.planAt) >= s.deadline
		for _, g := range a.plan.Groups {
			if g.Dropped != "" {
				continue // never sent to be scored: nothing to wait for
			}
			if a.preds[g.GroupID] == nil {
				ok = false
				break
			}
			if g.Anchor && !late && (a.execs[g.GroupID] == nil || s.absorbed[anchorGroup{n, g.GroupID}].seq == 0) {
				ok = false
				break
			}
		}
		if ok {
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out
}

// Fuse builds step n's update. The step stays open until Close.
func (s *Steps) Fuse(n int64, now time.Time) schemas.Update {
	a := s.open[n]
	rho := s.den.Rho()
	u := schemas.Update{
		Schema: schemas.Version, Run: s.run, Step: n, Rho: rho, D: s.den.Signal(),
		CalibrationVersion: s.version, PairsTotal: s.pairs, CalibrationSeq: s.seq, ClosedAt: a.plan.ClosedAt, PublishedAt: now,
		Items: []schemas.UpdateItem{}, Skipped: []schemas.SkippedGroup{}, LateAnchors: []string{},
	}
	if !s.debias {
		u.CalibrationVersion = 0
	}
	if s.norm != Standardize {
		u.AdvantageNorm = string(s.norm)
	}
	groups := make([]Group, 0, len(a.plan.Groups))
	// By group and trajectory: what the numbers came from. Route keeps
	// trajectory ids unique within a step; a plan made before it did
	// still gives each item its own record.
	record := map[recordKey]schemas.UpdateItem{}
	dropped := map[string]string{} // group to why it was not sent
	for _, pg := range a.plan.Groups {
		if pg.Dropped != "" {
			dropped[pg.GroupID] = pg.Dropped
		}
		groups = append(groups, s.group(n, a, pg, &u, record))
	}
	res := Fuse(groups, rho, s.norm)
	u.Groups, u.Anchors = res.Groups, res.Anchors
	for _, sk := range res.Skipped {
		u.Skipped = append(u.Skipped, schemas.SkippedGroup{GroupID: sk.GroupID, Reason: cmp.Or(dropped[sk.GroupID], sk.Reason)})
	}
	for _, it := range res.Items {
		ui := record[recordKey{it.GroupID, it.TrajID}]
		ui.TrajID, ui.GroupID, ui.Source = it.TrajID, it.GroupID, it.Source
		ui.Advantage, ui.Weight, ui.FusedAdvantage = it.Advantage, it.Weight, it.FusedAdvantage
		if it.Graded {
			r := it.Reward
			ui.Reward = &r
		}
		u.Items = append(u.Items, ui)
	}
	nameModels(&u, a)
	return u
}

// nameModels says in u which world model scored step a: once for the
// step when one scored every group that was sent to be scored, else on
// each item (empty where a prediction named none).
func nameModels(u *schemas.Update, a *stepAsm) {
	models := map[string]string{} // group to the model of its prediction
	one, mixed := "", false
	for _, pg := range a.plan.Groups {
		p := a.preds[pg.GroupID]
		if pg.Dropped != "" || p == nil {
			continue
		}
		if len(models) == 0 {
			one = p.Model
		}
		models[pg.GroupID] = p.Model
		mixed = mixed || p.Model != one
	}
	if !mixed {
		u.WMModel = one
		return
	}
	for i := range u.Items {
		u.Items[i].WMModel = models[u.Items[i].GroupID]
	}
}

// recordKey is a trajectory of a step's update: its group and its ID.
type recordKey struct{ group, traj string }

// group is planned group pg of step n as Fuse takes it: each trajectory's
// reward, the truth where it was executed in time, else the calibrated
// prediction. It records in record what each trajectory's numbers came
// from, and in u the group if it is a late or failed anchor group.
func (s *Steps) group(n int64, a *stepAsm, pg schemas.PlanGroup, u *schemas.Update, record map[recordKey]schemas.UpdateItem) Group {
	g := Group{ID: pg.GroupID}
	preds := map[string]schemas.PredItem{}
	if pg.Dropped == "" {
		for _, it := range a.preds[pg.GroupID].Items {
			preds[it.TrajID] = it
		}
	}
	// An anchor group counts as one once executed and calibrated; at its
	// deadline without both it is late: world-model rewards here, and its
	// pairs reach the calibration (and the archive) later. One executed
	// with fewer than two scores cannot be ranked on them: world-model
	// rewards too, rather than dropping the group.
	execs := map[string]schemas.ExecItem{}
	e := a.execs[pg.GroupID]
	cal := s.absorbed[anchorGroup{n, pg.GroupID}]
	executed := pg.Anchor && e != nil && cal.seq > 0
	g.Anchor = executed && scored(e) >= 2
	switch {
	case executed && !g.Anchor:
		u.FailedAnchors = append(u.FailedAnchors, pg.GroupID)
	case pg.Anchor && !g.Anchor:
		u.LateAnchors = append(u.LateAnchors, pg.GroupID)
	}
	if executed {
		for _, it := range e.Items {
			execs[it.TrajID] = it
		}
	}
	for i, id := range pg.TrajIDs {
		rec := schemas.UpdateItem{TaskID: pg.TaskID, WMStatus: schemas.PredUngraded}
		if pg.Dropped != "" {
			rec.WMStatus = schemas.PredNotSent
		}
		if i < len(pg.PolicyVersions) {
			rec.PolicyVersion = pg.PolicyVersions[i]
		}
		p, predicted := preds[id]
		if predicted {
			rec.Predicted, rec.WMStatus = p.Score, p.Status
			if pg.Anchor { // where a truth is, to set them against
				rec.WMVerdict, rec.WMRationale = p.Verdict, p.Rationale
			}
		}
		item := Item{TrajID: id}
		if executed {
			if x, ok := execs[id]; ok {
				sec := x.Seconds
				rec.TrueScore, rec.ExecStatus, rec.ExecSeconds, rec.ExecDetail = x.Score, x.Status, &sec, x.Detail
				rec.ExecCopyOf, rec.ExecCopyStep, rec.ExecCopyGroup = x.CopyOf, x.CopyStep, x.CopyGroup
			}
			rec.AbsorbedSeq = cal.seq
		}
		if g.Anchor {
			item.Graded = rec.TrueScore != nil
			if b, ok := cal.before[id]; ok {
				rec.Calibrated = &b
			}
		} else if predicted && p.Score != nil {
			item.Graded = true
			c := s.calibrate(*p.Score)
			rec.Calibrated = &c
		}
		switch {
		case !item.Graded:
		case g.Anchor:
			item.Reward = *rec.TrueScore
		default:
			item.Reward = *rec.Calibrated
		}
		record[recordKey{pg.GroupID, id}] = rec
		g.Items = append(g.Items, item)
	}
	return g
}

// scored counts the trajectories of e with a score.
func scored(e *schemas.Execution) int {
	n := 0
	for _, it := range e.Items {
		if it.Score != nil {
			n++
		}
	}
	return n
}

func (s *Steps) calibrate(x float64) float64 {
	if !s.debias || s.cal == nil {
		return x
	}
	return s.cal.Predict(x)
}

// Close marks step n published and forgets its inputs.
func (s *Steps) Close(n int64) {
	delete(s.open, n)
	s.published.Add(n)
	for k := range s.absorbed {
		if k.step == n {
			delete(s.absorbed, k)
		}
	}
}

// Open is the number of steps being assembled.
func (s *Steps) Open() int { return len(s.open) }
