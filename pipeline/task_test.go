package pipeline

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/connectors/sandbox"
	"github.com/wmrl/wmrl/connectors/sandbox/sandboxtest"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/pipeline/offline"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
)

// TestPipelineExecutesARealTask runs the pipeline with real execution of
// anchors on the example task: every anchor reward must be the sandbox's
// grading of that same solution, computed here independently.
func TestPipelineExecutesARealTask(t *testing.T) {
	dir, files := housingTask(t)
	cfg := testConfig(t)
	cfg.TaskDir, cfg.Steps, cfg.Groups, cfg.GroupSize = dir, 3, 4, 4
	cfg.Anchors.Fraction = 0.5
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	task, err := sandbox.LoadTask(dir)
	if err != nil {
		t.Fatal(err)
	}
	exe := &sandbox.Subprocess{Task: task}
	want := map[string]float64{}  // solution code -> reward
	graded := map[string]string{} // solution code -> how this grading ended, for a failure
	for _, f := range files {
		code, _ := os.ReadFile(f)
		r, err := exe.Execute(ctx, schemas.Trajectory{Response: string(code)})
		if err != nil {
			t.Fatal(err)
		}
		want[string(code)], graded[string(code)] = r.Score, fmt.Sprintf("%s: %s", r.Status, r.Detail)
	}
	pol, _ := sim.NewTaskPolicy("default", dir, task.Name, task.Description, 0, 4, 4)
	anchors, distinct := 0, map[float64]bool{}
	for _, u := range decodeUpdates(t, readStored(t, cfg.DataDir, "wmrl.default.update")) {
		trajs, _ := pol.Step(u.Step)
		code := map[string]string{}
		for _, tr := range trajs {
			code[tr.TrajID] = tr.Response
		}
		for _, it := range u.Items {
			if it.Source != "anchor" {
				continue
			}
			anchors++
			if it.Reward == nil || *it.Reward != want[code[it.TrajID]] {
				got := "null"
				if it.Reward != nil {
					got = fmt.Sprint(*it.Reward)
				}
				t.Fatalf("step %d %s: anchor reward %s, the sandbox grades that solution %v (%s)\n%s", u.Step, it.TrajID, got, want[code[it.TrajID]], graded[code[it.TrajID]], code[it.TrajID][:60])
			}
			distinct[*it.Reward] = true
		}
		checkFusion(t, u)
	}
	if anchors != 3*2*4 || len(distinct) < 2 {
		t.Fatalf("%d anchor items with %d distinct rewards", anchors, len(distinct))
	}
}

// TestPipelineExecutesSeveralTasks: --task DIR of task directories; each
// anchor is executed and graded on the task its task_id names (here the
// same data under another name and leaderboard, on which every valid
// solution scores 0.5), and the run says which tasks it has.
func TestPipelineExecutesSeveralTasks(t *testing.T) {
	dirA, _ := housingTask(t)
	dirB, _ := housingTask(t)
	raw, _ := os.ReadFile(filepath.Join(dirB, "task.json"))
	os.WriteFile(filepath.Join(dirB, "task.json"), []byte(strings.Replace(string(raw), `"name": "housing"`, `"name": "housing-b"`, 1)), 0o644)
	os.WriteFile(filepath.Join(dirB, "leaderboard.csv"), []byte("public_score,private_score\n0,0\n"), 0o644)
	tasks := t.TempDir()
	if err := errors.Join(os.Symlink(dirA, filepath.Join(tasks, "a")), os.Symlink(dirB, filepath.Join(tasks, "b"))); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t)
	cfg.TaskDir, cfg.Steps, cfg.Groups, cfg.GroupSize = tasks, 2, 4, 4
	cfg.Anchors.Fraction = 0.5
	said := runSaid(t, cfg)
	if want := "on 2 tasks (housing, housing-b), each execution: "; !strings.Contains(said, want) ||
		!strings.Contains(said, "; each trajectory on the task its task_id names") {
		t.Errorf("the run said:\n%s\nwant %q and how trajectories find their task", said, want)
	}
	graders := map[string]*sandbox.Subprocess{}
	for _, d := range []string{dirA, dirB} {
		task, err := sandbox.LoadTask(d)
		if err != nil {
			t.Fatal(err)
		}
		graders[task.Name] = &sandbox.Subprocess{Task: task}
	}
	executed := map[string]schemas.ExecItem{}
	for _, it := range storedExecutions(t, cfg.DataDir) {
		executed[it.TrajID] = it
	}
	onTask := map[string]int{}
	for _, raw := range readStored(t, cfg.DataDir, "wmrl.default.exec") { // the anchor groups
		var g schemas.Group
		if err := json.Unmarshal(raw, &g); err != nil {
			t.Fatal(err)
		}
		for _, tr := range g.Trajectories {
			want, err := graders[tr.TaskID].Execute(context.Background(), tr)
			if err != nil {
				t.Fatal(err)
			}
			onTask[tr.TaskID]++
			got := executed[tr.TrajID]
			if got.Score == nil || *got.Score != want.Score {
				t.Errorf("%s on %s: %+v; its task grades it %v", tr.TrajID, tr.TaskID, got, want.Score)
			}
		}
	}
	if onTask["housing"] == 0 || onTask["housing-b"] == 0 {
		t.Errorf("anchors by task: %v; want both", onTask)
	}
}

// runSaid runs cfg to its end (2 minutes at most) and returns what the
// run said.
func runSaid(t *testing.T, cfg Config) string {
	t.Helper()
	var out bytes.Buffer
	cfg.Quiet, cfg.Out = false, &out
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	return out.String()
}

// storedExecutions are the executions a stopped pipeline stored.
func storedExecutions(t *testing.T, dataDir string) []schemas.ExecItem {
	var items []schemas.ExecItem
	for _, raw := range readStored(t, dataDir, "wmrl.default.execution") {
		var e schemas.Execution
		if err := json.Unmarshal(raw, &e); err != nil {
			t.Fatal(err)
		}
		items = append(items, e.Items...)
	}
	return items
}

// housingTask generates the example task, with its candidate solutions,
// into a temporary directory.
func housingTask(t *testing.T) (dir string, solutions []string) {
	t.Helper()
	dir = t.TempDir()
	solutions = sandboxtest.Housing(t, dir)
	os.MkdirAll(filepath.Join(dir, "solutions"), 0o755)
	for _, f := range solutions {
		b, _ := os.ReadFile(f)
		os.WriteFile(filepath.Join(dir, "solutions", filepath.Base(f)), b, 0o644)
	}
	return dir, solutions
}

// TestExecutionSettingsReachTheExecutor: --exec-timeout and friends bound
// the real executions, --exec-python and --exec-env run them, and the run
// says what each gets.
func TestExecutionSettingsReachTheExecutor(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	dir, files := housingTask(t)
	for _, f := range files {
		os.Remove(filepath.Join(dir, "solutions", filepath.Base(f)))
	}
	// The solution sleeps for as long as its environment says, run by a
	// "virtualenv" python that marks it.
	os.WriteFile(filepath.Join(dir, "solutions", "slow.py"),
		[]byte("import os, time\nassert os.environ['VIA'] == 'venv'\nassert os.environ['CUDA_VISIBLE_DEVICES'] in ('0,1', '2,3')\n"+
			"time.sleep(int(os.environ['SLEEP_FOR']))\n"), 0o644)
	venv, err := os.MkdirTemp("", "wmrl-venv-") // readable by the user the code runs as
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(venv) })
	os.Chmod(venv, 0o755)
	python := filepath.Join(venv, "python")
	os.WriteFile(python, []byte("#!/bin/sh\nexport VIA=venv\nexec python3 \"$@\"\n"), 0o755)
	cfg := testConfig(t)
	cfg.TaskDir, cfg.Steps, cfg.Groups, cfg.GroupSize = dir, 1, 4, 2
	cfg.Anchors.Fraction = 0.5
	cfg.ExecTimeout, cfg.ExecMemoryMB, cfg.ExecCPUSeconds, cfg.ExecProcesses, cfg.ExecDiskMB = time.Second, 2048, 30, 500, 64
	cfg.ExecGPUs, cfg.ExecGPUsEach = "0,1,2,3,4", 2
	// A python the code's user cannot run stops the run before it starts:
	// as root, one in a directory only root can enter (the code runs as
	// nobody); else one that is not executable.
	cfg.ExecPython = python
	refusal := "python does not run as the code's user"
	if os.Geteuid() == 0 {
		os.Chmod(venv, 0o700)
	} else {
		os.Chmod(python, 0o644)
		refusal = "--exec-python"
	}
	if err := Run(context.Background(), cfg); err == nil || !strings.Contains(err.Error(), refusal) {
		t.Fatalf("a python that cannot run: %v; want the run refused (%s)", err, refusal)
	}
	os.Chmod(venv, 0o755)
	os.Chmod(python, 0o755)
	if os.Geteuid() == 0 {
		// Users whose every process is killed after each execution: not
		// an account's, such as nobody's.
		cfg.ExecUIDs = "65530-65535"
		if err := Run(context.Background(), cfg); err == nil || !strings.Contains(err.Error(), "--exec-uids 65530-65535: takes the ids of accounts in /etc/passwd: 65534 (nobody). ") {
			t.Fatalf("--exec-uids over nobody's id: %v; want the run refused, naming it", err)
		}
		cfg.ExecUIDs = "2000000201-2000000216"
	}
	cfg.DataDir = t.TempDir()
	cfg.ExecEnv = []string{"SLEEP_FOR=60"}
	// Another run on this machine has an execution on GPU 3: the run says
	// so (its executions keep off the set 2,3 while it does, as
	// TestTwoProcessesShareUsersAndGPUs shows).
	task, err := sandbox.LoadTask(dir)
	if err != nil {
		t.Fatal(err)
	}
	other := &sandbox.Subprocess{Task: task, Limits: sandbox.Limits{Timeout: time.Minute}, GPUs: [][]string{{"3"}}}
	probe := &sandbox.Subprocess{GPUs: other.GPUs}
	otherCtx, stopOther := context.WithCancel(context.Background())
	otherDone := make(chan struct{})
	go func() { defer close(otherDone); other.Run(otherCtx, "import time\ntime.sleep(60)\n") }()
	t.Cleanup(func() { stopOther(); <-otherDone })
	waitFor(t, 30*time.Second, func() bool { _, gpus, _ := probe.HeldElsewhere(); return len(gpus) == 1 })
	said := runSaid(t, cfg)
	stopOther()
	<-otherDone
	if want := "execute: another wmrl process on this machine has an execution on GPUs 3 now: "; !strings.Contains(said, want) {
		t.Errorf("the run said:\n%s\nwant %q", said, want)
	}
	gpus := fmt.Sprintf(", GPUs 0,1 | 2,3 (a set each), GPUs 4 unused (fewer than --exec-gpus-each), 2 at once: fewer than the %d --exec-slots", cfg.ExecSlots)
	want := ") on task housing, each execution: as this process's user" + gpus + ", " + sandbox.Isolation() + "; wall clock 1s, CPU time 30 s, address space 2048 MiB, 64 MiB on disk, 500 processes and threads for all at once\n"
	if os.Geteuid() == 0 {
		want = strings.Replace(want, "as this process's user", "each as a user of its own (uids 2000000201-2000000216)", 1)
	}
	if !strings.HasPrefix(said, "execute: subprocess (") || !strings.Contains(said, want) {
		t.Errorf("the run said:\n%s\nwant a line ending %q", said, want)
	}
	items := storedExecutions(t, cfg.DataDir)
	for _, it := range items {
		if it.Status != schemas.ExecTimedOut || it.Detail != "killed after 1s, its wall-clock limit" || it.Seconds > 10 {
			t.Errorf("%s: %+v; want timed out after the 1 s of --exec-timeout (it sleeps 60 s when run by --exec-python with --exec-env)", it.TrajID, it)
		}
	}
	if items := len(items); items != 2*2 {
		t.Fatalf("%d executions; want 2 anchor groups of 2", items)
	}
}

// TestTheCodeCannotSeeTheRunsData: the store and the archive hold every
// trajectory's code with its score; a solution that found them could run
// the best one scored so far. They are out of its view, wherever they are.
func TestTheCodeCannotSeeTheRunsData(t *testing.T) {
	if !strings.Contains(sandbox.Isolation(), "wmrl's data out of view") {
		t.Skipf("the code's view is the host's here: %s", sandbox.Isolation())
	}
	// Outside /tmp, which the code sees its own of, and where its user
	// may enter.
	var base string
	home, _ := os.UserHomeDir()
	for _, parent := range []string{"/var/lib", "/srv", "/opt", home} {
		if d, err := os.MkdirTemp(parent, "wmrl-test-"); err == nil && !strings.HasPrefix(d, "/tmp/") {
			t.Cleanup(func() { os.RemoveAll(d) })
			base = d
			break
		}
	}
	if base == "" || os.Chmod(base, 0o755) != nil {
		t.Skip("no directory outside /tmp to write in")
	}
	dir, files := housingTask(t)
	for _, f := range files {
		os.Remove(filepath.Join(dir, "solutions", filepath.Base(f)))
	}
	cfg := testConfig(t)
	cfg.DataDir, cfg.ArchiveDir = filepath.Join(base, "data"), filepath.Join(base, "archive")
	os.WriteFile(filepath.Join(dir, "solutions", "look.py"), []byte(fmt.Sprintf(`import os
raise SystemExit("saw %%s" %% [sorted(os.listdir(d)) if os.path.isdir(d) else None for d in (%q, %q)])
`, cfg.DataDir, cfg.ArchiveDir)), 0o644)
	cfg.TaskDir, cfg.Steps, cfg.Groups, cfg.GroupSize = dir, 2, 4, 2
	cfg.Anchors.Fraction = 0.5
	runSaid(t, cfg)
	items := storedExecutions(t, cfg.DataDir)
	for _, it := range items {
		if it.Detail != "exit code 1: saw [[], []]" {
			t.Errorf("%s: %q; want the data and the archive empty", it.TrajID, it.Detail)
		}
	}
	if items := len(items); items != 2*2*2 {
		t.Fatalf("%d executions; want 2 steps of 2 anchor groups of 2", items)
	}
}

// TestExecutionsThatAllFailAreNoticed: solutions that all fail alike (here
// an import the sandbox's Python lacks) score 0 and would train the
// calibration silently; the run says so, and the metrics count them.
func TestExecutionsThatAllFailAreNoticed(t *testing.T) {
	dir, files := housingTask(t)
	for _, f := range files {
		os.Remove(filepath.Join(dir, "solutions", filepath.Base(f)))
	}
	os.WriteFile(filepath.Join(dir, "solutions", "needs.py"), []byte("import a_package_not_installed\n"), 0o644)
	cfg := testConfig(t)
	cfg.TaskDir, cfg.Steps, cfg.Groups, cfg.GroupSize = dir, 2, 4, 8
	cfg.Anchors.Fraction = 0.5 // 2 groups of 8 a step: 32 executions
	var out bytes.Buffer
	cfg.Quiet, cfg.Out = false, &out
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p := started(t, ctx, cfg)
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("execute: none of the last %d executions scored (crashed %d); the newest: exit code 1: ", FailedInARow, FailedInARow)
	if !strings.Contains(out.String(), want) || !strings.Contains(out.String(), "ModuleNotFoundError: No module named 'a_package_not_installed'") {
		t.Errorf("the run said:\n%s\nwant a line starting %q, naming the missing module", out.String(), want)
	}
	// All of a process's executions run as one user: their process limit
	// is for all its slots together.
	if want := fmt.Sprintf(", %d processes and threads for all at once", sandbox.DefaultProcesses(cfg.ExecSlots)); !strings.Contains(out.String(), want) {
		t.Errorf("the run said:\n%s\nwant the limit of its %d slots: %q", out.String(), cfg.ExecSlots, want)
	}
	if n := testutil.ToFloat64(p.Metrics().Executions.WithLabelValues(schemas.ExecCrashed)); n != 32 {
		t.Errorf("wmrl_executions_total{status=crashed} %v; want 32", n)
	}
	if n := testutil.ToFloat64(p.Metrics().Executions.WithLabelValues(schemas.ExecScored)); n != 0 {
		t.Errorf("wmrl_executions_total{status=scored} %v; want 0", n)
	}

	// The archive keeps what each execution said, and the audit counts the
	// failures by it.
	rows, err := archive.ReadAll(cfg.ArchiveRoot(), cfg.Run)
	if err != nil {
		t.Fatal(err)
	}
	detailed := 0
	for _, r := range rows {
		if r.ExecDetail != nil && strings.HasSuffix(*r.ExecDetail, "ModuleNotFoundError: No module named 'a_package_not_installed'") {
			detailed++
		}
	}
	if detailed != 32 {
		t.Errorf("%d archived rows have the executions' detail; want all 32", detailed)
	}
	a, err := offline.RunAudit(rows, offline.AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(a.Causes) != 1 || a.Causes[0].Cause != "ModuleNotFoundError: No module named 'a_package_not_installed'" ||
		a.Causes[0].Pairs != a.Pairs || a.Pairs < 24 || a.Causes[0].Share != 1 {
		t.Errorf("audit of %d anchor pairs: causes %+v; want all of them the missing module", a.Pairs, a.Causes)
	}
}

// TestTheWorldModelIsToldTheExecutionLimits: whether a solution finishes in
// time and memory is part of its outcome, so the world model's prompt says
// what an execution may take, as the executor resolves it.
func TestTheWorldModelIsToldTheExecutionLimits(t *testing.T) {
	dir, _ := housingTask(t)
	var mu sync.Mutex
	var prompts []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Messages []struct{ Content string } `json:"messages"`
		}
		json.NewDecoder(r.Body).Decode(&req)
		mu.Lock()
		prompts = append(prompts, req.Messages[0].Content)
		mu.Unlock()
		content := `{"status":"scored","score":0.5,"rationale":"fits"}`
		json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"message": map[string]any{"content": content}}}})
	}))
	defer srv.Close()
	cfg := testConfig(t)
	cfg.TaskDir, cfg.Steps, cfg.Groups, cfg.GroupSize, cfg.ExecTimeout = dir, 1, 2, 2, 7*time.Second
	cfg.WorldModel, cfg.WMURL, cfg.WMModel = "openai", srv.URL+"/v1", "judge"
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	want := "It runs with 7s of wall clock, 1024 MiB of memory (address space); a solution over either fails."
	// And what data the task has, read from its public data.
	data := "Data:\ndata/test.csv (7.8 KiB): 200 rows; columns id, x1, x2, x3, x4\ndata/train.csv (18.2 KiB): 400 rows; columns id, x1, x2, x3, x4, price\n"
	if len(prompts) == 0 {
		t.Fatal("the world model was never asked")
	}
	for _, p := range prompts {
		if !strings.Contains(p, want) || !strings.Contains(p, data) {
			t.Fatalf("a prompt without the limits (%q) or the data (%q):\n%s", want, data, p)
		}
	}
}

// TestCopiesOfASolutionAreExecutedOnceInARun: with --exec-copies-once, a
// run of the example task (5 candidate solutions, groups of 8, so most
// groups hold copies, and every group the solutions of others)
// runs each distinct solution once in the run, and says it does; the
// archive marks every copy with the trajectory that ran (its step and
// group when another), its true score the sandbox's grade of the
// solution, its seconds 0.
func TestCopiesOfASolutionAreExecutedOnceInARun(t *testing.T) {
	dir, _ := housingTask(t)
	task, err := sandbox.LoadTask(dir)
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t)
	cfg.TaskDir, cfg.Steps, cfg.Groups, cfg.GroupSize = dir, 3, 4, 8
	cfg.Anchors.Fraction, cfg.ExecCopiesOnce = 0.5, true
	out := &syncBuffer{}
	cfg.Quiet, cfg.Out = false, out
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p := started(t, ctx, cfg)
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "; a solution runs once in the run, its copies in any anchor group taking its outcome (--exec-copies-once)\n") {
		t.Errorf("the run did not say that copies run once:\n%s", out.String())
	}
	rows, err := archive.ReadAll(cfg.ArchiveRoot(), cfg.Run)
	if err != nil {
		t.Fatal(err)
	}
	pol, _ := sim.NewTaskPolicy("default", dir, task.Name, task.Description, 0, 4, 8)
	type at struct {
		step        int64
		group, traj string
	}
	code := map[at]string{}
	for step := range int64(3) {
		trajs, _ := pol.Step(step)
		for _, tr := range trajs {
			code[at{step, tr.GroupID, tr.TrajID}] = tr.Response
		}
	}
	byTraj := map[at]archive.Row{}
	for _, r := range rows {
		byTraj[at{r.Step, r.GroupID, r.TrajID}] = r
	}
	anchors, copies, elsewhere := 0, 0, 0
	distinct, perGroup := map[string]bool{}, map[[2]string]bool{}
	for _, r := range rows {
		here := at{r.Step, r.GroupID, r.TrajID}
		if !r.IsAnchor {
			if r.ExecCopyOf != nil {
				t.Errorf("%s, not an anchor, is a copy of %s", r.TrajID, *r.ExecCopyOf)
			}
			continue
		}
		anchors++
		distinct[code[here]] = true
		perGroup[[2]string{fmt.Sprint(r.Step, r.GroupID), code[here]}] = true
		if r.ExecCopyOf == nil {
			continue
		}
		copies++
		of := at{r.Step, r.GroupID, *r.ExecCopyOf}
		if (r.ExecCopyStep == nil) != (r.ExecCopyGroup == nil) {
			t.Errorf("%s names the step %v and group %v of the one it copies: both or neither", r.TrajID, r.ExecCopyStep, r.ExecCopyGroup)
		} else if r.ExecCopyStep != nil {
			of = at{*r.ExecCopyStep, *r.ExecCopyGroup, *r.ExecCopyOf}
			elsewhere++
			if of.step == r.Step && of.group == r.GroupID {
				t.Errorf("%s of step %d names step %d, group %s", r.TrajID, r.Step, of.step, of.group)
			}
		}
		first, ok := byTraj[of]
		switch {
		case !ok || code[of] != code[here] || first.ExecCopyOf != nil:
			t.Errorf("%s is a copy of %+v, which is not an executed copy of its solution", r.TrajID, of)
		case r.TrueScore == nil || first.TrueScore == nil || *r.TrueScore != *first.TrueScore:
			t.Errorf("%s's true score %v, %s's %v", r.TrajID, r.TrueScore, first.TrajID, first.TrueScore)
		case r.ExecSeconds == nil || *r.ExecSeconds != 0 || first.ExecSeconds == nil || *first.ExecSeconds == 0:
			t.Errorf("%s took %v seconds as a copy; %s took %v", r.TrajID, r.ExecSeconds, first.TrajID, first.ExecSeconds)
		}
	}
	if anchors != 3*2*8 || elsewhere == 0 || len(distinct) >= len(perGroup) {
		t.Fatalf("%d anchor rows, %d copies, %d of another group's; %d distinct solutions, %d counted by group: want 48 rows, copies of other groups, fewer solutions in the run than by group",
			anchors, copies, elsewhere, len(distinct), len(perGroup))
	}
	ran := 0.0
	for _, s := range schemas.ExecStatuses {
		ran += testutil.ToFloat64(p.Metrics().Executions.WithLabelValues(s))
	}
	if ran != float64(len(distinct)) || ran != float64(anchors-copies) || testutil.ToFloat64(p.Metrics().ExecutionsShared) != float64(copies) {
		t.Fatalf("the sandbox ran %v executions, %v shared, for %d anchor trajectories: want one per distinct solution of the run, %d, and %d copies",
			ran, testutil.ToFloat64(p.Metrics().ExecutionsShared), anchors, len(distinct), copies)
	}
	t.Logf("the sandbox ran %v executions for %d anchor trajectories (%d distinct solutions counted by group, as a group's copies alone ran them)", ran, anchors, len(perGroup))
	// wmrl status counts the executions run, and the copies apart.
	st, err := ReadStatus(ctx, StreamSource{DataDir: cfg.DataDir, Prefix: cfg.Prefix}, cfg.Run)
	if err != nil {
		t.Fatal(err)
	}
	stored := 0
	for _, n := range st.Executions.ByStatus {
		stored += n
	}
	if float64(stored) != ran || st.Executions.Shared != copies {
		t.Errorf("status: %d executions and %d shared, want %v and %d", stored, st.Executions.Shared, ran, copies)
	}
}

// A run removes the work directories that a killed one left, each with its
// copy of the task's data, and says so: nothing else would, and restarts
// over days would fill the disk with them.
func TestARunRemovesTheWorkDirectoriesAKilledOneLeft(t *testing.T) {
	tmp, err := os.MkdirTemp("", "wmrl-leftovers-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(tmp) })
	os.Chmod(tmp, 0o755) // the code's user passes through it to its directory
	t.Setenv("TMPDIR", tmp)
	left := filepath.Join(sandbox.WorkParent(), "wmrl-exec-00112233445566778899aabbccddeeff")
	if err := os.MkdirAll(filepath.Join(left, "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	model := make([]byte, 3<<20) // random: a compressing file system keeps all of it
	crand.Read(model)
	if err := os.WriteFile(filepath.Join(left, "model.pt"), model, 0o644); err != nil {
		t.Fatal(err)
	}
	os.Chmod(filepath.Join(left, "data"), 0o555) // as an execution has it
	dir, _ := housingTask(t)
	cfg := testConfig(t)
	cfg.TaskDir, cfg.Steps = dir, 1
	said := runSaid(t, cfg)
	if want := "execute: removed 1 work directory (3.0 MiB) that a killed wmrl left in " + sandbox.WorkParent(); !strings.Contains(said, want) {
		t.Errorf("the run said:\n%s\nwant %q", said, want)
	}
	if _, err := os.Stat(left); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the directory a killed run left is still there: %v", err)
	}
}
