package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
)

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

// TestTwoProcessesShareUsersAndGPUs: each user of --exec-uids is taken
// back by killing whatever runs as it. Two wmrl processes on one machine
// given the same range (two runs, a stage's two replicas) ran executions
// as one user at once, and the first to end killed the other's: a
// solution that scored 0 as crashed by signal 9. Given the same GPUs, they
// ran two executions on one GPU at once. Each user and each GPU is now
// claimed machine-wide, and the other waits for it, counted as waiting
// for a user or for GPUs. Two executors with pools of their own stand for
// the two processes (a claim is a flock, which two opens of one file
// contend for in one process too); their GPU sets differ, and overlap.
func TestTwoProcessesShareUsersAndGPUs(t *testing.T) {
	task := housing(t)
	gpus := [][]string{{"wmrl-test-gpu-a", "wmrl-test-gpu-b"}, {"wmrl-test-gpu-b"}} // one set each
	for _, c := range []struct {
		what  string
		share func(s *Subprocess, i int)
	}{
		{"user", func(s *Subprocess, i int) { s.UIDs = []uint32{2000000113} }},
		{"gpus", func(s *Subprocess, i int) { s.GPUs = gpus[i : i+1] }},
	} {
		if c.what == "user" && os.Geteuid() != 0 {
			t.Log("users of their own need root: GPUs only")
			continue
		}
		var waits, waiting atomic.Int64
		count := func(what string, d int) {
			if what == c.what {
				waiting.Add(int64(d))
				if d > 0 {
					waits.Add(1)
				}
			}
		}
		var runs [2]Run
		var wg sync.WaitGroup
		for i := range runs {
			s := &Subprocess{Task: task, Limits: Limits{Timeout: 20 * time.Second}, Waiting: count}
			c.share(s, i)
			// The second runs longer: the first ends while it runs.
			code := fmt.Sprintf("import os, time\nprint(time.time())\ntime.sleep(%d)\nprint(time.time(), os.environ.get('CUDA_VISIBLE_DEVICES'))\n", 1+i)
			wg.Go(func() {
				var err error
				if runs[i], err = s.Run(context.Background(), code); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
		var spans [2][2]float64
		for i, r := range runs {
			var saw string
			if _, err := fmt.Sscan(r.Stdout, &spans[i][0], &spans[i][1], &saw); err != nil || !r.Started || r.ExitCode != 0 || r.Signal != 0 {
				t.Fatalf("%s: execution %d: exit code %d, signal %d, printed %q (%v); want both to run to their end", c.what, i+1, r.ExitCode, r.Signal, r.Stdout, err)
			}
			want := "None"
			if c.what == "gpus" {
				want = strings.Join(gpus[i], ",")
			}
			if saw != want {
				t.Errorf("%s: execution %d saw GPUs %s, want %s", c.what, i+1, saw, want)
			}
		}
		if spans[0][0] < spans[1][1] && spans[1][0] < spans[0][1] {
			t.Errorf("%s: the two ran at once: %v and %v", c.what, spans[0], spans[1])
		}
		if waits.Load() != 1 || waiting.Load() != 0 {
			t.Errorf("%s: waiting counted %d times, %d still; want the one that waited, once, and none left", c.what, waits.Load(), waiting.Load())
		}
	}
}

// TestTheCheckIsNotBoundBySolutionsWallClock: the check before a run gave
// python the solutions' wall clock. With one of a second, a python that
// took longer to start (a loaded machine: CI, at --exec-timeout 1s) failed
// the check, and the run was refused with unshare's words for its child's
// SIGKILL: "(exit code 1): unshare: sigprocmask unblock failed". The check
// now gives it checkWallClock at least; solutions keep their own.
func TestTheCheckIsNotBoundBySolutionsWallClock(t *testing.T) {
	venv, err := os.MkdirTemp("", "wmrl-slow-python-") // readable by the user the code runs as
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(venv) })
	os.Chmod(venv, 0o755)
	python := filepath.Join(venv, "python")
	os.WriteFile(python, []byte("#!/bin/sh\nsleep 2\nexec python3 \"$@\"\n"), 0o755)
	s := exe(housing(t))
	s.Command, s.Limits.Timeout = []string{python, "solution.py"}, time.Second
	if v, err := s.Check(context.Background()); err != nil || !strings.Contains(v, "python") {
		t.Fatalf("check of a python 2 s to start, with solutions' wall clock of 1 s: %q %v; want its version", v, err)
	}
	if r := run1(t, s, "print('hi')\n"); r.status != schemas.ExecTimedOut || r.detail != "killed after 1s, its wall-clock limit" {
		t.Errorf("a solution run by it: %s: %s; want killed at its own wall clock of 1 s", r.status, r.detail)
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
		"TestSystemVIPCIsTheExecutionsOwn", "TestDirectoriesEveryUserWritesAreTheExecutionsOwn",
		"TestAnExecutionEndsWithTheWmrlThatStartedIt"} {
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
