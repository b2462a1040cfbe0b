package calibrate

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"runtime/debug"
	"slices"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
)

// Source yields the run's pair groups in stream order, from the first
// retained one, then follows new ones.
type Source interface {
	Next(ctx context.Context) (Input, error)
}

// Input is one message read in stream order (a pair group, for
// calibrate) and its stream sequence.
type Input struct {
	Data []byte
	Seq  uint64
}

// Checkpoint is the stage's state once the pair groups up to stream
// sequence StreamSeq are absorbed and their calibrations stored. Restored,
// it stands for all of them, so a restart needs only the messages after
// it: those before may have aged out of the stream.
type Checkpoint struct {
	StreamSeq uint64        `json:"stream_seq"`
	Seq       int64         `json:"seq"`
	Debiaser  DebiaserState `json:"debiaser"`
	// SeenParts name the parts of the record of the pair groups absorbed
	// (Stage.SaveSeen) that together hold every one up to StreamSeq the
	// stream still retains, saved before the checkpoint. With them
	// (SeenKept; false in a checkpoint from before they were kept), a
	// restart reads only the pair groups after StreamSeq; without, it
	// reads every retained one to know them (the stream interleaves them
	// with everything else, so that read grows with the run).
	SeenParts []uint64 `json:"seen_parts,omitempty"`
	SeenKept  bool     `json:"seen_kept,omitempty"`
}

// DefaultSeenPartKeys is how many pair groups a part of the record holds
// at most unless configured: about 100 KB, well under a NATS server's
// smallest max_payload.
const DefaultSeenPartKeys = 4096

// DefaultCheckpointEvery is how many anchor groups pass between
// checkpoints unless configured.
const DefaultCheckpointEvery = 256

// Stage is the calibrate stage. It owns the run's Debiaser. On start it
// restores its checkpoint, if any, and replays the retained pair groups
// after it in order, which rebuilds exactly the map and version it had;
// with no checkpoint it replays every retained pair group. It publishes a
// Calibration for each group after the last one already published.
// One calibrate stage per run.
type Stage struct {
	RunID string
	Out   string // calibration subject
	Pub   message.Publisher
	Deb   *Debiaser
	// Published is the Seq of the last Calibration already stored (0: none).
	Published int64
	// DeadLetter receives pair groups that cannot be used.
	DeadLetter func(in Input, reason error)
	// OnCalibration, if set, sees every Calibration (metrics, progress).
	OnCalibration func(schemas.Calibration)
	// Resume, if set, is the checkpoint to start from; groups after its
	// StreamSeq are numbered from its Seq. Made with Deb's configuration,
	// it replaces Deb, and the pair groups at or before its StreamSeq are
	// only remembered (so that a copy arriving later is known), or not
	// read at all with ResumeSeen. Made with another, Deb is rebuilt from
	// the retained pair groups under the configuration in force, those
	// before the checkpoint absorbed without publishing (their
	// calibrations were published before).
	Resume *Checkpoint
	// ResumeSeen, if set, is the record of the pair groups absorbed that
	// Resume's SeenParts hold, by key, with the stream sequence each came
	// at: Source then starts after Resume's StreamSeq (ReadsAfter).
	ResumeSeen map[string]uint64
	// SaveSeen, if set, stores a part of the record of the pair groups
	// absorbed (each group's key and the stream sequence it came at),
	// named by the highest sequence in it, before
	// each checkpoint; the checkpoint lists the parts. DropSeen, if set,
	// deletes a part, once the stream has aged out every group in it and
	// a checkpoint no longer lists it.
	SaveSeen func(ctx context.Context, part uint64, keys map[string]uint64) error
	DropSeen func(ctx context.Context, part uint64) error
	// SeenPartKeys bounds a part (default DefaultSeenPartKeys).
	SeenPartKeys int
	// Save, if set, stores a checkpoint every CheckpointEvery groups
	// (default DefaultCheckpointEvery) and when Run ends; its error goes
	// to OnSaveError and the stage carries on (the stream still holds what
	// a restart needs, for its retention).
	Save            func(ctx context.Context, c Checkpoint) error
	CheckpointEvery int
	OnSaveError     func(error)
	// Skip, if set, names the pair groups, by stream sequence, to pass
	// over: those whose absorption panicked before, so that a restart
	// does not meet them again.
	Skip func(seq uint64) bool
	// Panicked, if set, hears of a panic taking in (a bug that in set
	// off) with its value and stack: it keeps in to be sent again once the
	// bug is fixed and has Skip name it from then on. Run returns its
	// error at once, with no checkpoint (the state may be half-changed;
	// a restart rebuilds it). Unset, the panic goes on.
	Panicked func(in Input, v any, stack []byte) error
	// FirstRetained, if set, is the stream sequence of the oldest message
	// the stream still holds, asked every CheckpointEvery groups read. A
	// pair group before it cannot come again (the executions and
	// predictions it was paired from are older still, and gone too), so
	// the stage forgets that it absorbed it, as a restart, which reads the
	// retained groups alone, does. Unset, that record grows by an entry an
	// anchor group for as long as the process runs.
	FirstRetained func(ctx context.Context) (uint64, error)

	seq     int64
	seen    map[string]uint64 // by groupKey, the pair groups absorbed or remembered: the stream sequence each came at (0: not from a stream)
	oldest  uint64            // the lowest sequence in seen but 0 (0: none)
	stored  uint64            // stream sequence of the last group whose calibration is stored
	saved   uint64            // ... as of the last checkpoint
	pending map[string]uint64 // the part of seen in no part saved (SaveSeen)
	parts   []uint64          // the parts saved, by name, oldest first
	dropped []uint64          // parts aged out, deleted once a checkpoint no longer lists them
	lost    atomic.Bool       // the saved parts are gone (RecordLost)
	// replaying: the record of the groups before Resume is rebuilt from
	// the stream; the first checkpoint after them saves it at once, so
	// that the next start need not read them again.
	replaying bool
}

// Seq is the number of anchor groups absorbed.
func (s *Stage) Seq() int64 { return s.seq }

// Run consumes src until ctx is done.
func (s *Stage) Run(ctx context.Context, src Source) error {
	exact := false
	if cp := s.Resume; cp != nil {
		if exact = s.Resumes(*cp); exact {
			d, err := RestoreDebiaser(cp.Debiaser)
			if err != nil {
				return fmt.Errorf("calibrate: checkpoint: %w", err)
			}
			s.Deb, s.seq = d, cp.Seq
		}
		s.stored, s.saved = cp.StreamSeq, cp.StreamSeq
		after := s.ReadsAfter()
		s.replaying = after == 0 && s.SaveSeen != nil
		if after > 0 {
			s.seen, s.parts = s.ResumeSeen, slices.Clone(cp.SeenParts)
			for _, seq := range s.seen {
				if seq > 0 && (s.oldest == 0 || seq < s.oldest) {
					s.oldest = seq
				}
			}
		}
	}
	every := s.CheckpointEvery
	if every <= 0 {
		every = DefaultCheckpointEvery
	}
	for read := 1; ; read++ {
		if read%every == 0 {
			s.forgetAgedOut(ctx)
		}
		in, err := src.Next(ctx)
		if err != nil {
			// Every group absorbed so far has its calibration stored.
			s.checkpoint(context.WithoutCancel(ctx))
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("calibrate: read pairs: %w", err)
		}
		if s.Skip != nil && s.Skip(in.Seq) {
			s.stored = max(s.stored, in.Seq)
			continue
		}
		switch err := s.guard(in, func() error { return s.take(ctx, in, exact, every) }); {
		case errors.Is(err, errStopped):
			return nil // stopped before it was stored: a restart absorbs it again, so no checkpoint
		case err != nil:
			return err // no checkpoint either: after a panic the state may be half-changed
		}
	}
}

// errStopped: the stage stopped while storing a calibration.
var errStopped = errors.New("calibrate: stopped")

// guard runs f, which takes in; a panic in it (a bug that in set off) is
// Panicked's, or goes on without it.
func (s *Stage) guard(in Input, f func() error) (err error) {
	if s.Panicked == nil {
		return f()
	}
	defer func() {
		if v := recover(); v != nil {
			err = s.Panicked(in, v, debug.Stack())
		}
	}()
	return f()
}

// take absorbs one pair group read in order and stores its calibration.
func (s *Stage) take(ctx context.Context, in Input, exact bool, every int) error {
	if cp := s.Resume; cp != nil {
		if in.Seq <= cp.StreamSeq {
			if exact {
				s.remember(in)
			} else {
				_, _ = s.absorb(in.Data, in.Seq) // rebuilding the map: published (or dead-lettered) before
			}
			return nil
		}
		s.seq = max(s.seq, cp.Seq) // the groups after the checkpoint are numbered after it
	}
	c, err := s.absorb(in.Data, in.Seq)
	if errors.Is(err, schemas.ErrInvalid) {
		if s.DeadLetter != nil {
			s.DeadLetter(in, err)
		}
		s.stored = in.Seq
		return nil
	}
	if err != nil || c == nil {
		s.stored = in.Seq
		return nil
	}
	if c.Seq > s.Published {
		if err := s.publish(ctx, *c); err != nil {
			if ctx.Err() != nil {
				return errStopped
			}
			return err
		}
		s.Published = c.Seq
	}
	s.stored = in.Seq
	if c.Seq%int64(every) == 0 || s.replaying {
		s.replaying = false
		s.checkpoint(ctx)
	}
	return nil
}

// Resumes reports whether a checkpoint was made with the configuration of
// Deb, so that restoring it is exact.
func (s *Stage) Resumes(cp Checkpoint) bool {
	return reflect.DeepEqual(cp.Debiaser.Config, s.Deb.Config())
}

// ReadsAfter is the stream sequence after which Run's Source must start
// (0: at the first retained pair group): Resume's, when it is exact and
// ResumeSeen holds the record of the groups up to it.
func (s *Stage) ReadsAfter() uint64 {
	if cp := s.Resume; cp != nil && cp.SeenKept && s.ResumeSeen != nil && s.Resumes(*cp) {
		return cp.StreamSeq
	}
	return 0
}

// remember marks a pair group as seen without absorbing it.
func (s *Stage) remember(in Input) {
	var pg schemas.PairGroup
	if schemas.Decode(in.Data, s.RunID, &pg) == nil {
		s.see(groupKey(pg), in.Seq)
	}
}

// see records the pair group key, read at stream sequence seq.
func (s *Stage) see(key string, seq uint64) {
	if s.seen == nil {
		s.seen = map[string]uint64{}
	}
	s.seen[key] = seq
	if seq > 0 && (s.oldest == 0 || seq < s.oldest) {
		s.oldest = seq
	}
	if seq > 0 && s.SaveSeen != nil {
		if s.pending == nil {
			s.pending = map[string]uint64{}
		}
		s.pending[key] = seq
	}
}

// forgetAgedOut forgets the pair groups read before the oldest message
// the stream still holds. It looks through the record only once the
// stream has aged out one of them; an error asking leaves it as it is.
func (s *Stage) forgetAgedOut(ctx context.Context) {
	if s.FirstRetained == nil || s.oldest == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	first, err := s.FirstRetained(ctx)
	if err != nil || first <= s.oldest {
		return
	}
	s.oldest = 0
	for key, seq := range s.seen {
		switch {
		case seq == 0:
		case seq < first:
			delete(s.seen, key)
			delete(s.pending, key)
		case s.oldest == 0 || seq < s.oldest:
			s.oldest = seq
		}
	}
	// A part named below first holds groups aged out alone.
	kept := s.parts[:0]
	for _, part := range s.parts {
		if part < first {
			s.dropped = append(s.dropped, part)
		} else {
			kept = append(kept, part)
		}
	}
	s.parts = kept
}

// groupKey names an anchor group within the run.
func groupKey(pg schemas.PairGroup) string { return fmt.Sprintf("%d/%s", pg.Step, pg.GroupID) }

// checkpoint saves the state as of the last stored calibration, if it
// moved since the last checkpoint.
func (s *Stage) checkpoint(ctx context.Context) {
	if s.Save == nil || s.stored == s.saved {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	// A bucket made anew while these are saved (RecordLost) took the
	// parts the checkpoint lists: they are saved again, and it too.
	for try := 0; try == 0 || try == 1 && s.SaveSeen != nil && s.lost.Load(); try++ {
		if err := s.saveSeen(ctx); err != nil {
			if s.OnSaveError != nil {
				s.OnSaveError(err)
			}
			return // a checkpoint stands only for groups whose record is saved
		}
		err := s.Save(ctx, Checkpoint{StreamSeq: s.stored, Seq: s.seq, Debiaser: s.Deb.Snapshot(),
			SeenParts: slices.Clone(s.parts), SeenKept: s.SaveSeen != nil})
		if err != nil {
			if s.OnSaveError != nil {
				s.OnSaveError(err)
			}
			return
		}
	}
	s.saved = s.stored
	for len(s.dropped) > 0 && s.DropSeen != nil {
		if err := s.DropSeen(ctx, s.dropped[0]); err != nil {
			if s.OnSaveError != nil {
				s.OnSaveError(err)
			}
			return // tried again after the next checkpoint
		}
		s.dropped = s.dropped[1:]
	}
	s.dropped = nil
}

// RecordLost says that the parts of the record saved so far are gone
// (their bucket was deleted and made anew): the next checkpoint saves the
// whole record again. Safe to call while Run runs.
func (s *Stage) RecordLost() { s.lost.Store(true) }

// saveSeen saves the pair groups absorbed since the last part saved as
// parts of at most SeenPartKeys, oldest first.
func (s *Stage) saveSeen(ctx context.Context) error {
	if s.SaveSeen != nil && s.lost.Swap(false) {
		s.parts, s.dropped, s.pending = nil, nil, map[string]uint64{}
		for key, seq := range s.seen {
			if seq > 0 {
				s.pending[key] = seq
			}
		}
	}
	if s.SaveSeen == nil || len(s.pending) == 0 {
		return nil
	}
	keys := slices.Collect(maps.Keys(s.pending))
	slices.SortFunc(keys, func(a, b string) int { return cmp.Compare(s.pending[a], s.pending[b]) })
	size := s.SeenPartKeys
	if size <= 0 {
		size = DefaultSeenPartKeys
	}
	for chunk := range slices.Chunk(keys, size) {
		part := make(map[string]uint64, len(chunk))
		for _, k := range chunk {
			part[k] = s.pending[k]
		}
		name := s.pending[chunk[len(chunk)-1]]
		if err := s.SaveSeen(ctx, name, part); err != nil {
			return fmt.Errorf("calibrate: the record of the pair groups absorbed through stream sequence %d: %w", name, err)
		}
		if !slices.Contains(s.parts, name) {
			s.parts = append(s.parts, name)
		}
		for _, k := range chunk {
			delete(s.pending, k)
		}
	}
	return nil
}

// Absorb feeds one encoded PairGroup to the debiaser and returns the
// resulting Calibration, or nil for a group seen before.
func (s *Stage) Absorb(data []byte) (*schemas.Calibration, error) { return s.absorb(data, 0) }

// absorb is Absorb of a pair group read at stream sequence seq.
func (s *Stage) absorb(data []byte, seq uint64) (*schemas.Calibration, error) {
	var pg schemas.PairGroup
	if err := schemas.Decode(data, s.RunID, &pg); err != nil {
		return nil, fmt.Errorf("calibrate: %w", err)
	}
	key := groupKey(pg)
	if _, again := s.seen[key]; again {
		return nil, nil
	}
	s.see(key, seq)
	c := schemas.Calibration{Schema: schemas.Version, Run: s.RunID, Step: pg.Step, GroupID: pg.GroupID,
		Pairs: make([]schemas.CalibratedPair, 0, len(pg.Pairs))}
	for _, p := range pg.Pairs {
		c.Pairs = append(c.Pairs, schemas.CalibratedPair{TrajID: p.TrajID, Predicted: p.Predicted, True: p.True, Before: s.Deb.Predict(p.Predicted)})
	}
	for i, p := range pg.Pairs {
		if _, err := s.Deb.Push(Pair{Predicted: p.Predicted, True: p.True}); err != nil {
			c.Pairs = c.Pairs[:i] // NaN cannot come through JSON; keep what was pushed
			break
		}
	}
	for i := range c.Pairs {
		c.Pairs[i].After = s.Deb.Predict(c.Pairs[i].Predicted)
	}
	s.seq++
	c.Seq, c.Version, c.PairsTotal = s.seq, s.Deb.Version(), s.Deb.Pushed()
	if m := s.Deb.Map(); m != nil {
		x, y := m.Thresholds()
		c.Map = &schemas.Thresholds{X: x, Y: y}
	}
	return &c, nil
}

// publish stores c, retrying until it is stored or ctx is done.
func (s *Stage) publish(ctx context.Context, c schemas.Calibration) error {
	m, err := schemas.NewMessage(fmt.Sprintf("%s/calibration/%d", s.RunID, c.Seq), c)
	if err != nil {
		return err
	}
	for wait := 100 * time.Millisecond; ; wait = min(2*wait, 5*time.Second) {
		if err := s.Pub.Publish(s.Out, m); err == nil {
			if s.OnCalibration != nil {
				s.OnCalibration(c)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
	}
}
