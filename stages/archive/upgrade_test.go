package archive

import (
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"

	"github.com/wmrl/wmrl/schemas"
)

// testdata/archive-v1 is writeReaderFixture's archive as wmrl wrote it
// before the exec_detail column (at f81bfa1): three files of run "r".

// later are the columns added since.
var later = []string{"exec_detail", "wm_verdict", "wm_rationale", "prompt", "response", "response_bytes", "exec_copy_of", "exec_copy_step", "exec_copy_group", "wm_model"}

// oldArchive copies it into root as run.
func oldArchive(t *testing.T, root, run string) {
	t.Helper()
	src := filepath.Join("testdata", "archive-v1", "run=r")
	ents, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	dst := RunDir(root, run)
	if err := os.MkdirAll(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dst, e.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// lacking counts run's files without column.
func lacking(t *testing.T, root, run, column string) int {
	t.Helper()
	files, err := Files(root, run)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, path := range files {
		f, pf, err := openParquet(path)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := pf.Schema().Lookup(column); !ok {
			n++
		}
		f.Close()
	}
	return n
}

// An archive from before a column reads as it did, the column null.
func TestAnArchiveFromBeforeExecDetailReadsAsBefore(t *testing.T) {
	root := t.TempDir()
	oldArchive(t, root, "r")
	if n := lacking(t, root, "r", "exec_detail"); n != 3 {
		t.Fatalf("the fixture has %d files without exec_detail, want its 3", n)
	}
	old, err := ReadAll(root, "r")
	if err != nil {
		t.Fatal(err)
	}
	_, rows := writeReaderFixture(t)
	// Late rows then were one per pair, marked scored, with no execution
	// columns: the outcomes were not read.
	scored := schemas.ExecScored
	var want []Row
	for _, r := range rows {
		r.ExecDetail, r.WMVerdict, r.WMRationale, r.Prompt, r.Response, r.ResponseBytes, r.ExecCopyOf = nil, nil, nil, nil, nil, nil, nil
		r.ExecCopyStep, r.ExecCopyGroup, r.WMModel = nil, nil, nil
		if r.Source == SourceLateAnchor {
			if r.Predicted == nil {
				continue
			}
			r.ExecStatus, r.ExecSeconds = &scored, nil
		}
		want = append(want, r)
	}
	if !reflect.DeepEqual(old, want) {
		t.Fatalf("the old archive read %d rows unlike what wrote it (%d rows)", len(old), len(want))
	}
}

// Compact rewrites files that lack a later column, alone or not, only
// when asked; rows stay as they were.
func TestCompactAddsLaterColumns(t *testing.T) {
	root := t.TempDir()
	oldArchive(t, root, "r")
	before, err := ReadAll(root, "r")
	if err != nil {
		t.Fatal(err)
	}
	// Files of up to 1 row: none may merge, each is alone.
	rep, err := Compact(root, "r", CompactConfig{MaxRows: 1})
	if err != nil || rep.Upgraded != 0 || rep.Merged != 0 || lacking(t, root, "r", "exec_detail") != 3 {
		t.Fatalf("without Upgrade: %+v, %v; %d files lack exec_detail, want 3 as they were", rep, err, lacking(t, root, "r", "exec_detail"))
	}
	rep, err = Compact(root, "r", CompactConfig{MaxRows: 1, Upgrade: true})
	if err != nil || rep.Upgraded != 3 || rep.Merged != 0 || rep.FilesAfter != 3 || !slices.Equal(rep.Added, later) {
		t.Fatalf("with Upgrade: %+v, %v; want the 3 files rewritten alone, adding %v", rep, err, later)
	}
	if n := lacking(t, root, "r", "exec_detail"); n != 0 {
		t.Fatalf("%d files still lack exec_detail", n)
	}
	after, err := ReadAll(root, "r")
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(after, before) {
		t.Fatal("the rewritten files read other rows")
	}
	if rep, err := Compact(root, "r", CompactConfig{MaxRows: 1, Upgrade: true}); err != nil || rep.Upgraded != 0 || len(rep.Added) != 0 {
		t.Fatalf("again: %+v, %v; want nothing left to do", rep, err)
	}

	// Merging old files gives the merged file the column too.
	root = t.TempDir()
	oldArchive(t, root, "r")
	rep, err = Compact(root, "r", CompactConfig{})
	if err != nil || rep.Merged != 1 || rep.Upgraded != 0 || !slices.Equal(rep.Added, later) || lacking(t, root, "r", "exec_detail") != 0 {
		t.Fatalf("a merge of old files: %+v, %v", rep, err)
	}
}

// Outside readers of an archive holding files from before exec_detail and
// after: DuckDB with union_by_name reads it as it is; pandas takes the
// first file's columns for all, so the column is missing until Compact
// (wmrl compact) has rewritten the old files.
func TestOutsideReadersOfAnArchiveFromBeforeExecDetail(t *testing.T) {
	mixed := func(t *testing.T) (string, []Row) {
		root, _ := writeReaderFixture(t) // run "r", with details
		oldArchive(t, root, "a-old")     // listed first
		rows, err := ReadAll(root, "a-old")
		if err != nil {
			t.Fatal(err)
		}
		return root, append(rows, scanRun(t, root, "r")...)
	}
	t.Run("duckdb", func(t *testing.T) {
		root, rows := mixed(t)
		compareAggregates(t, "duckdb", duckdbRead(t, root), ourAggregates(rows))
	})
	t.Run("pandas", func(t *testing.T) {
		root, rows := mixed(t)
		if got := pandasRead(t, root); got["exec_details"] != "no column" || got["responses"] != "no column" {
			t.Errorf("pandas read exec_detail (%s values) and response (%s) from an archive whose first file lacks them: then wmrl compact need not add them",
				got["exec_details"], got["responses"])
		}
		if _, err := Compact(root, "a-old", CompactConfig{MaxRows: 1, Upgrade: true}); err != nil {
			t.Fatal(err)
		}
		compareAggregates(t, "pandas", withoutFileCounts(pandasRead(t, root)), ourAggregates(rows))
	})
}
