package sandbox

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
)

// twoTasks makes a directory of two tasks: housing, and housing-b, the
// same data with every answer 50 higher, so that a solution scores
// differently on each.
func twoTasks(t *testing.T) (dir string, a, b *Task) {
	dir = t.TempDir()
	housingIn(t, filepath.Join(dir, "a"))
	bDir := filepath.Join(dir, "b")
	housingIn(t, bDir)
	raw, err := os.ReadFile(filepath.Join(bDir, "task.json"))
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(bDir, "task.json"), []byte(strings.Replace(string(raw), `"name": "housing"`, `"name": "housing-b"`, 1)), 0o644)
	answers := filepath.Join(bDir, "private", "answers.csv")
	rows, err := readCSV(answers)
	if err != nil {
		t.Fatal(err)
	}
	shifted := "id,target,board\n"
	for _, r := range rows {
		v, _ := strconv.ParseFloat(r["target"], 64)
		shifted += fmt.Sprintf("%s,%.3f,%s\n", r["id"], v+50, r["board"])
	}
	os.WriteFile(answers, []byte(shifted), 0o644)
	tasks, err := LoadTasks(dir)
	if err != nil || len(tasks) != 2 || tasks[0].Name != "housing" || tasks[1].Name != "housing-b" {
		t.Fatalf("LoadTasks: %v %v", tasks, err)
	}
	return dir, tasks[0], tasks[1]
}

// TestTasksAreLoadedFromADirectoryOfThem: --task names a task, or a
// directory of them (MLE-Dojo's layout), which must have distinct names:
// a trajectory's task_id picks its task by name.
func TestTasksAreLoadedFromADirectoryOfThem(t *testing.T) {
	dir, a, _ := twoTasks(t)
	if one, err := LoadTasks(a.Dir); err != nil || len(one) != 1 || one[0].Name != "housing" {
		t.Errorf("a task's own directory: %v %v", one, err)
	}
	if names := TaskNames([]*Task{a}); names != "task housing" {
		t.Errorf("one task is named %q", names)
	}
	twin := filepath.Join(dir, "c")
	housingIn(t, twin)
	if _, err := LoadTasks(dir); err == nil || !strings.Contains(err.Error(), `are both named "housing"`) {
		t.Errorf("two tasks named alike: %v", err)
	}
	os.RemoveAll(twin)
	if _, err := LoadTasks(t.TempDir()); err == nil || !strings.Contains(err.Error(), "no task.json in it, nor in any directory in it") {
		t.Errorf("no task: %v", err)
	}
}

// TestEachTrajectoryRunsOnItsTask: a trajectory is executed and graded on
// the task its task_id names, one that names none is a sandbox error (no
// score) that lists the tasks, and the tasks' executions share the users
// and GPUs given out.
func TestEachTrajectoryRunsOnItsTask(t *testing.T) {
	_, a, b := twoTasks(t)
	s := exe(a)
	s.GPUs = [][]string{{"0"}}
	var mu sync.Mutex
	waiting := 0
	s.Waiting = func(_ string, d int) { mu.Lock(); waiting += d; mu.Unlock() }
	byTask := ByTask{Executors: map[string]execute.Executor{"housing": s.ForTask(a), "housing-b": s.ForTask(b)}}
	code := solution(t, "03_interactions.py")
	want := map[string]float64{}
	for _, task := range []*Task{a, b} {
		r := run1(t, exe(task), code)
		want[task.Name] = r.score
	}
	if want["housing"] == want["housing-b"] {
		t.Fatalf("the solution scores %v on both tasks: they cannot be told apart", want["housing"])
	}
	// The test holds the one set of GPUs: an execution of either task
	// waits for it.
	set, _ := s.gpus.take(context.Background(), s.GPUs, nil)
	got := map[string]execute.Result{}
	var wg sync.WaitGroup
	for _, name := range []string{"housing", "housing-b", "titanic"} {
		wg.Go(func() {
			r, err := byTask.Execute(context.Background(), schemas.Trajectory{TrajID: name, TaskID: name, Response: code})
			if err != nil {
				t.Error(err)
			}
			mu.Lock()
			got[name] = r
			mu.Unlock()
		})
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		mu.Lock()
		n := waiting
		mu.Unlock()
		if n == 2 || time.Now().After(deadline) {
			if n != 2 {
				t.Errorf("%d executions waited for the GPUs; want both tasks'", n)
			}
			break
		}
	}
	s.gpus.give(set)
	wg.Wait()
	for _, name := range []string{"housing", "housing-b"} {
		if r := got[name]; r.Status != schemas.ExecScored || r.Score != want[name] {
			t.Errorf("on %s: %s %v; want scored %v", name, r.Status, r.Score, want[name])
		}
	}
	if r := got["titanic"]; r.Status != schemas.ExecSandboxError || r.Detail != `no such task: task_id "titanic" is none of the tasks of --task (housing, housing-b)` {
		t.Errorf("an unknown task: %s %q", r.Status, r.Detail)
	}
}

// TestTheDataSummaryNamesFilesRowsAndColumns: what a world model is told
// of a task's data: each file as the code sees it, its rows and columns
// (05_crash.py reads a column that is not there), a directory by its
// files, a large CSV file's rows estimated.
func TestTheDataSummaryNamesFilesRowsAndColumns(t *testing.T) {
	task := housing(t)
	os.MkdirAll(filepath.Join(task.PublicDir(), "images"), 0o755)
	os.WriteFile(filepath.Join(task.PublicDir(), "images", "a.png"), make([]byte, 2048), 0o644)
	os.WriteFile(filepath.Join(task.PublicDir(), "sample.csv"), []byte("id,price\n1,2\n3,4"), 0o644) // no last newline
	got, err := task.DataSummary()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"data/images/: 1 files, 2.0 KiB",
		"data/sample.csv (16 bytes): 2 rows; columns id, price",
		"): 200 rows; columns id, x1, x2, x3, x4\n",
		"): 400 rows; columns id, x1, x2, x3, x4, price",
	} {
		if !strings.Contains(got+"\n", want) {
			t.Errorf("summary:\n%s\nwant %q", got, want)
		}
	}
	if !strings.HasPrefix(got, "data/images/") || !strings.Contains(got, "\ndata/test.csv (") {
		t.Errorf("summary:\n%s\nwant the entries in name order, as data/...", got)
	}
	// Counted in the first 4 KiB of the 18 KiB of train.csv, its rows are
	// estimated, within a few percent here (rows of one length).
	defer func(n int64) { csvCountBytes = n }(csvCountBytes)
	csvCountBytes = 4 << 10
	got, _ = task.DataSummary()
	var rows int
	if i := strings.Index(got, "data/train.csv ("); i < 0 {
		t.Fatalf("summary:\n%s", got)
	} else if _, err := fmt.Sscanf(got[i+strings.Index(got[i:], "): about ")+len("): about "):], "%d rows", &rows); err != nil || rows < 380 || rows > 420 {
		t.Errorf("train.csv's rows estimated at %d (%v), of 400:\n%s", rows, err, got)
	}
}
