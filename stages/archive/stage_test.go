package archive

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/stagetest"
)

// anchorGroup is what route sends the executor for testUpdate's anchor
// group "a" of step.
func anchorGroup(step int64) schemas.Group {
	g := schemas.Group{Schema: 1, Run: "r", Step: step, GroupID: "a", TaskID: "ta", Anchor: true}
	for i := range 3 {
		g.Trajectories = append(g.Trajectories, schemas.Trajectory{Schema: 1, Run: "r", Step: step, GroupID: "a",
			TrajID: fmt.Sprintf("a%d", i), GroupSize: 3, TaskID: "ta", Prompt: "predict the price",
			Response: fmt.Sprintf("import pandas as pd  # step %d, solution %d", step, i)})
	}
	return g
}

// codeStage is a stage on a writer that closes its files at once, with
// codeWait; the writer closes when the test ends.
func codeStage(t *testing.T, codeWait time.Duration) (*Stage, *Writer) {
	t.Helper()
	w, err := OpenWriter(WriterConfig{Dir: t.TempDir(), Run: "r", MaxAge: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	s := NewStage("r", w)
	s.CodeWait = codeWait
	return s, w
}

// TestStageArchivesTheAnchorsCode: an anchor group's prompts and
// responses reach its rows, whether its trajectories come before the
// update (as they do) or within CodeWait after it (a restart's
// redeliveries); past CodeWait the rows are archived without them, the
// stage says which groups, and the trajectories that come later are let
// go at once. World-model groups get none; Read leaves the columns out.
func TestStageArchivesTheAnchorsCode(t *testing.T) {
	s, w := codeStage(t, 300*time.Millisecond)
	var mu sync.Mutex
	noCode := map[int64][]string{}
	s.OnNoCode = func(step int64, groups []string) { mu.Lock(); noCode[step] = groups; mu.Unlock() }
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	handle := func(h func(msg *message.Message) error, v any) chan error {
		done := make(chan error, 1)
		go func() { done <- h(stagetest.Message(t, ctx, v)) }()
		return done
	}

	// Step 0: the trajectories first, held until the update is archived.
	exec0 := handle(s.HandleExec, anchorGroup(0))
	time.Sleep(50 * time.Millisecond)
	select {
	case err := <-exec0:
		t.Fatalf("the trajectories were let go (%v) before their step was archived", err)
	default:
	}
	if err := <-handle(s.HandleUpdate, testUpdate(0)); err != nil {
		t.Fatal(err)
	}
	if err := <-exec0; err != nil {
		t.Fatal(err)
	}
	// Step 1: the update alone; its trajectories come after CodeWait.
	if err := <-handle(s.HandleUpdate, testUpdate(1)); err != nil {
		t.Fatal(err)
	}
	if err := <-handle(s.HandleExec, anchorGroup(1)); err != nil {
		t.Fatal(err)
	}
	// Step 2: the update first, its trajectories within CodeWait.
	up2 := handle(s.HandleUpdate, testUpdate(2))
	time.Sleep(50 * time.Millisecond)
	exec2 := handle(s.HandleExec, anchorGroup(2))
	if err := <-up2; err != nil {
		t.Fatal(err)
	}
	if err := <-exec2; err != nil {
		t.Fatal(err)
	}

	if fmt.Sprint(noCode) != "map[1:[a]]" {
		t.Errorf("archived without code: %v, want step 1's group a only", noCode)
	}
	s.mu.Lock()
	if len(s.code) != 0 {
		t.Errorf("%d groups' trajectories still held after their steps were archived", len(s.code))
	}
	s.mu.Unlock()
	files, err := Files(w.cfg.Dir, "r")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{}
	for _, step := range []int64{0, 2} {
		for _, tr := range anchorGroup(step).Trajectories {
			want[fmt.Sprintf("%d/%s", step, tr.TrajID)] = tr.Response
		}
	}
	n := 0
	if err := Scan(files, func(rows []Row) error {
		for _, r := range rows {
			n++
			key := fmt.Sprintf("%d/%s", r.Step, r.TrajID)
			switch resp, ok := want[key]; {
			case ok && (r.Response == nil || *r.Response != resp || r.Prompt == nil || *r.Prompt != "predict the price"):
				t.Errorf("%s: prompt %v, response %v; want its trajectory's", key, r.Prompt, r.Response)
			case !ok && (r.Response != nil || r.Prompt != nil):
				t.Errorf("%s (anchor %v): code %q archived where there is none", key, r.IsAnchor, *r.Response)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if n != 18 {
		t.Fatalf("%d rows, want 18", n)
	}
	rows, err := Read(files, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if r.Response != nil || r.Prompt != nil {
			t.Fatalf("Read gave %d/%s's code", r.Step, r.TrajID)
		}
		resp, coded := want[fmt.Sprintf("%d/%s", r.Step, r.TrajID)]
		if coded != (r.ResponseBytes != nil) || coded && *r.ResponseBytes != int64(len(resp)) {
			t.Fatalf("Read gave %d/%s response_bytes %v; its response has %d", r.Step, r.TrajID, r.ResponseBytes, len(resp))
		}
	}
}

// TestStageStopsWaitingForCodeNothingSends: where no trajectories come at
// all (a topology that sends the anchor groups elsewhere), one update
// waits out CodeWait and the next ones do not wait, until trajectories
// come again.
func TestStageStopsWaitingForCodeNothingSends(t *testing.T) {
	s, w := codeStage(t, 100*time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var noCode []int64
	s.OnNoCode = func(step int64, _ []string) { noCode = append(noCode, step) }
	if err := s.HandleUpdate(stagetest.Message(t, ctx, testUpdate(0))); err != nil {
		t.Fatal(err)
	}
	// Were step 1 to wait, it would wait an hour.
	s.CodeWait = time.Hour
	done := make(chan error, 1)
	go func() { done <- s.HandleUpdate(stagetest.Message(t, ctx, testUpdate(1))) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("step 1 waits for trajectories although none has come since the stage started")
	}
	// Trajectories come again (step 2's), and an update waits for its
	// own again: step 3's come after it.
	held := make(chan error, 1)
	go func() { held <- s.HandleExec(stagetest.Message(t, ctx, anchorGroup(2))) }()
	for {
		s.mu.Lock()
		saw := s.sawCode
		s.mu.Unlock()
		if saw {
			break
		}
		time.Sleep(time.Millisecond)
	}
	if err := s.HandleUpdate(stagetest.Message(t, ctx, testUpdate(2))); err != nil {
		t.Fatal(err)
	}
	up3 := make(chan error, 1)
	go func() { up3 <- s.HandleUpdate(stagetest.Message(t, ctx, testUpdate(3))) }()
	time.Sleep(50 * time.Millisecond)
	if err := s.HandleExec(stagetest.Message(t, ctx, anchorGroup(3))); err != nil {
		t.Fatal(err)
	}
	for _, c := range []chan error{held, up3} {
		if err := <-c; err != nil {
			t.Fatal(err)
		}
	}
	if fmt.Sprint(noCode) != "[0 1]" {
		t.Errorf("archived without code: steps %v, want [0 1]", noCode)
	}
	files, _ := Files(w.cfg.Dir, "r")
	coded := map[int64]int{}
	if err := Scan(files, func(rows []Row) error {
		for _, r := range rows {
			if r.Response != nil {
				coded[r.Step]++
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(coded) != "map[2:3 3:3]" {
		t.Errorf("rows with code by step: %v, want steps 2 and 3's anchors", coded)
	}
}

// TestALateCalibrationRacingItsUpdateIsArchived: a late anchor group's
// calibration handled while its step's update is being added gets its
// rows, whichever handler gets to the writer first. The stage used to
// look for the late group, then for the update, with the update added in
// between: the calibration was acknowledged with no rows, and a run of a
// fixed number of steps waited for them for ever (a CI failure of
// TestReplayReproducesLateAnchors).
func TestALateCalibrationRacingItsUpdateIsArchived(t *testing.T) {
	w, err := OpenWriter(WriterConfig{Dir: t.TempDir(), Run: "r", MaxAge: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	s := NewStage("r", w)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const steps = 2000
	var wg sync.WaitGroup
	errs := make(chan error, 2*steps)
	for step := range int64(steps) {
		c := schemas.Calibration{Schema: 1, Run: "r", Seq: step + 1, Version: 1, Step: step, GroupID: "b",
			Pairs: []schemas.CalibratedPair{{TrajID: "b0", Predicted: 0.1, True: 0.4, Before: 0.2}}}
		update, calibration := stagetest.Message(t, ctx, testUpdate(step, "b")), stagetest.Message(t, ctx, c)
		wg.Add(2)
		go func() { defer wg.Done(); errs <- s.HandleUpdate(update) }()
		go func() { defer wg.Done(); errs <- s.HandleCalibration(calibration) }()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if pending := w.PendingLate(); len(pending) != 0 {
		t.Fatalf("%d of %d late groups' calibrations were acknowledged without their rows, the first step %d's", len(pending), steps, pending[0].Step)
	}
}

// A late group's rows are stamped with when its calibration was stored
// (Stored), not when the stage came to it, and with now when that is not
// known.
func TestLateRowsAreStampedWhenTheirCalibrationWasStored(t *testing.T) {
	w, err := OpenWriter(WriterConfig{Dir: t.TempDir(), Run: "r", MaxAge: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	s := NewStage("r", w)
	stored, now := time.Date(2026, 12, 2, 10, 0, 30, 0, time.UTC), time.Date(2026, 12, 2, 11, 0, 0, 0, time.UTC)
	s.Now = func() time.Time { return now }
	s.Stored = func(m *message.Message) time.Time {
		if m.Metadata.Get("known") == "" {
			return time.Time{}
		}
		return stored
	}
	ctx := context.Background()
	for step := range int64(2) {
		if err := s.HandleUpdate(stagetest.Message(t, ctx, testUpdate(step, "b"))); err != nil {
			t.Fatal(err)
		}
		c := stagetest.Message(t, ctx, schemas.Calibration{Schema: 1, Run: "r", Seq: step + 1, Version: 1, Step: step, GroupID: "b",
			Pairs: []schemas.CalibratedPair{{TrajID: "b0", Predicted: 0.1, True: 0.4, Before: 0.2}}})
		if step == 0 {
			c.Metadata.Set("known", "yes")
		}
		if err := s.HandleCalibration(c); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	rows, err := ReadAll(w.cfg.Dir, "r")
	if err != nil {
		t.Fatal(err)
	}
	late := map[int64]time.Time{}
	for _, r := range rows {
		if r.Source == SourceLateAnchor {
			late[r.Step] = r.TS
		}
	}
	if len(late) != 2 || !late[0].Equal(stored) || !late[1].Equal(now) {
		t.Errorf("late rows stamped %v; want step 0's when its calibration was stored, %v, and step 1's now, %v", late, stored, now)
	}
}

// TestLateRowsTakeTheirExecutionsFromTheOutcomes: a late group's rows
// take their execution's status, seconds, detail and copy from the
// outcomes (a calibration has only the scores), so a timeout scored 0
// reads timed_out, not scored; a trajectory without a pair (the world
// model did not grade it, or its execution gave no score) gets a row of
// its own from its outcome; a miss, or a kept execution without a score,
// leaves a pair's columns null, and a miss leaves a trajectory without a
// pair rowless; an error ends the reads, said once.
func TestLateRowsTakeTheirExecutionsFromTheOutcomes(t *testing.T) {
	c := schemas.Calibration{Run: "r", Step: 7, GroupID: "g1", Seq: 12, Version: 3, Pairs: []schemas.CalibratedPair{
		{TrajID: "t0", Predicted: 0.6, True: 0, Before: 0.5},
		{TrajID: "t1", Predicted: 0.4, True: 0.7, Before: 0.45},
		{TrajID: "t2", Predicted: 0.3, True: 0.2, Before: 0.3},
	}}
	// t6 and t7 the world model graded, but they have no pair: their
	// executions gave no score.
	g := LateGroup{Step: 7, GroupID: "g1", TaskID: "house", PolicyVersion: map[string]int64{"t0": 4, "t1": 4, "t2": 5, "t3": 5, "t4": 5, "t5": 5, "t7": 6, "t6": 6},
		Ungraded: []UngradedTraj{{TrajID: "t3", WMStatus: schemas.PredUngraded}, {TrajID: "t4", WMStatus: schemas.PredUngraded}, {TrajID: "t5", WMStatus: "not_sent"}}}
	from := int64(5)
	var asked []string
	var heard []error
	down := "7/g1/t7"
	s := &Stage{
		Outcome: func(_ context.Context, step int64, group, traj string) (schemas.ExecItem, bool, error) {
			key := fmt.Sprintf("%d/%s/%s", step, group, traj)
			asked = append(asked, key)
			if key == down {
				return schemas.ExecItem{}, false, fmt.Errorf("bucket down")
			}
			switch key {
			case "7/g1/t0":
				return schemas.ExecItem{TrajID: "t0", Score: f64(0), Status: schemas.ExecTimedOut, Seconds: 1800, Detail: "killed at the time limit"}, true, nil
			case "7/g1/t1":
				return schemas.ExecItem{TrajID: "t1", Score: f64(0.7), Status: schemas.ExecScored, CopyOf: "t9", CopyStep: &from, CopyGroup: "g4"}, true, nil
			case "7/g1/t2": // a second process ran it, and ended it so (as the bucket last heard)
				return schemas.ExecItem{TrajID: "t2", Status: schemas.ExecSandboxError, Seconds: 3, Detail: "container evicted"}, true, nil
			case "7/g1/t3":
				return schemas.ExecItem{TrajID: "t3", Score: f64(0.9), Status: schemas.ExecScored, Seconds: 1200}, true, nil
			case "7/g1/t6":
				return schemas.ExecItem{TrajID: "t6", Status: schemas.ExecSandboxError, Seconds: 1500, Detail: "sandbox lost"}, true, nil
			}
			return schemas.ExecItem{}, false, nil
		},
		OnOutcomeError: func(err error) { heard = append(heard, err) },
	}
	now := time.Date(2026, 12, 5, 10, 0, 0, 0, time.UTC)
	rows := FromLate(c, g, s.outcomesOf(context.Background(), c, g), now)
	if fmt.Sprint(asked) != "[7/g1/t0 7/g1/t1 7/g1/t2 7/g1/t3 7/g1/t4 7/g1/t5 7/g1/t6 7/g1/t7]" {
		t.Fatalf("asked for %v", asked)
	}
	var got []string
	for _, r := range rows {
		got = append(got, r.TrajID)
		if r.Source != SourceLateAnchor || !r.IsAnchor || r.AbsorbedSeq != 12 || r.CalibrationSeq != 12 || r.CalibrationVersion != 3 ||
			r.TaskID != "house" || r.PolicyVersion != g.PolicyVersion[r.TrajID] || r.Reward != nil || !r.TS.Equal(now) {
			t.Errorf("row %+v", r)
		}
	}
	if fmt.Sprint(got) != "[t0 t1 t2 t3 t6]" {
		t.Fatalf("rows for %v, want the three pairs, then t3 and t6 (t4 and t5 have no outcome, t7's read failed)", got)
	}
	str := func(p *string) string {
		if p == nil {
			return "<nil>"
		}
		return *p
	}
	if r := rows[0]; str(r.ExecStatus) != schemas.ExecTimedOut || r.ExecSeconds == nil || *r.ExecSeconds != 1800 || str(r.ExecDetail) != "killed at the time limit" ||
		r.TrueScore == nil || *r.TrueScore != 0 || *r.Predicted != 0.6 || *r.Calibrated != 0.5 || r.WMStatus != schemas.PredOK || r.ExecCopyOf != nil {
		t.Errorf("timed-out pair: %+v", r)
	}
	if r := rows[1]; str(r.ExecStatus) != schemas.ExecScored || r.ExecSeconds == nil || *r.ExecSeconds != 0 ||
		str(r.ExecCopyOf) != "t9" || r.ExecCopyStep == nil || *r.ExecCopyStep != 5 || str(r.ExecCopyGroup) != "g4" {
		t.Errorf("copied pair: %+v", r)
	}
	if r := rows[2]; r.ExecStatus != nil || r.ExecSeconds != nil || r.TrueScore == nil || *r.TrueScore != 0.2 {
		t.Errorf("pair whose kept execution gave no score: %+v; want its score and no execution columns", r)
	}
	if r := rows[3]; r.Predicted != nil || r.Calibrated != nil || r.WMStatus != schemas.PredUngraded || r.TrueScore == nil || *r.TrueScore != 0.9 ||
		str(r.ExecStatus) != schemas.ExecScored || r.ExecSeconds == nil || *r.ExecSeconds != 1200 {
		t.Errorf("ungraded trajectory's row: %+v", r)
	}
	if r := rows[4]; r.Predicted != nil || r.Calibrated != nil || r.WMStatus != schemas.PredOK || r.TrueScore != nil || r.PolicyVersion != 6 ||
		str(r.ExecStatus) != schemas.ExecSandboxError || r.ExecSeconds == nil || *r.ExecSeconds != 1500 || str(r.ExecDetail) != "sandbox lost" {
		t.Errorf("sandbox error's row: %+v", r)
	}
	if len(heard) != 1 || !strings.Contains(heard[0].Error(), "late anchor t7 of step 7: bucket down (its row, and those after it") {
		t.Errorf("errors heard: %v", heard)
	}

	// The first error ends the reads: what comes after it is not asked.
	asked, heard, down = nil, nil, "7/g1/t1"
	if rows := FromLate(c, g, s.outcomesOf(context.Background(), c, g), now); len(rows) != 3 || rows[0].ExecStatus == nil || rows[1].ExecStatus != nil {
		t.Errorf("with t1's read failing: %+v", rows)
	}
	if fmt.Sprint(asked) != "[7/g1/t0 7/g1/t1]" || len(heard) != 1 {
		t.Errorf("with t1's read failing, asked for %v, heard %v", asked, heard)
	}
}

// An update whose advantages were formed otherwise than the files record
// (another process's fuse stage given another --advantage-norm) is
// heard of, and archived all the same; one formed as they record is not.
func TestStageHearsOfAnUpdateOfOtherAdvantages(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, tc := range []struct {
		recorded fuse.Normalization
		fused    string
		heard    string
	}{
		{"", "", ""},
		{"", "center", "step 0: center, recorded std"},
		{fuse.CenterOnly, "center", ""},
		{fuse.CenterOnly, "", "step 0: std, recorded center"},
	} {
		w, err := OpenWriter(WriterConfig{Dir: t.TempDir(), Run: "r", MaxAge: 10 * time.Millisecond, Settings: Settings{AdvantageNorm: tc.recorded}})
		if err != nil {
			t.Fatal(err)
		}
		s := NewStage("r", w)
		var heard []string
		s.OnOtherAdvantages = func(step int64, fused, recorded fuse.Normalization) {
			heard = append(heard, fmt.Sprintf("step %d: %s, recorded %s", step, fused, recorded))
		}
		u := testUpdate(0)
		u.AdvantageNorm = tc.fused
		if err := s.HandleUpdate(stagetest.Message(t, ctx, u)); err != nil {
			t.Fatal(err)
		}
		if got := strings.Join(heard, "; "); got != tc.heard {
			t.Errorf("files recording %q, an update of %q: heard %q, want %q", tc.recorded, tc.fused, got, tc.heard)
		}
		if archived := w.Archived(); len(archived) != 1 || archived[0] != 0 {
			t.Errorf("files recording %q, an update of %q: archived steps %v, want [0]", tc.recorded, tc.fused, archived)
		}
		w.Close()
	}
}
