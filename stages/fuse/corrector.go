package fuse

import (
	"fmt"

	"github.com/wmrl/wmrl/stages/calibrate"
)

// CorrectorConfig selects the two corrections of WMRL.
type CorrectorConfig struct {
	// Debias maps world-model scores through the online isotonic fit; off,
	// they are used raw (the map is still learned, for audits).
	Debias   bool                     `json:"debias"`
	Debiaser calibrate.DebiaserConfig `json:"debiaser"`
	// Denoiser.Estimator EstimatorOff turns denoising off (rho = 1).
	Denoiser DenoiserConfig `json:"denoiser"`
}

// DefaultCorrectorConfig: both corrections on, reference debiaser, the
// default rho estimator.
func DefaultCorrectorConfig() CorrectorConfig {
	return CorrectorConfig{Debias: true, Debiaser: calibrate.DefaultDebiaserConfig()}
}

// Corrector holds the learned state of both corrections and applies them in
// the order the estimator needs: an anchor group is scored with the map
// fitted before its own pairs were added (out-of-sample), except for the
// reference estimator, which pushes first (in-sample), as the released code
// does. Not safe for concurrent use.
type Corrector struct {
	cfg CorrectorConfig
	deb *calibrate.Debiaser
	den *Denoiser
}

// NewCorrector builds an untrained corrector.
func NewCorrector(cfg CorrectorConfig) (*Corrector, error) {
	deb, err := calibrate.NewDebiaser(cfg.Debiaser)
	if err != nil {
		return nil, err
	}
	den, err := NewDenoiser(cfg.Denoiser)
	if err != nil {
		return nil, err
	}
	cfg.Debiaser, cfg.Denoiser = deb.Config(), den.Config()
	return &Corrector{cfg: cfg, deb: deb, den: den}, nil
}

// Config is the configuration in force.
func (c *Corrector) Config() CorrectorConfig { return c.cfg }

// Debiaser and Denoiser expose the parts, for metrics and snapshots.
func (c *Corrector) Debiaser() *calibrate.Debiaser { return c.deb }
func (c *Corrector) Denoiser() *Denoiser           { return c.den }

// Calibrate maps a world-model score to the reward used for a
// world-model-only group.
func (c *Corrector) Calibrate(pred float64) float64 {
	if !c.cfg.Debias {
		return pred
	}
	return c.deb.Predict(pred)
}

// Rho is the current anchor weight.
func (c *Corrector) Rho() float64 { return c.den.Rho() }

// AnchorGroupResult says what one anchor group did to the corrections.
type AnchorGroupResult struct {
	Counted bool    // the denoiser counted the group
	Refits  int     // map refits its pairs triggered
	Rho     float64 // rho after the group
}

// ObserveAnchorGroup feeds one executed anchor group: pred[i] the world
// model's score and truth[i] the true score of the i-th graded trajectory.
func (c *Corrector) ObserveAnchorGroup(pred, truth []float64) (AnchorGroupResult, error) {
	if len(pred) != len(truth) {
		return AnchorGroupResult{}, fmt.Errorf("fuse: anchor group has %d predictions, %d true scores", len(pred), len(truth))
	}
	var res AnchorGroupResult
	push := func() error {
		for i := range pred {
			refit, err := c.deb.Push(calibrate.Pair{Predicted: pred[i], True: truth[i]})
			if err != nil {
				return fmt.Errorf("fuse: anchor pair %d: %w", i, err)
			}
			if refit {
				res.Refits++
			}
		}
		return nil
	}
	if c.cfg.Denoiser.InSample() {
		if err := push(); err != nil {
			return res, err
		}
	}
	cal := make([]float64, len(pred))
	for i, p := range pred {
		cal[i] = c.Calibrate(p)
	}
	res.Rho, res.Counted = c.den.Observe(cal, truth)
	if !c.cfg.Denoiser.InSample() {
		if err := push(); err != nil {
			return res, err
		}
	}
	return res, nil
}

// CorrectorState is a Corrector's whole state; it round-trips through JSON.
type CorrectorState struct {
	Debias   bool                    `json:"debias"`
	Debiaser calibrate.DebiaserState `json:"debiaser"`
	Denoiser DenoiserState           `json:"denoiser"`
}

// Snapshot copies the state.
func (c *Corrector) Snapshot() CorrectorState {
	return CorrectorState{Debias: c.cfg.Debias, Debiaser: c.deb.Snapshot(), Denoiser: c.den.Snapshot()}
}

// RestoreCorrector rebuilds a corrector from a snapshot.
func RestoreCorrector(s CorrectorState) (*Corrector, error) {
	deb, err := calibrate.RestoreDebiaser(s.Debiaser)
	if err != nil {
		return nil, err
	}
	den, err := RestoreDenoiser(s.Denoiser)
	if err != nil {
		return nil, err
	}
	return &Corrector{
		cfg: CorrectorConfig{Debias: s.Debias, Debiaser: deb.Config(), Denoiser: den.Config()},
		deb: deb, den: den,
	}, nil
}
