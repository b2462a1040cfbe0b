package pipeline

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

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

// stateStore opens the prefix's checkpoint bucket, once per process,
// waiting out a full store (openWithRoom).
func (p *Pipeline) stateStore(ctx context.Context) (*natsjs.StateStore, error) {
	if p.state == nil {
		var st *natsjs.StateStore
		said := p.bucketRemade(StateBucket(p.cfg.Prefix), "its stages' next checkpoints are written to it, and a restart before them rebuilds those stages from what the stream retains")
		err := p.openWithRoom(ctx, "bucket "+StateBucket(p.cfg.Prefix), roomToMake, func(ctx context.Context) (err error) {
			st, err = natsjs.OpenStore(ctx, p.tr.js, natsjs.StoreConfig{
				Bucket: StateBucket(p.cfg.Prefix), Description: "wmrl stage checkpoints",
				Replicas: p.cfg.Replicas, // the stream's, resolved at connect
				Remade: func(bucket string) {
					said(bucket)
					if st := p.calibrate.Load(); st != nil {
						st.RecordLost() // its record's parts went with the bucket
					}
				},
			})
			return err
		})
		if err != nil {
			return nil, err
		}
		p.state = st
	}
	return p.state, nil
}

// storedCheckpoint is a checkpoint as the bucket keeps it: with the
// creation time of the stream whose messages it stands for, so that one
// outliving its stream (deleted and made anew) is known.
type storedCheckpoint[T any] struct {
	StreamCreated time.Time `json:"stream_created"`
	Checkpoint    T         `json:"checkpoint"`
}

// loadCheckpoint reads stage's checkpoint for the run; ok is false when
// there is none. One made from another stream is an error naming the key.
// A bucket that does not answer yet (a fresh cluster) is waited for up to
// StartupWait, and a full store for as long as it lasts.
func loadCheckpoint[T any](ctx context.Context, p *Pipeline, stage string) (store *natsjs.StateStore, cp T, ok bool, err error) {
	if store, err = p.stateStore(ctx); err != nil {
		return nil, cp, false, err
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.StartupWait)
	defer cancel()
	var sc storedCheckpoint[T]
	if ok, err = store.Load(ctx, checkpointKey(p.cfg.Run, stage), &sc); err != nil || !ok {
		return store, cp, false, err
	}
	if created := p.tr.created; !sc.StreamCreated.Equal(created) {
		return nil, cp, false, fmt.Errorf("%s: the checkpoint of run %s was made from stream %s as created at %s, but the stream now was created at %s: "+
			"it was deleted and made anew, and the checkpoint belongs to the old one; start a new run (--run NAME), or delete key %s of bucket %s to start this one over",
			stage, p.cfg.Run, p.tr.stream, sc.StreamCreated.Format(time.RFC3339Nano), created.Format(time.RFC3339Nano), checkpointKey(p.cfg.Run, stage), StateBucket(p.cfg.Prefix))
	}
	return store, sc.Checkpoint, true, nil
}

// notef prints a line about the process's own state, unless quiet.
func (p *Pipeline) notef(format string, args ...any) {
	if !p.cfg.Quiet {
		fmt.Fprintf(p.cfg.Out, format+"\n", args...)
	}
}

// bucketRemade is what the process's key-value bucket calls when it was
// found gone from the server (deleted by hand, or by a tool that cleans
// up) and made anew: it says so, and then, what follows for the run, and
// counts it (at 0 from the start, so that an increase is defined).
func (p *Pipeline) bucketRemade(bucket, then string) func(string) {
	remade := p.metrics.BucketsRemade.WithLabelValues(bucket)
	return func(string) {
		remade.Inc()
		p.notef("the key-value bucket %s was gone from the NATS server at %s (deleted?), and this process made it anew: %s", bucket, p.tr.url, then)
	}
}

// takenOver says whether another process took stage over from this one:
// it keeps the stage's state, and this one writes none over it.
func (p *Pipeline) takenOver(stage string) bool {
	_, lost := p.leaseLost.Load(stage)
	return lost
}

// saver stores a stage's checkpoints under its key and counts them.
func saver[T any](p *Pipeline, st *natsjs.StateStore, stage string) (save func(context.Context, T) error, onErr func(error)) {
	key := checkpointKey(p.cfg.Run, stage)
	save = func(ctx context.Context, c T) error {
		if p.takenOver(stage) {
			// The process that took the stage over keeps its checkpoints;
			// this one's, older, would replace theirs.
			p.notef("%s: no checkpoint saved: another process runs this stage now", stage)
			return nil
		}
		if err := st.Save(ctx, key, storedCheckpoint[T]{StreamCreated: p.tr.created, Checkpoint: c}); err != nil {
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
	store, cp, ok, err := loadCheckpoint[calibrate.Checkpoint](ctx, p, StageCalibrate)
	if err != nil {
		return err
	}
	seen, err := p.loadSeen(ctx, store, cp, ok && st.Resumes(cp) && cp.SeenKept)
	if err != nil {
		return err
	}
	switch {
	case ok && st.Resumes(cp):
		st.Resume, st.ResumeSeen = &cp, seen
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
	p.calibrate.Store(st)
	st.SaveSeen = func(ctx context.Context, part uint64, keys map[string]uint64) error {
		if p.takenOver(StageCalibrate) {
			return nil // as for the checkpoints: the process that took calibrate over keeps its own
		}
		return store.Save(ctx, seenKey(p.cfg.Run, part), keys)
	}
	st.DropSeen = func(ctx context.Context, part uint64) error {
		if p.takenOver(StageCalibrate) {
			return nil
		}
		return store.Delete(ctx, seenKey(p.cfg.Run, part))
	}
	return nil
}

// seenPrefix is the prefix of the keys of the parts of calibrate's record
// of the pair groups it absorbed, seenKey one part's, named by the highest
// stream sequence in it.
func seenPrefix(run string) string { return checkpointKey(run, StageCalibrate+"_seen") }

func seenKey(run string, part uint64) string {
	return seenPrefix(run) + "." + strconv.FormatUint(part, 10)
}

// loadSeen reads the parts of calibrate's record of the pair groups it
// absorbed. With use, it returns the record that cp's parts hold, or nil
// when one is missing (the bucket was deleted, or a part by hand): the
// stage then reads every retained pair group to know them, and its next
// checkpoints save a record anew. The parts no checkpoint will use (left
// by a checkpoint that failed after them, or by the record replaced) are
// deleted.
func (p *Pipeline) loadSeen(ctx context.Context, store *natsjs.StateStore, cp calibrate.Checkpoint, use bool) (map[string]uint64, error) {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.StartupWait)
	defer cancel()
	parts := map[uint64]map[string]uint64{}
	prefix := seenPrefix(p.cfg.Run)
	if err := store.LoadAll(ctx, prefix, func(key string, value []byte) error {
		part, err := strconv.ParseUint(strings.TrimPrefix(key, prefix+"."), 10, 64)
		if err != nil {
			return nil // not a part's key: another run's whose name begins as this one's does
		}
		var keys map[string]uint64
		if err := json.Unmarshal(value, &keys); err != nil {
			return fmt.Errorf("calibrate: key %s of bucket %s: %w", key, StateBucket(p.cfg.Prefix), err)
		}
		parts[part] = keys
		return nil
	}); err != nil {
		return nil, err
	}
	var seen map[string]uint64
	if use {
		seen = map[string]uint64{}
		for _, part := range cp.SeenParts {
			keys, ok := parts[part]
			if !ok {
				p.notef("calibrate: part %d of the record of the anchor groups calibrated (key %s of bucket %s) is missing: "+
					"reading every retained pair group to know them, and saving the record anew",
					part, seenKey(p.cfg.Run, part), StateBucket(p.cfg.Prefix))
				seen = nil
				break
			}
			for key, seq := range keys {
				if seq <= cp.StreamSeq {
					seen[key] = seq
				}
			}
		}
	}
	if p.takenOver(StageCalibrate) {
		return seen, nil
	}
	for part := range parts {
		if seen == nil || !slices.Contains(cp.SeenParts, part) {
			if err := store.Delete(ctx, seenKey(p.cfg.Run, part)); err != nil {
				return nil, err
			}
		}
	}
	return seen, nil
}

// wireFuseCheckpoints does the same for fuse.
func (p *Pipeline) wireFuseCheckpoints(ctx context.Context, st *fuse.Stage) error {
	store, cp, ok, err := loadCheckpoint[fuse.Checkpoint](ctx, p, StageFuse)
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
