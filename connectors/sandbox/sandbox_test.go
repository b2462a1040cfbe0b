package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/sandbox/sandboxtest"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
)

// TestMain gives the package's tests a TMPDIR of their own, and with it a
// WorkParent of their own: the work directories a killed run of them left
// would otherwise count among theirs. A test's helper process keeps its
// test's.
func TestMain(m *testing.M) {
	if tmp := os.Getenv("TMPDIR"); tmp != "" && os.Getenv("WMRL_SANDBOX_TEST_TMPDIR") == tmp {
		os.Exit(m.Run())
	}
	dir, err := os.MkdirTemp("", "wmrl-sandbox-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Chmod(dir, 0o755) // the code's user passes through it to its own
	os.Setenv("TMPDIR", dir)
	os.Setenv("WMRL_SANDBOX_TEST_TMPDIR", dir)
	code := m.Run()
	removeWorkDir(dir) // read-only directories and all
	os.Exit(code)
}

// housing generates the example task into a temporary directory.
func housing(t testing.TB) *Task {
	t.Helper()
	return housingIn(t, t.TempDir())
}

// housingIn generates the example task into dir.
func housingIn(t testing.TB, dir string) *Task {
	t.Helper()
	sandboxtest.Housing(t, dir)
	task, err := LoadTask(dir)
	if err != nil {
		t.Fatal(err)
	}
	return task
}

func solution(t testing.TB, name string) string {
	b, err := os.ReadFile(filepath.Join("../../examples/tasks/housing/solutions", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// exe is an executor of task for a test. Its 32 processes are a limit on
// all the processes of its user at once, machine-wide: as nobody, the
// default, every other package's executions as nobody took them, and a
// test here failed with "sandbox: 2: Cannot fork" (in CI, with cmd/wmrl's
// tests running pipelines beside it). As root it runs as a user of this
// package's own.
func exe(task *Task) *Subprocess {
	return &Subprocess{Task: task, RunAs: 2000000100, Limits: Limits{Timeout: 10 * time.Second, MemoryBytes: 512 << 20, Processes: 32}}
}

func run1(t *testing.T, s *Subprocess, code string) (r struct {
	status, detail string
	score          float64
}) {
	t.Helper()
	res, err := s.Execute(context.Background(), schemas.Trajectory{TrajID: "t", Response: code})
	if err != nil {
		t.Fatal(err)
	}
	r.status, r.detail, r.score = res.Status, res.Detail, res.Score
	return r
}

func TestCandidateSolutionsRankByQuality(t *testing.T) {
	task := housing(t)
	s := exe(task)
	mean := run1(t, s, solution(t, "01_mean.py"))
	one := run1(t, s, solution(t, "02_one_feature.py"))
	best := run1(t, s, solution(t, "03_interactions.py"))
	t.Logf("rewards: mean %.3f, one feature %.3f, with interactions %.3f", mean.score, one.score, best.score)
	for _, r := range []struct {
		status, detail string
		score          float64
	}{mean, one, best} {
		if r.status != schemas.ExecScored {
			t.Fatalf("status %s: %s", r.status, r.detail)
		}
	}
	if !(mean.score < one.score && one.score < best.score) || best.score < 0.9 {
		t.Fatalf("rewards not ordered by quality: %.3f %.3f %.3f", mean.score, one.score, best.score)
	}
	if r := run1(t, s, solution(t, "04_wrong_format.py")); r.status != schemas.ExecInvalid || !strings.Contains(r.detail, `columns "id" and "price"`) {
		t.Fatalf("wrong format: %+v", r)
	}
	if r := run1(t, s, solution(t, "05_crash.py")); r.status != schemas.ExecCrashed || !strings.Contains(r.detail, "KeyError") {
		t.Fatalf("crash: %+v", r)
	}
	if r := run1(t, s, "print('no submission')"); r.status != schemas.ExecInvalid || !strings.Contains(r.detail, "no submission.csv") {
		t.Fatalf("no submission: %+v", r)
	}
}

func TestSandboxContainsHostileCode(t *testing.T) {
	task := housing(t)
	s := exe(task)
	s.Limits.Timeout = 2 * time.Second

	if r := run1(t, s, "while True:\n    pass\n"); r.status != schemas.ExecTimedOut {
		t.Fatalf("infinite loop: %+v", r)
	}
	if r := run1(t, s, "x = bytearray(2 * 1024**3)\n"); r.status != schemas.ExecCrashed || !strings.Contains(r.detail, "MemoryError") ||
		!strings.Contains(r.detail, "address space is limited to 512 MiB") {
		t.Fatalf("memory hog: %+v", r)
	}
	bomb := "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n"
	// As a user of its own: a bomb as nobody would take the process limit
	// from every other test's executions as nobody, in every package.
	bomber := exe(task)
	bomber.Limits.Timeout, bomber.UIDs = 2*time.Second, []uint32{2000000111}
	start := time.Now()
	r := run1(t, bomber, bomb)
	if r.status != schemas.ExecTimedOut && r.status != schemas.ExecCrashed {
		t.Fatalf("fork bomb: %+v", r)
	}
	if time.Since(start) > time.Minute {
		t.Fatal("fork bomb not contained")
	}
	if os.Geteuid() == 0 {
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			out, _ := exec.Command("pgrep", "-u", "2000000111").Output()
			if len(out) == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("processes left behind by the fork bomb: %s", out)
			}
		}
	}

	// Writing outside its directory, reading the private answers, reaching
	// the network: each attempt is reported by the code itself.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	outside := filepath.Join(task.Dir, "escaped.txt")
	probe := fmt.Sprintf(`import socket
res = []
for name, act in [("write", lambda: open(%q, "w").write("x")),
                  ("read_answers", lambda: open(%q).read()),
                  ("network", lambda: socket.create_connection(("127.0.0.1", %d), timeout=1))]:
    try:
        act()
        res.append(name + "=ok")
    except Exception as e:
        res.append(name + "=" + type(e).__name__)
raise SystemExit(" ".join(res))
`, outside, filepath.Join(task.Dir, "private", "answers.csv"), l.Addr().(*net.TCPAddr).Port)
	r = run1(t, s, probe)
	t.Logf("probe: %s", r.detail)
	if _, err := os.Stat(outside); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the code wrote outside its directory (%s)", outside)
	}
	if os.Geteuid() == 0 {
		// Kept out by permissions, or out of its view: a task under /tmp
		// is, where the code has its own /tmp.
		refused := "PermissionError"
		if hidden := []string{"/tmp/", "/var/tmp/"}; namespaceTools().privateTmp &&
			slices.ContainsFunc(hidden, func(d string) bool { return strings.HasPrefix(task.Dir, d) }) {
			refused = "FileNotFoundError"
		}
		for _, want := range []string{"write=" + refused, "read_answers=" + refused} {
			if !strings.Contains(r.detail, want) {
				t.Errorf("probe %q lacks %s", r.detail, want)
			}
		}
	}
	if !strings.Contains(r.detail, "network not isolated") && strings.Contains(r.detail, "network=ok") {
		t.Errorf("network reachable although isolated: %s", r.detail)
	}
}

// What ended an execution is at the end of its stderr, after whatever the
// code logged first (training progress, warnings): the detail must say it,
// whatever came before and however long a line.
func TestTheDetailIsTheEndOfALongStderr(t *testing.T) {
	s := exe(housing(t))
	logged := "import sys\nfor i in range(20000):\n    print('epoch', i, 'loss 0.123456', file=sys.stderr)\nimport lightgbm_not_installed\n"
	r := run1(t, s, logged)
	if r.status != schemas.ExecCrashed || !strings.HasSuffix(r.detail, "ModuleNotFoundError: No module named 'lightgbm_not_installed'") {
		t.Fatalf("480 kB of log, then an import error: %+v", r)
	}
	wide := "import sys\nsys.stderr.write('x' * 3000000 + '\\n')\nraise ValueError('bad input')\n"
	r = run1(t, s, wide)
	if r.status != schemas.ExecCrashed || !strings.HasSuffix(r.detail, "ValueError: bad input") || len(r.detail) > 5*(lineBytes+3)+40 {
		t.Fatalf("a 3 MB line, then an error: %s, %d bytes ending %q", r.status, len(r.detail), r.detail[max(0, len(r.detail)-60):])
	}
}

// capped keeps exactly the first and last halves of what was written,
// however the writes are cut, and says how much it dropped between.
func TestCappedKeepsTheStartAndTheEnd(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for range 2000 {
		n := 1 + rng.IntN(64)
		all := make([]byte, rng.IntN(400))
		for i := range all {
			all[i] = byte('a' + rng.IntN(26))
		}
		c := &capped{n: n}
		for rest := all; len(rest) > 0; {
			k := 1 + rng.IntN(min(len(rest), 1+rng.IntN(3*n)))
			if w, err := c.Write(rest[:k]); w != k || err != nil {
				t.Fatalf("Write(%d bytes) = %d, %v", k, w, err)
			}
			rest = rest[k:]
		}
		want := string(all)
		if head, keep := n/2, n-n/2; len(all) > n {
			want = fmt.Sprintf("%s\n[%d bytes dropped]\n%s", all[:head], len(all)-n, all[len(all)-keep:])
		}
		if got := c.String(); got != want {
			t.Fatalf("n %d, %d bytes written: %q, want %q", n, len(all), got, want)
		}
	}
}

func TestGraderRejectsBadSubmissions(t *testing.T) {
	task := housing(t)
	good := "id,price\n"
	for id := range task.answers {
		good += id + ",200\n"
	}
	if _, err := task.Grade([]byte(good)); err != nil {
		t.Fatalf("a complete submission: %v", err)
	}
	for name, sub := range map[string]string{
		"missing rows":  "id,price\n1000,1\n",
		"unknown id":    good + "99999,1\n",
		"duplicate id":  good + "1000,1\n",
		"not a number":  strings.Replace(good, ",200\n", ",cheap\n", 1),
		"wrong columns": "house,value\n1000,1\n",
	} {
		if _, err := task.Grade([]byte(sub)); !errors.Is(err, ErrInvalidSubmission) {
			t.Errorf("%s: got %v, want ErrInvalidSubmission", name, err)
		}
	}
}

func TestMetrics(t *testing.T) {
	if v, _ := metric("accuracy", []string{"a", "b", "c", "d"}, []string{"a", "b", "x", "d"}); v != 0.75 {
		t.Errorf("accuracy %v", v)
	}
	if v, _ := metric("f1", []string{"1", "1", "0", "0"}, []string{"1", "0", "1", "0"}); v != 0.5 {
		t.Errorf("f1 %v", v)
	}
	if v, _ := metric("rmse", []string{"1", "3"}, []string{"2", "2"}); v != 1 {
		t.Errorf("rmse %v", v)
	}
	if v, _ := metric("auc", []string{"0.1", "0.4", "0.35", "0.8"}, []string{"0", "0", "1", "1"}); v != 0.75 {
		t.Errorf("auc %v (sklearn's roc_auc_score gives 0.75)", v)
	}
}

// asNobody runs the test named, from a copy of this test binary, as the
// user nobody, with env added to its environment, and fails with its
// output if it fails.
func asNobody(t *testing.T, test string, env ...string) {
	runuser, err := exec.LookPath("runuser")
	if err != nil {
		t.Skip("running as root, and no runuser to run as nobody")
	}
	dir, err := os.MkdirTemp("", "wmrl-as-nobody-") // t.TempDir's parent is private
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	os.Chmod(dir, 0o755)
	bin := filepath.Join(dir, "sandbox.test")
	src, err := os.Open(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := os.OpenFile(bin, os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(dst, src); err != nil || dst.Close() != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(dir, "tmp")
	os.Mkdir(tmp, 0o777)
	os.Chmod(tmp, 0o1777)
	cmd := exec.Command(runuser, "-u", "nobody", "--", bin, "-test.run=^"+test+"$", "-test.v", "-test.count=1")
	cmd.Env = append(append(os.Environ(), "TMPDIR="+tmp, "HOME="+tmp), env...)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: "+test) {
		t.Fatalf("as nobody: %v\n%s", err, out)
	}
	t.Logf("as nobody:\n%s", out)
}

func TestTheCodesEnvironment(t *testing.T) {
	s := &Subprocess{Command: []string{"/opt/ml/bin/python", "solution.py"}, Env: []string{"OMP_NUM_THREADS=4", "LANG=en_US.UTF-8"}}
	got := s.environ("/w", nil)
	want := []string{"PATH=/opt/ml/bin:/usr/local/bin:/usr/bin:/bin", "HOME=/w", "TMPDIR=/w", "PYTHONDONTWRITEBYTECODE=1", "OMP_NUM_THREADS=4", "LANG=en_US.UTF-8"}
	if !slices.Equal(got, want) {
		t.Errorf("environment %q; want %q (the python's directory first on PATH, LANG as given)", got, want)
	}
	if got := (&Subprocess{}).environ("/w", nil); got[0] != "PATH=/usr/local/bin:/usr/bin:/bin" || len(got) != 5 {
		t.Errorf("default environment %q", got)
	}
	// GPUs shared out are named, and win over one --exec-env names.
	s.Env = append(s.Env, "CUDA_VISIBLE_DEVICES=0,1,2,3")
	if got := s.environ("/w", []string{"2", "3"}); got[len(got)-1] != "CUDA_VISIBLE_DEVICES=2,3" ||
		slices.Contains(got, "CUDA_VISIBLE_DEVICES=0,1,2,3") {
		t.Errorf("with GPUs 2 and 3: %q", got)
	}
}

// TestAnInterpreterThatCannotStartIsNotAScore: a python the code's user
// cannot run is the sandbox's failure, not a crash scored 0.
func TestAnInterpreterThatCannotStartIsNotAScore(t *testing.T) {
	task := housing(t)
	dir, err := os.MkdirTemp("", "wmrl-python-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	notExecutable := filepath.Join(dir, "python")
	os.WriteFile(notExecutable, []byte("#!/bin/sh\nexec python3 \"$@\"\n"), 0o644)
	for _, python := range []string{filepath.Join(dir, "missing"), notExecutable} {
		s := exe(task)
		s.Command = []string{python, "solution.py"}
		if r := run1(t, s, solution(t, "01_mean.py")); r.status != schemas.ExecSandboxError || !strings.Contains(r.detail, python) {
			t.Errorf("%s: %+v; want a sandbox error naming it", python, r)
		} else {
			t.Logf("%s", r.detail)
		}
	}
	if r := run1(t, exe(task), "raise SystemExit(127)"); r.status != schemas.ExecCrashed {
		t.Errorf("code that exits 127 itself: %+v; want crashed", r)
	}
	// Ungraded is better than 0 for failing code, so code must not be
	// able to pass for the shell that could not start it.
	spoof := "import sys\nsys.stderr.write('sandbox: 1: python3: not found\\n')\nsys.exit(127)\n"
	if r := run1(t, exe(task), spoof); r.status != schemas.ExecCrashed {
		t.Errorf("code that says what the shell says when it cannot start it: %+v; want crashed", r)
	}
	if os.Geteuid() != 0 {
		return
	}
	// No process left under the limit for the code (a user of its own, so
	// that no other test's executions count): the shell cannot start it.
	s := exe(task)
	s.UIDs, s.Limits.Processes = []uint32{2000000112}, 1
	if r := run1(t, s, solution(t, "01_mean.py")); r.status != schemas.ExecSandboxError || !strings.Contains(r.detail, "Cannot fork") {
		t.Errorf("a process limit that leaves the shell no fork: %+v; want a sandbox error saying so", r)
	}
}

// TestTheCodeDiesOfItsOwnSignals: the code is not its PID namespace's
// init, which would ignore the signals it sends itself.
func TestTheCodeDiesOfItsOwnSignals(t *testing.T) {
	r := run1(t, exe(housing(t)), "import os\nos.abort()\n")
	if r.status != schemas.ExecCrashed || !strings.HasPrefix(r.detail, "killed by signal 6 (aborted)") {
		t.Fatalf("os.abort(): %+v; want crashed by SIGABRT", r)
	}
}

// TestNothingTheCodeStartsOutlivesIt: a process the code left in a session
// of its own, out of its process group, used to run on after the execution
// as long as it liked (a user of its own, --exec-uids, was the only way to
// end it); in its PID namespace it ends with the execution.
func TestNothingTheCodeStartsOutlivesIt(t *testing.T) {
	if !namespaceTools().ok {
		t.Skipf("no namespaces here: %s", Isolation())
	}
	marker := fmt.Sprintf("wmrl-daemon-%d", time.Now().UnixNano())
	daemon := fmt.Sprintf("import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', %q], start_new_session=True,\n"+
		"    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n", marker)
	if r := run1(t, exe(housing(t)), daemon); r.status != schemas.ExecInvalid {
		t.Fatalf("%+v; want the code to have run (no submission)", r)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		pids := withArg(marker)
		if len(pids) == 0 {
			break
		}
		if time.Now().After(deadline) {
			for _, pid := range pids {
				syscall.Kill(pid, syscall.SIGKILL)
			}
			t.Fatalf("the code's daemon (pids %v) outlived its execution", pids)
		}
	}
}

// withArg lists the processes with arg on their command line.
func withArg(arg string) []int {
	var pids []int
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		b, _ := os.ReadFile(filepath.Join(d, "cmdline"))
		if slices.Contains(strings.Split(string(b), "\x00"), arg) {
			pid, _ := strconv.Atoi(filepath.Base(d))
			pids = append(pids, pid)
		}
	}
	return pids
}

// TestExecutionsLeaveNoZombies: where wmrl is PID 1 (a container's entry
// point), the processes of the code that the sandbox kills after their
// parent (a worker pool at a timeout) come to it to be reaped, and the Go
// runtime reaps only its own children: they used to stay, zombies, each
// holding a PID, for as long as wmrl ran. The test runs itself again as a
// child subreaper, which orphans come to as they come to PID 1.
func TestExecutionsLeaveNoZombies(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("PID namespaces need root")
	}
	if os.Getenv("WMRL_TEST_SUBREAPER") == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestExecutionsLeaveNoZombies$", "-test.v")
		cmd.Env = append(os.Environ(), "WMRL_TEST_SUBREAPER=1")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("as a subreaper: %v\n%s", err, out)
		}
		return
	}
	const prSetChildSubreaper = 36
	if _, _, errno := syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0); errno != 0 {
		t.Skipf("prctl(PR_SET_CHILD_SUBREAPER): %v", errno)
	}
	s := exe(housing(t))
	s.Limits.Timeout = 2 * time.Second
	pool := "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        time.sleep(600)\n        os._exit(0)\ntime.sleep(600)\n"
	if r := run1(t, s, pool); r.status != schemas.ExecTimedOut {
		t.Fatalf("%+v; want it killed at its wall clock", r)
	}
	time.Sleep(200 * time.Millisecond) // for the kills to land
	var zombies []string
	dirs, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, d := range dirs {
		b, _ := os.ReadFile(d)
		// pid (comm) state ppid ...
		if i := strings.LastIndexByte(string(b), ')'); i > 0 {
			f := strings.Fields(string(b)[i+1:])
			if len(f) > 1 && f[0] == "Z" && f[1] == strconv.Itoa(os.Getpid()) {
				zombies = append(zombies, string(b[:i+1]))
			}
		}
	}
	if len(zombies) > 0 {
		t.Fatalf("%d zombies left to this process: %v", len(zombies), zombies)
	}
}

// TestConcurrentExecutionsEachStartThreads: executions at once run as one
// user, whose processes and threads the kernel counts together. With the
// process limit of 16 slots, 16 executions that each start 8 threads all
// run to their end; a flat 64 had 12 of them crash ("can't start new
// thread") and score 0. As root they run as a user of this test's own:
// as nobody, their 200 or so threads left other packages' executions as
// nobody, whose limit is one slot's, "Cannot fork" (pipeline's
// TestPipelineExecutesARealTask graded a solution 0 that way in CI).
func TestConcurrentExecutionsEachStartThreads(t *testing.T) {
	task := housing(t)
	s := &Subprocess{Task: task, RunAs: 2000000120, Limits: Limits{Timeout: 30 * time.Second, Processes: DefaultProcesses(16)}}
	code := "import threading, time\nts = [threading.Thread(target=time.sleep, args=(1,)) for _ in range(8)]\n" +
		"[x.start() for x in ts]\n[x.join() for x in ts]\nopen('submission.csv', 'w').write('id,price\\n')\n"
	var wg sync.WaitGroup
	results := make([]execute.Result, 16)
	for i := range results {
		wg.Go(func() {
			var err error
			if results[i], err = s.Execute(context.Background(), schemas.Trajectory{Response: code}); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	for i, r := range results {
		if r.Status != schemas.ExecInvalid || !strings.Contains(r.Detail, "0 of 200 rows") {
			t.Errorf("execution %d of 16 at once: %s: %s", i, r.Status, r.Detail)
		}
	}
}

// TestADaemonDoesNotHoldTheExecution: code that leaves a process behind,
// outside its process group and holding its output open, used to hold
// the execution (and its slot) for as long as that process lived.
func TestADaemonDoesNotHoldTheExecution(t *testing.T) {
	task := housing(t)
	daemon := "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\n"
	start := time.Now()
	r := run1(t, &Subprocess{Task: task, Limits: Limits{Timeout: 60 * time.Second}}, daemon)
	if took := time.Since(start); took > 20*time.Second || r.status != schemas.ExecInvalid {
		t.Fatalf("%s after %v: %s; want the execution over when its own process is, not after the daemon's 30 s", r.status, took, r.detail)
	}
}
