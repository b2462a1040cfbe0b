package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
)

// housing generates the example task into a temporary directory.
func housing(t testing.TB) *Task {
	t.Helper()
	return housingIn(t, t.TempDir())
}

// housingIn generates the example task into dir.
func housingIn(t testing.TB, dir string) *Task {
	t.Helper()
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("python3 not installed")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	src := "../../examples/tasks/housing"
	for _, f := range []string{"generate.py", "task.json"} {
		b, err := os.ReadFile(filepath.Join(src, f))
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(dir, f), b, 0o644)
	}
	if out, err := exec.Command("python3", filepath.Join(dir, "generate.py")).CombinedOutput(); err != nil {
		t.Fatalf("generate: %v\n%s", err, out)
	}
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

func exe(task *Task) *Subprocess {
	return &Subprocess{Task: task, Limits: Limits{Timeout: 10 * time.Second, MemoryBytes: 512 << 20, Processes: 32}}
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

func TestLimitsComeFromTheRunTheTaskOrTheDefaults(t *testing.T) {
	task := &Task{TimeLimitSeconds: 1200, MemoryMB: 8192}
	cores := runtime.NumCPU()
	for _, tc := range []struct {
		name string
		l    Limits
		task *Task
		want Limits
	}{
		{"defaults", Limits{}, nil, Limits{Timeout: time.Minute, MemoryBytes: 1 << 30, CPUSeconds: 60*cores + 1}},
		{"the task's", Limits{}, task, Limits{Timeout: 20 * time.Minute, MemoryBytes: 8 << 30, CPUSeconds: 1200*cores + 1}},
		{"the run's over the task's", Limits{Timeout: 90 * time.Second, MemoryBytes: 2 << 30, CPUSeconds: 7}, task,
			Limits{Timeout: 90 * time.Second, MemoryBytes: 2 << 30, CPUSeconds: 7}},
		{"the CPU time follows the wall clock", Limits{Timeout: 1500 * time.Millisecond}, task,
			Limits{Timeout: 1500 * time.Millisecond, MemoryBytes: 8 << 30, CPUSeconds: 2*cores + 1}},
		{"no address-space limit, from the task", Limits{}, &Task{MemoryMB: -1}, Limits{Timeout: time.Minute, MemoryBytes: -1 << 20, CPUSeconds: 60*cores + 1}},
	} {
		got := tc.l.For(tc.task)
		if got.Timeout != tc.want.Timeout || got.MemoryBytes != tc.want.MemoryBytes || got.CPUSeconds != tc.want.CPUSeconds {
			t.Errorf("%s: %v; want %v", tc.name, got, tc.want)
		}
	}

	if s := (Limits{MemoryBytes: -1}).For(nil).String(); !strings.Contains(s, "address space unlimited,") {
		t.Errorf("no address-space limit reads %q", s)
	}
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "task.json"), []byte(`{"name":"x","metric":"rmse","time_limit_seconds":-1}`), 0o644)
	if _, err := LoadTask(dir); err == nil || !strings.Contains(err.Error(), "time_limit_seconds -1") {
		t.Errorf("a negative time limit: %v; want an error naming it", err)
	}
}

// TestExecutionsTakeTheTasksLimitsAndSayWhichOneEndedThem runs code into
// each limit: the task's wall clock, the CPU time, the address space.
func TestExecutionsTakeTheTasksLimitsAndSayWhichOneEndedThem(t *testing.T) {
	task := housing(t)
	task.TimeLimitSeconds = 1
	start := time.Now()
	r := run1(t, &Subprocess{Task: task}, "import time\ntime.sleep(30)\n")
	if r.status != schemas.ExecTimedOut || r.detail != "killed after 1s, its wall-clock limit" || time.Since(start) > 20*time.Second {
		t.Fatalf("the task's 1 s: %+v after %v", r, time.Since(start))
	}

	// 1.2 GiB: over the default address-space limit, and fine without one.
	hog := "x = bytearray(1200 * 1024**2)\n" + solution(t, "01_mean.py")
	roomy := Limits{Timeout: 20 * time.Second}
	if r := run1(t, &Subprocess{Task: task, Limits: roomy}, hog); r.status != schemas.ExecCrashed || !strings.Contains(r.detail, "limited to 1024 MiB") {
		t.Fatalf("1.2 GiB under the default limit: %+v", r)
	}
	task.MemoryMB = -1
	if r := run1(t, &Subprocess{Task: task, Limits: roomy}, hog); r.status != schemas.ExecScored {
		t.Fatalf("1.2 GiB with memory_mb -1: %+v; want it scored", r)
	}

	r = run1(t, &Subprocess{Task: task, Limits: Limits{Timeout: 20 * time.Second, CPUSeconds: 1}}, "while True:\n    pass\n")
	if r.status != schemas.ExecTimedOut || !strings.HasPrefix(r.detail, "killed after 1 s of CPU time, its limit") {
		t.Fatalf("1 s of CPU time: %+v; want timed out, saying it was the CPU time", r)
	}
	t.Logf("1 s of CPU time: %s", r.detail)

	r = run1(t, &Subprocess{Task: task, Limits: Limits{Timeout: 20 * time.Second}}, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
	if r.status != schemas.ExecCrashed || !strings.HasPrefix(r.detail, "killed by signal 11 (segmentation fault)") {
		t.Fatalf("a segmentation fault: %+v; want crashed, naming the signal", r)
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

// TestCodeOnEveryCoreMeetsItsWallClockFirst: the CPU limit counts all of a
// process's threads, so code that trains on every core (BLAS, n_jobs) must
// not be cut at a fraction of its wall clock.
func TestCodeOnEveryCoreMeetsItsWallClockFirst(t *testing.T) {
	if runtime.NumCPU() < 2 {
		t.Skip("one core")
	}
	task := housing(t)
	// Two threads hashing (hashlib lets go of the GIL) for 2.5 s of wall
	// clock: up to 5 s of CPU time, over a limit of the 3 s wall clock + 1.
	code := `import hashlib, threading, time
buf = b"x" * (1 << 20)
def burn():
    end = time.time() + 2.5
    while time.time() < end:
        hashlib.sha256(buf).digest()
ts = [threading.Thread(target=burn) for _ in range(2)]
[x.start() for x in ts]
[x.join() for x in ts]
open("submission.csv", "w").write("id,price\n")
`
	r := run1(t, &Subprocess{Task: task, Limits: Limits{Timeout: 3 * time.Second}}, code)
	if r.status != schemas.ExecInvalid || !strings.Contains(r.detail, "0 of 200 rows") {
		t.Fatalf("%+v; want it to run to its end (and write an empty submission)", r)
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

// TestTheSubmissionIsAFileInTheCodesDirectory: the grader, as wmrl's
// user (root), read the submission by its name, following a symlink
// wherever it pointed: code that pointed it at a file it could not read
// itself, a perfect submission there, scored 1.0; one that made it a
// named pipe held its execution slot for ever; one that pointed it at
// /dev/zero would have grown wmrl until the kernel killed it. And a
// submission as large as the disk limit was read whole into wmrl's memory.
func TestTheSubmissionIsAFileInTheCodesDirectory(t *testing.T) {
	task := housing(t)
	perfect := "id,price\n"
	for id, a := range task.answers {
		perfect += id + "," + a.value + "\n"
	}
	if score, err := task.Grade([]byte(perfect)); err != nil || score != 1 {
		t.Fatalf("the perfect submission: %v %v", score, err)
	}
	elsewhere := filepath.Join(t.TempDir(), "perfect.csv") // which the code cannot read
	if err := os.WriteFile(elsewhere, []byte(perfect), 0o600); err != nil {
		t.Fatal(err)
	}
	s := exe(task)
	s.Limits.SubmissionBytes = 1 << 20
	for _, c := range []struct{ name, code, want string }{
		{"a symlink out of its directory", fmt.Sprintf("import os\nos.symlink(%q, 'submission.csv')\n", elsewhere),
			"submission.csv cannot be read in the code's directory"},
		{"a named pipe", "import os\nos.mkfifo('submission.csv')\n", "submission.csv is not a file but a named pipe"},
		{"larger than its limit", "open('submission.csv', 'w').truncate(2 << 20)\n", "submission.csv is 2 MiB, over the 1 MiB a submission may be"},
		{"a symlink to a file in its directory", "import os\nos.symlink('data/train.csv', 'submission.csv')\n", `unknown id "0"`},
	} {
		done := make(chan execute.Result, 1)
		go func() {
			r, err := s.Execute(context.Background(), schemas.Trajectory{TrajID: "t", Response: c.code})
			if err != nil {
				t.Error(err)
			}
			done <- r
		}()
		select {
		case r := <-done:
			t.Logf("%s: %s", c.name, r.Detail)
			if r.Status != schemas.ExecInvalid || !strings.Contains(r.Detail, c.want) {
				t.Errorf("%s: %s %v %q; want invalid, %q", c.name, r.Status, r.Score, r.Detail, c.want)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: the execution has not ended in 30 s", c.name)
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

// TestWorkDirsAreRemovedAsAnyUser: a user other than root cannot unlink
// from the read-only data/ of a work directory (nor from read-only
// directories the code makes), so every execution used to leave its
// directory, with a copy of the task's data, behind. Run as root, the test
// runs itself again as nobody.
func TestWorkDirsAreRemovedAsAnyUser(t *testing.T) {
	if os.Geteuid() == 0 {
		asNobody(t, "TestWorkDirsAreRemovedAsAnyUser")
		return
	}
	task := housing(t)
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	readOnly := "import os\nos.makedirs('out/deep')\nopen('out/deep/x', 'w').write('x')\nos.chmod('out/deep', 0o500)\nos.chmod('out', 0o500)\n"
	// Temporary files go with the work directory, not into a shared /tmp.
	temp := "import os, tempfile\nf = tempfile.NamedTemporaryFile(delete=False)\nassert f.name.startswith(os.getcwd() + '/'), f.name\n"
	for _, code := range []string{solution(t, "01_mean.py"), readOnly, temp} {
		if r := run1(t, exe(task), code); strings.Contains(r.detail, "left behind") || r.status == schemas.ExecCrashed {
			t.Errorf("%s: %s", r.status, r.detail)
		}
	}
	if left, _ := filepath.Glob(filepath.Join(WorkParent(), "*")); len(left) > 0 {
		t.Fatalf("work directories left behind: %v", left)
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

// TestDataInDirectoriesReachesTheCode: an image task keeps its data in
// directories under public/; both executors hand them to the code whole
// (the subprocess executor read-only; Sandbox Fusion's server decides).
func TestDataInDirectoriesReachesTheCode(t *testing.T) {
	task := housing(t)
	os.MkdirAll(filepath.Join(task.PublicDir(), "images", "train"), 0o755)
	os.WriteFile(filepath.Join(task.PublicDir(), "images", "train", "a.txt"), []byte("hello"), 0o644)
	read := "assert open('data/images/train/a.txt').read() == 'hello', 'data/images/train/a.txt'\n"
	write := `try:
    open("data/images/train/b.txt", "w").write("x")
    raise SystemExit("wrote into data/images/train")
except PermissionError:
    pass
`
	srv, _ := fusionServer(t, 0)
	for name, tc := range map[string]struct {
		exe  execute.Executor
		code string
	}{
		"subprocess":     {exe(task), read + write},
		"sandbox fusion": {&Fusion{URL: srv.URL, Task: task}, read},
	} {
		r, err := tc.exe.Execute(context.Background(), schemas.Trajectory{Response: tc.code + solution(t, "01_mean.py")})
		if err != nil || r.Status != schemas.ExecScored {
			t.Errorf("%s: %+v %v; want the code to find its data and be scored", name, r, err)
		}
	}
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

// TestExecutionsAtOnceShareTheGPUsOut: with GPUs given, each execution
// sees one set of them, and no two executions at once the same set;
// executions past the sets wait for one. Without it, every execution at
// once saw every GPU, and CUDA put them all on the first.
func TestExecutionsAtOnceShareTheGPUsOut(t *testing.T) {
	task := housing(t)
	s := exe(task)
	s.GPUs = [][]string{{"0", "1"}, {"GPU-5f0c3e9a"}}
	code := "import os, time\nstart = time.time()\ntime.sleep(0.5)\n" +
		"raise SystemExit('gpus %s from %.3f to %.3f' % (os.environ.get('CUDA_VISIBLE_DEVICES'), start, time.time()))\n"
	type held struct {
		gpus       string
		start, end float64
	}
	runs := make([]held, 5)
	var wg sync.WaitGroup
	for i := range runs {
		wg.Go(func() {
			res, err := s.Execute(context.Background(), schemas.Trajectory{TrajID: fmt.Sprint(i), Response: code})
			if err != nil {
				t.Error(err)
				return
			}
			d := res.Detail[strings.Index(res.Detail, "gpus "):]
			if _, err := fmt.Sscanf(d, "gpus %s from %f to %f", &runs[i].gpus, &runs[i].start, &runs[i].end); err != nil {
				t.Errorf("execution %d: %q: %v", i, res.Detail, err)
			}
		})
	}
	wg.Wait()
	sets := map[string]int{}
	for i, a := range runs {
		sets[a.gpus]++
		if a.gpus != "0,1" && a.gpus != "GPU-5f0c3e9a" {
			t.Errorf("execution %d saw GPUs %q", i, a.gpus)
		}
		for j, b := range runs[:i] {
			if a.gpus == b.gpus && a.start < b.end && b.start < a.end {
				t.Errorf("executions %d and %d had GPUs %s at once: %+v %+v", j, i, a.gpus, b, a)
			}
		}
	}
	if len(sets) != 2 {
		t.Errorf("sets used: %v; want both", sets)
	}
	if got := (exe(task)).environ("/w", nil); slices.ContainsFunc(got, func(e string) bool { return strings.HasPrefix(e, "CUDA_VISIBLE_DEVICES=") }) {
		t.Errorf("without GPUs shared out, the code is told %q", got)
	}
}

// TestExecutionsWaitingForGPUsAreTold: with every set of GPUs taken, an
// execution waits, and the executor says so (the metric that tells the
// GPUs, not the slots, hold executions back).
func TestExecutionsWaitingForGPUsAreTold(t *testing.T) {
	task := housing(t)
	s := exe(task)
	s.GPUs = [][]string{{"0"}, {"1"}}
	var mu sync.Mutex
	waiting, most := 0, 0
	s.Waiting = func(what string, d int) {
		mu.Lock()
		defer mu.Unlock()
		if what != "gpus" {
			t.Errorf("waiting for %q", what)
		}
		waiting += d
		most = max(most, waiting)
	}
	// The test holds both sets, so every execution has to wait.
	var held [][]string
	for range 2 {
		set, err := s.gpus.take(context.Background(), s.GPUs, nil)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, set)
	}
	var wg sync.WaitGroup
	for i := range 3 {
		wg.Go(func() {
			if r, err := s.Execute(context.Background(), schemas.Trajectory{TrajID: fmt.Sprint(i), Response: "pass\n"}); err != nil || r.Status != schemas.ExecInvalid {
				t.Errorf("execution %d: %+v %v", i, r, err)
			}
		})
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		mu.Lock()
		n := waiting
		mu.Unlock()
		if n == 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("%d of the 3 executions told waiting in 20 s", n)
			break
		}
	}
	for _, set := range held {
		s.gpus.give(set)
	}
	wg.Wait()
	if waiting != 0 || most != 3 {
		t.Errorf("waiting %d at the end, at most %d; want 0, and 3", waiting, most)
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

// TestTheCodeSeesItsOwnProcesses: in a PID namespace, the code's
// os.getpid() is its PID there; with the host's /proc, psutil, joblib's
// workers and the like, which look themselves up in /proc by it, found
// another process. It also cannot regain privileges through a setuid
// program.
func TestTheCodeSeesItsOwnProcesses(t *testing.T) {
	if !namespaceTools().ok {
		t.Skipf("no namespaces here: %s", Isolation())
	}
	probe := "import os\nps = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n" +
		"me = int(open('/proc/self/stat').read().split()[0])\n" +
		"nnp = [l for l in open('/proc/self/status') if l.startswith('NoNewPrivs:')][0].split()[1]\n" +
		"assert me == os.getpid() and len(ps) < 10 and nnp == '1', (me, os.getpid(), ps, nnp)\n"
	if r := run1(t, exe(housing(t)), probe); r.status != schemas.ExecInvalid {
		t.Fatalf("%s: %s; want the probe to pass (and write no submission)", r.status, r.detail)
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
// thread") and score 0.
func TestConcurrentExecutionsEachStartThreads(t *testing.T) {
	task := housing(t)
	s := &Subprocess{Task: task, Limits: Limits{Timeout: 30 * time.Second, Processes: DefaultProcesses(16)}}
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

// TestExecutionsWithUsersOfTheirOwnCannotReachEachOther: a solution that
// looks for another execution's directory while it runs, to read its
// submission, finds and reads it when both run as nobody, and cannot when
// each has a user of its own; a process left running under a user of its
// own outside its process group is killed when the execution ends.
func TestExecutionsWithUsersOfTheirOwnCannotReachEachOther(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("users of their own need root")
	}
	task := housing(t)
	victim := "import time\nopen('submission.csv', 'w').write('id,price\\n')\ntime.sleep(3)\n"
	// The thief looks for the other's directory where the executions'
	// directories are made, and says whether it could list that.
	thief := fmt.Sprintf(`import glob, os, time
time.sleep(1)
parent = %q
try:
    os.listdir(parent)
    listed = "listed"
except (PermissionError, FileNotFoundError):
    listed = "not listed"
for d in glob.glob(parent + "/wmrl-exec-*"):
    if not os.path.samefile(d, "."):
        try:
            open(d + "/submission.csv").read()
            raise SystemExit("read " + d + "/submission.csv")
        except (PermissionError, FileNotFoundError):
            pass
raise SystemExit(listed + ", read nothing")
`, WorkParent())
	steal := func(s *Subprocess) execute.Result {
		var wg sync.WaitGroup
		var r execute.Result
		wg.Go(func() { s.Execute(context.Background(), schemas.Trajectory{Response: victim}) })
		wg.Go(func() {
			var err error
			if r, err = s.Execute(context.Background(), schemas.Trajectory{Response: thief}); err != nil {
				t.Error(err)
			}
		})
		wg.Wait()
		return r
	}
	limits := Limits{Timeout: 20 * time.Second}
	// This process's own user lists the executions' parent: the victim's
	// directory is there while it runs (else the thief finds nothing for
	// want of anything to find).
	seen := make(chan []string, 1)
	go func() {
		time.Sleep(500 * time.Millisecond) // both started, neither ended
		dirs, _ := filepath.Glob(filepath.Join(WorkParent(), "wmrl-exec-*"))
		seen <- dirs
	}()
	want := "not listed, read nothing"
	if r := steal(&Subprocess{Task: task, Limits: limits}); r.Status != schemas.ExecCrashed || !strings.Contains(r.Detail, want) {
		t.Fatalf("both as nobody: %s: %s; want the thief unable to list the other's directory (%q)", r.Status, r.Detail, want)
	}
	dirs := <-seen
	if len(dirs) != 2 {
		t.Fatalf("%d execution directories while both ran, want 2: %v", len(dirs), dirs)
	}
	for _, d := range dirs {
		if n := len(filepath.Base(d)); n != 42 { // "wmrl-exec-" and 32 hex digits: 128 random bits
			t.Fatalf("execution directory %s: a name of %d characters, want 42", d, n)
		}
	}
	own := &Subprocess{Task: task, Limits: limits, UIDs: []uint32{2000000101, 2000000102}}
	if r := steal(own); r.Status != schemas.ExecCrashed || !strings.Contains(r.Detail, want) {
		t.Fatalf("users of their own: %s: %s; want the thief kept out (%q)", r.Status, r.Detail, want)
	}

	// A daemon that leaves its process group outlives the execution's
	// group kill, but not its user's.
	daemon := "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
	own.UIDs = []uint32{2000000103}
	own.uids = pool[uint32]{}
	run1(t, own, daemon)
	out, _ := exec.Command("ps", "-u", "2000000103", "-o", "pid=,stat=").Output()
	for line := range strings.Lines(string(out)) {
		if f := strings.Fields(line); len(f) == 2 && !strings.HasPrefix(f[1], "Z") { // a zombie is dead, waiting to be reaped
			t.Fatalf("a process of the execution's user left running: %s", line)
		}
	}
}

// needPrivateTmp skips a test where executions cannot have their own /tmp.
func needPrivateTmp(t *testing.T) {
	t.Helper()
	if !namespaceTools().privateTmp {
		t.Skipf("no private /tmp here: %s", Isolation())
	}
}

// TestEachExecutionHasItsOwnTmp: solutions write fixed paths such as
// /tmp/model.pkl. Two executions at once, as the same user, overwrote each
// other's file there and read the other's back (a score of the wrong
// model), and what they left in the host's /tmp and /dev/shm stayed for
// as long as the machine ran. Each now has its directory as /tmp and
// /var/tmp, and a /dev/shm of its own.
func TestEachExecutionHasItsOwnTmp(t *testing.T) {
	needPrivateTmp(t)
	task := housing(t)
	name := fmt.Sprintf("wmrl-test-%d", rand.Uint64())
	code := func(tag string) string {
		return fmt.Sprintf(`import os, time
for d in ("/tmp", "/var/tmp", "/dev/shm"):
    open(os.path.join(d, %[1]q + os.path.basename(d)), "w").write(%[2]q)
open("written", "w").close()
for _ in range(600):
    if os.path.exists("go"):
        break
    time.sleep(0.05)
got = [open(os.path.join(d, %[1]q + os.path.basename(d))).read() for d in ("/tmp", "/var/tmp", "/dev/shm")]
raise SystemExit("home %%s, tmpdir %%s, cwd %%s, read %%s" %% (os.environ["HOME"], os.environ["TMPDIR"], os.getcwd(), " ".join(got)))
`, name, tag)
	}
	var wg sync.WaitGroup
	details := make([]string, 2)
	for i, tag := range []string{"first", "second"} {
		wg.Go(func() {
			res, err := exe(task).Execute(context.Background(), schemas.Trajectory{TrajID: tag, Response: code(tag)})
			if err != nil {
				t.Error(err)
			}
			details[i] = res.Detail
		})
	}
	// Both have written before either reads back: each waits for "go",
	// which the test puts in their directories once both have.
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		written, _ := filepath.Glob(filepath.Join(WorkParent(), "wmrl-exec-*", "written"))
		if len(written) == 2 {
			for _, w := range written {
				os.WriteFile(filepath.Join(filepath.Dir(w), "go"), nil, 0o644)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("%d of the 2 executions wrote in 20 s", len(written))
			break
		}
	}
	wg.Wait()
	for i, tag := range []string{"first", "second"} {
		want := fmt.Sprintf("home /tmp, tmpdir /tmp, cwd /tmp, read %[1]s %[1]s %[1]s", tag)
		if !strings.Contains(details[i], want) {
			t.Errorf("the %s execution: %q, want %q", tag, details[i], want)
		}
	}
	for _, d := range []string{"/tmp", "/var/tmp", "/dev/shm"} {
		left := filepath.Join(d, name+filepath.Base(d))
		if _, err := os.Stat(left); !errors.Is(err, os.ErrNotExist) {
			os.Remove(left)
			t.Errorf("%s is left on the host (%v)", left, err)
		}
	}
}

// TestAnInterpreterInTmpStaysInView: a virtualenv made in the host's
// /tmp (--exec-python /tmp/venv/bin/python) vanished from the code's view
// behind its own /tmp, and no solution could start. It is shown at its
// path, and stays whole on the host: the work directory it is shown in is
// removed after every execution.
func TestAnInterpreterInTmpStaysInView(t *testing.T) {
	needPrivateTmp(t)
	venv, err := os.MkdirTemp("/tmp", "wmrl-venv-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(venv) })
	os.Chmod(venv, 0o755)
	os.Mkdir(filepath.Join(venv, "bin"), 0o755)
	python := filepath.Join(venv, "bin", "python")
	os.WriteFile(python, []byte("#!/bin/sh\nexport VIA=venv\nexec python3 \"$@\"\n"), 0o755)
	s := exe(housing(t))
	s.Command = []string{python, "solution.py"}
	for i := range 2 {
		r := run1(t, s, "import os, sys\nraise SystemExit('via %s, %s' % (os.environ.get('VIA'), sorted(os.listdir(os.path.dirname(sys.argv[0]) or '.'))))\n")
		if want := "via venv, ['data', 'solution.py', '" + filepath.Base(venv) + "']"; !strings.Contains(r.detail, want) {
			t.Fatalf("execution %d: %s: %s; want %q", i+1, r.status, r.detail, want)
		}
		if _, err := os.Stat(python); err != nil {
			t.Fatalf("after execution %d, the interpreter on the host: %v", i+1, err)
		}
	}
	if v, err := s.Check(context.Background()); err != nil || !strings.HasPrefix(v, "/usr/") {
		t.Fatalf("check: %q %v", v, err)
	}
}

func TestWhatOfTmpTheCodeKeeps(t *testing.T) {
	real, err := os.MkdirTemp("/tmp", "wmrl-real-python-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(real) })
	os.WriteFile(filepath.Join(real, "python"), []byte("#!/bin/sh\n"), 0o755)
	links, err := os.MkdirTemp("/tmp", "wmrl-links-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(links) })
	link := filepath.Join(links, "bin", "python")
	os.Mkdir(filepath.Dir(link), 0o755)
	if err := os.Symlink(filepath.Join(real, "python"), link); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		command string
		want    []string
	}{
		{"python3", nil},
		{"/usr/bin/python3", nil},
		{"/tmp/venv/bin/python", []string{"/tmp/venv"}},
		{"/tmp//venv/./bin/python", []string{"/tmp/venv"}},
		{"/var/tmp/ml/python", []string{"/var/tmp/ml"}},
		{"/tmpfoo/python", nil},
		{link, []string{links, real}}, // what it is called, and what it is
	} {
		s := &Subprocess{Command: []string{c.command, "solution.py"}}
		if got := s.keptInTmp(); !slices.Equal(got, c.want) {
			t.Errorf("%s: kept %q, want %q", c.command, got, c.want)
		}
	}
}

// TestCodeThatFillsTheDiskIsKilled: a solution that writes in a loop
// used to fill the disk its directory is on, which the executions share
// with whatever else is there (the NATS store, on one disk). It is killed
// past its disk limit, a crash that says so, and its directory removed;
// the task's data, copied in, does not count, nor does a sparse file's
// size beyond what it holds.
func TestCodeThatFillsTheDiskIsKilled(t *testing.T) {
	task := housing(t)
	s := exe(task)
	s.Limits.DiskBytes = 16 << 20
	into := "x"
	if namespaceTools().privateTmp {
		into = "/tmp/x" // its own /tmp is its directory
	}
	filler := fmt.Sprintf("import os, time\nwith open(%q, 'wb') as f:\n", into) +
		"    for i in range(400):\n        f.write(os.urandom(1 << 20)); f.flush(); os.fsync(f.fileno()); time.sleep(0.01)\n"
	start := time.Now()
	r := run1(t, s, filler)
	if want := "over its disk limit of 16 MiB"; r.status != schemas.ExecCrashed || !strings.Contains(r.detail, want) {
		t.Fatalf("%s: %s; want it killed (%q)", r.status, r.detail, want)
	}
	t.Logf("%s in %v", r.detail, time.Since(start).Round(time.Millisecond))
	// Under the limit: 8 MiB written, and a sparse file of 1 GiB; the
	// task's data, 24 MiB of it, is not the code's.
	if err := os.WriteFile(filepath.Join(task.PublicDir(), "big.bin"), bytes.Repeat([]byte{1}, 24<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	within := "import os, time\nopen('some.bin', 'wb').write(os.urandom(8 << 20))\n" +
		"with open('sparse', 'wb') as f:\n    f.seek(1 << 30); f.write(b'x')\ntime.sleep(1.5)\n"
	if r := run1(t, s, within); r.status != schemas.ExecInvalid {
		t.Fatalf("%s: %s; want it to run to its end (and write no submission)", r.status, r.detail)
	}
	if left, _ := filepath.Glob(filepath.Join(WorkParent(), "wmrl-exec-*")); len(left) > 0 {
		t.Fatalf("work directories left behind: %v", left)
	}
}

// TestExecutionsAreIsolatedWithoutRootToo: wmrl not run as root (a
// cluster's user, a container's) used to run the code as its own user
// with the network reachable, the host's /tmp shared, and nothing that
// ended what it left behind. Where the kernel allows user namespaces, the
// code now runs in one, as its root without capabilities: the tests of
// isolation pass as nobody as they do as root, and the code cannot undo
// the mount that hides the host's /tmp.
func TestExecutionsAreIsolatedWithoutRootToo(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("runs its tests as nobody, from root")
	}
	if err := exec.Command("runuser", "-u", "nobody", "--", "unshare", "--user", "--map-root-user", "true").Run(); err != nil {
		t.Skipf("no user namespaces for nobody here: %v", err)
	}
	for _, test := range []string{"TestUserNamespaceRootCannotUndoItsMounts", "TestEachExecutionHasItsOwnTmp",
		"TestAnExecutionCannotReachAnotherKnowingItsPath", "TestTheCodeSeesItsOwnProcesses", "TestNothingTheCodeStartsOutlivesIt",
		"TestSystemVIPCIsTheExecutionsOwn", "TestDirectoriesEveryUserWritesAreTheExecutionsOwn"} {
		// Not TestSandboxContainsHostileCode: its fork bomb, as nobody,
		// would take the process limit from every execution as nobody
		// of the other packages' tests running at the same time.
		asNobody(t, test)
	}
}

// TestUserNamespaceRootCannotUndoItsMounts runs as nobody (from
// TestExecutionsAreIsolatedWithoutRootToo).
func TestUserNamespaceRootCannotUndoItsMounts(t *testing.T) {
	if os.Geteuid() == 0 || !namespaceTools().privateTmp {
		t.Skipf("for a user other than root, in a user namespace: %s", Isolation())
	}
	probe := `import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
res = []
for target in (b"/tmp", b"/dev/shm"):
    rc = libc.umount2(target, 2)  # MNT_DETACH
    res.append("umount %s=%s" % (target.decode(), "ok" if rc == 0 else os.strerror(ctypes.get_errno())))
try:
    socket.create_connection(("1.1.1.1", 53), timeout=1)
    res.append("network=ok")
except OSError as e:
    res.append("network=" + type(e).__name__)
res.append("caps=" + [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff:")][0])
raise SystemExit(" ".join(res))
`
	r := run1(t, exe(housing(t)), probe)
	t.Logf("probe: %s", r.detail)
	for _, want := range []string{"umount /tmp=Operation not permitted", "umount /dev/shm=Operation not permitted", "network=OSError", "caps=0000000000000000"} {
		if !strings.Contains(r.detail, want) {
			t.Errorf("probe %q lacks %s", r.detail, want)
		}
	}
}

// TestAPrivateTmpThatCannotBeMountedSaysWhy: the mounts happen before
// the code starts; when one fails, the code does not run, and the shell
// says which and mount's reason on fd 3, so that the execution is a
// sandbox error that names it rather than a crash scored 0.
func TestAPrivateTmpThatCannotBeMountedSaysWhy(t *testing.T) {
	needPrivateTmp(t)
	ns := namespaceTools()
	said, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer said.Close()
	ran := filepath.Join(t.TempDir(), "ran")
	argv := append(append(ns.flags(), privateTmpArgs("/nonexistent-wmrl-work-dir", "/nonexistent", "", nil, nil, nil)...), "/bin/sh", "-c", "touch "+ran)
	cmd := exec.Command(ns.unshare, argv...)
	cmd.ExtraFiles = []*os.File{w}
	err = cmd.Run()
	w.Close()
	b, _ := io.ReadAll(said)
	if _, statErr := os.Stat(ran); err == nil || statErr == nil {
		t.Fatalf("exit %v, the command ran: %v; want neither", err, statErr)
	}
	if want := "its own /tmp could not be mounted: mount: "; !strings.HasPrefix(string(b), want) || !strings.Contains(string(b), "/nonexistent-wmrl-work-dir") ||
		strings.Count(strings.TrimSpace(string(b)), "\n") > 0 {
		t.Fatalf("the shell said %q; want %q and the directory, in a line", b, want)
	}
	t.Logf("said: %s", b)
}

// TestAnExecutionCannotReachAnotherKnowingItsPath: as the same user
// (nobody), an execution that knew a concurrent one's directory (a
// traceback in the world model's prompt, a log) could read and overwrite
// its submission; the directories were apart only by their unlisted,
// random names. The executions' parent is now out of the code's view.
func TestAnExecutionCannotReachAnotherKnowingItsPath(t *testing.T) {
	needPrivateTmp(t)
	task := housing(t)
	s := &Subprocess{Task: task, Limits: Limits{Timeout: 20 * time.Second}}
	// The victim runs until the test has seen what the thief did (a file
	// the test puts in its directory), 30 s at most.
	// It marks its directory with a name of this test's, so that no other
	// directory there (one a killed test run left) passes for it.
	mark := fmt.Sprintf("victim-%d", rand.Uint64())
	victim := "import os, time\nopen('submission.csv', 'w').write('id,price\\n')\nopen('" + mark + "', 'w').close()\n" +
		"for _ in range(600):\n    if os.path.exists('thief-done'):\n        break\n    time.sleep(0.05)\n"
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { s.Execute(context.Background(), schemas.Trajectory{TrajID: "victim", Response: victim}) })
	var dir string
	for deadline := time.Now().Add(3 * time.Second); dir == ""; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the victim's directory did not appear")
		}
		dirs, _ := filepath.Glob(filepath.Join(WorkParent(), "wmrl-exec-*", mark))
		if len(dirs) == 1 {
			dir = filepath.Dir(dirs[0])
		}
	}
	thief := fmt.Sprintf(`import os
res = []
for name, act in [("read", lambda: open(%[1]q + "/submission.csv").read()),
                  ("write", lambda: open(%[1]q + "/submission.csv", "w").write("id,price\n1,0\n")),
                  ("list", lambda: os.listdir(%[2]q))]:
    try:
        got = act()
        res.append(name + "=ok" + ("" if name != "list" else str(len(got))))
    except Exception as e:
        res.append(name + "=" + type(e).__name__)
raise SystemExit(" ".join(res))
`, dir, WorkParent())
	r := run1(t, s, thief)
	t.Logf("thief: %s", r.detail)
	for _, stole := range []string{"read=ok", "write=ok", "list=ok1", "list=ok2"} {
		if strings.Contains(r.detail, stole) {
			t.Errorf("the thief, knowing %s: %s", dir, r.detail)
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "submission.csv")); err != nil || string(b) != "id,price\n" {
		t.Errorf("the victim's submission: %q (%v)", b, err)
	}
	if err := os.WriteFile(filepath.Join(dir, "thief-done"), nil, 0o644); err != nil {
		t.Errorf("the victim ended before the thief did: %v", err)
	}
}

// TestSystemVIPCIsTheExecutionsOwn: System V shared memory, semaphores
// and message queues outlive the process that made them. Code killed at
// its limit (or that never removes them) left them in the host's kernel
// for as long as the machine ran, against its limits on them, and the
// next execution found them by their key: a channel from one execution
// to another. Each execution has an IPC namespace of its own, gone with
// it.
func TestSystemVIPCIsTheExecutionsOwn(t *testing.T) {
	if !namespaceTools().ok && os.Geteuid() != 0 {
		t.Skipf("no namespaces here: %s", Isolation())
	}
	task := housing(t)
	key := 0x574d0000 + rand.IntN(0xffff)
	code := fmt.Sprintf(`import ctypes
libc = ctypes.CDLL(None, use_errno=True)
got = []
for name, call in [("shm", lambda f: libc.shmget(%[1]d, 4096, f)), ("sem", lambda f: libc.semget(%[1]d, 1, f)),
                   ("msg", lambda f: libc.msgget(%[1]d, f))]:
    found = call(0o666) >= 0
    made = found or call(0o1666) >= 0
    got.append("%%s found=%%s made=%%s" %% (name, found, made))
raise SystemExit(", ".join(got))
`, key)
	// The second finds nothing of the first's, and neither leaves anything.
	want := "shm found=False made=True, sem found=False made=True, msg found=False made=True"
	for i := range 2 {
		if r := run1(t, exe(task), code); !strings.Contains(r.detail, want) {
			t.Errorf("execution %d: %q, want %q", i+1, r.detail, want)
		}
	}
	for kind, ipcrm := range map[string]string{"shm": "-M", "sem": "-S", "msg": "-Q"} {
		b, err := os.ReadFile("/proc/sysvipc/" + kind)
		if err != nil {
			t.Fatalf("no /proc/sysvipc here: %v", err)
		}
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) > 0 && f[0] == strconv.Itoa(key) {
				exec.Command("ipcrm", ipcrm, strconv.Itoa(key)).Run()
				t.Errorf("the executions left their %s on the host: %s", kind, line)
			}
		}
	}
}

// outsideTmp is a directory of the test's outside /tmp, /var/tmp and
// /dev/shm (which the code sees its own of, where it has them), that the
// code's user may enter: what is there is in its view unless hidden.
// Run as nobody from root (asNobody), it is the one root made for it.
func outsideTmp(t *testing.T) string {
	if d := os.Getenv("WMRL_TEST_OUTSIDE_TMP"); d != "" {
		return d
	}
	home, _ := os.UserHomeDir()
	for _, parent := range []string{"/var/lib", "/srv", "/opt", home} {
		if parent == "" || slices.ContainsFunc([]string{"/tmp", "/var/tmp", "/dev/shm"}, func(d string) bool {
			return parent == d || strings.HasPrefix(parent, d+"/")
		}) {
			continue
		}
		d, err := os.MkdirTemp(parent, "wmrl-test-")
		if err != nil {
			continue
		}
		t.Cleanup(func() { os.RemoveAll(d) })
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
		return d
	}
	t.Skip("no directory outside /tmp to write in")
	return ""
}

// TestDirectoriesEveryUserWritesAreTheExecutionsOwn: besides /tmp,
// /var/tmp and /dev/shm, a host has directories every user may write,
// /run/lock among them (on this machine's root disk). Code wrote there
// past its disk limit, which counts only its own directory, and what it
// left stayed for the next execution to find: a cache of a trained model
// from one execution to the next, or a channel between two at once. Each
// execution now has its own, empty, gone with it.
func TestDirectoriesEveryUserWritesAreTheExecutionsOwn(t *testing.T) {
	needPrivateTmp(t)
	var dirs []string
	if fi, err := os.Lstat("/run/lock"); err == nil && fi.IsDir() && fi.Mode().Perm()&0o002 != 0 {
		dirs = append(dirs, "/run/lock")
	}
	task := housing(t)
	// As root, one more, made for the test (as nobody, /run/lock alone).
	if shared, err := os.MkdirTemp("/var/lib", "wmrl-test-shared-"); err == nil {
		t.Cleanup(func() { os.RemoveAll(shared) })
		if err := os.Chmod(shared, 0o1777); err != nil {
			t.Fatal(err)
		}
		dirs = append(dirs, shared)
		// An interpreter there would be hidden with it: refused before a run.
		s := exe(task)
		s.Command = []string{filepath.Join(shared, "venv", "bin", "python"), "solution.py"}
		if _, err := s.Check(context.Background()); err == nil || !strings.Contains(err.Error(), " is in "+shared+", which every user may write") {
			t.Errorf("an interpreter in %s: %v", shared, err)
		}
	}
	if len(dirs) == 0 {
		t.Skip("no directory every user may write here, and none to make")
	}
	name := fmt.Sprintf("wmrl-test-%d", rand.Uint64())
	code := fmt.Sprintf(`import os
res = []
for d in %q.split():
    p = os.path.join(d, %q)
    found = os.path.exists(p)
    open(p, "w").write("cached")
    res.append("%%s found=%%s wrote=%%s" %% (d, found, os.path.exists(p)))
raise SystemExit(", ".join(res))
`, strings.Join(dirs, " "), name)
	for i := range 2 {
		r := run1(t, exe(task), code)
		for _, d := range dirs {
			if want := d + " found=False wrote=True"; !strings.Contains(r.detail, want) {
				t.Errorf("execution %d: %q; want %q", i+1, r.detail, want)
			}
		}
	}
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, name)); !errors.Is(err, os.ErrNotExist) {
			os.Remove(filepath.Join(d, name))
			t.Errorf("%s is left on the host (%v)", filepath.Join(d, name), err)
		}
	}
}

// TestTheCodeSeesNeitherTheAnswersNorWmrlsData: the code could read the
// task's private answers wherever their permissions let its user: as
// wmrl's own user, which it is without root, always (and submit them, for
// a perfect score), and as nobody where the task was made without taking
// them from everyone. It could read wmrl's data too, where the archive
// keeps every anchor's code with its score (a policy could learn to find
// the best and run it). Both are now out of its view, and it still gets
// the task's public data and scores.
func TestTheCodeSeesNeitherTheAnswersNorWmrlsData(t *testing.T) {
	needPrivateTmp(t)
	if os.Geteuid() == 0 && os.Getenv("WMRL_TEST_OUTSIDE_TMP") == "" {
		// As root, in a directory nobody may read; and as nobody, who then
		// is the code's user outside its user namespace.
		d := outsideTmp(t)
		if err := os.Chown(d, 65534, 65534); err != nil {
			t.Fatal(err)
		}
		asNobody(t, "TestTheCodeSeesNeitherTheAnswersNorWmrlsData", "WMRL_TEST_OUTSIDE_TMP="+d)
	}
	dir, err := os.MkdirTemp(outsideTmp(t), "case-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755)
	task := housingIn(t, filepath.Join(dir, "task"))
	answers := filepath.Join(task.Dir, "private", "answers.csv")
	// Made without care: every user may read the answers.
	if err := errors.Join(os.Chmod(filepath.Dir(answers), 0o755), os.Chmod(answers, 0o644)); err != nil {
		t.Fatal(err)
	}
	data := filepath.Join(dir, "wmrl-data")
	kept := filepath.Join(data, "archive", "run=default", "part-000000000000.parquet")
	if err := errors.Join(os.MkdirAll(filepath.Dir(kept), 0o755), os.WriteFile(kept, []byte("the anchors' code and scores"), 0o644)); err != nil {
		t.Fatal(err)
	}
	s := exe(task)
	s.Hide = []string{data}
	probe := fmt.Sprintf(`import os
res = []
for name, act in [("answers", lambda: "%%d bytes" %% len(open(%[1]q).read())), ("private", lambda: os.listdir(%[2]q)),
                  ("archive", lambda: "%%d bytes" %% len(open(%[3]q).read())), ("data", lambda: os.listdir(%[4]q)),
                  ("task", lambda: sorted(os.listdir(%[5]q)))]:
    try:
        res.append("%%s=%%s" %% (name, act()))
    except Exception as e:
        res.append(name + "=" + type(e).__name__)
raise SystemExit(" ".join(res))
`, answers, filepath.Dir(answers), kept, data, task.Dir)
	r := run1(t, s, probe)
	t.Logf("probe: %s", r.detail)
	want := "answers=FileNotFoundError private=[] archive=FileNotFoundError data=[] task=['generate.py', 'leaderboard.csv', 'private', 'public', 'task.json']"
	if !strings.Contains(r.detail, want) {
		t.Errorf("the code saw %q; want %q", r.detail, want)
	}
	if r := run1(t, s, solution(t, "03_interactions.py")); r.status != schemas.ExecScored || r.score < 0.99 {
		t.Errorf("the best solution, with the answers out of view: %s %v %s", r.status, r.score, r.detail)
	}
	if b, err := os.ReadFile(answers); err != nil || len(b) == 0 {
		t.Errorf("the answers on the host: %d bytes, %v", len(b), err)
	}
}

// TestWhatTheCodeNeedsToStartIsNotHidden: a virtualenv inside wmrl's
// data directory, hidden from the code, would fail every execution as a
// sandbox error; the check before the run starts says which path is where.
func TestWhatTheCodeNeedsToStartIsNotHidden(t *testing.T) {
	needPrivateTmp(t)
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	data := t.TempDir()
	venv := filepath.Join(data, "venv", "bin")
	if err := errors.Join(os.MkdirAll(venv, 0o755), os.Symlink(python, filepath.Join(venv, "python"))); err != nil {
		t.Fatal(err)
	}
	task := housing(t)
	for _, c := range []struct {
		command []string
		hide    []string
		want    string
	}{
		{[]string{filepath.Join(venv, "python"), "solution.py"}, []string{data}, filepath.Join(venv, "python") + " is in " + data + ", which the code must not see"},
		{nil, []string{"/usr/"}, " is in /usr, which the code must not see"},
		{nil, []string{filepath.Join(task.Dir, "private", "..", "public")}, ""},
	} {
		s := exe(task)
		s.Command, s.Hide = c.command, c.hide
		_, err := s.Check(context.Background())
		if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%v hiding %v: %v; want %q", c.command, c.hide, err, c.want)
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

// A process that does not grade (the world model's, told the limits) reads
// task.json alone: it needs no private answers, which LoadTask does.
func TestTaskJSONAloneGivesTheLimits(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "task.json"), []byte(`{"name":"x","metric":"rmse","time_limit_seconds":1200,"memory_mb":4096}`), 0o644)
	task, err := ReadTaskJSON(dir)
	if err != nil || task.TimeLimitSeconds != 1200 || task.MemoryMB != 4096 || task.Submission != "submission.csv" {
		t.Fatalf("ReadTaskJSON: %+v, %v", task, err)
	}
	if _, err := LoadTask(dir); err == nil || !strings.Contains(err.Error(), "answers") {
		t.Fatalf("LoadTask without private answers: %v; want an error naming them", err)
	}
	os.WriteFile(filepath.Join(dir, "task.json"), []byte(`{"name":"x","metric":"mse"}`), 0o644)
	if _, err := ReadTaskJSON(dir); err == nil || !strings.Contains(err.Error(), `metric "mse"`) {
		t.Fatalf("a bad metric: %v", err)
	}
}

// A WorkParent that is not this user's own directory (a symlink planted
// in a shared /tmp, or another user's) is refused, naming it: whoever
// made it could list the executions in it.
func TestAWorkParentNotOfThisUserIsRefused(t *testing.T) {
	task := housing(t)
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	if err := os.Symlink(t.TempDir(), WorkParent()); err != nil {
		t.Fatal(err)
	}
	_, err := exe(task).Run(context.Background(), "print(1)\n")
	if err == nil || !strings.Contains(err.Error(), WorkParent()+" is not a directory of this process's user") {
		t.Fatalf("a symlink for the work parent: %v; want it refused, named", err)
	}
	// Its own, made too open (by an older wmrl, or by hand), is closed.
	os.Remove(WorkParent())
	if err := os.Mkdir(WorkParent(), 0o777); err != nil {
		t.Fatal(err)
	}
	if _, err := exe(task).Run(context.Background(), "print(1)\n"); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(WorkParent()); err != nil || fi.Mode().Perm() != 0o711 {
		t.Errorf("the work parent after a run: %v %v; want mode 0711", fi.Mode(), err)
	}
}
