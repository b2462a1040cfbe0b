package archive

import (
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
)

func f64(x float64) *float64 { return &x }

func testUpdate(step int64, late ...string) schemas.Update {
	u := schemas.Update{Schema: 1, Run: "r", Step: step, Rho: 2, D: 0.1, CalibrationVersion: 3, CalibrationSeq: 7,
		PublishedAt: time.Date(2026, 12, 2, 10, 0, int(step), 0, time.UTC), LateAnchors: late}
	// Odd steps were scored by two world models, one a group.
	if step%2 == 0 {
		u.WMModel = "qwen"
	}
	for g, group := range []string{"a", "b"} {
		for i := range 3 {
			it := schemas.UpdateItem{TrajID: group + string(rune('0'+i)), GroupID: group, Source: SourceWorldModel,
				TaskID: "t" + group, PolicyVersion: step, Predicted: f64(0.1 * float64(i+g)), WMStatus: schemas.PredOK,
				Calibrated: f64(0.2 * float64(i)), Reward: f64(0.2 * float64(i)), Advantage: float64(i) - 1, Weight: 1,
				FusedAdvantage: (float64(i) - 1) / 3}
			if step%2 == 1 {
				it.WMModel = map[string]string{"a": "qwen", "b": "llama"}[group]
			}
			if group == "a" {
				it.Source, it.TrueScore, it.ExecStatus, it.ExecSeconds, it.AbsorbedSeq = SourceAnchor, f64(0.3), schemas.ExecScored, f64(0.02), 5
				if i == 2 { // the same solution as a1's, run once
					it.ExecCopyOf = "a1"
				}
				if i == 0 && step > 0 { // the same solution as a0's of the step before
					before := step - 1
					it.ExecCopyOf, it.ExecCopyStep, it.ExecCopyGroup = "a0", &before, "a"
				}
				if i == 1 {
					it.ExecDetail = fmt.Sprintf("step %d: (not isolated: no permission for network and PID namespaces)", step)
					it.WMRationale = "reads the data as the task says"
				}
				it.WMVerdict = schemas.ExecScored
			}
			if i == 2 && group == "b" {
				it.Predicted, it.WMStatus, it.Calibrated, it.Reward = nil, schemas.PredUngraded, nil, nil
			}
			u.Items = append(u.Items, it)
		}
	}
	return u
}

func TestWriterRoundTripAndRoll(t *testing.T) {
	dir := t.TempDir()
	w, err := OpenWriter(WriterConfig{Dir: dir, Run: "r", MaxRows: 10, MaxAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	var want []Row
	var commits []*Commit
	for step := range int64(5) {
		rows, _ := FromUpdate(testUpdate(step))
		want = append(want, rows...)
		c, err := w.Add(UpdateKey(step), rows, nil)
		if err != nil {
			t.Fatal(err)
		}
		commits = append(commits, c)
	}
	// 6 rows a step, 10 a file: steps 0-1 close the first file, 2-3 the
	// second; step 4 waits for the flush.
	for i, c := range commits {
		select {
		case <-c.Done():
			if i == 4 {
				t.Fatalf("step 4's commit done before its file closed")
			}
		default:
			if i < 4 {
				t.Fatalf("step %d's commit not done after its file reached MaxRows", i)
			}
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := commits[4].Err(); err != nil {
		t.Fatal(err)
	}
	files, _ := Files(dir, "r")
	if len(files) != 3 || filepath.Base(files[0]) != "part-000000000000.parquet" {
		t.Fatalf("files = %v, want 3 named part-000000000000.parquet...", files)
	}
	got, err := ReadAll(dir, "r")
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("read %d rows, wrote %d", len(got), len(want))
	}
	for i := range want {
		if !reflect.DeepEqual(got[i], want[i]) {
			t.Fatalf("row %d:\n got %+v\nwant %+v", i, got[i], want[i])
		}
	}
	if n, _ := Count(files); n != int64(len(want)) {
		t.Fatalf("Count = %d, want %d", n, len(want))
	}
}

// A crash leaves the open file under its temporary name: a reopened writer
// removes it, keeps the closed files' keys, and numbers new files after
// them; a key archived before is not written again.
func TestWriterRecoversAfterCrash(t *testing.T) {
	dir := t.TempDir()
	w, err := OpenWriter(WriterConfig{Dir: dir, Run: "r", MaxAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	rows, late := FromUpdate(testUpdate(1, "b"))
	if _, err := w.Add(UpdateKey(1), rows, late); err != nil {
		t.Fatal(err)
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	rows, _ = FromUpdate(testUpdate(2))
	if _, err := w.Add(UpdateKey(2), rows, nil); err != nil {
		t.Fatal(err)
	}
	// "Crash": abandon w with step 2 in its open file.
	if ents := dataFiles(t, RunDir(dir, "r")); len(ents) != 2 {
		t.Fatalf("want one closed and one temporary file, have %v", ents)
	}
	if _, err := OpenWriter(WriterConfig{Dir: dir, Run: "r", MaxAge: time.Hour}); err == nil || !strings.Contains(err.Error(), "one archive stage per run") {
		t.Fatalf("a second writer while the first one lives: %v", err)
	}
	w.owner.Close() // the crash ends its process, and its lock with it
	w2, err := OpenWriter(WriterConfig{Dir: dir, Run: "r", MaxAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if w2.Has(UpdateKey(1)) == nil || w2.Has(UpdateKey(2)) != nil {
		t.Fatalf("after restart: step 1 must be archived and step 2 not")
	}
	g, _, ok := w2.Late(1, "b")
	if !ok || g.TaskID != "tb" || g.PolicyVersion["b1"] != 1 {
		t.Fatalf("late group after restart = %+v, %v", g, ok)
	}
	if c, err := w2.Add(UpdateKey(1), rows, nil); err != nil || c != committed {
		t.Fatalf("re-adding an archived key must write nothing: %v %v", c, err)
	}
	rows, _ = FromUpdate(testUpdate(2))
	if _, err := w2.Add(UpdateKey(2), rows, nil); err != nil {
		t.Fatal(err)
	}
	if err := w2.Close(); err != nil {
		t.Fatal(err)
	}
	files, _ := Files(dir, "r")
	if len(files) != 2 || filepath.Base(files[1]) != "part-000000000001.parquet" {
		t.Fatalf("files = %v", files)
	}
	got, _ := ReadAll(dir, "r")
	if len(got) != 12 || got[0].Step != 1 || got[11].Step != 2 {
		t.Fatalf("read %d rows", len(got))
	}
	if got[3].ExecStatus == nil || *got[3].ExecStatus != ExecLate || !got[3].IsAnchor {
		t.Fatalf("late group's world-model row = %+v", got[3])
	}
}

// dataFiles lists dir's entries but its lock files.
func dataFiles(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".lock") {
			out = append(out, e.Name())
		}
	}
	return out
}
