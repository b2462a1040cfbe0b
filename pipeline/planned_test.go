package pipeline

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// The plans route asks about are read from the asking trajectory's stream
// sequence on, up to the step's plan, keeping those on the way (a burst
// after a crash asks about a few steps, many times each), the newest keep
// of them.
func TestPlansAreReadUpToTheStepAskedAbout(t *testing.T) {
	// Step s's plan is at sequence 10(s+1), its trajectories before it.
	var stored []natsjs.Record
	for step := range int64(10) {
		b, _ := json.Marshal(schemas.Plan{Schema: schemas.Version, Run: "r", Step: step,
			Groups: []schemas.PlanGroup{{GroupID: "g", TrajIDs: []string{fmt.Sprintf("g-%d", step)}}}})
		stored = append(stored, natsjs.Record{Seq: uint64(10 * (step + 1)), Data: b})
	}
	read := 0
	x := &plans{run: "r", keep: 4, after: func(_ context.Context, seq uint64, fn func(natsjs.Record) error) error {
		for _, r := range stored {
			if r.Seq <= seq {
				continue
			}
			read++
			if err := fn(r); err != nil {
				return err
			}
		}
		return nil
	}}
	took := func(step int64, seq uint64, traj string) bool {
		t.Helper()
		ok, err := x.took(context.Background(), seq, schemas.Trajectory{Step: step, GroupID: "g", TrajID: traj})
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if !took(2, 25, "g-2") || read != 1 {
		t.Errorf("step 2's plan, asked by a trajectory just before it: read %d plans; want it found, reading 1", read)
	}
	if took(2, 25, "g-7") || read != 1 {
		t.Errorf("a trajectory step 2's plan did not take was found, or read for (%d read)", read)
	}
	x.steps, read = nil, 0
	if !took(0, 0, "g-0") || read != 1 {
		t.Fatalf("step 0, asked by a trajectory of no known sequence: %d read", read)
	}
	x.steps, read = nil, 0
	if !took(5, 44, "g-5") || read != 2 || !took(4, 44, "g-4") || read != 2 {
		t.Errorf("steps 5 then 4, asked from sequence 44: %d plans read; want 2, step 4's kept on the way", read)
	}
	// A trajectory stored after its step's plan (sent again after the
	// de-duplication window) was not taken by it, whatever its IDs.
	x.steps, read = nil, 0
	if took(2, 31, "g-2") || read != 7 {
		t.Errorf("a trajectory of step 2 stored after its plan: a copy, or %d plans read; want late, reading the 7 after it", read)
	}
	for step := int64(6); step < 10; step++ {
		took(step, uint64(10*step+5), "")
	}
	if x.steps.Has(5) || x.steps.Len() != 4 {
		t.Errorf("kept the plans of %d steps, step 5's among them (%v); want the newest 4", x.steps.Len(), x.steps.Has(5))
	}
}
