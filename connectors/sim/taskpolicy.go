package sim

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"

	"github.com/wmrl/wmrl/schemas"
)

// TaskPolicy rolls out a real task: every trajectory is one of the task's
// candidate solutions (solutions/*.py), drawn by a seeded generator, so
// groups mix solutions of different quality for real execution to score.
type TaskPolicy struct {
	Run, TaskID, Prompt string
	Seed                uint64
	Groups, GroupSize   int
	solutions           []string
}

// NewTaskPolicy loads the candidate solutions of the task in dir.
func NewTaskPolicy(run, dir, taskID, prompt string, seed uint64, groups, groupSize int) (*TaskPolicy, error) {
	files, err := filepath.Glob(filepath.Join(dir, "solutions", "*.py"))
	if err != nil || len(files) == 0 {
		return nil, fmt.Errorf("sim: no candidate solutions in %s/solutions", dir)
	}
	slices.Sort(files)
	p := &TaskPolicy{Run: run, TaskID: taskID, Prompt: prompt, Seed: seed, Groups: groups, GroupSize: groupSize}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		p.solutions = append(p.solutions, string(b))
	}
	return p, nil
}

// Step returns step n's trajectories and watermark.
func (p *TaskPolicy) Step(n int64) ([]schemas.Trajectory, schemas.StepClose) {
	r := rand.New(rand.NewPCG(p.Seed, uint64(n)))
	var trajs []schemas.Trajectory
	for g := 0; g < p.Groups; g++ {
		gid := fmt.Sprintf("s%d-g%d", n, g)
		for i := 0; i < p.GroupSize; i++ {
			trajs = append(trajs, schemas.Trajectory{
				Schema: schemas.Version, Run: p.Run, Step: n, GroupID: gid, TrajID: fmt.Sprintf("%s-t%d", gid, i),
				GroupSize: p.GroupSize, TaskID: p.TaskID, Prompt: p.Prompt,
				Response: p.solutions[r.IntN(len(p.solutions))], PolicyVersion: n, Meta: map[string]any{},
			})
		}
	}
	return trajs, schemas.StepClose{Schema: schemas.Version, Run: p.Run, Step: n, Groups: p.Groups}
}
