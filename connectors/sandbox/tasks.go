package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
)

// LoadTasks reads the tasks of dir: dir itself when it holds a task.json,
// else each directory in it that does (MLE-Dojo's layout: a directory per
// competition), in the order of their names. Names must differ: a
// trajectory's task_id picks its task by name.
func LoadTasks(dir string) ([]*Task, error) { return readTasks(dir, LoadTask) }

// ReadTasksJSON is LoadTasks with task.json alone (ReadTaskJSON): for a
// process that does not grade.
func ReadTasksJSON(dir string) ([]*Task, error) { return readTasks(dir, ReadTaskJSON) }

func readTasks(dir string, read func(string) (*Task, error)) ([]*Task, error) {
	if _, err := os.Stat(filepath.Join(dir, "task.json")); err == nil {
		t, err := read(dir)
		if err != nil {
			return nil, err
		}
		return []*Task{t}, nil
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("tasks %s: %w", dir, err)
	}
	var tasks []*Task
	seen := map[string]string{}
	for _, e := range entries {
		sub := filepath.Join(dir, e.Name())
		if _, err := os.Stat(filepath.Join(sub, "task.json")); err != nil || !e.IsDir() && e.Type()&os.ModeSymlink == 0 {
			continue
		}
		t, err := read(sub)
		if err != nil {
			return nil, err
		}
		if other, ok := seen[t.Name]; ok {
			return nil, fmt.Errorf("tasks %s: %s and %s are both named %q: a trajectory's task_id could not tell them apart", dir, other, sub, t.Name)
		}
		seen[t.Name] = sub
		tasks = append(tasks, t)
	}
	if len(tasks) == 0 {
		return nil, fmt.Errorf("tasks %s: no task.json in it, nor in any directory in it", dir)
	}
	return tasks, nil
}

// TaskNames names tasks, a few of them and how many more.
func TaskNames(tasks []*Task) string {
	names := make([]string, len(tasks))
	for i, t := range tasks {
		names[i] = t.Name
	}
	if len(names) > 5 {
		return fmt.Sprintf("%d tasks (%s, and %d more)", len(names), strings.Join(names[:5], ", "), len(names)-5)
	}
	if len(names) == 1 {
		return "task " + names[0]
	}
	return fmt.Sprintf("%d tasks (%s)", len(names), strings.Join(names, ", "))
}

// ByTask executes each trajectory with the executor of its task_id.
type ByTask struct {
	Executors map[string]execute.Executor
}

var _ execute.Executor = ByTask{}

// ErrUnknownTask: a trajectory's task_id names no task the executor has.
var ErrUnknownTask = errors.New("no such task")

// Execute runs t with its task's executor. A task_id that names none of
// them is a sandbox error (no score: not the code's doing), which says
// which tasks there are.
func (b ByTask) Execute(ctx context.Context, t schemas.Trajectory) (execute.Result, error) {
	exe, ok := b.Executors[t.TaskID]
	if !ok {
		names := make([]string, 0, len(b.Executors))
		for name := range b.Executors {
			names = append(names, name)
		}
		slices.Sort(names)
		if len(names) > 10 {
			names = append(names[:10], "...")
		}
		return execute.Result{Status: schemas.ExecSandboxError,
			Detail: fmt.Sprintf("%v: task_id %q is none of the tasks of --task (%s)", ErrUnknownTask, t.TaskID, strings.Join(names, ", "))}, nil
	}
	return exe.Execute(ctx, t)
}

// ForTask is s for the task t: the same settings, and the same users
// and sets of GPUs, shared out among the executions of every task at once.
func (s *Subprocess) ForTask(t *Task) *Subprocess {
	return &Subprocess{Task: t, Command: s.Command, Env: s.Env, Limits: s.Limits, RunAs: s.RunAs, UIDs: s.UIDs, GPUs: s.GPUs,
		Hide: s.Hide, Waiting: s.Waiting, pools: s.owner()}
}

// owner is the Subprocess whose users and GPUs s takes from.
func (s *Subprocess) owner() *Subprocess {
	if s.pools != nil {
		return s.pools
	}
	return s
}
