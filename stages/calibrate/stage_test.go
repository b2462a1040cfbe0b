package calibrate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
)

// pairGroups makes n encoded pair groups of 8 pairs, stream sequences 10,
// 20, ... (other subjects' messages sit between them in a real stream).
func pairGroups(n int) []Input {
	r := rand.New(rand.NewPCG(1, 2))
	out := make([]Input, n)
	for i := range out {
		pg := schemas.PairGroup{Schema: schemas.Version, Run: "r", Step: int64(i / 2), GroupID: fmt.Sprintf("g%d", i%2)}
		for k := range 8 {
			q := r.Float64()
			pg.Pairs = append(pg.Pairs, schemas.PairItem{TrajID: fmt.Sprintf("t%d", k), Predicted: 0.3 + 0.4*q*q + 0.05*r.NormFloat64(), True: q})
		}
		b, _ := json.Marshal(pg)
		out[i] = Input{Data: b, Seq: uint64(10 * (i + 1))}
	}
	return out
}

// listSource yields its inputs, then blocks until ctx is done.
type listSource struct{ in []Input }

func (s *listSource) Next(ctx context.Context) (Input, error) {
	if len(s.in) == 0 {
		<-ctx.Done()
		return Input{}, ctx.Err()
	}
	in := s.in[0]
	s.in = s.in[1:]
	return in, nil
}

// recorder is a publisher that keeps calibrations, and fails once failAt
// calibrations are stored (0: never).
type recorder struct {
	mu     sync.Mutex
	cals   []schemas.Calibration
	failAt int
}

func (r *recorder) Publish(_ string, msgs ...*message.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.failAt > 0 && len(r.cals) >= r.failAt {
		return errors.New("store unavailable")
	}
	for _, m := range msgs {
		var c schemas.Calibration
		if err := json.Unmarshal(m.Payload, &c); err != nil {
			return err
		}
		r.cals = append(r.cals, c)
	}
	return nil
}

func (r *recorder) Close() error { return nil }

func (r *recorder) stored() []schemas.Calibration {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]schemas.Calibration(nil), r.cals...)
}

// runStage runs st over in until it has published want calibrations (or,
// with want < 0, until the source is drained and a moment has passed).
func runStage(t *testing.T, st *Stage, in []Input, pub *recorder, want int) {
	t.Helper()
	runStageOn(t, st, &listSource{in: in}, pub, want)
}

// runStageOn is runStage on the inputs of src.
func runStageOn(t *testing.T, st *Stage, src Source, pub *recorder, want int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- st.Run(ctx, src) }()
	deadline := time.Now().Add(10 * time.Second)
	for want >= 0 && len(pub.stored()) < want && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if want < 0 {
		time.Sleep(300 * time.Millisecond)
	}
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// checkpointing is a stage on the test settings that checkpoints every
// `every` groups into the slice it returns (read it once Run is over).
func checkpointing(t *testing.T, pub *recorder, every int) (*Stage, *[]Checkpoint) {
	var cps []Checkpoint
	st := &Stage{RunID: "r", Pub: pub, Deb: mustDebiaser(t, testDebiaserConfig()), CheckpointEvery: every,
		Save: func(_ context.Context, c Checkpoint) error { cps = append(cps, c); return nil }}
	return st, &cps
}

func testDebiaserConfig() DebiaserConfig {
	cfg := DefaultDebiaserConfig()
	cfg.MinPairs, cfg.RefitEvery = 32, 16
	return cfg
}

// A stage resumed from a checkpoint, fed only the pair groups the stream
// still holds (those before the checkpoint gone, some of those after it
// already calibrated), publishes exactly what one stage fed every group
// publishes from there on: same sequence numbers, versions, maps and
// out-of-sample predictions.
func TestStageResumesFromItsCheckpoint(t *testing.T) {
	in := pairGroups(40)
	full := &recorder{}
	st, checkpoints := checkpointing(t, full, 8)
	runStage(t, st, in, full, 40)
	var seqs []int64
	for _, c := range *checkpoints {
		seqs = append(seqs, c.Seq)
	}
	if fmt.Sprint(seqs) != "[8 16 24 32 40]" {
		t.Fatalf("checkpoints after groups %v; want every 8 groups, and none more at the stop (nothing new)", seqs)
	}
	cp := (*checkpoints)[1] // after group 16
	if cp.Seq != 16 || cp.StreamSeq != in[15].Seq {
		t.Fatalf("second checkpoint: seq %d at stream seq %d, want 16 at %d", cp.Seq, cp.StreamSeq, in[15].Seq)
	}
	want := full.stored()

	// The restart: groups 1-10 aged out; 11-20 were calibrated before the
	// stop (Published 20), 11-16 are in the checkpoint.
	resumed := &recorder{}
	st2 := &Stage{RunID: "r", Pub: resumed, Deb: mustDebiaser(t, testDebiaserConfig()), Resume: &cp, Published: 20}
	runStage(t, st2, in[10:], resumed, 20)
	got := resumed.stored()
	if len(got) != 20 {
		t.Fatalf("resumed stage published %d calibrations, want 20 (groups 21-40)", len(got))
	}
	for i, g := range got {
		w := want[20+i]
		gb, _ := json.Marshal(g)
		wb, _ := json.Marshal(w)
		if string(gb) != string(wb) {
			t.Fatalf("calibration %d after the resume:\n got %s\nwant %s", w.Seq, gb, wb)
		}
	}

	// A copy of a group inside the checkpoint, arriving after it, is known.
	dup := &recorder{}
	st3 := &Stage{RunID: "r", Pub: dup, Deb: mustDebiaser(t, testDebiaserConfig()), Resume: &cp, Published: 16}
	again := in[12]
	again.Seq = in[39].Seq + 10
	runStage(t, st3, append(in[10:16:16], again), dup, -1)
	if n := len(dup.stored()); n != 0 {
		t.Fatalf("a copy of a checkpointed group was absorbed again (%d calibrations)", n)
	}
}

// seenStore keeps the parts of a stage's record of the pair groups
// absorbed, as the checkpoint bucket would.
type seenStore struct {
	parts   map[uint64]map[string]uint64
	dropped []uint64
}

// wire has st save its record into the store.
func (s *seenStore) wire(st *Stage) {
	s.parts = map[uint64]map[string]uint64{}
	st.SaveSeen = func(_ context.Context, part uint64, keys map[string]uint64) error {
		s.parts[part] = maps.Clone(keys)
		return nil
	}
	st.DropSeen = func(_ context.Context, part uint64) error {
		delete(s.parts, part)
		s.dropped = append(s.dropped, part)
		return nil
	}
}

// record is what a checkpoint's parts hold, or an error naming a part the
// store lacks.
func (s *seenStore) record(cp Checkpoint) (map[string]uint64, error) {
	out := map[string]uint64{}
	for _, part := range cp.SeenParts {
		keys, ok := s.parts[part]
		if !ok {
			return nil, fmt.Errorf("part %d, listed, is not stored", part)
		}
		maps.Copy(out, keys)
	}
	return out, nil
}

// keysThrough are the keys of the groups in at or before stream sequence
// seq.
func keysThrough(t *testing.T, in []Input, seq uint64) map[string]uint64 {
	t.Helper()
	out := map[string]uint64{}
	for _, g := range in {
		var pg schemas.PairGroup
		if err := json.Unmarshal(g.Data, &pg); err != nil {
			t.Fatal(err)
		}
		if g.Seq <= seq {
			out[groupKey(pg)] = g.Seq
		}
	}
	return out
}

// Each checkpoint lists the saved parts of the record of the groups
// absorbed, which together hold every group up to it. Resumed from it and
// its record, the stage starts reading after it (none of the groups
// before are read), publishes what a stage fed every group publishes, and
// refuses a copy of a group from before it. Resumed without its record (a
// part lost), it reads every retained group as before, and its next
// checkpoint lists a record of them all.
func TestAResumeFromTheSavedRecordReadsOnlyWhatCameAfter(t *testing.T) {
	in := pairGroups(40)
	full := &recorder{}
	st, checkpoints := checkpointing(t, full, 8)
	st.SeenPartKeys = 5
	var store seenStore
	store.wire(st)
	runStage(t, st, in, full, 40)
	want := full.stored()
	for _, cp := range *checkpoints {
		got, err := store.record(cp)
		if err != nil {
			t.Fatalf("checkpoint after group %d: %v", cp.Seq, err)
		}
		if w := keysThrough(t, in, cp.StreamSeq); !maps.Equal(got, w) || !cp.SeenKept {
			t.Fatalf("checkpoint after group %d (kept %v): its parts hold %v; want the groups through it, %v", cp.Seq, cp.SeenKept, got, w)
		}
	}
	if n := len(store.parts); n != 10 {
		t.Errorf("%d parts for 40 groups checkpointed every 8 in parts of at most 5; want 10 (5 and 3 a checkpoint)", n)
	}

	cp := (*checkpoints)[1] // after group 16
	seen, _ := store.record(cp)
	resumed := &recorder{}
	st2 := &Stage{RunID: "r", Pub: resumed, Deb: mustDebiaser(t, testDebiaserConfig()), Resume: &cp, ResumeSeen: seen, Published: 20}
	if st2.ReadsAfter() != in[15].Seq {
		t.Fatalf("ReadsAfter %d; want %d, the checkpoint's", st2.ReadsAfter(), in[15].Seq)
	}
	again := in[12]
	again.Seq = in[39].Seq + 10
	runStage(t, st2, append(slices.Clone(in[16:]), again), resumed, 20)
	got := resumed.stored()
	if len(got) != 20 {
		t.Fatalf("resumed stage published %d calibrations, want 20 (groups 21-40; the copy of group 13 refused)", len(got))
	}
	for i, g := range got {
		gb, _ := json.Marshal(g)
		wb, _ := json.Marshal(want[20+i])
		if string(gb) != string(wb) {
			t.Fatalf("calibration %d after the resume:\n got %s\nwant %s", want[20+i].Seq, gb, wb)
		}
	}

	// Without its record, the stage reads from the first retained group.
	lost := &recorder{}
	st3 := &Stage{RunID: "r", Pub: lost, Deb: mustDebiaser(t, testDebiaserConfig()), Resume: &cp, Published: 20, CheckpointEvery: 8}
	var cps []Checkpoint
	st3.Save = func(_ context.Context, c Checkpoint) error { cps = append(cps, c); return nil }
	var anew seenStore
	anew.wire(st3)
	if st3.ReadsAfter() != 0 {
		t.Fatalf("ReadsAfter %d without the record; want 0", st3.ReadsAfter())
	}
	runStage(t, st3, in, lost, 20)
	if len(cps) < 2 || cps[0].Seq != 17 {
		t.Fatalf("%d checkpoints after the resume; want the first at once after group 17, the first after those read again", len(cps))
	}
	for _, cp := range cps {
		if rec, err := anew.record(cp); err != nil || !maps.Equal(rec, keysThrough(t, in, cp.StreamSeq)) {
			t.Fatalf("the checkpoint after group %d, after a resume without the record: %v; its parts hold %d groups, want the %d through it",
				cp.Seq, err, len(rec), len(keysThrough(t, in, cp.StreamSeq)))
		}
	}
}

// A part of the record whose groups the stream aged out is dropped from
// the next checkpoint, then deleted.
func TestAPartOfTheRecordIsDroppedOnceItsGroupsAgedOut(t *testing.T) {
	in := pairGroups(40)
	pub := &recorder{}
	src := &agingSource{listSource: listSource{in: in}, keep: 10}
	st, checkpoints := checkpointing(t, pub, 8)
	st.SeenPartKeys, st.FirstRetained = 5, src.FirstRetained
	var store seenStore
	store.wire(st)
	runStageOn(t, st, src, pub, 40)
	last := (*checkpoints)[len(*checkpoints)-1]
	first, _ := src.FirstRetained(context.Background())
	if len(store.dropped) == 0 {
		t.Fatal("no part dropped; the stream aged out 30 of 40 groups")
	}
	for _, part := range store.dropped {
		if part >= first || slices.Contains(last.SeenParts, part) {
			t.Errorf("part %d dropped (first retained %d; the last checkpoint lists %v)", part, first, last.SeenParts)
		}
	}
	rec, err := store.record(last)
	if err != nil {
		t.Fatal(err)
	}
	for key, seq := range keysThrough(t, in, last.StreamSeq) {
		if _, ok := rec[key]; !ok && seq >= first {
			t.Errorf("group %s at %d, retained, is in no part the last checkpoint lists", key, seq)
		}
	}
}

// hookSource calls hook before it gives out its at-th input.
type hookSource struct {
	listSource
	read, at int
	hook     func()
}

func (s *hookSource) Next(ctx context.Context) (Input, error) {
	if s.read++; s.read == s.at {
		s.hook()
	}
	return s.listSource.Next(ctx)
}

// The parts of the record went with their bucket (deleted, made anew):
// the next checkpoint saves the whole record again, rather than list
// parts that a restart would not find.
func TestARecordLostWithItsBucketIsSavedAnew(t *testing.T) {
	in := pairGroups(24)
	pub := &recorder{}
	st, checkpoints := checkpointing(t, pub, 8)
	var store seenStore
	store.wire(st)
	src := &hookSource{listSource: listSource{in: in}, at: 20, hook: func() { clear(store.parts); st.RecordLost() }}
	runStageOn(t, st, src, pub, 24)
	store.lastHoldsEveryGroup(t, *checkpoints, in)
}

// lastHoldsEveryGroup fails t unless the last of checkpoints is after the
// last of in and lists stored parts that hold every group.
func (s *seenStore) lastHoldsEveryGroup(t *testing.T, checkpoints []Checkpoint, in []Input) {
	t.Helper()
	last := checkpoints[len(checkpoints)-1]
	if last.Seq != int64(len(in)) {
		t.Fatalf("last checkpoint after group %d; want %d", last.Seq, len(in))
	}
	if rec, err := s.record(last); err != nil || !maps.Equal(rec, keysThrough(t, in, last.StreamSeq)) {
		t.Fatalf("the last checkpoint: %v; its parts hold %d groups, want all %d", err, len(rec), len(in))
	}
}

// The bucket is made anew while a checkpoint saves its record: the
// parts saved before went with it, and the checkpoint, which lists them,
// is saved again after the whole record.
func TestARecordLostWhileACheckpointIsSavedIsSavedAgainAtOnce(t *testing.T) {
	in := pairGroups(16)
	pub := &recorder{}
	st, checkpoints := checkpointing(t, pub, 8)
	var store seenStore
	store.wire(st)
	saved, calls := st.SaveSeen, 0
	st.SaveSeen = func(ctx context.Context, part uint64, keys map[string]uint64) error {
		if calls++; calls == 2 { // the second checkpoint's first part
			clear(store.parts)
			st.RecordLost()
		}
		return saved(ctx, part, keys)
	}
	runStage(t, st, in, pub, 16)
	store.lastHoldsEveryGroup(t, *checkpoints, in)
}

// agingSource is a stream that keeps the newest `keep` pair groups it
// gave out (10 sequences apart, as pairGroups numbers them): its
// FirstRetained is the oldest of those.
type agingSource struct {
	listSource
	keep int
	last atomic.Uint64
}

func (s *agingSource) Next(ctx context.Context) (Input, error) {
	in, err := s.listSource.Next(ctx)
	if err == nil {
		s.last.Store(in.Seq)
	}
	return in, err
}

func (s *agingSource) FirstRetained(context.Context) (uint64, error) {
	return uint64(max(1, int64(s.last.Load())-10*int64(s.keep-1))), nil
}

// The stage remembers the pair groups it absorbed, to refuse a copy. A
// copy comes only while the stream still holds the original (the
// executions and predictions it was paired from are older, and go
// first), so the stage forgets a group the stream aged out, as a restart,
// which reads the retained groups alone, does. Before, the record grew by
// an entry an anchor group for the life of the process.
func TestTheStageForgetsTheGroupsTheStreamAgedOut(t *testing.T) {
	in := pairGroups(40)
	copyOf := func(i int, seq uint64) Input { c := in[i]; c.Seq = seq; return c }
	retained, forgotten := copyOf(35, 410), copyOf(2, 420)
	for _, aging := range []bool{true, false} {
		pub := &recorder{}
		src := &agingSource{listSource: listSource{in: append(slices.Clone(in), retained, forgotten)}, keep: 10}
		st := &Stage{RunID: "r", Pub: pub, Deb: mustDebiaser(t, testDebiaserConfig()), CheckpointEvery: 8}
		if aging {
			st.FirstRetained = src.FirstRetained
		}
		runStageOn(t, st, src, pub, -1)
		got := pub.stored()
		if !aging {
			if len(st.seen) != 40 || len(got) != 40 {
				t.Fatalf("without FirstRetained: %d groups remembered and %d calibrations; want 40 and 40 (both copies refused)", len(st.seen), len(got))
			}
			continue
		}
		// Looked at before groups 8, 16, ..., 40 were read: the last time
		// the stream held groups 30 to 39 (sequences 300 to 390).
		for key, seq := range st.seen {
			if seq < 300 {
				t.Errorf("group %s (stream sequence %d) still remembered, aged out of the stream", key, seq)
			}
		}
		if len(st.seen) != 12 {
			t.Errorf("%d groups remembered; want 12 (the 10 the stream held when last asked, group 40, and the copy absorbed again)", len(st.seen))
		}
		if len(got) != 41 || got[40].Step != 1 || got[40].GroupID != "g0" {
			t.Fatalf("%d calibrations (the last of step %d, group %s); want 41: every group, the copy of a retained one refused, "+
				"and the copy of one aged out (step 1, g0) absorbed again, as a restart would", len(got), got[len(got)-1].Step, got[len(got)-1].GroupID)
		}
	}
}

// A calibration the store refused is not in any checkpoint: the stage
// stops without saving one that would skip the group on restart.
func TestStageDoesNotCheckpointWhatIsNotStored(t *testing.T) {
	in := pairGroups(12)
	pub := &recorder{failAt: 10}
	st, checkpoints := checkpointing(t, pub, 4)
	runStage(t, st, in, pub, -1)
	if len(pub.stored()) != 10 {
		t.Fatalf("%d calibrations stored, want 10", len(pub.stored()))
	}
	for _, c := range *checkpoints {
		if c.Seq > 10 || c.StreamSeq > in[9].Seq {
			t.Fatalf("checkpoint at group %d (stream seq %d): group 11 was never stored", c.Seq, c.StreamSeq)
		}
	}
	if last := (*checkpoints)[len(*checkpoints)-1]; last.Seq != 8 {
		t.Fatalf("last checkpoint at group %d, want 8 (the one after it was never stored)", last.Seq)
	}
}

// A checkpoint that fails to save is reported and the stage carries on.
func TestStageCarriesOnWhenACheckpointFails(t *testing.T) {
	in := pairGroups(8)
	var reported []error
	pub := &recorder{}
	st := &Stage{RunID: "r", Pub: pub, Deb: mustDebiaser(t, testDebiaserConfig()), CheckpointEvery: 2,
		Save:        func(context.Context, Checkpoint) error { return errors.New("bucket gone") },
		OnSaveError: func(err error) { reported = append(reported, err) }}
	runStage(t, st, in, pub, 8)
	if len(pub.stored()) != 8 || len(reported) == 0 {
		t.Fatalf("%d calibrations, %d save errors reported; want 8 and some", len(pub.stored()), len(reported))
	}
}

// Restarted with other calibration settings, a stage rebuilds the map from
// the pair groups the stream still holds under the new settings, and keeps
// numbering the groups after its checkpoint from the checkpoint's count.
func TestStageRebuildsUnderNewSettingsAndKeepsTheNumbering(t *testing.T) {
	in := pairGroups(40)
	first := &recorder{}
	st, checkpoints := checkpointing(t, first, 8)
	runStage(t, st, in[:20], first, 20)
	cp := (*checkpoints)[1] // after group 16

	other := testDebiaserConfig()
	other.MinPairs, other.RefitEvery, other.Bins = 64, 8, 0
	resumed := &recorder{}
	st2 := &Stage{RunID: "r", Pub: resumed, Deb: mustDebiaser(t, other), Resume: &cp, Published: 20}
	if st2.Resumes(cp) {
		t.Fatal("a checkpoint made with other settings counts as exact")
	}
	runStage(t, st2, in[10:], resumed, 20) // groups 1-10 aged out
	got := resumed.stored()

	ref := &Stage{RunID: "r", Deb: mustDebiaser(t, other)} // the new settings on what the stream holds
	var want []*schemas.Calibration
	for _, x := range in[10:] {
		c, err := ref.Absorb(x.Data)
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, c)
	}
	if len(got) != 20 {
		t.Fatalf("%d calibrations after the restart, want 20 (groups 21-40)", len(got))
	}
	for i, g := range got {
		w := *want[10+i]
		w.Seq = int64(21 + i)
		gb, _ := json.Marshal(g)
		wb, _ := json.Marshal(w)
		if string(gb) != string(wb) {
			t.Fatalf("group %d:\n got %s\nwant %s", 21+i, gb, wb)
		}
	}
}

// panicking publishes through rec, and panics on the publish of group
// seq's calibration (a bug that group sets off before it is stored).
type panicking struct {
	*recorder
	seq int64
}

func (p panicking) Publish(topic string, msgs ...*message.Message) error {
	var c schemas.Calibration
	if json.Unmarshal(msgs[0].Payload, &c) == nil && c.Seq == p.seq {
		var m map[string]int
		m["x"]++ // a write to a nil map
	}
	return p.recorder.Publish(topic, msgs...)
}

// A panic taking a pair group is Panicked's, whose error Run returns at
// once, with no checkpoint of the state it may have half-changed; resumed
// from the last checkpoint with Skip naming the group, the stage passes
// over it and calibrates the rest as it would have without it. Before,
// the panic ended the process, and a restart read the group again and
// ended again.
func TestAPanicTakingAPairGroupIsSkippedAfterARestart(t *testing.T) {
	in := pairGroups(24)
	rec := &recorder{}
	st, checkpoints := checkpointing(t, rec, 8)
	st.Pub = panicking{rec, 12}
	var heard []uint64
	st.Panicked = func(in Input, v any, stack []byte) error {
		heard = append(heard, in.Seq)
		if !strings.Contains(fmt.Sprint(v), "nil map") || !strings.Contains(string(stack), "stage_test.go") {
			t.Errorf("panic %v, stack:\n%s", v, stack)
		}
		return errors.New("the bug")
	}
	err := st.Run(context.Background(), &listSource{in: in})
	if err == nil || err.Error() != "the bug" || !slices.Equal(heard, []uint64{in[11].Seq}) {
		t.Fatalf("Run: %v, Panicked heard %v; want its error, of group 12 (stream seq %d)", err, heard, in[11].Seq)
	}
	if n := len(*checkpoints); n != 1 || (*checkpoints)[0].Seq != 8 || len(rec.stored()) != 11 {
		t.Fatalf("%d checkpoints, %d calibrations; want the one after group 8 alone, and 11", n, len(rec.stored()))
	}

	// Restarted: from the checkpoint after group 8, passing over group 12.
	again := &recorder{}
	resumed, _ := checkpointing(t, again, 8)
	resumed.Resume, resumed.Published = &(*checkpoints)[0], 11
	resumed.Skip = func(seq uint64) bool { return seq == in[11].Seq }
	runStage(t, resumed, in, again, 12)
	// The reference: a stage that never had group 12.
	ref := &recorder{}
	without := slices.Delete(slices.Clone(in), 11, 12)
	fresh, _ := checkpointing(t, ref, 8)
	runStage(t, fresh, without, ref, 23)
	got, want := again.stored(), ref.stored()[11:]
	if len(got) != len(want) {
		t.Fatalf("resumed: %d calibrations after the 11 stored, want %d", len(got), len(want))
	}
	for i := range got {
		if got[i].Seq != want[i].Seq || got[i].GroupID != want[i].GroupID || got[i].Version != want[i].Version || !reflect.DeepEqual(got[i].Map, want[i].Map) {
			t.Fatalf("resumed calibration %d: %+v, want %+v", i, got[i], want[i])
		}
	}
}
