package sim

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"

	"github.com/wmrl/wmrl/schemas"
)

// TaskPolicy rolls out real tasks: every trajectory is one of its task's
// candidate solutions (solutions/*.py), drawn by a seeded generator, so
// groups mix solutions of different quality for real execution to score.
// With several tasks, group g of a step is on task g mod their number.
type TaskPolicy struct {
	Run               string
	Seed              uint64
	Groups, GroupSize int
	tasks             []policyTask
}

type policyTask struct {
	id, prompt string
	solutions  []string
}

// PolicyTask is a task for NewTasksPolicy: its directory, its id (the
// trajectories' task_id) and the prompt its trajectories carry.
type PolicyTask struct{ Dir, ID, Prompt string }

// NewTaskPolicy loads the candidate solutions of the task in dir.
func NewTaskPolicy(run, dir, taskID, prompt string, seed uint64, groups, groupSize int) (*TaskPolicy, error) {
	return NewTasksPolicy(run, []PolicyTask{{Dir: dir, ID: taskID, Prompt: prompt}}, seed, groups, groupSize)
}

// NewTasksPolicy loads the candidate solutions of every task.
func NewTasksPolicy(run string, tasks []PolicyTask, seed uint64, groups, groupSize int) (*TaskPolicy, error) {
	p := &TaskPolicy{Run: run, Seed: seed, Groups: groups, GroupSize: groupSize}
	for _, t := range tasks {
		files, err := filepath.Glob(filepath.Join(t.Dir, "solutions", "*.py"))
		if err != nil || len(files) == 0 {
			return nil, fmt.Errorf("sim: no candidate solutions in %s/solutions", t.Dir)
		}
		slices.Sort(files)
		pt := policyTask{id: t.ID, prompt: t.Prompt}
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				return nil, err
			}
			pt.solutions = append(pt.solutions, string(b))
		}
		p.tasks = append(p.tasks, pt)
	}
	if len(p.tasks) == 0 {
		return nil, fmt.Errorf("sim: no tasks")
	}
	return p, nil
}

// Step returns step n's trajectories and watermark.
func (p *TaskPolicy) Step(n int64) ([]schemas.Trajectory, schemas.StepClose) {
	r := rand.New(rand.NewPCG(p.Seed, uint64(n)))
	var trajs []schemas.Trajectory
	for g := 0; g < p.Groups; g++ {
		gid := fmt.Sprintf("s%d-g%d", n, g)
		task := p.tasks[g%len(p.tasks)]
		for i := 0; i < p.GroupSize; i++ {
			trajs = append(trajs, schemas.Trajectory{
				Schema: schemas.Version, Run: p.Run, Step: n, GroupID: gid, TrajID: fmt.Sprintf("%s-t%d", gid, i),
				GroupSize: p.GroupSize, TaskID: task.id, Prompt: task.prompt,
				Response: task.solutions[r.IntN(len(task.solutions))], PolicyVersion: n,
			})
		}
	}
	return trajs, schemas.StepClose{Schema: schemas.Version, Run: p.Run, Step: n, Groups: p.Groups}
}
