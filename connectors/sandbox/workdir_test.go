package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/sandbox/fusiontest"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
)

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
	srv, _ := fusiontest.Server(t, 0)
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

// A wmrl killed with an execution under way (SIGKILL, the OOM killer, a
// preempted node) takes the execution with it, and its work directory,
// which nothing else removes, goes at the next start, while one in use by
// another process is kept. Before, the code ran on with nothing to
// enforce its wall clock, holding its GPUs and its user for the restarted
// wmrl to give out again, and the directories, each with a copy of the
// task's data, piled up across restarts.
func TestAnExecutionEndsWithTheWmrlThatStartedIt(t *testing.T) {
	task := housing(t)
	mark := fmt.Sprintf("wmrl-killed-%d", rand.Int64())
	helper := exec.Command(os.Args[0], "-test.run=^TestHelperKilledWithAnExecution$", "-test.count=1", "-test.v")
	helper.Env = append(os.Environ(), "WMRL_TEST_KILLED_TASK="+task.Dir, "WMRL_TEST_KILLED_MARK="+mark)
	var out bytes.Buffer
	helper.Stdout, helper.Stderr = &out, &out
	if err := helper.Start(); err != nil {
		t.Fatal(err)
	}
	defer helper.Process.Kill()
	marked := filepath.Join(WorkParent(), workDirPrefix+"*", mark)
	deadline := time.Now().Add(30 * time.Second)
	for found, _ := filepath.Glob(marked); len(found) == 0; found, _ = filepath.Glob(marked) {
		if time.Now().After(deadline) {
			t.Fatalf("the helper's execution did not start in 30 s:\n%s", out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if len(withArg(mark)) == 0 {
		t.Fatal("no process carries the execution's mark: the test cannot tell")
	}
	helper.Process.Kill()
	helper.Wait()
	deadline = time.Now().Add(10 * time.Second)
	for len(withArg(mark)) > 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if left := withArg(mark); len(left) > 0 {
		for _, pid := range left {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		t.Fatalf("%d processes of the execution (%v) outlived the wmrl that started it by 10 s (%s)", len(left), left, Isolation())
	}

	// Another process's execution under way: its directory is held.
	live, held, err := newWorkDir()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { removeWorkDir(live); held.Close() }()
	stale, _ := filepath.Glob(marked)
	if len(stale) != 1 {
		t.Fatalf("the killed helper left %d directories with its mark, want 1", len(stale))
	}
	removed, size, err := RemoveLeftovers()
	if err != nil {
		t.Fatal(err)
	}
	if removed != 1 || size < blocksUnder(task.PublicDir(), "") {
		t.Errorf("RemoveLeftovers removed %d directories of %d bytes, want 1 of at least the task's data", removed, size)
	}
	if _, err := os.Stat(filepath.Dir(stale[0])); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the killed helper's directory is still there: %v", err)
	}
	if _, err := os.Stat(live); err != nil {
		t.Errorf("the directory of an execution under way was removed: %v", err)
	}
}

// The helper of TestAnExecutionEndsWithTheWmrlThatStartedIt: a wmrl with
// an execution under way, which that test kills.
func TestHelperKilledWithAnExecution(t *testing.T) {
	mark := os.Getenv("WMRL_TEST_KILLED_MARK")
	if mark == "" {
		t.Skip("run by TestAnExecutionEndsWithTheWmrlThatStartedIt")
	}
	task, err := LoadTask(os.Getenv("WMRL_TEST_KILLED_TASK"))
	if err != nil {
		t.Fatal(err)
	}
	s := exe(task)
	s.Limits.Timeout = 10 * time.Minute
	s.Command = []string{"python3", "solution.py", mark}
	r, err := s.Run(context.Background(), "import sys, time\nopen(sys.argv[1], 'w').close()\ntime.sleep(600)\n")
	t.Fatalf("the execution ended before this process was killed: %+v, %v", r, err)
}
