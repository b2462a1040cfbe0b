package fuse

import (
	"fmt"
	"slices"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/calibrate"
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
	published map[int64]bool
	absorbed  map[string]bool // "step/group" of anchor groups calibrated
	cal       *calibrate.Isotonic
	version   int64
	pairs     int64
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
	if cfg.Norm == "" {
		cfg.Norm = Standardize
	}
	if cfg.AnchorDeadline <= 0 {
		return nil, fmt.Errorf("%w: anchor deadline %v must be > 0", ErrConfig, cfg.AnchorDeadline)
	}
	return &Steps{
		run: cfg.Run, debias: cfg.Debias, norm: cfg.Norm, deadline: cfg.AnchorDeadline, den: den,
		open: map[int64]*stepAsm{}, published: map[int64]bool{}, absorbed: map[string]bool{},
	}, nil
}

// Denoiser exposes the rho estimator's state.
func (s *Steps) Denoiser() *Denoiser { return s.den }

// MarkPublished records a step whose update is stored already.
func (s *Steps) MarkPublished(step int64) { s.published[step] = true; delete(s.open, step) }

// Published reports whether a step's update is stored.
func (s *Steps) Published(step int64) bool { return s.published[step] }

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
	if s.published[p.Step] {
		return
	}
	a := s.step(p.Step)
	if a.plan == nil {
		a.plan, a.planAt = &p, now
	}
}

// AddPrediction records a group's prediction.
func (s *Steps) AddPrediction(p schemas.Prediction) {
	if !s.published[p.Step] {
		s.step(p.Step).preds[p.GroupID] = &p
	}
}

// AddExecution records an anchor group's execution. It reports false when
// the step was published already (the execution came too late for it).
func (s *Steps) AddExecution(e schemas.Execution) bool {
	if s.published[e.Step] {
		return false
	}
	s.step(e.Step).execs[e.GroupID] = &e
	return true
}

// AddCalibration absorbs one Calibration, in stream order: the map in force
// and the anchor group's contribution to rho.
func (s *Steps) AddCalibration(c schemas.Calibration) error {
	if c.Map != nil {
		m, err := calibrate.NewIsotonic(c.Map.X, c.Map.Y)
		if err != nil {
			return fmt.Errorf("fuse: calibration %d: %w", c.Seq, err)
		}
		s.cal = m
	} else {
		s.cal = nil
	}
	s.version, s.pairs = c.Version, c.PairsTotal
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
	if !s.published[c.Step] {
		s.absorbed[fmt.Sprintf("%d/%s", c.Step, c.GroupID)] = true
	}
	return nil
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
			if a.preds[g.GroupID] == nil {
				ok = false
				break
			}
			if g.Anchor && !late && (a.execs[g.GroupID] == nil || !s.absorbed[fmt.Sprintf("%d/%s", n, g.GroupID)]) {
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
		CalibrationVersion: s.version, PairsTotal: s.pairs, ClosedAt: a.plan.ClosedAt, PublishedAt: now,
		Items: []schemas.UpdateItem{}, Skipped: []schemas.SkippedGroup{}, LateAnchors: []string{},
	}
	if !s.debias {
		u.CalibrationVersion = 0
	}
	groups := make([]Group, 0, len(a.plan.Groups))
	for _, pg := range a.plan.Groups {
		g := Group{ID: pg.GroupID}
		if e := a.execs[pg.GroupID]; pg.Anchor && e != nil {
			g.Anchor = true
			byID := map[string]schemas.ExecItem{}
			for _, it := range e.Items {
				byID[it.TrajID] = it
			}
			for _, id := range pg.TrajIDs {
				it, ok := byID[id]
				item := Item{TrajID: id, Graded: ok && it.Score != nil}
				if item.Graded {
					item.Reward = *it.Score
				}
				g.Items = append(g.Items, item)
			}
		} else {
			if pg.Anchor {
				u.LateAnchors = append(u.LateAnchors, pg.GroupID)
			}
			byID := map[string]schemas.PredItem{}
			for _, it := range a.preds[pg.GroupID].Items {
				byID[it.TrajID] = it
			}
			for _, id := range pg.TrajIDs {
				it, ok := byID[id]
				item := Item{TrajID: id, Graded: ok && it.Score != nil}
				if item.Graded {
					item.Reward = s.calibrate(*it.Score)
				}
				g.Items = append(g.Items, item)
			}
		}
		groups = append(groups, g)
	}
	res := Fuse(groups, rho, s.norm)
	u.Groups, u.Anchors = res.Groups, res.Anchors
	for _, sk := range res.Skipped {
		u.Skipped = append(u.Skipped, schemas.SkippedGroup{GroupID: sk.GroupID, Reason: sk.Reason})
	}
	for _, it := range res.Items {
		ui := schemas.UpdateItem{TrajID: it.TrajID, GroupID: it.GroupID, Source: it.Source,
			Advantage: it.Advantage, Weight: it.Weight, FusedAdvantage: it.FusedAdvantage}
		if it.Graded {
			r := it.Reward
			ui.Reward = &r
		}
		u.Items = append(u.Items, ui)
	}
	return u
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
	s.published[n] = true
	prefix := fmt.Sprintf("%d/", n)
	for k := range s.absorbed {
		if len(k) > len(prefix) && k[:len(prefix)] == prefix {
			delete(s.absorbed, k)
		}
	}
}

// Open is the number of steps being assembled.
func (s *Steps) Open() int { return len(s.open) }
