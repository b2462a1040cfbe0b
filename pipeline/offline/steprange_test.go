package offline

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/stages/archive"
)

func TestParseStepRange(t *testing.T) {
	for _, c := range []struct {
		in, want, wantErr string
	}{
		{in: "100-200", want: "steps 100 to 200"},
		{in: "100-", want: "steps 100 and after"},
		{in: "-200", want: "steps 0 to 200"},
		{in: " 7 ", want: "step 7"},
		{in: "7-7", want: "step 7"},
		{in: "", wantErr: "no step"},
		{in: "-", wantErr: "no step"},
		{in: "200-100", wantErr: "the last step is before the first"},
		{in: "x-3", wantErr: "the first step is not a step number"},
		{in: "3-y", wantErr: "the last step is not a step number"},
		{in: "1-2-3", wantErr: "the last step is not a step number"},
	} {
		r, err := ParseStepRange(c.in)
		switch {
		case c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)):
			t.Errorf("%q: %v, %v; want an error saying %q", c.in, r, err, c.wantErr)
		case c.wantErr == "" && err != nil:
			t.Errorf("%q: %v", c.in, err)
		case c.wantErr == "" && r.String() != c.want:
			t.Errorf("%q: %s; want %s", c.in, r, c.want)
		}
	}
}

// An audit of a range of steps says what an audit of those steps' rows
// alone says, streamed from the archive's files as the command reads them
// (whose first read asks for the predictions alone, and gets the steps
// too), to the last digit; a range the run does not reach is refused,
// naming the steps it holds.
func TestAuditOfAStepRangeIsTheAuditOfItsRows(t *testing.T) {
	rows, _, files := archiveRunFiles(t, 30, nil)
	to := int64(24)
	r := StepRange{From: 10, To: &to}
	var in []archive.Row
	for _, row := range rows {
		if r.Has(row.Step) {
			in = append(in, row)
		}
	}
	if len(in) == 0 || len(in) == len(rows) {
		t.Fatalf("%d of %d rows in %s: the test wants some in and some out", len(in), len(rows), r)
	}
	want, err := RunAudit(in, AuditOptions{Steps: &r})
	if err != nil {
		t.Fatal(err)
	}
	got, err := RunAuditRows(files, AuditOptions{Steps: &r})
	if err != nil {
		t.Fatal(err)
	}
	if got.Rows != len(in) || got.Steps != 15 || got.Drift[0].Step != 10 || got.Drift[len(got.Drift)-1].Step != 24 {
		t.Errorf("audited %d rows over %d steps (%d to %d); want %d over 15, 10 to 24", got.Rows, got.Steps, got.Drift[0].Step, got.Drift[len(got.Drift)-1].Step, len(in))
	}
	if g, w := summaryJSON(t, got), summaryJSON(t, want); g != w {
		t.Errorf("steps 10 to 24 from the files:\n%s\ntheir rows alone:\n%s", g, w)
	}
	past := StepRange{From: 30}
	if _, err := RunAuditRows(files, AuditOptions{Steps: &past}); err == nil ||
		!strings.Contains(err.Error(), "no rows in steps 30 and after: the run's rows are of steps 0 to 29") {
		t.Errorf("a range past the run: %v", err)
	}
}

// LastSteps counts back from the newest update: a late anchor's row,
// stamped when its group was calibrated, neither is the newest nor brings
// its step in.
func TestLastStepsCountsBackFromTheNewestUpdate(t *testing.T) {
	t0 := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	var rows []archive.Row
	for step := range int64(10) {
		for i := range 3 {
			rows = append(rows, archive.Row{Step: step, TrajID: fmt.Sprint(i), Source: archive.SourceWorldModel, TS: t0.Add(time.Duration(step) * time.Minute)})
		}
	}
	rows = append(rows, archive.Row{Step: 2, Source: archive.SourceLateAnchor, TS: t0.Add(time.Hour)})
	for _, c := range []struct {
		d    time.Duration
		from int64
	}{{5 * time.Minute, 4}, {time.Minute, 8}, {0, 9}, {time.Hour, 0}} {
		r, err := LastSteps(InMemory(rows), c.d)
		if err != nil || r.From != c.from || r.To != nil {
			t.Errorf("the last %s: %v, %v; want steps %d and after", c.d, r, err, c.from)
		}
	}
	if _, err := LastSteps(InMemory(rows[len(rows)-1:]), time.Hour); err == nil || !strings.Contains(err.Error(), "no step fused") {
		t.Errorf("late rows alone: %v", err)
	}
}

// A run's rows name the world model that scored them, and the audit says
// which it measured: several when a run was scored by more than one, in
// the order of their first steps; --wm-model audits one alone, as an
// audit of its rows alone says, and a name the rows do not hold is
// refused, naming those they do.
func TestAuditNamesItsWorldModels(t *testing.T) {
	rows, _, files := archiveRunFiles(t, 6, nil)
	for _, r := range rows {
		if r.WMModel == nil || *r.WMModel != "sim" {
			t.Fatalf("step %d, %s: wm_model %v, want the simulated world model's name, sim", r.Step, r.TrajID, r.WMModel)
		}
	}
	a, err := RunAuditRows(files, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if want := []WorldModelUse{{Model: "sim", Rows: a.Rows, Pairs: a.Pairs, FirstStep: 0, LastStep: 5}}; !slices.Equal(a.WorldModels, want) {
		t.Fatalf("world models %+v, want %+v", a.WorldModels, want)
	}

	// Step 0's rows as an archive from before wm_model has them, steps 1
	// and 2 by sim, the rest by another world model after a restart.
	qwen := "qwen"
	uses := map[string]*WorldModelUse{}
	var mixed, ofQwen []archive.Row
	for _, r := range rows {
		switch {
		case r.Step == 0:
			r.WMModel = nil
		case r.Step >= 3:
			r.WMModel = &qwen
		}
		name := modelOf(r)
		u := uses[name]
		if u == nil {
			u = &WorldModelUse{Model: name, FirstStep: r.Step}
			uses[name] = u
		}
		u.FirstStep, u.LastStep = min(u.FirstStep, r.Step), max(u.LastStep, r.Step)
		if r.Source != archive.SourceLateAnchor {
			u.Rows++
		}
		if r.IsAnchor && r.Predicted != nil && r.TrueScore != nil && r.Source != archive.SourceWorldModel {
			u.Pairs++
		}
		mixed = append(mixed, r)
		if name == qwen {
			ofQwen = append(ofQwen, r)
		}
	}
	a, err = RunAudit(mixed, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if want := []WorldModelUse{*uses[""], *uses["sim"], *uses["qwen"]}; !slices.Equal(a.WorldModels, want) {
		t.Fatalf("world models %+v, want %+v", a.WorldModels, want)
	}
	want, err := RunAudit(ofQwen, AuditOptions{Model: &qwen})
	if err != nil {
		t.Fatal(err)
	}
	got, err := RunAudit(mixed, AuditOptions{Model: &qwen})
	if err != nil {
		t.Fatal(err)
	}
	if got.Rows != uses["qwen"].Rows || len(got.WorldModels) != 1 || got.WorldModels[0].Model != qwen {
		t.Errorf("audited %d rows of %+v; want qwen's %d alone", got.Rows, got.WorldModels, uses["qwen"].Rows)
	}
	if g, w := summaryJSON(t, got), summaryJSON(t, want); g != w {
		t.Errorf("qwen's rows picked out:\n%s\nits rows alone:\n%s", g, w)
	}
	other := "gpt"
	if _, err := RunAudit(mixed, AuditOptions{Model: &other}); err == nil ||
		!strings.Contains(err.Error(), `no rows of world model "gpt": the rows' world models are none named (rows from before wm_model was kept), "qwen", "sim"`) {
		t.Errorf("a world model the rows do not hold: %v", err)
	}
}
