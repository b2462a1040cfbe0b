package route

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
)

// FuzzAssembly runs any sequence of trajectories and watermarks, in any
// order and with any repeats, clashing ids, sizes and tasks, through the
// assembly, planning each step as it becomes ready. Whatever comes, a
// refusal is ErrInvalid, and the plans keep the contract the later stages
// rely on: every trajectory taken is planned once, in its own group, no
// group holds more than its size, trajectory ids are unique within a step,
// and nothing is taken for a step once it is planned. Run it longer with
// make fuzz.
func FuzzAssembly(f *testing.F) {
	f.Add([]byte{0, 0, 0, 0, 2, 0, 0, 0, 1, 2, 0, 1, 0, 0, 2, 0, 1, 1, 0, 2, 1, 0, 0, 0, 2, 3, 0, 0, 0, 0})
	f.Add([]byte{0, 1, 0, 0, 3, 0, 1, 1, 0, 3, 0, 1, 0, 1, 3, 1, 1, 2, 0, 0, 3, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, ops []byte) {
		a := NewAssembly(time.Second)
		sched, err := NewScheduler(SchedulerConfig{Fraction: 0.25})
		if err != nil {
			t.Fatal(err)
		}
		now := time.Unix(0, 0)
		taken := map[string]bool{}   // "step/group/traj" of every trajectory taken
		planned := map[string]bool{} // the same, of every trajectory planned
		closed := map[int64]bool{}
		for i := 0; i+5 <= len(ops); i += 5 {
			op, step, group, id, size := ops[i]%4, int64(ops[i+1]%3), ops[i+2]%3, ops[i+3]%4, 1+int(ops[i+4]%3)
			switch op {
			case 0, 1: // a trajectory (op 1: of another task)
				tr := schemas.Trajectory{Schema: 1, Run: "r", Step: step, GroupID: fmt.Sprintf("g%d", group),
					TrajID: fmt.Sprintf("t%d", id), GroupSize: size, TaskID: fmt.Sprintf("task%d", op)}
				err := a.AddTraj(tr)
				switch {
				case err != nil && !errors.Is(err, schemas.ErrInvalid):
					t.Fatalf("%+v: %v is not ErrInvalid", tr, err)
				case err == nil && closed[step]:
					t.Fatalf("%+v taken for step %d, planned already", tr, step)
				case err == nil:
					taken[fmt.Sprintf("%d/%s/%s", step, tr.GroupID, tr.TrajID)] = true
				}
			case 2: // a watermark
				if err := a.AddWatermark(schemas.StepClose{Schema: 1, Run: "r", Step: step, Groups: size}, now); err != nil && !errors.Is(err, schemas.ErrInvalid) {
					t.Fatalf("watermark: %v is not ErrInvalid", err)
				}
			case 3: // time passes
				now = now.Add(time.Duration(size) * 400 * time.Millisecond)
			}
			for _, n := range a.Ready(now) {
				plan, groups := a.Plan("r", n, sched, 0, nil, now)
				if len(groups) != len(plan.Groups) {
					t.Fatalf("step %d: %d groups for a plan of %d", n, len(groups), len(plan.Groups))
				}
				ids := map[string]bool{}
				for _, g := range plan.Groups {
					if len(g.TrajIDs) > g.Want {
						t.Fatalf("step %d: group %s holds %d of its %d", n, g.GroupID, len(g.TrajIDs), g.Want)
					}
					for _, id := range g.TrajIDs {
						if ids[id] {
							t.Fatalf("step %d: trajectory id %s in two groups", n, id)
						}
						ids[id] = true
						planned[fmt.Sprintf("%d/%s/%s", n, g.GroupID, id)] = true
					}
				}
				a.Close(n)
				closed[n] = true
			}
		}
		for k := range planned {
			if !taken[k] {
				t.Fatalf("%s planned, never taken", k)
			}
		}
		for k := range taken {
			var step int64
			fmt.Sscanf(k, "%d/", &step)
			if closed[step] && !planned[k] {
				t.Fatalf("%s taken, and its step planned without it", k)
			}
		}
	})
}
