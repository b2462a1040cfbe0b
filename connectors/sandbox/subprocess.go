// Package sandbox runs candidate solutions for real, in the style of
// MLE-Dojo: a fresh working directory per execution holding the code and the
// task's public data, a wall-clock timeout, resource limits, its own process
// group killed whole, captured output with a size cap, and a grader that
// scores the submission file against the task's private answers.
package sandbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
)

// Subprocess executes trajectories' code as local processes.
type Subprocess struct {
	Task    *Task
	Command []string // default: python3 solution.py
	// Env is added to the code's environment (KEY=VALUE; it wins over the
	// base: PATH, HOME and TMPDIR (its work directory),
	// PYTHONDONTWRITEBYTECODE, LANG). When Command's
	// first word is a path, its directory leads PATH, as a virtualenv's
	// activation would have it.
	Env    []string
	Limits Limits
	// RunAs is the uid/gid the code runs as when wmrl runs as root
	// (default 65534, nobody): root ignores the process limit and can write
	// anywhere. Not root: the code runs as the current user.
	RunAs uint32
	// UIDs, as root, are users for the executions at once, one each (RunAs
	// is then unused; an execution waits for a free one). Sharing one user,
	// an execution can read and overwrite another's directory (its
	// submission): a policy can learn to. With a user of its own it
	// cannot, and every process left under that user when it ends is
	// killed, even one that left its process group (which its PID
	// namespace ends anyway, where the kernel allows one). Other wmrl
	// processes on the machine drawing on the same users wait for them
	// as this one's executions do (claimsDir).
	UIDs []uint32
	// GPUs are the sets of GPUs the executions at once share out: each
	// execution takes a free set (it waits for one) and sees only those,
	// as CUDA_VISIBLE_DEVICES (an index or a UUID each, as nvidia-smi
	// lists them). Empty: the code's environment does not name them, and
	// CUDA gives every execution every GPU of the machine. Other wmrl
	// processes of this user on the machine given the same GPUs wait for
	// them as this one's executions do (claimsDir).
	GPUs [][]string
	// Hide are directories the code must not see, beside the task's
	// private/ (always hidden): wmrl's own data, whose archive keeps every
	// anchor's code with its score, a policy could learn to find the best
	// and run it. Where the code has a mount namespace of its own with its
	// own /tmp (Isolation says), each is an empty, read-only directory
	// there; elsewhere only permissions keep it out.
	Hide []string
	// Waiting, if set, is told when an execution starts (+1) and stops
	// (-1) waiting because every user of UIDs ("user") or every set of
	// GPUs ("gpus") is taken: what holds executions back, for metrics.
	Waiting func(what string, delta int)

	uids  pool[uint32]
	gpus  pool[[]string]
	pools *Subprocess // ForTask's: whose uids and gpus to take from
}

var _ execute.Executor = (*Subprocess)(nil)

// Run is one execution's outcome before grading.
type Run struct {
	ExitCode int // 128 + the signal for code killed by one
	TimedOut bool
	// Signal killed the code (0: it exited); CPUSeconds is the CPU time it
	// used, user and system, all threads.
	Signal     syscall.Signal
	CPUSeconds float64
	// Leftover: the work directory could not be removed, and why.
	Leftover       error
	Stdout, Stderr string
	Seconds        float64
	Submission     []byte // nil: none written
	// SubmissionErr: the submission is not one the grader reads (not a
	// file in the code's directory, or over its limit), and why.
	SubmissionErr error
	// Isolated: the code ran in network and PID namespaces of its own (no
	// network; nothing it starts outlives it; it sees and can signal no
	// process outside).
	Isolated bool
	// OverDisk, when not 0, is what the code had written in its directory
	// when it was killed for passing its disk limit.
	OverDisk int64
	// Started: the code ran (ExitCode, Signal are then its own), as the
	// shell said on a channel the code cannot write; else Shell is what
	// the shell said about why it did not start.
	Started bool
	Shell   string
}

// Execute runs t.Response as the solution and grades its submission.
func (s *Subprocess) Execute(ctx context.Context, t schemas.Trajectory) (execute.Result, error) {
	run, err := s.Run(ctx, t.Response)
	if err != nil {
		if ctx.Err() != nil {
			return execute.Result{}, ctx.Err() // shutting down: retried elsewhere
		}
		return execute.Result{Status: schemas.ExecSandboxError, Detail: err.Error()}, nil
	}
	res := execute.Result{Seconds: run.Seconds}
	l := s.limits()
	tail := lastLines(run.Stderr, 5)
	switch {
	case run.TimedOut:
		res.Status, res.Detail = schemas.ExecTimedOut, fmt.Sprintf("killed after %v, its wall-clock limit", l.Timeout)
	case run.OverDisk > 0:
		res.Status, res.Detail = schemas.ExecCrashed, fmt.Sprintf("killed after writing %d MiB in its directory, over its disk limit of %d MiB",
			run.OverDisk>>20, l.DiskBytes>>20)
	case !run.Started:
		// The shell could not start the command (not found, not
		// executable by the code's user, no process left under the
		// limit): no fault of the code's, which may score on a rerun.
		why := cmp.Or(run.Shell, lastLines(run.Stderr, 2), fmt.Sprintf("its shell ended, with exit code %d, before it", run.ExitCode))
		return execute.Result{Status: schemas.ExecSandboxError, Detail: "could not start the code: " + why}, nil
	case run.Signal != 0 && run.CPUSeconds >= float64(l.CPUSeconds)-0.5:
		// The kernel kills code at its CPU limit with SIGKILL (soft and
		// hard limit are the same): a time limit, not a crash.
		res.Status, res.Detail = schemas.ExecTimedOut, fmt.Sprintf("killed after %.0f s of CPU time, its limit (%v of wall clock)",
			run.CPUSeconds, time.Duration(run.Seconds*float64(time.Second)).Round(time.Millisecond))
	case run.Signal != 0:
		res.Status, res.Detail = schemas.ExecCrashed, fmt.Sprintf("killed by signal %d (%v): %s", int(run.Signal), run.Signal, tail)
	case run.ExitCode != 0:
		res.Status, res.Detail = schemas.ExecCrashed, fmt.Sprintf("exit code %d: %s", run.ExitCode, tail)
		if strings.Contains(run.Stderr, "MemoryError") && l.MemoryBytes > 0 {
			res.Detail += fmt.Sprintf(" (its address space is limited to %d MiB)", l.MemoryBytes>>20)
		}
	case run.SubmissionErr != nil:
		res.Status, res.Detail = schemas.ExecInvalid, run.SubmissionErr.Error()
	case run.Submission == nil:
		res.Status, res.Detail = schemas.ExecInvalid, "no "+s.Task.Submission+" written"
	default:
		score, err := s.Task.Grade(run.Submission)
		if err != nil {
			res.Status, res.Detail = schemas.ExecInvalid, err.Error()
		} else {
			res.Status, res.Score = schemas.ExecScored, score
		}
	}
	if !run.Isolated {
		res.Detail = strings.TrimSpace(res.Detail + " (" + execute.NoteNotIsolated + ")")
	}
	if run.Leftover != nil {
		res.Detail = strings.TrimSpace(res.Detail + " (" + execute.NoteLeftover + run.Leftover.Error() + ")")
	}
	return res, nil
}

// Check runs a line of Python the way solutions are run, as their user,
// and returns what it printed (the interpreter's version), or why it did
// not run: a python that user cannot start would otherwise fail every
// execution.
func (s *Subprocess) Check(ctx context.Context) (string, error) {
	if err := s.checkHidden(); err != nil {
		return "", err
	}
	wall := max(s.limits().Timeout, checkWallClock)
	run, err := s.run(ctx, "import sys; print(sys.executable, sys.version.split()[0])", false, wall)
	switch {
	case err != nil:
		return "", err
	case run.TimedOut:
		return "", fmt.Errorf("sandbox: python, run as the code's user, did not print its version within %v", wall)
	case !run.Started:
		return "", fmt.Errorf("sandbox: python does not run as the code's user: %s", cmp.Or(run.Shell, lastLines(run.Stderr, 3)))
	case run.ExitCode != 0:
		return "", fmt.Errorf("sandbox: python does not run as the code's user (exit code %d): %s", run.ExitCode, lastLines(run.Stderr, 3))
	}
	return strings.TrimSpace(run.Stdout), nil
}

// checkWallClock is the least wall clock Check gives python to print its
// version. The check is no solution's run: a wall clock for quick
// solutions (one second) refused whole runs before they started, when
// python took longer than that to start on a loaded machine. Killed at
// its limit, util-linux's unshare before 2.39 did not even say so: it
// cannot pass on its child's SIGKILL, and says "sigprocmask unblock
// failed" instead.
const checkWallClock = 30 * time.Second

// lookPath finds name as the code's shell does, in the code's PATH.
func (s *Subprocess) lookPath(name string) (string, bool) {
	if strings.Contains(name, "/") {
		return name, true
	}
	for _, kv := range s.environ("", nil) {
		if dirs, ok := strings.CutPrefix(kv, "PATH="); ok {
			for _, dir := range filepath.SplitList(dirs) {
				path := filepath.Join(dir, name)
				if fi, err := os.Stat(path); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
					return path, true
				}
			}
		}
	}
	return "", false
}

// Run executes code in a fresh directory and returns what happened. An
// error means the sandbox itself failed (not the code).
func (s *Subprocess) Run(ctx context.Context, code string) (Run, error) {
	return s.run(ctx, code, true, s.limits().Timeout)
}

// run is Run, with the task's public data copied in or not, killed after
// wall of wall clock.
func (s *Subprocess) run(ctx context.Context, code string, data bool, wall time.Duration) (run Run, err error) {
	uid, free, err := s.user(ctx)
	if err != nil {
		return Run{}, err
	}
	defer free()
	gpus, freeGPUs, err := s.gpuSet(ctx)
	if err != nil {
		return Run{}, err
	}
	defer freeGPUs()
	dir, held, err := newWorkDir()
	if err != nil {
		return Run{}, fmt.Errorf("sandbox: work dir: %w", err)
	}
	defer func() {
		run.Leftover = removeWorkDir(dir)
		held.Close()
	}()
	if err := s.prepare(dir, code, data, uid); err != nil {
		return Run{}, err
	}
	cmdline := s.Command
	if len(cmdline) == 0 {
		cmdline = []string{"python3", "solution.py"}
	}
	l := s.limits()
	kib := "unlimited"
	if l.MemoryBytes > 0 {
		kib = fmt.Sprint(l.MemoryBytes / 1024)
	}
	script := fmt.Sprintf(shellScript, kib, l.CPUSeconds, l.OpenFiles, l.Processes)
	run, err = s.start(ctx, dir, append([]string{"/bin/sh", "-c", script, "sandbox"}, cmdline...), true, uid, gpus, wall)
	if errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EINVAL) {
		run, err = s.start(ctx, dir, append([]string{"/bin/sh", "-c", script, "sandbox"}, cmdline...), false, uid, gpus, wall)
	}
	if err != nil {
		return Run{}, err
	}
	run.Submission, run.SubmissionErr = readSubmission(dir, s.Task.Submission, l.SubmissionBytes)
	return run, nil
}

// environ is the code's environment in work directory dir, with the
// GPUs it may use (nil: no GPUs were shared out).
func (s *Subprocess) environ(dir string, gpus []string) []string {
	path := "/usr/local/bin:/usr/bin:/bin"
	if len(s.Command) > 0 && strings.Contains(s.Command[0], "/") {
		path = filepath.Dir(s.Command[0]) + ":" + path
	}
	// TMPDIR: what the code's libraries put in temporary files (tempfile,
	// joblib's memory maps) goes with its directory, not into a /tmp that
	// every execution shares and none cleans.
	env := []string{"PATH=" + path, "HOME=" + dir, "TMPDIR=" + dir, "PYTHONDONTWRITEBYTECODE=1", "LANG=C.UTF-8"}
	for _, kv := range s.Env {
		if gpus != nil && strings.HasPrefix(kv, "CUDA_VISIBLE_DEVICES=") {
			continue // the GPUs shared out win
		}
		key, _, _ := strings.Cut(kv, "=")
		env = slices.DeleteFunc(env, func(e string) bool { return strings.HasPrefix(e, key+"=") })
		env = append(env, kv)
	}
	if gpus != nil {
		env = append(env, "CUDA_VISIBLE_DEVICES="+strings.Join(gpus, ","))
	}
	return env
}

// limits are the configured limits with the task's and the defaults filled
// in. The executor is shared by concurrent executions: nothing here writes
// to it.
func (s *Subprocess) limits() Limits { return s.Limits.For(s.Task) }

// capped keeps the first and the last n/2 bytes written and counts what
// lies between: a solution's output is anyone's size, and what says why it
// failed (a traceback) comes last, after however many lines of training
// log it wrote to stderr first.
type capped struct {
	n       int
	head    []byte
	tail    []byte // the newest bytes; at most n - n/2 once trimmed
	dropped int
}

func (c *capped) Write(p []byte) (int, error) {
	written := len(p)
	if room := c.n/2 - len(c.head); room > 0 {
		k := min(room, len(p))
		c.head = append(c.head, p[:k]...)
		p = p[k:]
	}
	keep := c.n - c.n/2
	if len(p) >= keep {
		c.dropped += len(c.tail) + len(p) - keep
		c.tail = append(c.tail[:0], p[len(p)-keep:]...)
		return written, nil
	}
	c.tail = append(c.tail, p...)
	if len(c.tail) >= 2*keep { // trim now and then, not on every write
		cut := len(c.tail) - keep
		c.dropped += cut
		c.tail = c.tail[:copy(c.tail, c.tail[cut:])]
	}
	return written, nil
}

func (c *capped) String() string {
	keep := c.n - c.n/2
	tail, dropped := c.tail, c.dropped
	if len(tail) > keep {
		dropped += len(tail) - keep
		tail = tail[len(tail)-keep:]
	}
	if dropped == 0 {
		return string(c.head) + string(tail)
	}
	return fmt.Sprintf("%s\n[%d bytes dropped]\n%s", c.head, dropped, tail)
}

// start runs argv, a shell that runs the code as its child, as uid when
// root, for wall of wall clock at most; isolate puts it in network, PID
// and IPC namespaces of its own.
//
// What start starts is killed when wmrl dies, however it dies: killed
// (SIGKILL, the OOM killer) before its timer could stop the code, wmrl
// used to leave it running with nothing to enforce its wall clock, holding
// its GPUs and its user, which the restarted wmrl gives to the next
// execution. The kernel sends the parent-death signal when the thread
// that started the process ends, not the process: the goroutine stays on
// that thread until the process is reaped, so that the Go runtime cannot
// end the thread under it.
func (s *Subprocess) start(ctx context.Context, dir string, argv []string, isolate bool, uid uint32, gpus []string, wall time.Duration) (Run, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	attr := &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	l := s.limits()
	ns := namespaceTools()
	viaUnshare := isolate && ns.ok
	seen := dir // the work directory's path as the code sees it
	switch {
	case viaUnshare:
		// util-linux's unshare mounts a /proc of the namespace's own, which
		// the kernel's clone alone cannot: the code's os.getpid() is its
		// PID in the namespace, and psutil, joblib's workers and the like
		// look themselves up in /proc by it. setpriv then drops to uid,
		// with no_new_privs: no setuid program gives root back.
		drop := ns.drop(uid)
		if ns.privateTmp {
			drop = append(privateTmpArgs(dir, filepath.Dir(dir), l.shmSize(), s.keptInTmp(), s.hidden(), sharedDirs()), drop...)
			seen = "/tmp"
		}
		argv = append(append(append([]string{ns.unshare}, ns.flags()...), drop...), argv...)
	case isolate:
		attr.Cloneflags = syscall.CLONE_NEWNET | syscall.CLONE_NEWPID | syscall.CLONE_NEWIPC
		fallthrough
	default:
		if os.Geteuid() == 0 {
			attr.Credential = &syscall.Credential{Uid: uid, Gid: uid, NoSetGroups: true}
		}
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = dir
	cmd.Env = s.environ(seen, gpus)
	stdout, stderr := &capped{n: l.OutputBytes}, &capped{n: l.OutputBytes}
	cmd.Stdout, cmd.Stderr, cmd.Stdin = stdout, stderr, nil
	// A process that leaves the group with the output still open (a
	// daemon) would hold Wait until it ends: its output is cut instead.
	cmd.WaitDelay = time.Second
	cmd.SysProcAttr = attr
	said, w, err := os.Pipe() // the shell's fd 3
	if err != nil {
		return Run{}, fmt.Errorf("sandbox: %w", err)
	}
	defer said.Close()
	cmd.ExtraFiles = []*os.File{w}
	start := time.Now()
	err = cmd.Start()
	w.Close()
	if err != nil {
		return Run{}, fmt.Errorf("sandbox: start: %w", err)
	}
	shell := make(chan string, 1)
	go func() {
		b, _ := io.ReadAll(io.LimitReader(said, 4096))
		shell <- strings.TrimSpace(string(b))
	}()
	pgid := cmd.Process.Pid
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	timer := time.NewTimer(wall)
	defer timer.Stop()
	run := Run{Isolated: isolate}
	full := make(chan int64, 1)
	stopWatch := watchDisk(dir, l.DiskBytes, full)
	defer stopWatch()
	var werr error
	select {
	case werr = <-done:
	case <-timer.C:
		run.TimedOut = true
		stop(pgid, viaUnshare)
		werr = <-done
	case run.OverDisk = <-full:
		stop(pgid, viaUnshare)
		werr = <-done
	case <-ctx.Done():
		stop(pgid, viaUnshare)
		<-done
		return Run{}, ctx.Err()
	}
	killGroup(pgid) // whatever the code left behind
	run.Seconds = time.Since(start).Seconds()
	run.Stdout, run.Stderr = stdout.String(), stderr.String()
	var exit *exec.ExitError
	switch {
	case werr == nil || errors.Is(werr, exec.ErrWaitDelay):
	case errors.As(werr, &exit):
		run.ExitCode = exit.ExitCode()
		ws := exit.Sys().(syscall.WaitStatus)
		switch {
		case ws.Signaled(): // the shell itself (killed at a limit)
			run.Signal = ws.Signal()
			run.ExitCode = 128 + int(run.Signal)
		case run.ExitCode > 128 && run.ExitCode <= 128+64:
			// The shell's report of the code killed by a signal (a
			// solution exiting with such a code reads as one).
			run.Signal = syscall.Signal(run.ExitCode - 128)
		}
	default:
		return Run{}, fmt.Errorf("sandbox: wait: %w", werr)
	}
	run.CPUSeconds = (cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()).Seconds()
	// The shell and all it started are gone: the pipe is at its end.
	run.Shell = <-shell
	if strings.HasPrefix(run.Shell, "ran ") {
		run.Started, run.Shell = true, ""
	}
	return run, nil
}

// stop kills what start started, whose process group is pgid. Under
// unshare it kills the namespace's init alone, which takes everything in
// the namespace with it, and unshare reaps it and exits: killed with the
// group, unshare would die first, leaving the init to the nearest
// subreaper (PID 1 in a container, which reaps nothing it did not start)
// as a zombie.
func stop(pgid int, viaUnshare bool) {
	if viaUnshare {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pgid, pgid))
		if kids := strings.Fields(string(b)); err == nil && len(kids) > 0 {
			for _, k := range kids {
				if pid, err := strconv.Atoi(k); err == nil {
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
			return
		}
	}
	killGroup(pgid)
}

// killGroup kills the process group until it is empty: a process forking
// while the signal is delivered can leave a child the first kill missed.
func killGroup(pgid int) {
	for i := 0; i < 200; i++ {
		if err := syscall.Kill(-pgid, syscall.SIGKILL); errors.Is(err, syscall.ESRCH) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// lineBytes bounds each line of output quoted in a detail.
const lineBytes = 300

// lastLines is the end of a solution's output, for a detail.
func lastLines(s string, n int) string {
	return execute.LastLines(s, n, lineBytes)
}
