package archive

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"
	"time"
)

// smallFiles writes steps [from, to) of testUpdate a file each, with
// settings s, and returns their rows in order; a step in late names its
// anchor group "a" late.
func smallFiles(t *testing.T, dir string, from, to int64, s Settings, late map[int64]bool) []Row {
	t.Helper()
	w, err := OpenWriter(WriterConfig{Dir: dir, Run: "r", MaxAge: time.Hour, Settings: s})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	var rows []Row
	for step := from; step < to; step++ {
		var names []string
		if late[step] {
			names = []string{"a"}
		}
		r, lg := FromUpdate(testUpdate(step, names...))
		if _, err := w.Add(UpdateKey(step), r, lg); err != nil {
			t.Fatal(err)
		}
		if err := w.Flush(); err != nil {
			t.Fatal(err)
		}
		rows = append(rows, r...)
	}
	for i := range rows {
		rows[i].Run = "r"
	}
	return rows
}

func readRun(t *testing.T, dir string) ([]string, []Row) {
	t.Helper()
	files, err := Files(dir, "r")
	if err != nil {
		t.Fatal(err)
	}
	rows, err := Read(files, nil)
	if err != nil {
		t.Fatal(err)
	}
	return files, rows
}

// TestCompactMergesFilesAndLosesNothing: 30 files of 6 rows become files of
// at most 50 rows, with every row in its order, the files' keys, late
// groups and settings; a writer opened afterwards knows every input as
// archived and numbers new files after the merged ones.
func TestCompactMergesFilesAndLosesNothing(t *testing.T) {
	dir := t.TempDir()
	set := Settings{Debias: true, AnchorFraction: 0.125}
	want := smallFiles(t, dir, 0, 30, set, map[int64]bool{4: true, 17: true})
	before, _ := readRun(t, dir)
	if len(before) != 30 {
		t.Fatalf("%d files before, want 30", len(before))
	}

	rep, err := Compact(dir, "r", CompactConfig{MaxRows: 50})
	if err != nil {
		t.Fatal(err)
	}
	// 8 files (48 rows) a merge: 8+8+8+6.
	if rep.FilesBefore != 30 || rep.FilesAfter != 4 || rep.Merged != 4 || rep.Rows != 180 {
		t.Errorf("report %+v, want 30 files -> 4, 4 merged, 180 rows", rep)
	}
	files, got := readRun(t, dir)
	if len(files) != 4 {
		t.Fatalf("files after: %v", files)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("rows after the merge differ from the rows written (%d against %d)", len(got), len(want))
	}
	for _, want := range []string{before[0], before[8], before[16], before[24]} {
		if !contains(files, want) {
			t.Errorf("merged files %v do not keep the first input's name %s", files, filepath.Base(want))
		}
	}
	var keys []string
	lateSteps := map[int64]bool{}
	for _, f := range files {
		k, late, _, err := readMeta(f)
		if err != nil {
			t.Fatal(err)
		}
		keys = append(keys, k...)
		for _, g := range late {
			lateSteps[g.Step] = true
		}
		if s, err := ReadSettings(f); err != nil || !reflect.DeepEqual(s, set) {
			t.Errorf("%s records settings %+v (%v), want %+v", filepath.Base(f), s, err, set)
		}
	}
	if len(keys) != 30 || keys[0] != UpdateKey(0) || keys[29] != UpdateKey(29) {
		t.Errorf("merged keys %v", keys)
	}
	if !lateSteps[4] || !lateSteps[17] || len(lateSteps) != 2 {
		t.Errorf("late groups after the merge: steps %v, want 4 and 17", lateSteps)
	}
	if ents := dataFiles(t, RunDir(dir, "r")); len(ents) != 4 {
		t.Errorf("left in the directory: %v", ents)
	}

	w, err := OpenWriter(WriterConfig{Dir: dir, Run: "r", MaxAge: time.Hour, Settings: set})
	if err != nil {
		t.Fatal(err)
	}
	for _, step := range []int64{0, 15, 29} {
		if w.Has(UpdateKey(step)) != committed {
			t.Errorf("a writer opened after the merge does not know step %d as archived", step)
		}
	}
	if _, _, ok := w.Late(17, "a"); !ok {
		t.Error("a writer opened after the merge does not know step 17's late group")
	}
	rows, _ := FromUpdate(testUpdate(30))
	if _, err := w.Add(UpdateKey(30), rows, nil); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	files, got = readRun(t, dir)
	if len(files) != 5 || filepath.Base(files[4]) <= filepath.Base(before[29]) || len(got) != 186 { // never a name used before
		t.Errorf("after a new file: %d files, the last %s, %d rows", len(files), filepath.Base(files[len(files)-1]), len(got))
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// Files of other settings, files younger than MinAge and files already at
// MaxRows stay as they are; merges never reach across them.
func TestCompactKeepsSettingsAgeAndSizeApart(t *testing.T) {
	dir := t.TempDir()
	a, b := Settings{AnchorFraction: 0.1}, Settings{AnchorFraction: 0.25}
	var want []Row
	want = append(want, smallFiles(t, dir, 0, 3, a, nil)...)
	want = append(want, smallFiles(t, dir, 3, 6, b, nil)...) // a restart with other flags
	want = append(want, smallFiles(t, dir, 6, 9, a, nil)...)
	files, _ := readRun(t, dir)
	old := time.Now().Add(-2 * time.Hour)
	for _, f := range files[:7] {
		if err := os.Chtimes(f, old, old); err != nil {
			t.Fatal(err)
		}
	}
	rep, err := Compact(dir, "r", CompactConfig{MaxRows: 1000, MinAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	// [0 1 2] a, [3 4 5] b, [6] a and old: alone, [7 8] a but young.
	after, got := readRun(t, dir)
	if rep.Merged != 2 || len(after) != 5 {
		t.Errorf("report %+v, files %d; want 2 merges leaving 5 files", rep, len(after))
	}
	if !reflect.DeepEqual(got, want) {
		t.Error("rows changed")
	}
	for i, want := range []float64{0.1, 0.25, 0.1, 0.1, 0.1} {
		if s, _ := ReadSettings(after[i]); s.AnchorFraction != want {
			t.Errorf("file %d records anchor fraction %v, want %v", i, s.AnchorFraction, want)
		}
	}

	// Files of 6 rows with MaxRows 6 are full already.
	if rep, err := Compact(dir, "r", CompactConfig{MaxRows: 6}); err != nil || rep.Merged != 0 {
		t.Errorf("with every file at MaxRows: %+v, %v", rep, err)
	}
}

// Each file names the wmrl build that wrote it, and a compaction keeps the
// files of two builds apart, so that a file's rows are all of one build:
// files from before the build was kept, then a run's two builds, an
// upgrade between its restarts.
func TestFilesNameTheBuildThatWroteThem(t *testing.T) {
	dir := t.TempDir()
	older, a, b := Settings{AnchorFraction: 0.1}, Settings{AnchorFraction: 0.1, Build: "v1, commit 1a"}, Settings{AnchorFraction: 0.1, Build: "v2, commit 2b"}
	var want []Row
	want = append(want, smallFiles(t, dir, 0, 2, older, nil)...)
	want = append(want, smallFiles(t, dir, 2, 4, a, nil)...)
	want = append(want, smallFiles(t, dir, 4, 6, b, nil)...)
	files, _ := readRun(t, dir)
	d, err := Describe(files)
	if err != nil || !slices.Equal(d.Builds, []string{"", "v1, commit 1a", "v2, commit 2b"}) {
		t.Fatalf("builds %q (%v); want none recorded, then v1's, then v2's", d.Builds, err)
	}
	if d.Rows != int64(len(want)) || d.Settings != b {
		t.Errorf("described %d rows and settings %+v; want %d and the newest file's %+v", d.Rows, d.Settings, len(want), b)
	}
	old := time.Now().Add(-2 * time.Hour)
	for _, f := range files {
		if err := os.Chtimes(f, old, old); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := Compact(dir, "r", CompactConfig{MaxRows: 1000, MinAge: time.Hour}); err != nil {
		t.Fatal(err)
	}
	after, got := readRun(t, dir)
	if !reflect.DeepEqual(got, want) {
		t.Error("rows changed")
	}
	if len(after) != 3 {
		t.Fatalf("%d files after compaction; want one of each build", len(after))
	}
	for i, want := range []string{"", "v1, commit 1a", "v2, commit 2b"} {
		if s, err := ReadSettings(after[i]); err != nil || s.Build != want {
			t.Errorf("merged file %d names build %q (%v); want %q", i, s.Build, err, want)
		}
	}
}

// A merge a crash interrupted is undone before its rename and completed
// after it, by whichever comes first of a merge, a writer or a reader. A
// journal whose merged file is gone and was never renamed (a crash while
// a failed rename was being cleaned up) leaves the inputs alone.
func TestCompactRecoversFromACrash(t *testing.T) {
	for _, state := range []string{"written", "renamed", "never renamed"} {
		dir := t.TempDir()
		want := smallFiles(t, dir, 0, 6, Settings{}, nil)
		files, _ := readRun(t, dir)
		runDir := RunDir(dir, "r")
		j := journal{Tmp: ".compact-" + filepath.Base(files[0]) + ".tmp", Output: filepath.Base(files[0])}
		for _, f := range files[:4] {
			j.Inputs = append(j.Inputs, filepath.Base(f))
		}
		j.MergedTo, _ = partNumber(j.Inputs[3])
		// The merged file, made by a real merge of a copy of the inputs.
		cp := t.TempDir()
		smallFiles(t, cp, 0, 4, Settings{}, nil)
		if _, err := Compact(cp, "r", CompactConfig{}); err != nil {
			t.Fatal(err)
		}
		merged, _ := os.ReadFile(filepath.Join(RunDir(cp, "r"), j.Output))
		switch state {
		case "written": // under its temporary name, the journal written
			err := os.WriteFile(filepath.Join(runDir, j.Tmp), merged, 0o644)
			if err != nil {
				t.Fatal(err)
			}
		case "renamed": // over the first input; the other three not removed yet
			if err := os.WriteFile(filepath.Join(runDir, j.Output), merged, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		b, _ := json.Marshal(j)
		if err := os.WriteFile(filepath.Join(runDir, compactJournal), b, 0o644); err != nil {
			t.Fatal(err)
		}

		release, err := ReadLock(dir, "r") // a reader comes first
		if err != nil {
			t.Fatal(err)
		}
		after, got := readRun(t, dir)
		release()
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s: a reader after the crash read %d rows, want the %d written once each", state, len(got), len(want))
		}
		wantFiles := 6
		if state == "renamed" {
			wantFiles = 3
		}
		if len(after) != wantFiles {
			t.Errorf("%s: %d files after recovery, want %d", state, len(after), wantFiles)
		}
		for _, name := range []string{compactJournal, j.Tmp} {
			if _, err := os.Stat(filepath.Join(runDir, name)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s: %s left behind (%v)", state, name, err)
			}
		}
	}
}

// A reader holding the directory keeps merges out: without Wait a merge
// says so, with Wait it goes ahead once the reader is done.
func TestCompactWaitsForReaders(t *testing.T) {
	dir := t.TempDir()
	smallFiles(t, dir, 0, 4, Settings{}, nil)
	release, err := ReadLock(dir, "r")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Compact(dir, "r", CompactConfig{}); !errors.Is(err, ErrBusy) {
		t.Fatalf("a merge while a reader holds the directory: %v, want ErrBusy", err)
	}
	done := make(chan CompactReport)
	go func() {
		rep, err := Compact(dir, "r", CompactConfig{Wait: true})
		if err != nil {
			t.Error(err)
		}
		done <- rep
	}()
	select {
	case <-done:
		t.Fatal("a waiting merge went ahead while the reader held the directory")
	case <-time.After(200 * time.Millisecond):
	}
	release()
	if rep := <-done; rep.FilesAfter != 1 {
		t.Errorf("after the reader: %+v", rep)
	}
}

// A merged file that is merged again passes on the highest number it
// replaced, so a writer never hands out a name that held other rows.
func TestMergedNamesAreNeverReused(t *testing.T) {
	dir := t.TempDir()
	smallFiles(t, dir, 0, 8, Settings{}, nil)
	files, _ := readRun(t, dir)
	old := time.Now().Add(-2 * time.Hour)
	for _, f := range files[4:] {
		if err := os.Chtimes(f, old, old); err != nil {
			t.Fatal(err)
		}
	}
	if rep, err := Compact(dir, "r", CompactConfig{MinAge: time.Hour}); err != nil || rep.Merged != 1 {
		t.Fatalf("merging files 4-7: %+v, %v", rep, err)
	}
	if rep, err := Compact(dir, "r", CompactConfig{}); err != nil || rep.FilesAfter != 1 {
		t.Fatalf("merging files 0-3 with the merged 4-7: %+v, %v", rep, err)
	}
	w, err := OpenWriter(WriterConfig{Dir: dir, Run: "r", MaxAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if w.next != 8 {
		t.Errorf("the writer's next file is part %d; parts up to 7 held rows before", w.next)
	}
}
