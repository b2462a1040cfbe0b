package fuse

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
)

func score(v float64) *float64 { return &v }

func TestStepsFallBackForLateAnchors(t *testing.T) {
	s, err := NewSteps(StepsConfig{Run: "r", Debias: true, AnchorDeadline: time.Second, Denoiser: DenoiserConfig{Estimator: EstimatorOff}})
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Unix(1000, 0)
	plan := schemas.Plan{Step: 3, Groups: []schemas.PlanGroup{
		{GroupID: "a", Anchor: true, TrajIDs: []string{"a0", "a1"}},
		{GroupID: "w", TrajIDs: []string{"w0", "w1", "w2"}},
	}}
	s.AddPlan(plan, t0)
	s.AddPrediction(schemas.Prediction{Step: 3, GroupID: "a", Items: []schemas.PredItem{{TrajID: "a0", Score: score(0.2)}, {TrajID: "a1", Score: score(0.6)}}})
	if len(s.Ready(t0)) != 0 {
		t.Fatal("ready without the world-model group's prediction")
	}
	s.AddPrediction(schemas.Prediction{Step: 3, GroupID: "w", Items: []schemas.PredItem{
		{TrajID: "w0", Score: score(0.1)}, {TrajID: "w1", Score: nil, Status: schemas.PredUngraded}, {TrajID: "w2", Score: score(0.9)}}})
	// The map halves scores.
	if err := s.AddCalibration(schemas.Calibration{Seq: 1, Version: 4, Step: 2, GroupID: "x",
		Map: &schemas.Thresholds{X: []float64{0, 1}, Y: []float64{0, 0.5}}}); err != nil {
		t.Fatal(err)
	}
	if len(s.Ready(t0.Add(999*time.Millisecond))) != 0 {
		t.Fatal("ready before the anchor deadline without the execution")
	}
	if r := s.Ready(t0.Add(time.Second)); len(r) != 1 {
		t.Fatal("not ready at the anchor deadline")
	}
	u := s.Fuse(3, t0.Add(time.Second))
	if len(u.LateAnchors) != 1 || u.LateAnchors[0] != "a" || u.Anchors != 0 || u.Groups != 2 || u.CalibrationVersion != 4 {
		t.Fatalf("update %+v", u)
	}
	for _, it := range u.Items {
		if it.Source != SourceWorldModel {
			t.Fatalf("%s: source %s for a late anchor", it.TrajID, it.Source)
		}
	}
	if got := *u.Items[0].Reward; got != 0.1 { // calibrated 0.2
		t.Fatalf("late anchor reward %v, want its calibrated prediction 0.1", got)
	}
	if u.Items[3].Reward != nil || u.Items[3].FusedAdvantage != 0 {
		t.Fatalf("ungraded item got %+v", u.Items[3])
	}
	s.Close(3)
	if s.AddExecution(schemas.Execution{Step: 3, GroupID: "a"}) {
		t.Fatal("an execution after publication was accepted")
	}
}

func TestStepsUseExecutionOnceCalibrated(t *testing.T) {
	s, _ := NewSteps(StepsConfig{Run: "r", Debias: true, AnchorDeadline: time.Hour, Denoiser: DenoiserConfig{Estimator: EstimatorOff}})
	t0 := time.Unix(0, 0)
	s.AddPlan(schemas.Plan{Step: 1, Groups: []schemas.PlanGroup{{GroupID: "a", Anchor: true, TrajIDs: []string{"a0", "a1"}}}}, t0)
	s.AddPrediction(schemas.Prediction{Step: 1, GroupID: "a", Items: []schemas.PredItem{{TrajID: "a0", Score: score(0.5)}, {TrajID: "a1", Score: score(0.5)}}})
	s.AddExecution(schemas.Execution{Step: 1, GroupID: "a", Items: []schemas.ExecItem{{TrajID: "a0", Score: score(0.3)}, {TrajID: "a1", Score: score(0.8)}}})
	if len(s.Ready(t0)) != 0 {
		t.Fatal("ready before the anchor group was calibrated")
	}
	s.AddCalibration(schemas.Calibration{Seq: 1, Step: 1, GroupID: "a"})
	if len(s.Ready(t0)) != 1 {
		t.Fatal("not ready once executed and calibrated")
	}
	u := s.Fuse(1, t0)
	if u.Anchors != 1 || *u.Items[1].Reward != 0.8 || u.Items[1].Source != SourceAnchor {
		t.Fatalf("update %+v", u)
	}
	want := 0.25 / (0.25 + AdvantageEps)
	if math.Abs(u.Items[1].FusedAdvantage-want) > 1e-12 {
		t.Fatalf("fused %v, want %v", u.Items[1].FusedAdvantage, want)
	}
}

// The advantages are formed as the run was told, its trainer's way:
// standardised (GRPO) by default, centred only (Dr. GRPO) when asked, and
// the update says which when it is not the default. Another name is
// refused.
func TestStepsFormAdvantagesAsTheTrainerDoes(t *testing.T) {
	fused := func(norm Normalization) schemas.Update {
		s, err := NewSteps(StepsConfig{Run: "r", Debias: true, Norm: norm, AnchorDeadline: time.Hour, Denoiser: DenoiserConfig{Estimator: EstimatorOff}})
		if err != nil {
			t.Fatal(err)
		}
		t0 := time.Unix(0, 0)
		s.AddPlan(schemas.Plan{Step: 1, Groups: []schemas.PlanGroup{{GroupID: "a", Anchor: true, TrajIDs: []string{"a0", "a1", "a2"}}}}, t0)
		s.AddPrediction(schemas.Prediction{Step: 1, GroupID: "a", Items: []schemas.PredItem{{TrajID: "a0", Score: score(0.5)}, {TrajID: "a1", Score: score(0.5)}, {TrajID: "a2", Score: score(0.5)}}})
		s.AddExecution(schemas.Execution{Step: 1, GroupID: "a", Items: []schemas.ExecItem{{TrajID: "a0", Score: score(0.2)}, {TrajID: "a1", Score: score(0.3)}, {TrajID: "a2", Score: score(0.7)}}})
		s.AddCalibration(schemas.Calibration{Seq: 1, Step: 1, GroupID: "a"})
		return s.Fuse(1, t0)
	}
	sd := math.Sqrt((0.2*0.2 + 0.1*0.1 + 0.3*0.3) / 3) // around the mean 0.4
	for _, tc := range []struct {
		norm     Normalization
		said     string
		wantA2   float64
		wantNorm string
	}{
		{"", "", 0.3 / (sd + AdvantageEps), ""},
		{Standardize, "", 0.3 / (sd + AdvantageEps), ""},
		{CenterOnly, "center", 0.3, "center"},
	} {
		u := fused(tc.norm)
		if u.AdvantageNorm != tc.wantNorm {
			t.Errorf("norm %q: the update says %q, want %q", tc.norm, u.AdvantageNorm, tc.wantNorm)
		}
		if got := u.Items[2].Advantage; math.Abs(got-tc.wantA2) > 1e-12 {
			t.Errorf("norm %q: the advantage of 0.7 among 0.2, 0.3, 0.7 is %v, want %v", tc.norm, got, tc.wantA2)
		}
		if got := u.Items[2].FusedAdvantage; math.Abs(got-tc.wantA2) > 1e-12 { // rho 1, one group
			t.Errorf("norm %q: fused %v, want %v", tc.norm, got, tc.wantA2)
		}
	}
	if _, err := NewSteps(StepsConfig{Run: "r", Norm: "zscore", AnchorDeadline: time.Hour}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), `"zscore"`) {
		t.Errorf("norm zscore: %v, want ErrConfig naming it", err)
	}
}

// calibrations makes n anchor-group calibrations of 4 pairs, each with the
// map (halving scores) and counters a calibrate stage would send.
// An anchor group executed in time with fewer than two scores (sandbox
// errors, an executor given up on) cannot be ranked on its executions: it
// is fused at once on its world-model rewards, as a late one is at its
// deadline, and its executions' statuses are kept; with two scores it is
// an anchor.
func TestStepsFallBackForFailedAnchors(t *testing.T) {
	for _, tc := range []struct {
		name   string
		scores []*float64
		anchor bool
	}{
		{"none scored", []*float64{nil, nil, nil}, false},
		{"one scored", []*float64{score(0.9), nil, nil}, false},
		{"two scored", []*float64{score(0.9), nil, score(0.1)}, true},
	} {
		s, _ := NewSteps(StepsConfig{Run: "r", Debias: true, AnchorDeadline: time.Hour, Denoiser: DenoiserConfig{Estimator: EstimatorOff}})
		t0 := time.Unix(0, 0)
		s.AddPlan(schemas.Plan{Step: 1, Groups: []schemas.PlanGroup{{GroupID: "a", Anchor: true, TrajIDs: []string{"a0", "a1", "a2"}}}}, t0)
		s.AddPrediction(schemas.Prediction{Step: 1, GroupID: "a", Items: []schemas.PredItem{
			{TrajID: "a0", Score: score(0.2)}, {TrajID: "a1", Score: score(0.4)}, {TrajID: "a2", Score: score(0.6)}}})
		e := schemas.Execution{Step: 1, GroupID: "a"}
		for i, v := range tc.scores {
			it := schemas.ExecItem{TrajID: fmt.Sprintf("a%d", i), Score: v, Status: schemas.ExecScored}
			if v == nil {
				it.Status = schemas.ExecSandboxError
			}
			e.Items = append(e.Items, it)
		}
		s.AddExecution(e)
		s.AddCalibration(schemas.Calibration{Seq: 1, Step: 1, GroupID: "a"})
		if len(s.Ready(t0)) != 1 {
			t.Fatalf("%s: not ready once executed and calibrated", tc.name)
		}
		u := s.Fuse(1, t0)
		if tc.anchor {
			if u.Anchors != 1 || len(u.FailedAnchors) != 0 || u.Items[0].Source != SourceAnchor || u.Items[1].Reward != nil {
				t.Fatalf("%s: update %+v; want an anchor on its two scores", tc.name, u)
			}
			continue
		}
		if u.Anchors != 0 || u.Groups != 1 || len(u.Skipped) != 0 || len(u.LateAnchors) != 0 || len(u.FailedAnchors) != 1 || u.FailedAnchors[0] != "a" {
			t.Fatalf("%s: update %+v; want a world-model group, listed as a failed anchor", tc.name, u)
		}
		for i, it := range u.Items {
			if it.Source != SourceWorldModel || it.Reward == nil || *it.Reward != *it.Predicted || it.AbsorbedSeq != 1 ||
				it.ExecStatus != e.Items[i].Status || (it.TrueScore == nil) != (tc.scores[i] == nil) {
				t.Fatalf("%s: item %+v; want the world model's reward (identity map), with the execution recorded", tc.name, it)
			}
		}
	}
}

func calibrations(n int) []schemas.Calibration {
	out := make([]schemas.Calibration, n)
	for i := range out {
		c := schemas.Calibration{Seq: int64(i + 1), Version: int64(i / 3), PairsTotal: int64(4 * (i + 1)), Step: int64(i / 2), GroupID: fmt.Sprintf("g%d", i%2),
			Map: &schemas.Thresholds{X: []float64{0, 1}, Y: []float64{0, 0.5 + 0.01*float64(i)}}}
		for k := range 4 {
			q := float64((7*i+3*k)%10) / 10
			c.Pairs = append(c.Pairs, schemas.CalibratedPair{TrajID: fmt.Sprintf("t%d", k), Predicted: q, True: math.Mod(q*q+0.1*float64(i%3), 1), Before: q / 2})
		}
		out[i] = c
	}
	return out
}

// Restored from a checkpoint and fed only the calibrations after it (those
// before aged out), Steps ends where Steps fed every calibration ends: the
// same rho, map and counters. A calibration at or before the checkpoint
// still tells which anchor group is calibrated, without counting twice. A
// checkpoint made with other settings is refused.
func TestStepsRestoreFromACheckpoint(t *testing.T) {
	cfg := StepsConfig{Run: "r", Debias: true, AnchorDeadline: time.Hour, Denoiser: DenoiserConfig{Warmup: 4}}
	cals := calibrations(30)
	full, _ := NewSteps(cfg)
	var cp Checkpoint
	for i, c := range cals {
		if err := full.AddCalibration(c); err != nil {
			t.Fatal(err)
		}
		if i == 11 {
			cp = full.Checkpoint()
		}
	}
	b, _ := json.Marshal(cp) // the checkpoint travels as JSON
	var back Checkpoint
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	resumed, _ := NewSteps(cfg)
	if err := resumed.Restore(back); err != nil {
		t.Fatal(err)
	}
	for _, c := range cals[10:] { // 11 and 12 are in the checkpoint too
		if err := resumed.AddCalibration(c); err != nil {
			t.Fatal(err)
		}
	}
	g, w := resumed.Checkpoint(), full.Checkpoint()
	gb, _ := json.Marshal(g)
	wb, _ := json.Marshal(w)
	if string(gb) != string(wb) {
		t.Fatalf("resumed:\n%s\nfed every calibration:\n%s", gb, wb)
	}
	if w.Denoiser.Count < 20 || w.Denoiser.Rho == 1 {
		t.Fatalf("the denoiser counted %d groups, rho %v: the comparison is vacuous", w.Denoiser.Count, w.Denoiser.Rho)
	}
	if _, ok := resumed.absorbed[anchorGroup{5, "g1"}]; !ok {
		t.Fatal("calibration 12, inside the checkpoint, did not mark its anchor group calibrated")
	}

	// The checkpoint holds the calibrated anchor groups of the steps not
	// published, so that a restart reads none of the calibrations up to
	// it: fed only those after, it ends as fed every one. Those of steps
	// published by the restart are not taken back.
	after, _ := NewSteps(cfg)
	after.MarkPublished(0)
	if err := after.Restore(back); err != nil {
		t.Fatal(err)
	}
	for _, c := range cals[12:] {
		if err := after.AddCalibration(c); err != nil {
			t.Fatal(err)
		}
	}
	full.Close(0)
	ab, _ := json.Marshal(after.Checkpoint())
	if wb, _ := json.Marshal(full.Checkpoint()); string(ab) != string(wb) {
		t.Fatalf("fed only the calibrations after the checkpoint:\n%s\nfed every calibration:\n%s", ab, wb)
	}
	if len(back.Absorbed) < 10 || !back.AbsorbedKept {
		t.Fatalf("the checkpoint kept %d calibrated anchor groups (kept: %v); want those of calibrations 1-12", len(back.Absorbed), back.AbsorbedKept)
	}
	if _, ok := after.absorbed[anchorGroup{0, "g0"}]; ok {
		t.Error("step 0, published, got its anchor group back from the checkpoint")
	}

	for name, other := range map[string]StepsConfig{
		"debias off":        {Run: "r", Debias: false, AnchorDeadline: time.Hour, Denoiser: cfg.Denoiser},
		"another estimator": {Run: "r", Debias: true, AnchorDeadline: time.Hour, Denoiser: DenoiserConfig{Warmup: 4, Estimator: EstimatorRatio}},
	} {
		s, _ := NewSteps(other)
		if err := s.Restore(back); !errors.Is(err, ErrOtherSettings) {
			t.Errorf("%s: restoring a checkpoint made otherwise gives %v, want ErrOtherSettings", name, err)
		}
		if s.den.Snapshot().Count != 0 || s.seq != 0 {
			t.Errorf("%s: a refused checkpoint changed the state", name)
		}
	}
}

func TestStepsSayWhichPredictionsAStepWaitsFor(t *testing.T) {
	s, err := NewSteps(StepsConfig{Run: "r", AnchorDeadline: time.Second, Denoiser: DenoiserConfig{Estimator: EstimatorOff}})
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Unix(1000, 0)
	s.AddPrediction(schemas.Prediction{Step: 4, GroupID: "w"}) // before its plan: not waiting on anything yet
	if w := s.Waiting(t0.Add(time.Hour)); len(w) != 0 {
		t.Fatalf("a step without a plan waits: %+v", w)
	}
	s.AddPlan(schemas.Plan{Step: 4, Groups: []schemas.PlanGroup{
		{GroupID: "a", Anchor: true, TrajIDs: []string{"a0", "a1"}}, {GroupID: "w", TrajIDs: []string{"w0"}}, {GroupID: "v", TrajIDs: []string{"v0"}},
	}}, t0)
	s.AddPlan(schemas.Plan{Step: 2, Groups: []schemas.PlanGroup{{GroupID: "x", TrajIDs: []string{"x0"}}}}, t0.Add(time.Minute))
	if w := s.Waiting(t0); len(w) != 0 {
		t.Fatalf("steps planned at or after since listed: %+v", w)
	}
	w := s.Waiting(t0.Add(2 * time.Minute))
	if len(w) != 2 || w[0].Step != 2 || w[1].Step != 4 || fmt.Sprint(w[1].Missing) != "[a v]" || w[1].Groups != 3 || !w[1].At.Equal(t0) {
		t.Fatalf("waiting %+v, want step 2, then step 4 missing [a v] of 3 since t0", w)
	}
	s.AddPrediction(schemas.Prediction{Step: 4, GroupID: "a"})
	s.AddPrediction(schemas.Prediction{Step: 4, GroupID: "v"})
	// The anchor group's execution is still missing, but that has its deadline.
	if w := s.Waiting(t0.Add(2 * time.Minute)); len(w) != 1 || w[0].Step != 2 {
		t.Fatalf("waiting %+v, want only step 2", w)
	}
}

// A group the plan marks dropped (never sent to be scored) is waited for
// by nothing: the step is ready on its other groups' predictions, and its
// update has the dropped group skipped with the plan's reason, its items
// ungraded as not sent.
func TestStepsDoNotWaitForADroppedGroup(t *testing.T) {
	s, err := NewSteps(StepsConfig{Run: "r", AnchorDeadline: time.Hour, Denoiser: DenoiserConfig{Estimator: EstimatorOff}})
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Unix(1000, 0)
	const why = "not scored: the group's message is 9.0 MiB"
	s.AddPlan(schemas.Plan{Step: 0, Groups: []schemas.PlanGroup{
		{GroupID: "big", TrajIDs: []string{"b0", "b1"}, Dropped: why}, {GroupID: "w", TrajIDs: []string{"w0", "w1"}},
	}}, t0)
	if w := s.Waiting(t0.Add(time.Minute)); len(w) != 1 || fmt.Sprint(w[0].Missing) != "[w]" {
		t.Fatalf("waiting %+v, want only w's prediction", w)
	}
	s.AddPrediction(schemas.Prediction{Step: 0, GroupID: "w", Items: []schemas.PredItem{
		{TrajID: "w0", Score: score(0.2), Status: schemas.PredOK}, {TrajID: "w1", Score: score(0.7), Status: schemas.PredOK}}})
	if r := s.Ready(t0); len(r) != 1 || r[0] != 0 {
		t.Fatalf("ready %v, want step 0 without the dropped group", r)
	}
	u := s.Fuse(0, t0)
	if u.Groups != 1 || len(u.Skipped) != 1 || u.Skipped[0] != (schemas.SkippedGroup{GroupID: "big", Reason: why}) || len(u.LateAnchors) != 0 {
		t.Fatalf("update: %d groups, skipped %+v, late %v", u.Groups, u.Skipped, u.LateAnchors)
	}
	for _, it := range u.Items {
		if dropped := it.GroupID == "big"; dropped != (it.WMStatus == schemas.PredNotSent) || dropped != (it.Reward == nil) {
			t.Errorf("item %+v", it)
		}
	}
}

// Each item's record is its own group's, even where two groups of a plan
// share trajectory ids (route refuses that now; a plan made before it did
// gave every such item the last group's task and scores).
func TestItemsKeepTheirGroupsRecords(t *testing.T) {
	s, _ := NewSteps(StepsConfig{Run: "r", AnchorDeadline: time.Hour, Denoiser: DenoiserConfig{Estimator: EstimatorOff}})
	t0 := time.Unix(0, 0)
	s.AddPlan(schemas.Plan{Step: 1, Groups: []schemas.PlanGroup{
		{GroupID: "a", TaskID: "ta", TrajIDs: []string{"0", "1"}},
		{GroupID: "b", TaskID: "tb", TrajIDs: []string{"0", "1"}},
	}}, t0)
	for g, scores := range map[string][2]float64{"a": {0.1, 0.2}, "b": {0.7, 0.9}} {
		s.AddPrediction(schemas.Prediction{Step: 1, GroupID: g, Items: []schemas.PredItem{
			{TrajID: "0", Score: score(scores[0])}, {TrajID: "1", Score: score(scores[1])}}})
	}
	u := s.Fuse(1, t0)
	for _, it := range u.Items {
		if it.TaskID != "t"+it.GroupID || it.Predicted == nil || *it.Predicted != *it.Reward {
			t.Errorf("group %s item %s: task %s, predicted %v, reward %v; want its own group's", it.GroupID, it.TrajID, it.TaskID, *it.Predicted, *it.Reward)
		}
	}
}

// An update names the world model that scored it: once, when one scored
// every group sent to be scored (a dropped group has none), and on each
// item when two did (a restart onto another --wm-model, two predict
// processes), an item of a prediction that named none left empty.
func TestAnUpdateNamesItsWorldModel(t *testing.T) {
	for _, tc := range []struct {
		name    string
		models  [3]string // of groups a, b, c
		one     string
		perItem map[string]string // group to its items' model; nil: none set
		all     []string          // Models
	}{
		{"one model", [3]string{"qwen", "qwen", "qwen"}, "qwen", nil, []string{"qwen"}},
		{"two models", [3]string{"qwen", "llama", "qwen"}, "", map[string]string{"a": "qwen", "b": "llama", "c": "qwen", "big": ""}, []string{"qwen", "llama"}},
		{"one named, one not", [3]string{"", "qwen", "qwen"}, "", map[string]string{"a": "", "b": "qwen", "c": "qwen", "big": ""}, []string{"", "qwen"}},
		{"none named", [3]string{"", "", ""}, "", nil, []string{""}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := NewSteps(StepsConfig{Run: "r", AnchorDeadline: time.Hour, Denoiser: DenoiserConfig{Estimator: EstimatorOff}})
			t0 := time.Unix(0, 0)
			plan := schemas.Plan{Step: 1, Groups: []schemas.PlanGroup{{GroupID: "big", TrajIDs: []string{"x0", "x1"}, Dropped: "over max_payload"}}}
			for _, g := range []string{"a", "b", "c"} {
				plan.Groups = append(plan.Groups, schemas.PlanGroup{GroupID: g, TrajIDs: []string{g + "0", g + "1"}})
			}
			s.AddPlan(plan, t0)
			for i, g := range []string{"a", "b", "c"} {
				s.AddPrediction(schemas.Prediction{Step: 1, GroupID: g, Model: tc.models[i], Items: []schemas.PredItem{
					{TrajID: g + "0", Score: score(0.1)}, {TrajID: g + "1", Score: score(0.6)}}})
			}
			u := s.Fuse(1, t0)
			if u.WMModel != tc.one {
				t.Errorf("update's wm_model %q, want %q", u.WMModel, tc.one)
			}
			if !slices.Equal(u.Models(), tc.all) {
				t.Errorf("the update's models %q, want %q", u.Models(), tc.all)
			}
			for _, it := range u.Items {
				if want := tc.perItem[it.GroupID]; it.WMModel != want {
					t.Errorf("item %s of group %s: wm_model %q, want %q", it.TrajID, it.GroupID, it.WMModel, want)
				}
				if want := map[string]string{"a": tc.models[0], "b": tc.models[1], "c": tc.models[2]}[it.GroupID]; u.ItemModel(&it) != want {
					t.Errorf("item %s of group %s: its model %q, want %q", it.TrajID, it.GroupID, u.ItemModel(&it), want)
				}
			}
		})
	}
}
