package sandbox

import (
	"bytes"
	"context"
	"encoding/csv"
	"errors"
	"fmt"
	"io/fs"
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
// It names every setting (s holds its pools, which are not copied): a
// field added to Subprocess belongs here too.
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

// DataSummary describes the task's public data as the code sees it (under
// data/), for a world model's prompt: each file at the top with its size,
// and a CSV file's rows and columns; a directory by its files and size.
// A world model told the columns can tell that code reading one that is
// not there crashes. At most 20 entries; a CSV file's rows are counted
// in its first 64 MiB and estimated past them.
func (t *Task) DataSummary() (string, error) {
	entries, err := os.ReadDir(t.PublicDir())
	if err != nil {
		return "", fmt.Errorf("task %s: public data: %w", t.Name, err)
	}
	var lines []string
	for i, e := range entries {
		if i == 20 {
			lines = append(lines, fmt.Sprintf("and %d more", len(entries)-20))
			break
		}
		path := filepath.Join(t.PublicDir(), e.Name())
		if e.IsDir() {
			files, size := 0, int64(0)
			filepath.WalkDir(path, func(_ string, d fs.DirEntry, err error) error {
				if err == nil && d.Type().IsRegular() {
					if fi, err := d.Info(); err == nil {
						files, size = files+1, size+fi.Size()
					}
				}
				return nil
			})
			lines = append(lines, fmt.Sprintf("data/%s/: %d files, %s", e.Name(), files, bytesIn(size)))
			continue
		}
		fi, err := e.Info()
		if err != nil {
			continue
		}
		line := fmt.Sprintf("data/%s (%s)", e.Name(), bytesIn(fi.Size()))
		if strings.EqualFold(filepath.Ext(e.Name()), ".csv") {
			if rows, cols, exact, err := csvShape(path, fi.Size()); err == nil {
				about := ""
				if !exact {
					about = "about "
				}
				line += fmt.Sprintf(": %s%d rows; columns %s", about, rows, strings.Join(cols, ", "))
			}
		}
		lines = append(lines, line)
	}
	return strings.Join(lines, "\n"), nil
}

// csvCountBytes is how much of a CSV file DataSummary counts rows in.
var csvCountBytes int64 = 64 << 20

// csvShape is a CSV file's data rows (after its header) and columns,
// counted in its first 64 MiB and estimated past them (exact false).
func csvShape(path string, size int64) (rows int64, cols []string, exact bool, err error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, nil, false, err
	}
	defer f.Close()
	most := csvCountBytes
	buf := make([]byte, 1<<20)
	var read, lines int64
	var head []byte
	last := byte('\n')
	for read < most {
		n, err := f.Read(buf[:min(int64(len(buf)), most-read)])
		if n > 0 {
			head = append(head, buf[:min(n, 64<<10-len(head))]...)
			lines += int64(bytes.Count(buf[:n], []byte{'\n'}))
			read, last = read+int64(n), buf[n-1]
		}
		if err != nil {
			break
		}
	}
	if last != '\n' {
		lines++ // a last line without its newline
	}
	header, _, _ := bytes.Cut(head, []byte{'\n'})
	if cols, err = csv.NewReader(bytes.NewReader(header)).Read(); err != nil {
		return 0, nil, false, err
	}
	if read < size {
		return lines*size/read - 1, cols, false, nil
	}
	return max(lines-1, 0), cols, true, nil
}

// bytesIn is a size as people read it.
func bytesIn(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d bytes", n)
}
