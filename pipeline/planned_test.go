package pipeline

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// The plans route asks about are read from the asking trajectory's time on
// up to the step's plan, keeping those on the way (a burst after a crash
// asks about a few steps, many times each), the newest keep of them.
func TestPlansAreReadUpToTheStepAskedAbout(t *testing.T) {
	t0 := time.Unix(1e9, 0)
	var stored []natsjs.Record
	for step := range int64(10) {
		b, _ := json.Marshal(schemas.Plan{Schema: schemas.Version, Run: "r", Step: step,
			Groups: []schemas.PlanGroup{{GroupID: "g", TrajIDs: []string{fmt.Sprintf("g-%d", step)}}}})
		stored = append(stored, natsjs.Record{Seq: uint64(step + 1), Data: b, Time: t0.Add(time.Duration(step) * 40 * time.Second)})
	}
	read := 0
	x := &plans{run: "r", keep: 4, since: func(_ context.Context, since time.Time, fn func(natsjs.Record) error) error {
		for _, r := range stored {
			if r.Time.Before(since) {
				continue
			}
			read++
			if err := fn(r); err != nil {
				return err
			}
		}
		return nil
	}}
	took := func(step int64, traj string) bool {
		t.Helper()
		ok, err := x.took(context.Background(), t0.Add(time.Duration(step)*40*time.Second), schemas.Trajectory{Step: step, GroupID: "g", TrajID: traj})
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	// Plans are 40 s apart, and read from a minute (clockSkew) before the
	// trajectory asking: step 2's reads step 1's and its own.
	if !took(2, "g-2") || read != 2 {
		t.Errorf("step 2's plan: read %d plans; want it found, reading 2", read)
	}
	if took(2, "g-7") || read != 2 {
		t.Errorf("a trajectory step 2's plan did not take was found, or read for (%d read)", read)
	}
	x.steps, x.order, read = nil, nil, 0
	if !took(0, "g-0") || read != 1 {
		t.Fatalf("step 0: %d read", read)
	}
	x.steps, x.order, read = nil, nil, 0
	if !took(5, "g-5") || read != 2 || !took(4, "g-4") || read != 2 {
		t.Errorf("steps 5 then 4: %d plans read; want 2, step 4's kept on the way", read)
	}
	for step := int64(6); step < 10; step++ {
		took(step, "")
	}
	if _, kept := x.steps[5]; kept || len(x.steps) != 4 {
		t.Errorf("kept the plans of %d steps, step 5's among them: %v; want the newest 4", len(x.steps), x.order)
	}
}
