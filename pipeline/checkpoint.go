package pipeline

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/fuse"
)

// Calibrate and fuse carry state built from every anchor group of the run
// (the isotonic map's pairs and refit cadence, rho's running averages),
// while the stream keeps messages for --retention only. Each saves a
// checkpoint of that state in a key-value bucket, which nothing ages out,
// and a restart resumes from it and the retained messages after it.

// StateBucket is the key-value bucket of a prefix's checkpoints.
func StateBucket(prefix string) string {
	return "WMRL_STATE_" + strings.ToUpper(natsjs.SafeName(prefix))
}

// checkpointKey is a stage's checkpoint key for the run.
func checkpointKey(run, stage string) string { return run + "." + stage }

// stateStore opens the prefix's checkpoint bucket, once per process.
func (p *Pipeline) stateStore(ctx context.Context) (*natsjs.StateStore, error) {
	if p.state == nil {
		st, err := natsjs.OpenStateStore(ctx, p.tr.js, StateBucket(p.cfg.Prefix))
		if err != nil {
			return nil, err
		}
		p.state = st
	}
	return p.state, nil
}

// loadCheckpoint reads stage's checkpoint for the run into cp; ok is false
// when there is none.
func (p *Pipeline) loadCheckpoint(ctx context.Context, stage string, cp any) (store *natsjs.StateStore, ok bool, err error) {
	if store, err = p.stateStore(ctx); err != nil {
		return nil, false, err
	}
	ok, err = store.Load(ctx, checkpointKey(p.cfg.Run, stage), cp)
	return store, ok, err
}

// notef prints a line about the process's own state, unless quiet.
func (p *Pipeline) notef(format string, args ...any) {
	if !p.cfg.Quiet {
		fmt.Fprintf(p.cfg.Out, format+"\n", args...)
	}
}

// saver stores a stage's checkpoints under its key and counts them.
func saver[T any](p *Pipeline, st *natsjs.StateStore, stage string) (save func(context.Context, T) error, onErr func(error)) {
	key := checkpointKey(p.cfg.Run, stage)
	save = func(ctx context.Context, c T) error {
		if err := st.Save(ctx, key, c); err != nil {
			return err
		}
		p.metrics.Checkpoints.WithLabelValues(stage).Inc()
		return nil
	}
	onErr = func(err error) {
		p.metrics.CheckpointErrors.WithLabelValues(stage).Inc()
		p.notef("%s: checkpoint not saved (a restart rebuilds from the retained messages instead): %v", stage, err)
	}
	return save, onErr
}

// wireCalibrateCheckpoints resumes st from its checkpoint and has it save
// new ones. Without a checkpoint, st replays the retained pair groups,
// which only works while they are all the run's: retained is how many the
// stream holds.
func (p *Pipeline) wireCalibrateCheckpoints(ctx context.Context, st *calibrate.Stage, retained uint64) error {
	var cp calibrate.Checkpoint
	store, ok, err := p.loadCheckpoint(ctx, StageCalibrate, &cp)
	if err != nil {
		return err
	}
	if ok {
		state, err := p.tr.state(ctx)
		if err != nil {
			return err
		}
		if last := state.LastSeq; cp.StreamSeq > last {
			return fmt.Errorf("calibrate: the checkpoint of run %s stands for the stream's messages up to %d, but stream %s ends at %d: "+
				"the stream was deleted and made anew, and the checkpoint belongs to the old one; start a new run (--run NAME), or delete key %s of bucket %s to start this one over",
				p.cfg.Run, cp.StreamSeq, p.tr.stream, last, checkpointKey(p.cfg.Run, StageCalibrate), StateBucket(p.cfg.Prefix))
		}
	}
	switch {
	case ok && st.Resumes(cp):
		st.Resume = &cp
	case ok:
		was, _ := json.Marshal(cp.Debiaser.Config)
		now, _ := json.Marshal(st.Deb.Config())
		p.notef("calibrate: the checkpoint was made with other calibration settings (%s, now %s); rebuilding the map from the retained pairs under the new ones", was, now)
		st.Resume = &cp
	case retained < uint64(st.Published):
		return fmt.Errorf("calibrate: %d anchor groups of run %s were calibrated, the stream holds the pairs of %d (--retention aged out the rest) and there is no checkpoint to resume from: "+
			"the calibration cannot be rebuilt; start a new run (--run NAME), or keep the stream longer", st.Published, p.cfg.Run, retained)
	}
	st.Save, st.OnSaveError = saver[calibrate.Checkpoint](p, store, StageCalibrate)
	st.CheckpointEvery = p.cfg.CheckpointEvery
	return nil
}

// wireFuseCheckpoints does the same for fuse.
func (p *Pipeline) wireFuseCheckpoints(ctx context.Context, st *fuse.Stage) error {
	var cp fuse.Checkpoint
	store, ok, err := p.loadCheckpoint(ctx, StageFuse, &cp)
	if err != nil {
		return err
	}
	if ok {
		if err := st.Restore(cp); err != nil {
			p.notef("%v; rebuilding rho from the retained calibrations under the new settings", err)
		}
	}
	st.Save, st.OnSaveError = saver[fuse.Checkpoint](p, store, StageFuse)
	st.CheckpointEvery = p.cfg.CheckpointEvery
	return nil
}
