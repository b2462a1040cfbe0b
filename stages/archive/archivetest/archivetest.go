// Package archivetest makes archived rows and archives for the tests and
// benchmarks of the archive's readers (replay, audit, Scan).
package archivetest

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/wmrl/wmrl/stages/archive"
)

// Rows makes n rows of run "bench" shaped like a run's: 128 a step, 16
// groups of 8, the first 2 of them anchor groups whose pairs were absorbed
// in seq order, a third of their executions failed and saying why.
// Seeded: the same rows every time.
func Rows(n int) []archive.Row {
	rng := rand.New(rand.NewPCG(1, 2))
	rows := make([]archive.Row, n)
	t0 := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)
	status, crashed := "scored", "crashed"
	details := []string{
		"exit code 1: Traceback (most recent call last): | File \"/tmp/w/solution.py\", line 12, in <module> | import lightgbm | ModuleNotFoundError: No module named 'lightgbm'",
		"exit code 1: File \"/tmp/w/solution.py\", line 40, in <module> | df['area'] | KeyError: 'area'",
		"killed after 20m0s, its wall-clock limit",
	}
	for i := range rows {
		step, g := int64(i/128), (i%128)/8
		pred, truth, cal, rew := rng.Float64(), rng.Float64(), rng.Float64(), rng.Float64()
		r := archive.Row{Run: "bench", Step: step, GroupID: fmt.Sprintf("s%d-g%02d", step, g), TrajID: fmt.Sprintf("s%d-g%02d-%d", step, g, i%8),
			TaskID: fmt.Sprintf("task-%02d", rng.IntN(32)), PolicyVersion: step, Predicted: &pred, Calibrated: &cal, Reward: &rew,
			Advantage: rng.NormFloat64(), Weight: 1, FusedAdvantage: rng.NormFloat64(), Rho: 2, Source: archive.SourceWorldModel,
			WMStatus: "ok", TS: t0.Add(time.Duration(step) * time.Second), CalibrationSeq: 2 * step}
		if g < 2 {
			r.IsAnchor, r.Source, r.TrueScore, r.ExecStatus, r.AbsorbedSeq = true, archive.SourceAnchor, &truth, &status, 2*step+int64(g)
			if i%3 == 0 { // a third of the executions fail, and say why
				r.ExecStatus, r.ExecDetail = &crashed, &details[rng.IntN(len(details))]
			}
		}
		rows[i] = r
	}
	return rows
}

// Write archives rows as the archive stage does, a step an update, in
// files of up to maxRows rows and row groups of up to groupRows (0: the
// writer's 65,536) under root (root/run=<rows' run>/), and returns the
// files in order.
func Write(tb testing.TB, root string, rows []archive.Row, maxRows, groupRows int) []string {
	tb.Helper()
	if len(rows) == 0 {
		tb.Fatal("archivetest: no rows to write")
	}
	run := rows[0].Run
	w, err := archive.OpenWriter(archive.WriterConfig{Dir: root, Run: run, MaxRows: maxRows, RowGroupRows: int64(groupRows), MaxAge: time.Hour})
	if err != nil {
		tb.Fatal(err)
	}
	for i := 0; i < len(rows); {
		j := i
		for j < len(rows) && rows[j].Step == rows[i].Step {
			j++
		}
		if _, err := w.Add(archive.UpdateKey(rows[i].Step), rows[i:j], nil); err != nil {
			tb.Fatal(err)
		}
		i = j
	}
	if err := w.Close(); err != nil {
		tb.Fatal(err)
	}
	files, err := archive.Files(root, run)
	if err != nil {
		tb.Fatal(err)
	}
	return files
}
