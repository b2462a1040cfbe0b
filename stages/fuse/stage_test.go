package fuse

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/stagetest"
)

// listSource yields its calibrations, then waits for the end.
type listSource struct{ in []calibrate.Input }

func (s *listSource) Next(ctx context.Context) (calibrate.Input, error) {
	if len(s.in) == 0 {
		<-ctx.Done()
		return calibrate.Input{}, ctx.Err()
	}
	in := s.in[0]
	s.in = s.in[1:]
	return in, nil
}

// A calibration fuse cannot use (a stage replacing calibrate sent a map
// that goes down, or a message that is not a calibration) is handed to
// DeadLetter once, with the reason, and changes nothing: the next valid
// one is absorbed. The checkpoint keeps where the reading stood, so that a
// restart, which reads the retained calibrations again, does not
// dead-letter them a second time. Before, fuse skipped both without a word.
func TestACalibrationFuseCannotUseIsDeadLetteredOnce(t *testing.T) {
	cal := func(seq int64, m *schemas.Thresholds) []byte {
		b, err := json.Marshal(schemas.Calibration{Schema: schemas.Version, Run: "r", Seq: seq, Version: seq, Step: seq, GroupID: "g", Map: m,
			Pairs: []schemas.CalibratedPair{{TrajID: "t0", Predicted: 0.2, True: 0.1}, {TrajID: "t1", Predicted: 0.7, True: 0.9}}})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	in := []calibrate.Input{
		{Data: cal(1, &schemas.Thresholds{X: []float64{0.1, 0.9}, Y: []float64{0.2, 0.8}}), Seq: 10},
		{Data: cal(2, &schemas.Thresholds{X: []float64{0.1, 0.9}, Y: []float64{0.8, 0.2}}), Seq: 11}, // goes down
		{Data: []byte(`{"schema":1,"run":"r","seq":"three"}`), Seq: 12},
		{Data: cal(3, nil), Seq: 13},
	}
	var saved []Checkpoint
	run := func(restore *Checkpoint) (lettered []string, st *Stage) {
		st, err := NewStage(StepsConfig{Run: "r", Debias: true, Denoiser: DenoiserConfig{Warmup: 4}, AnchorDeadline: time.Minute}, "update", &stagetest.Recorder{})
		if err != nil {
			t.Fatal(err)
		}
		if restore != nil {
			if err := st.Restore(*restore); err != nil {
				t.Fatal(err)
			}
		}
		st.Save = func(_ context.Context, c Checkpoint) error { saved = append(saved, c); return nil }
		st.DeadLetter = func(in calibrate.Input, reason error) {
			if !strings.HasPrefix(reason.Error(), "fuse: ") || !errors.Is(reason, schemas.ErrInvalid) {
				t.Errorf("dead letter of %d: %v, want fuse's ErrInvalid", in.Seq, reason)
			}
			lettered = append(lettered, reason.Error())
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- st.Run(ctx, &listSource{in: in}, in[len(in)-1].Seq) }()
		deadline := time.Now().Add(10 * time.Second)
		for st.checkpointAt().stream != 13 {
			if time.Now().After(deadline) {
				t.Fatal("the calibrations were not all read")
			}
			time.Sleep(time.Millisecond)
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		return lettered, st
	}

	lettered, st := run(nil)
	if len(lettered) != 2 || !strings.Contains(lettered[0], "calibration 2 (step 2, group g): its map: ") ||
		!strings.Contains(lettered[0], "monotonically") || !strings.Contains(lettered[1], "seq") {
		t.Fatalf("dead letters %q, want calibration 2's map and the third message's seq", lettered)
	}
	cp := st.steps.Checkpoint()
	if cp.Seq != 3 || cp.Map != nil || cp.Version != 3 {
		t.Errorf("after the last calibration: seq %d, version %d, map %v; want 3, 3, none (calibration 3's)", cp.Seq, cp.Version, cp.Map)
	}
	if len(saved) == 0 || saved[len(saved)-1].StreamSeq != 13 {
		t.Fatalf("checkpoints %+v, the last one not at stream sequence 13", saved)
	}
	if again, _ := run(&saved[len(saved)-1]); len(again) != 0 {
		t.Errorf("the restart dead-lettered %q again", again)
	}
}

// sabotaged yields its calibrations, breaking st's denoiser (a bug, set
// off by the calibration at seq) as that one goes.
type sabotaged struct {
	listSource
	st *Stage
	at uint64
}

func (s *sabotaged) Next(ctx context.Context) (calibrate.Input, error) {
	in, err := s.listSource.Next(ctx)
	if err == nil && in.Seq == s.at {
		s.st.mu.Lock()
		s.st.steps.den = nil
		s.st.mu.Unlock()
	}
	return in, err
}

// A panic absorbing a calibration is Panicked's, whose error Run returns,
// with no checkpoint of the state it may have half-changed; a stage
// resumed with Skip naming it passes over it and ends as one that never
// had it. Before, the panic ended the process, and a restart read the
// calibration again and ended again.
func TestAPanicAbsorbingACalibrationIsSkippedAfterARestart(t *testing.T) {
	var in []calibrate.Input
	for i := range int64(6) {
		b, _ := json.Marshal(schemas.Calibration{Schema: schemas.Version, Run: "r", Seq: i + 1, Version: i + 1, Step: i, GroupID: "g",
			Pairs: []schemas.CalibratedPair{{TrajID: "t0", Predicted: 0.2, True: 0.1 * float64(i)}, {TrajID: "t1", Predicted: 0.7, True: 0.9}}})
		in = append(in, calibrate.Input{Data: b, Seq: uint64(20 + i)})
	}
	stage := func() *Stage {
		st, err := NewStage(StepsConfig{Run: "r", Debias: true, Denoiser: DenoiserConfig{Warmup: 2}, AnchorDeadline: time.Minute}, "update", &stagetest.Recorder{})
		if err != nil {
			t.Fatal(err)
		}
		st.CheckpointEvery = 2
		return st
	}
	var saved []Checkpoint
	st := stage()
	st.Save = func(_ context.Context, c Checkpoint) error { saved = append(saved, c); return nil }
	var heard []uint64
	st.Panicked = func(in calibrate.Input, v any, _ []byte) error {
		heard = append(heard, in.Seq)
		return errors.New("the bug")
	}
	err := st.Run(context.Background(), &sabotaged{listSource{in: in}, st, 23}, in[len(in)-1].Seq)
	if err == nil || err.Error() != "the bug" || !slices.Equal(heard, []uint64{23}) {
		t.Fatalf("Run: %v, Panicked heard %v; want its error, of the calibration at 23", err, heard)
	}
	if len(saved) != 1 || saved[0].Seq != 2 || saved[0].StreamSeq != 21 {
		t.Fatalf("checkpoints %+v; want the one after calibration 2 alone", saved)
	}

	resumed := stage()
	if err := resumed.Restore(saved[0]); err != nil {
		t.Fatal(err)
	}
	resumed.Skip = func(seq uint64) bool { return seq == 23 }
	ref := stage()
	for _, st := range []*Stage{resumed, ref} {
		src := &listSource{in: in}
		if st == ref {
			src.in = slices.Delete(slices.Clone(in), 3, 4)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- st.Run(ctx, src, 0) }()
		for deadline := time.Now().Add(10 * time.Second); st.checkpointAt().stream != 25; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("the calibrations were not all read")
			}
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	got, want := resumed.steps.Checkpoint(), ref.steps.Checkpoint()
	if !reflect.DeepEqual(got, want) {
		t.Errorf("resumed, passing over the calibration at 23: %+v\nwant, as one that never had it: %+v", got, want)
	}
}

// A panic fusing a step (a bug the step's inputs set off) is
// FusePanicked's, whose error Run returns: the step's update is not
// published and its inputs are not released (they are handed back, and a
// restart fuses the step again), and the state is not checkpointed.
// Before, the panic ended the process, skipping every stage's clean stop.
func TestAPanicFusingAStepStopsRunWithoutItsUpdate(t *testing.T) {
	rec := &stagetest.Recorder{}
	st, err := NewStage(StepsConfig{Run: "r", Debias: true, Denoiser: DenoiserConfig{Warmup: 2}, AnchorDeadline: time.Minute}, "update", rec)
	if err != nil {
		t.Fatal(err)
	}
	var saved []Checkpoint
	st.Save = func(_ context.Context, c Checkpoint) error { saved = append(saved, c); return nil }
	var heard []int64
	st.FusePanicked = func(step int64, v any, _ []byte) error {
		heard = append(heard, step)
		return fmt.Errorf("the bug: %v", v)
	}
	st.OnUpdate = func(u schemas.Update) {
		if u.Step == 0 {
			st.steps.den = nil // a bug that the next step's fusion sets off
		}
	}
	st.mu.Lock()
	for step := range int64(3) {
		st.steps.AddPlan(schemas.Plan{Step: step, Groups: []schemas.PlanGroup{{GroupID: "w", TrajIDs: []string{"w0", "w1"}}}}, st.Now())
		st.steps.AddPrediction(schemas.Prediction{Step: step, GroupID: "w", Items: []schemas.PredItem{{TrajID: "w0", Score: score(0.2)}, {TrajID: "w1", Score: score(0.7)}}})
	}
	released := st.doneFor(1)
	st.mu.Unlock()
	cal, _ := json.Marshal(schemas.Calibration{Schema: schemas.Version, Run: "r", Seq: 1, Version: 1, Step: 0, GroupID: "a",
		Pairs: []schemas.CalibratedPair{{TrajID: "a0", Predicted: 0.2, True: 0.1}, {TrajID: "a1", Predicted: 0.7, True: 0.9}}})
	if err := st.absorb(calibrate.Input{Data: cal, Seq: 5}, new(schemas.Calibration)); err != nil {
		t.Fatal(err) // a state a checkpoint at Run's end would save
	}
	err = st.Run(context.Background(), &listSource{}, 0)
	if err == nil || !strings.HasPrefix(err.Error(), "the bug: ") || !slices.Equal(heard, []int64{1}) {
		t.Fatalf("Run: %v, FusePanicked heard %v; want its error, of step 1", err, heard)
	}
	if rec.Count() != 1 {
		t.Fatalf("%d updates published; want step 0's alone", rec.Count())
	}
	// Nothing is fused from the state the panic may have half-changed
	// (Run's ticker and its reader both flush, and one may come after).
	if err := st.Flush(context.Background()); err != nil || rec.Count() != 1 || len(heard) != 1 {
		t.Fatalf("a flush after the panic: %v, %d updates, panics heard at %v; want nothing done", err, rec.Count(), heard)
	}
	select {
	case <-released:
		t.Fatal("step 1's inputs were released")
	default:
	}
	if len(saved) != 0 {
		t.Fatalf("checkpoints %+v after the panic; want none", saved)
	}
}

// A panic fusing a step in a Flush that a handler runs (its input was the
// step's last) ends Run with FusePanicked's error, as one in Run's own
// Flush does, and the handler hands its input back once the stage stops.
// Before, the handler returned the panic as its own: the pipeline
// dead-lettered the input and acknowledged it, and the restart's step
// waited for it (TestAPanicFusingAStepStopsTheRun failed now and then).
func TestAPanicFusingAStepInAHandlerStopsRun(t *testing.T) {
	st, err := NewStage(StepsConfig{Run: "r", Debias: true, Denoiser: DenoiserConfig{Warmup: 2}, AnchorDeadline: time.Minute}, "update", &stagetest.Recorder{})
	if err != nil {
		t.Fatal(err)
	}
	st.FusePanicked = func(step int64, v any, _ []byte) error { return fmt.Errorf("the bug: step %d: %v", step, v) }
	st.OnUpdate = func(u schemas.Update) {
		if u.Step == 0 {
			st.steps.den = nil // a bug that the next step's fusion sets off
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- st.Run(ctx, &listSource{}, 0) }()
	handle := func(step int64) chan error {
		handled := make(chan error, 2)
		for _, in := range []struct {
			h func(*message.Message) error
			v any
		}{
			{st.HandlePlan, schemas.Plan{Schema: schemas.Version, Run: "r", Step: step, Groups: []schemas.PlanGroup{{GroupID: "w", TrajIDs: []string{"w0", "w1"}}}}},
			{st.HandlePrediction, schemas.Prediction{Schema: schemas.Version, Run: "r", Step: step, GroupID: "w",
				Items: []schemas.PredItem{{TrajID: "w0", Score: score(0.2)}, {TrajID: "w1", Score: score(0.7)}}}},
		} {
			m, err := schemas.NewMessage("", in.v)
			if err != nil {
				t.Fatal(err)
			}
			m.SetContext(ctx)
			go func() { handled <- in.h(m) }()
		}
		return handled
	}
	for range 2 {
		if err := <-handle(0); err != nil {
			t.Fatalf("step 0's input: %v", err)
		}
	}
	handled := handle(1)
	select {
	case err := <-ran:
		if err == nil || !strings.HasPrefix(err.Error(), "the bug: step 1") {
			t.Fatalf("Run: %v; want FusePanicked's error, of step 1", err)
		}
	case err := <-handled:
		t.Fatalf("a handler of step 1 returned %v before Run ended", err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not end within 10 s of the panic")
	}
	cancel() // the pipeline stops
	for range 2 {
		if err := <-handled; err == nil || strings.Contains(err.Error(), "the bug") || !errors.Is(err, context.Canceled) {
			t.Errorf("a handler of step 1 returned %v; want its input handed back as the stage stops, not the panic", err)
		}
	}
}
