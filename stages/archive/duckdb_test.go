package archive

import (
	"encoding/json"
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

// TestDuckDBReadsTheArchive has DuckDB, through its Node package, read the
// files as they are and compares its aggregates with ours. .ci/run installs
// @duckdb/node-api and sets WMRL_NODE_PATH (and WMRL_REQUIRE_DUCKDB, so CI
// fails rather than skips without it); locally:
//
//	npm install --prefix /tmp/duck @duckdb/node-api
//	WMRL_NODE_PATH=/tmp/duck/node_modules go test -run DuckDB ./stages/archive
func TestDuckDBReadsTheArchive(t *testing.T) {
	nodePath := os.Getenv("WMRL_NODE_PATH")
	_, nodeErr := exec.LookPath("node")
	if nodePath == "" || nodeErr != nil {
		if os.Getenv("WMRL_REQUIRE_DUCKDB") != "" {
			t.Fatalf("WMRL_REQUIRE_DUCKDB is set but node (%v) or WMRL_NODE_PATH (%q) is missing", nodeErr, nodePath)
		}
		t.Skip("set WMRL_NODE_PATH to a node_modules holding @duckdb/node-api (see the comment)")
	}
	dir := t.TempDir()
	w, err := OpenWriter(WriterConfig{Dir: dir, Run: "r", MaxRows: 20, MaxAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	for step := range int64(6) {
		rows, late := FromUpdate(testUpdate(step, "b"))
		if _, err := w.Add(UpdateKey(step), rows, late); err != nil {
			t.Fatal(err)
		}
		c := schemas.Calibration{Run: "r", Seq: step + 1, Version: 1, Step: step, GroupID: "b",
			Pairs: []schemas.CalibratedPair{{TrajID: "b0", Predicted: 0.1, True: 0.4, Before: 0.2}}}
		g, _, _ := w.Late(step, "b")
		if _, err := w.Add(LateKey(step, "b"), FromLate(c, g, time.Date(2026, 12, 2, 11, 0, 0, 0, time.UTC)), nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	rows, err := ReadAll(dir, "r")
	if err != nil {
		t.Fatal(err)
	}
	files, _ := Files(dir, "r")
	if len(files) < 2 {
		t.Fatalf("want several files, have %d", len(files))
	}

	cmd := exec.Command("node", filepath.Join("testdata", "duckdb_read.cjs"), filepath.Join(dir, "*", "*.parquet"))
	cmd.Env = append(os.Environ(), "NODE_PATH="+nodePath)
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("duckdb: %v\n%s", err, stderr)
	}
	var got struct {
		Rows, Steps, Predicted, TrueScores, ExecStatuses, Anchors, Late string
		FusedByStep, Calibrated                                         float64
		FirstTS, Runs, Tasks                                            string
	}
	// DuckDB's JSON names are snake_case; map them by hand.
	var raw map[string]any
	if err := json.Unmarshal(out, &raw); err != nil {
		t.Fatalf("duckdb output %q: %v", out, err)
	}
	str := func(k string) string { s, _ := raw[k].(string); return s }
	num := func(k string) float64 { f, _ := raw[k].(float64); return f }
	got.Rows, got.Steps, got.Predicted, got.TrueScores = str("rows"), str("steps"), str("predicted"), str("true_scores")
	got.ExecStatuses, got.Anchors, got.Late = str("exec_statuses"), str("anchors"), str("late")
	got.FusedByStep, got.Calibrated, got.FirstTS, got.Runs, got.Tasks = num("fused_by_step"), num("calibrated"), str("first_ts"), str("runs"), str("tasks")

	var steps = map[int64]bool{}
	var predicted, truth, status, anchors, late int
	var fusedByStep, calibrated float64
	first := rows[0].TS
	tasks := map[string]bool{}
	for _, r := range rows {
		steps[r.Step] = true
		if r.Predicted != nil {
			predicted++
		}
		if r.TrueScore != nil {
			truth++
		}
		if r.ExecStatus != nil {
			status++
		}
		if r.IsAnchor {
			anchors++
		}
		if r.Source == SourceLateAnchor {
			late++
		}
		fusedByStep += r.FusedAdvantage * float64(r.Step)
		if r.Calibrated != nil {
			calibrated += *r.Calibrated
		}
		if r.TS.Before(first) {
			first = r.TS
		}
		tasks[r.TaskID] = true
	}
	taskList := make([]string, 0, len(tasks))
	for k := range tasks {
		taskList = append(taskList, k)
	}
	slices.Sort(taskList)
	itoa := func(n int) string { return strconv.Itoa(n) }
	checks := []struct {
		name       string
		duck, ours string
	}{
		{"rows", got.Rows, itoa(len(rows))},
		{"steps", got.Steps, itoa(len(steps))},
		{"predicted", got.Predicted, itoa(predicted)},
		{"true_score", got.TrueScores, itoa(truth)},
		{"exec_status", got.ExecStatuses, itoa(status)},
		{"is_anchor", got.Anchors, itoa(anchors)},
		{"late_anchor", got.Late, itoa(late)},
		{"run", got.Runs, "r"},
		{"task_id", got.Tasks, strings.Join(taskList, ",")},
		{"ts", strings.TrimSuffix(got.FirstTS, "+00"), first.Format("2006-01-02 15:04:05")},
	}
	for _, c := range checks {
		if c.duck != c.ours {
			t.Errorf("%s: duckdb %q, ours %q", c.name, c.duck, c.ours)
		}
	}
	if math.Abs(got.FusedByStep-fusedByStep) > 1e-6 || math.Abs(got.Calibrated-calibrated) > 1e-6 {
		t.Errorf("sums: duckdb fused %v calibrated %v, ours %v %v", got.FusedByStep, got.Calibrated, fusedByStep, calibrated)
	}
	if late != 6 || len(rows) != 6*6+6 {
		t.Fatalf("fixture: %d rows, %d late", len(rows), late)
	}
}
