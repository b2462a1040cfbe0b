package archive

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
)

// The archive is for other tools: these tests have two independent Parquet
// readers, DuckDB and pandas, read the files as they are and compare their
// aggregates with ours. Each reader is a script in testdata that prints one
// JSON object with the keys of ourAggregates. .ci/run installs both readers
// and sets WMRL_REQUIRE_DUCKDB / WMRL_REQUIRE_PANDAS so that CI fails rather
// than skips when one it set up is missing.

// TestDuckDBReadsTheArchive uses DuckDB through its Node package. Locally:
//
//	npm install --prefix /tmp/duck @duckdb/node-api
//	WMRL_NODE_PATH=/tmp/duck/node_modules go test -run DuckDB ./stages/archive
func TestDuckDBReadsTheArchive(t *testing.T) {
	dir, rows := writeReaderFixture(t)
	compareAggregates(t, "duckdb", duckdbRead(t, dir), ourAggregates(rows))
}

// duckdbRead runs testdata/duckdb_read.cjs on an archive root.
func duckdbRead(t *testing.T, root string) map[string]string {
	t.Helper()
	nodePath := os.Getenv("WMRL_NODE_PATH")
	_, nodeErr := exec.LookPath("node")
	if nodePath == "" || nodeErr != nil {
		skipOrFail(t, "WMRL_REQUIRE_DUCKDB", fmt.Sprintf("node (%v) or WMRL_NODE_PATH (%q) is missing; set WMRL_NODE_PATH to a node_modules holding @duckdb/node-api", nodeErr, nodePath))
	}
	got := runReader(t, append(os.Environ(), "NODE_PATH="+nodePath), "node", filepath.Join("testdata", "duckdb_read.cjs"), filepath.Join(root, "*", "*.parquet"))
	got["first_ts"] = strings.TrimSuffix(got["first_ts"], "+00")
	return got
}

// TestPandasReadsTheArchive uses pandas.read_parquet (pyarrow engine) on the
// archive directory, with the run partition, and on every file alone.
// WMRL_PYTHON names a Python with pandas and pyarrow; .ci/run builds one
// from Debian's packages (see .ci/pandas-python). Locally, with pandas
// installed: WMRL_PYTHON=python3 go test -run Pandas ./stages/archive
func TestPandasReadsTheArchive(t *testing.T) {
	dir, rows := writeReaderFixture(t)
	got := pandasRead(t, dir)

	// What pandas makes of the columns' types is part of "reads them as
	// they are": numbers stay numbers, optional ones become NaN-able
	// floats, timestamps keep their UTC zone.
	wantTypes := map[string]string{
		"step": "int64", "policy_version": "int64", "is_anchor": "bool",
		"predicted": "float64", "true_score": "float64", "calibrated": "float64",
		"fused_advantage": "float64", "exec_seconds": "float64", "calibration_version": "int64",
		"ts": "datetime64[us, UTC]",
	}
	var types map[string]string
	if err := json.Unmarshal([]byte(got["dtypes"]), &types); err != nil {
		t.Fatalf("pandas dtypes %q: %v", got["dtypes"], err)
	}
	for col, want := range wantTypes {
		if types[col] != want {
			t.Errorf("pandas reads %s as %q, want %q", col, types[col], want)
		}
	}
	files, _ := Files(dir, "r")
	if got["files_alone"] != strconv.Itoa(len(files)) || got["rows_alone"] != strconv.Itoa(len(rows)) {
		t.Errorf("pandas read %s files alone holding %s rows; the archive has %d files, %d rows",
			got["files_alone"], got["rows_alone"], len(files), len(rows))
	}
	compareAggregates(t, "pandas", withoutFileCounts(got), ourAggregates(rows))
}

// pandasRead runs testdata/pandas_read.py on an archive root.
func pandasRead(t *testing.T, root string) map[string]string {
	t.Helper()
	python := os.Getenv("WMRL_PYTHON")
	if python == "" {
		skipOrFail(t, "WMRL_REQUIRE_PANDAS", "WMRL_PYTHON is not set; set it to a Python with pandas and pyarrow")
	}
	return runReader(t, nil, python, filepath.Join("testdata", "pandas_read.py"), root)
}

// withoutFileCounts is what pandas_read.py printed but for what only its
// own test compares.
func withoutFileCounts(got map[string]string) map[string]string {
	got = maps.Clone(got)
	delete(got, "dtypes")
	delete(got, "files_alone")
	delete(got, "rows_alone")
	return got
}

func skipOrFail(t *testing.T, require, why string) {
	t.Helper()
	if os.Getenv(require) != "" {
		t.Fatalf("%s is set but %s", require, why)
	}
	t.Skip(why)
}

// writeReaderFixture writes six steps, each with two late anchor rows, into
// several files, and returns the directory and the rows as we read them.
func writeReaderFixture(t *testing.T) (string, []Row) {
	t.Helper()
	dir := t.TempDir()
	w, err := OpenWriter(WriterConfig{Dir: dir, Run: "r", MaxRows: 20, MaxAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	for step := range int64(6) {
		rows, late := FromUpdate(testUpdate(step, "b"))
		for i := range rows { // the anchors' code, as the stage adds it
			if rows[i].IsAnchor {
				prompt, response := "predict the price", fmt.Sprintf("print(%d)  # %s", step, rows[i].TrajID)
				n := int64(len(response))
				rows[i].Prompt, rows[i].Response, rows[i].ResponseBytes = &prompt, &response, &n
			}
		}
		if _, err := w.Add(UpdateKey(step), rows, late); err != nil {
			t.Fatal(err)
		}
		c := schemas.Calibration{Run: "r", Seq: step + 1, Version: 1, Step: step, GroupID: "b",
			Pairs: []schemas.CalibratedPair{{TrajID: "b0", Predicted: 0.1, True: 0.4, Before: 0.2}}}
		g, _, _ := w.Late(step, "b")
		// b2, which the world model did not grade, crashed: a row of
		// its own, with no pair.
		outcomes := map[string]schemas.ExecItem{
			"b0": {TrajID: "b0", Score: f64(0.4), Status: schemas.ExecScored, Seconds: 1500},
			"b2": {TrajID: "b2", Score: f64(0), Status: schemas.ExecCrashed, Seconds: 3, Detail: "Traceback: MemoryError"},
		}
		if _, err := w.Add(LateKey(step, "b"), FromLate(c, g, outcomes, time.Date(2026, 12, 2, 11, 0, 0, 0, time.UTC)), nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	rows := scanRun(t, dir, "r")
	if files, _ := Files(dir, "r"); len(files) < 2 {
		t.Fatalf("want several files, have %d", len(files))
	}
	late := 0
	for _, r := range rows {
		if r.Source == SourceLateAnchor {
			late++
		}
	}
	if late != 2*6 || len(rows) != 6*6+2*6 {
		t.Fatalf("fixture: %d rows, %d late", len(rows), late)
	}
	return dir, rows
}

// runReader runs an outside reader and returns its JSON object, every
// value as a string (numbers in their JSON spelling).
func runReader(t *testing.T, env []string, name string, args ...string) map[string]string {
	t.Helper()
	// It reads a few hundred rows in about a second: one that hangs is
	// killed, and says so, well before the package's timeout.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = env
	out, err := cmd.Output()
	if ctx.Err() != nil {
		t.Fatalf("%s did not finish in 2 minutes (killed); it printed %q", name, out)
	}
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("%s: %v\n%s", cmd.Args[0], err, stderr)
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(out, &raw); err != nil {
		t.Fatalf("%s printed %q: %v", name, out, err)
	}
	got := make(map[string]string, len(raw))
	for k, v := range raw {
		var s string
		if json.Unmarshal(v, &s) != nil {
			s = string(v)
		}
		got[k] = s
	}
	return got
}

// ourAggregates computes, from our own reader's rows, what each outside
// reader prints. Sums are compared as numbers, the rest as strings.
func ourAggregates(rows []Row) map[string]string {
	steps := map[int64]bool{}
	tasks, runs := map[string]bool{}, map[string]bool{}
	var predicted, truth, status, details, copies, copyGroups, verdicts, rationales, prompts, responses, responseChars, anchors, late int
	var copySteps int64
	var wmModels int
	models := map[string]bool{}
	var responseBytes int64
	var fusedByStep, calibrated float64
	first := rows[0].TS
	count := func(present bool, n *int) {
		if present {
			*n++
		}
	}
	for _, r := range rows {
		steps[r.Step] = true
		count(r.Predicted != nil, &predicted)
		count(r.TrueScore != nil, &truth)
		count(r.ExecStatus != nil, &status)
		count(r.ExecDetail != nil, &details)
		count(r.ExecCopyOf != nil, &copies)
		count(r.ExecCopyGroup != nil, &copyGroups)
		if r.ExecCopyStep != nil {
			copySteps += *r.ExecCopyStep
		}
		count(r.WMVerdict != nil, &verdicts)
		if r.WMModel != nil {
			wmModels++
			models[*r.WMModel] = true
		}
		count(r.WMRationale != nil, &rationales)
		count(r.Prompt != nil, &prompts)
		if r.Response != nil {
			responses++
			responseChars += len(*r.Response) // ASCII: bytes are characters
		}
		if r.ResponseBytes != nil {
			responseBytes += *r.ResponseBytes
		}
		count(r.IsAnchor, &anchors)
		count(r.Source == SourceLateAnchor, &late)
		fusedByStep += r.FusedAdvantage * float64(r.Step)
		if r.Calibrated != nil {
			calibrated += *r.Calibrated
		}
		if r.TS.Before(first) {
			first = r.TS
		}
		tasks[r.TaskID] = true
		runs[r.Run] = true
	}
	itoa := strconv.Itoa
	return map[string]string{
		"rows": itoa(len(rows)), "steps": itoa(len(steps)), "predicted": itoa(predicted),
		"true_scores": itoa(truth), "exec_statuses": itoa(status), "exec_details": itoa(details), "exec_copies": itoa(copies),
		"exec_copy_groups": itoa(copyGroups), "exec_copy_steps": strconv.FormatInt(copySteps, 10), "wm_verdicts": itoa(verdicts), "wm_rationales": itoa(rationales), "anchors": itoa(anchors),
		"prompts": itoa(prompts), "responses": itoa(responses), "response_chars": itoa(responseChars),
		"response_bytes": strconv.FormatInt(responseBytes, 10),
		"late":           itoa(late), "runs": strings.Join(slices.Sorted(maps.Keys(runs)), ","),
		"wm_models": itoa(wmModels), "wm_model_names": strings.Join(slices.Sorted(maps.Keys(models)), ","),
		"tasks":         strings.Join(slices.Sorted(maps.Keys(tasks)), ","),
		"first_ts":      first.UTC().Format("2006-01-02 15:04:05"),
		"fused_by_step": strconv.FormatFloat(fusedByStep, 'g', -1, 64),
		"calibrated":    strconv.FormatFloat(calibrated, 'g', -1, 64),
	}
}

func compareAggregates(t *testing.T, reader string, got, want map[string]string) {
	t.Helper()
	for k, w := range want {
		g, ok := got[k]
		switch {
		case !ok:
			t.Errorf("%s printed no %s", reader, k)
		case k == "fused_by_step" || k == "calibrated":
			gf, err1 := strconv.ParseFloat(g, 64)
			wf, _ := strconv.ParseFloat(w, 64)
			if err1 != nil || math.Abs(gf-wf) > 1e-6 {
				t.Errorf("%s: %s %s, ours %s", reader, k, g, w)
			}
		case g != w:
			t.Errorf("%s: %s %q, ours %q", reader, k, g, w)
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s printed %s, which nothing compares", reader, k)
		}
	}
}

// scanRun reads a run's rows with every column (Scan), the anchors' code
// too, which ReadAll leaves out.
func scanRun(t *testing.T, root, run string) []Row {
	t.Helper()
	files, err := Files(root, run)
	if err != nil {
		t.Fatal(err)
	}
	var rows []Row
	if err := Scan(files, func(rs []Row) error { rows = append(rows, rs...); return nil }); err != nil {
		t.Fatal(err)
	}
	return rows
}
