package route

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
)

func traj(step int64, group string, i, size int) schemas.Trajectory {
	return schemas.Trajectory{Schema: 1, Run: "r", Step: step, GroupID: group, TrajID: fmt.Sprintf("%s-%d", group, i),
		GroupSize: size, TaskID: "task-" + group}
}

func TestAssemblyClosesCompleteSteps(t *testing.T) {
	a := NewAssembly(time.Minute)
	t0 := time.Unix(0, 0)
	for g := 0; g < 3; g++ {
		for i := 0; i < 4; i++ {
			if err := a.AddTraj(traj(7, fmt.Sprint(g), i, 4)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if len(a.Ready(t0)) != 0 {
		t.Fatal("ready without a watermark")
	}
	if err := a.AddWatermark(schemas.StepClose{Step: 7, Groups: 4}, t0); err != nil {
		t.Fatal(err)
	}
	if len(a.Ready(t0)) != 0 {
		t.Fatal("ready with 3 of 4 declared groups")
	}
	for i := 0; i < 4; i++ {
		a.AddTraj(traj(7, "3", i, 4))
		a.AddTraj(traj(7, "3", i, 4)) // redelivered: ignored
	}
	if r := a.Ready(t0); len(r) != 1 || r[0] != 7 {
		t.Fatalf("ready %v, want [7]", r)
	}
	sched, _ := NewScheduler(SchedulerConfig{Fraction: 0.5})
	plan, groups := a.Plan("r", 7, sched, 0, nil, t0)
	if len(groups) != 4 || plan.Anchors != 2 || len(plan.Groups[0].TrajIDs) != 4 {
		t.Fatalf("plan %+v", plan)
	}
	a.Close(7)
	if err := a.AddTraj(traj(7, "0", 9, 4)); !errors.Is(err, schemas.ErrInvalid) {
		t.Fatalf("late trajectory: %v", err)
	}
}

func TestAssemblyTimesOutIncompleteGroups(t *testing.T) {
	a := NewAssembly(time.Second)
	t0 := time.Unix(100, 0)
	a.AddTraj(traj(1, "a", 0, 4))
	a.AddTraj(traj(1, "a", 1, 4))
	a.AddWatermark(schemas.StepClose{Step: 1, Groups: 1}, t0)
	if len(a.Ready(t0.Add(999*time.Millisecond))) != 0 {
		t.Fatal("closed before the timeout")
	}
	if len(a.Ready(t0.Add(time.Second))) != 1 {
		t.Fatal("not closed at the timeout")
	}
	sched, _ := NewScheduler(SchedulerConfig{})
	plan, _ := a.Plan("r", 1, sched, 0, nil, t0)
	if g := plan.Groups[0]; len(g.TrajIDs) != 2 || g.Want != 4 {
		t.Fatalf("incomplete group not recorded: %+v", g)
	}
}

func TestAssemblyRejectsInconsistentInput(t *testing.T) {
	a := NewAssembly(time.Second)
	a.AddTraj(traj(1, "a", 0, 4))
	bad := traj(1, "a", 1, 5)
	if err := a.AddTraj(bad); !errors.Is(err, schemas.ErrInvalid) {
		t.Fatalf("group size changed: %v", err)
	}
	bad = traj(1, "a", 1, 4)
	bad.TaskID = "other"
	if err := a.AddTraj(bad); !errors.Is(err, schemas.ErrInvalid) {
		t.Fatalf("task changed: %v", err)
	}
	a.AddWatermark(schemas.StepClose{Step: 1, Groups: 1}, time.Now())
	if err := a.AddWatermark(schemas.StepClose{Step: 1, Groups: 2}, time.Now()); !errors.Is(err, schemas.ErrInvalid) {
		t.Fatalf("conflicting watermark: %v", err)
	}
}

// A trajectory id is a step's: another group of the step with the same id
// is refused, naming both groups (the update's items are told apart by
// it); the same trajectory again, in its own group, is a redelivery.
func TestAssemblyRefusesATrajectoryIdTwoGroupsShare(t *testing.T) {
	a := NewAssembly(time.Second)
	first := traj(1, "a", 0, 2)
	if err := a.AddTraj(first); err != nil {
		t.Fatal(err)
	}
	if err := a.AddTraj(first); err != nil {
		t.Fatalf("a redelivery: %v", err)
	}
	twin := traj(1, "b", 0, 2)
	twin.TrajID = first.TrajID
	err := a.AddTraj(twin)
	if !errors.Is(err, schemas.ErrInvalid) || !strings.Contains(err.Error(), `trajectory id "a-0" of group b is taken by group a of step 1`) {
		t.Fatalf("a trajectory id of group a in group b: %v", err)
	}
	twin.Step = 2 // another step may name its trajectories alike
	if err := a.AddTraj(twin); err != nil {
		t.Fatal(err)
	}
	if n, groups := a.Received(1); n != 1 || groups != 1 {
		t.Errorf("step 1 holds %d trajectories in %d groups, want the first one alone", n, groups)
	}
}

// A trajectory that comes again under its id, in its group, with other
// content (a trainer resumed from a checkpoint sends its new rollouts as
// a step it had sent to) is refused, naming it; the first one stays. Taken
// as a redelivery before, it was dropped without a word, and the step's
// update gave the first one's advantage under the id of the second.
func TestAssemblyRefusesATrajectorySentAgainWithOtherContent(t *testing.T) {
	a := NewAssembly(time.Second)
	first := traj(1, "a", 0, 2)
	first.Response = "print(1)"
	if err := a.AddTraj(first); err != nil {
		t.Fatal(err)
	}
	if err := a.AddTraj(first); err != nil {
		t.Fatalf("a redelivery: %v", err)
	}
	other := first
	other.Response = "print(2)"
	err := a.AddTraj(other)
	if !errors.Is(err, schemas.ErrInvalid) || !strings.Contains(err.Error(), `trajectory "a-0" of group a of step 1 came before with another prompt, solution or field; the first one stays`) {
		t.Fatalf("trajectory a-0 again with another solution: %v", err)
	}
	other.Response, other.PolicyVersion = first.Response, first.PolicyVersion+1
	if err := a.AddTraj(other); !errors.Is(err, schemas.ErrInvalid) {
		t.Fatalf("trajectory a-0 again with another policy version: %v", err)
	}
	if err := a.AddTraj(traj(1, "a", 1, 2)); err != nil {
		t.Fatal(err)
	}
	if err := a.AddWatermark(schemas.StepClose{Schema: 1, Run: "r", Step: 1, Groups: 1}, time.Unix(0, 0)); err != nil {
		t.Fatal(err)
	}
	sched, err := NewScheduler(SchedulerConfig{Fraction: 1})
	if err != nil {
		t.Fatal(err)
	}
	_, groups := a.Plan("r", 1, sched, 0, nil, time.Unix(0, 0))
	if len(groups) != 1 || len(groups[0].Trajectories) != 2 || groups[0].Trajectories[0].Response != "print(1)" {
		t.Fatalf("step 1 planned as %+v, want group a with the first a-0", groups)
	}
}
