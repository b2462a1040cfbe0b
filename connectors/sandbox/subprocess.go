// Package sandbox runs candidate solutions for real, in the style of
// MLE-Dojo: a fresh working directory per execution holding the code and the
// task's public data, a wall-clock timeout, resource limits, its own process
// group killed whole, captured output with a size cap, and a grader that
// scores the submission file against the task's private answers.
package sandbox

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
)

// Limits bound one execution. Zero values take the task's own limits
// (task.json's time_limit_seconds and memory_mb), else the defaults.
type Limits struct {
	Timeout     time.Duration // wall clock (default 60s)
	MemoryBytes int64         // address space (default 1 GiB; < 0: none, as CUDA needs)
	// CPUSeconds is the code's CPU time, all its threads together (default:
	// the timeout times the cores, plus 1, so that code using every core
	// meets its wall clock first; the CPU limit is what stops code that
	// outlives its wall clock, as when wmrl itself is killed).
	CPUSeconds int
	OpenFiles  int // default 256
	// Processes bounds the processes and threads of the user the code runs
	// as (RLIMIT_NPROC), which stops a fork bomb. The kernel counts all of
	// that user's: every execution running at once, and wmrl's own threads
	// when it is not root (as root the code runs as nobody). Default:
	// DefaultProcesses(1); a process running several executions at once
	// wants DefaultProcesses of that many.
	Processes   int
	OutputBytes int // kept per stream, half its start and half its end (default 64 KiB)
	// DiskBytes bounds what the code keeps on disk in its directory (its
	// /tmp, where it has its own), the task's data apart: code that writes
	// past it is killed. Default 16 GiB; < 0: no limit. Without it, one
	// solution that writes in a loop fills the disk that the executions'
	// directories share with everything else on it (the NATS store, when
	// it is the same disk), and the run with it.
	DiskBytes int64
	// SubmissionBytes bounds the submission file the grader reads into
	// wmrl's memory (default 1 GiB): past it, the submission is invalid.
	SubmissionBytes int64
}

// DefaultDiskBytes is an execution's disk limit when none is set.
const DefaultDiskBytes = 16 << 30

// DefaultSubmissionBytes is the largest submission the grader reads when
// no limit is set.
const DefaultSubmissionBytes = 1 << 30

// DefaultProcesses is the process limit for slots executions at once
// as one user: 64 and 8 threads a core for each (BLAS, joblib and data
// loaders start a thread or a process per core). A flat 64 for everyone
// had 12 of 16 executions that each started 8 threads crash with "can't
// start new thread".
func DefaultProcesses(slots int) int { return max(1, slots) * (64 + 8*runtime.NumCPU()) }

// For is l with what it leaves at zero taken from the task, else from the
// defaults. t may be nil.
func (l Limits) For(t *Task) Limits {
	if l.Timeout == 0 && t != nil && t.TimeLimitSeconds > 0 {
		l.Timeout = time.Duration(t.TimeLimitSeconds * float64(time.Second))
	}
	if l.MemoryBytes == 0 && t != nil && t.MemoryMB != 0 {
		l.MemoryBytes = int64(t.MemoryMB) << 20
	}
	if l.Timeout == 0 {
		l.Timeout = 60 * time.Second
	}
	if l.MemoryBytes == 0 {
		l.MemoryBytes = 1 << 30
	}
	if l.CPUSeconds == 0 {
		l.CPUSeconds = int(math.Ceil(l.Timeout.Seconds()))*runtime.NumCPU() + 1
	}
	if l.OpenFiles == 0 {
		l.OpenFiles = 256
	}
	if l.Processes == 0 {
		l.Processes = DefaultProcesses(1)
	}
	if l.OutputBytes == 0 {
		l.OutputBytes = 64 << 10
	}
	if l.DiskBytes == 0 {
		l.DiskBytes = DefaultDiskBytes
	}
	if l.SubmissionBytes == 0 {
		l.SubmissionBytes = DefaultSubmissionBytes
	}
	return l
}

// String names the limits a run's executions get, for its log.
func (l Limits) String() string {
	disk := "no disk limit"
	if l.DiskBytes > 0 {
		disk = fmt.Sprintf("%d MiB on disk", l.DiskBytes>>20)
	}
	return fmt.Sprintf("wall clock %v, CPU time %d s, address space %s, %s, %d processes and threads for all at once", l.Timeout, l.CPUSeconds, l.addressSpace(), disk, l.Processes)
}

// ForCode is what the code may take, as the world model is told it: whether
// a solution finishes in time and memory is part of its outcome.
func (l Limits) ForCode() string {
	if l.MemoryBytes < 0 {
		return fmt.Sprintf("%v of wall clock, no memory limit", l.Timeout)
	}
	return fmt.Sprintf("%v of wall clock, %d MiB of memory (address space)", l.Timeout, l.MemoryBytes>>20)
}

// addressSpace is the address-space limit as ulimit -v takes it, and
// people read it.
func (l Limits) addressSpace() string {
	if l.MemoryBytes < 0 {
		return "unlimited"
	}
	return fmt.Sprintf("%d MiB", l.MemoryBytes>>20)
}

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
	// namespace ends anyway, where the kernel allows one).
	UIDs []uint32
	// GPUs are the sets of GPUs the executions at once share out: each
	// execution takes a free set (it waits for one) and sees only those,
	// as CUDA_VISIBLE_DEVICES (an index or a UUID each, as nvidia-smi
	// lists them). Empty: the code's environment does not name them, and
	// CUDA gives every execution every GPU of the machine.
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

// pool hands out items to the executions at once, one each, filled from
// a list on first use; take waits for a free one.
type pool[T any] struct {
	once sync.Once
	free chan T
}

// take waits for a free item of items (the pool's list) until ctx ends,
// telling waiting (if set) when it has to wait (+1) and when that ends
// (-1).
func (p *pool[T]) take(ctx context.Context, items []T, waiting func(delta int)) (T, error) {
	p.once.Do(func() {
		p.free = make(chan T, len(items))
		for _, it := range items {
			p.free <- it
		}
	})
	select {
	case it := <-p.free:
		return it, nil
	default:
	}
	if waiting != nil {
		waiting(1)
		defer waiting(-1)
	}
	select {
	case it := <-p.free:
		return it, nil
	case <-ctx.Done():
		var zero T
		return zero, ctx.Err()
	}
}

// waitingFor is Waiting for what, or nil.
func (s *Subprocess) waitingFor(what string) func(int) {
	if s.Waiting == nil {
		return nil
	}
	return func(delta int) { s.Waiting(what, delta) }
}

// give hands it back.
func (p *pool[T]) give(it T) { p.free <- it }

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
	run, err := s.run(ctx, "import sys; print(sys.executable, sys.version.split()[0])", false)
	switch {
	case err != nil:
		return "", err
	case !run.Started && !run.TimedOut:
		return "", fmt.Errorf("sandbox: python does not run as the code's user: %s", cmp.Or(run.Shell, lastLines(run.Stderr, 3)))
	case run.TimedOut || run.ExitCode != 0:
		return "", fmt.Errorf("sandbox: python does not run as the code's user (exit code %d): %s", run.ExitCode, lastLines(run.Stderr, 3))
	}
	return strings.TrimSpace(run.Stdout), nil
}

// checkHidden refuses a directory to hide that holds what the code needs
// to start: its interpreter, or the shell that starts it.
func (s *Subprocess) checkHidden() error {
	if !namespaceTools().privateTmp {
		return nil // nothing is hidden
	}
	interpreter := "python3"
	if len(s.Command) > 0 {
		interpreter = s.Command[0]
	}
	hidden, shared := s.hidden(), sharedDirs()
	for _, name := range []string{interpreter, "/bin/sh"} {
		path, ok := s.lookPath(name)
		if !ok {
			continue // the code's shell says so
		}
		paths := []string{path}
		if real, err := filepath.EvalSymlinks(path); err == nil {
			paths = append(paths, real)
		}
		for _, p := range paths {
			p, _ = filepath.Abs(p)
			for _, h := range hidden {
				if within(p, h) {
					return fmt.Errorf("sandbox: %s is in %s, which the code must not see (the task's answers, wmrl's data): put one or the other elsewhere", p, h)
				}
			}
			for _, d := range shared {
				if within(p, d) {
					return fmt.Errorf("sandbox: %s is in %s, which every user may write, so each execution gets an empty one of its own: put it elsewhere", p, d)
				}
			}
		}
	}
	return nil
}

// within reports whether path is dir or in it.
func within(path, dir string) bool {
	return path == dir || strings.HasPrefix(path, strings.TrimSuffix(dir, "/")+"/")
}

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
	return s.run(ctx, code, true)
}

// run is Run, with the task's public data copied in or not.
func (s *Subprocess) run(ctx context.Context, code string, data bool) (run Run, err error) {
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
	dir, err := newWorkDir()
	if err != nil {
		return Run{}, fmt.Errorf("sandbox: work dir: %w", err)
	}
	defer func() { run.Leftover = removeWorkDir(dir) }()
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
	run, err = s.start(ctx, dir, append([]string{"/bin/sh", "-c", script, "sandbox"}, cmdline...), true, uid, gpus)
	if errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EINVAL) {
		run, err = s.start(ctx, dir, append([]string{"/bin/sh", "-c", script, "sandbox"}, cmdline...), false, uid, gpus)
	}
	if err != nil {
		return Run{}, err
	}
	run.Submission, run.SubmissionErr = readSubmission(dir, s.Task.Submission, l.SubmissionBytes)
	return run, nil
}

// readSubmission reads the file name in dir, the code's, as the grader
// may take it: a file of at most limit bytes, in dir. The code made it
// and the grader runs as wmrl's user (root), so it is opened within dir
// (a symlink that leads out of it is not followed: it could point the
// grader at a file the code cannot read, such as a perfect submission),
// without waiting (a named pipe would block the open for ever), and read
// only if it is a regular file no larger than limit (a symlink to
// /dev/zero, or a file as large as the disk limit, would be read into
// wmrl's memory). Nil and no error: none written.
func readSubmission(dir, name string, limit int64) ([]byte, error) {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, fmt.Errorf("%s: the code's directory: %w", name, err)
	}
	defer root.Close()
	f, err := root.OpenFile(name, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOCTTY, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err // the path is the name
		}
		return nil, fmt.Errorf("%s cannot be read in the code's directory: %w", name, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	switch {
	case err != nil:
		return nil, fmt.Errorf("%s: %w", name, err)
	case !fi.Mode().IsRegular():
		return nil, fmt.Errorf("%s is not a file but a %s", name, fileKind(fi.Mode()))
	case fi.Size() > limit:
		return nil, overLimit(name, fi.Size(), limit)
	}
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	switch {
	case err != nil:
		return nil, fmt.Errorf("%s: %w", name, err)
	case int64(len(b)) > limit: // it grew: something the code left still writes
		return nil, fmt.Errorf("%s grew past the %d MiB a submission may be as it was read", name, limit>>20)
	}
	return b, nil
}

// overLimit says that the submission name is size bytes, over limit.
func overLimit(name string, size, limit int64) error {
	return fmt.Errorf("%s is %d MiB, over the %d MiB a submission may be", name, size>>20, limit>>20)
}

// fileKind names a file's type that is not a regular file's.
func fileKind(m fs.FileMode) string {
	switch {
	case m&fs.ModeDir != 0:
		return "directory"
	case m&fs.ModeNamedPipe != 0:
		return "named pipe"
	case m&fs.ModeSocket != 0:
		return "socket"
	case m&fs.ModeDevice != 0:
		return "device"
	}
	return m.Type().String()
}

// shellScript runs the command ("$@") under the limits (address space KiB,
// CPU seconds, open files, processes), set before it starts so that
// nothing the code starts escapes them.
//
// The shell stays, as the PID namespace's init (1), and runs the code as
// its child: an init ignores the signals it has no handler for, even its
// own (a solution's os.abort() would not end it), and when the init ends
// the kernel kills and reaps everything left in the namespace.
//
// It reports on fd 3, which the code does not get, whether the code ran
// ("ran STATUS") or why it could not start: the code's own output cannot
// pass for the shell's (an "ungraded" sandbox error, where failing code
// scores 0, would be a reward a policy could learn to claim).
const shellScript = `ulimit -v %s && ulimit -t %d && ulimit -n %d && ulimit -p %d || { echo "its limits could not be set" >&3; exit 1; }
p=$(command -v "$1") && [ -x "$p" ] || { echo "$1 is not found or not executable by user $(id -u)" >&3; exit 127; }
"$@" 3>&-
s=$?
echo "ran $s" >&3
exit $s`

// prepare writes the code and a read-only copy of the public data (an
// empty data/ without withData).
func (s *Subprocess) prepare(dir, code string, withData bool, uid uint32) error {
	if err := os.WriteFile(filepath.Join(dir, "solution.py"), []byte(code), 0o644); err != nil {
		return fmt.Errorf("sandbox: write solution: %w", err)
	}
	data := filepath.Join(dir, "data")
	if err := os.Mkdir(data, 0o755); err != nil {
		return fmt.Errorf("sandbox: data dir: %w", err)
	}
	dirs := []string{data}
	if withData {
		err := s.Task.walkPublic(func(path, rel string, dir bool) error {
			dst := filepath.Join(data, filepath.FromSlash(rel))
			if dir {
				dirs = append(dirs, dst)
				return os.Mkdir(dst, 0o755)
			}
			return copyFile(dst, path)
		})
		if err != nil {
			return fmt.Errorf("sandbox: public data: %w", err)
		}
	}
	for _, d := range slices.Backward(dirs) {
		if err := os.Chmod(d, 0o555); err != nil {
			return err
		}
	}
	if os.Geteuid() == 0 {
		if err := os.Chown(dir, int(uid), int(uid)); err != nil {
			return fmt.Errorf("sandbox: hand the work dir to uid %d: %w", uid, err)
		}
	}
	return nil
}

// WorkParent is the directory, under TMPDIR, that every execution's own
// directory is made in: wmrl-execs-<uid>, one per user that runs wmrl.
// Only that user may list it: code run as another user (nobody, or one of
// --exec-uids) enters its own directory, whose path it knows, but cannot
// find another's, whose name carries 128 random bits. An RL policy that
// learned to read a concurrent candidate's submission would be rewarded
// for it.
func WorkParent() string {
	return filepath.Join(os.TempDir(), fmt.Sprintf("wmrl-execs-%d", os.Geteuid()))
}

// newWorkDir makes an execution's directory in WorkParent.
func newWorkDir() (string, error) {
	parent := WorkParent()
	if err := os.Mkdir(parent, 0o711); err != nil && !errors.Is(err, fs.ErrExist) {
		return "", err
	}
	// One made by another user (in a /tmp every user writes) could be
	// listed, or replaced, by them.
	fi, err := os.Lstat(parent)
	if err != nil {
		return "", err
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); !fi.IsDir() || !ok || int(st.Uid) != os.Geteuid() {
		return "", fmt.Errorf("%s is not a directory of this process's user (uid %d): remove it, or set TMPDIR to a directory of this user's", parent, os.Geteuid())
	}
	if fi.Mode().Perm() != 0o711 {
		if err := os.Chmod(parent, 0o711); err != nil {
			return "", err
		}
	}
	var name [16]byte
	rand.Read(name[:])
	dir := filepath.Join(parent, "wmrl-exec-"+hex.EncodeToString(name[:]))
	if err := os.Mkdir(dir, 0o700); err != nil {
		return "", err
	}
	return dir, nil
}

// removeWorkDir removes an execution's directory. Its data/ is read-only,
// the code may have made read-only directories of its own, and a user
// other than root cannot unlink from a read-only directory: every
// directory is made writable first (as it is reached, before it is read),
// within dir: should something of the code's still run there (where there
// is no PID namespace to end it) and swap a directory for a symlink, the
// change cannot reach outside.
func removeWorkDir(dir string) error {
	if root, err := os.OpenRoot(dir); err == nil {
		filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
			if rel, relErr := filepath.Rel(dir, path); err == nil && relErr == nil && d.IsDir() {
				root.Chmod(rel, 0o700)
			}
			return nil
		})
		root.Close()
	}
	return os.RemoveAll(dir)
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

// copyFile copies src to a new read-only dst in the kernel
// (copy_file_range), never holding the file in memory: an ML task's data
// can be gigabytes, and every execution slot copies it.
func copyFile(dst, src string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o444)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// limits are the configured limits with the task's and the defaults filled
// in. The executor is shared by concurrent executions: nothing here writes
// to it.
func (s *Subprocess) limits() Limits { return s.Limits.For(s.Task) }

// user is the uid an execution runs as (as root), and gives it back with
// free: one of UIDs to itself, else RunAs.
func (s *Subprocess) user(ctx context.Context) (uid uint32, free func(), err error) {
	if len(s.UIDs) == 0 || os.Geteuid() != 0 {
		if s.RunAs == 0 {
			return 65534, func() {}, nil
		}
		return s.RunAs, func() {}, nil
	}
	uids := &s.owner().uids
	if uid, err = uids.take(ctx, s.UIDs, s.waitingFor("user")); err != nil {
		return 0, nil, err
	}
	return uid, func() { killUser(uid); uids.give(uid) }, nil
}

// gpuSet takes a free set of GPUs for an execution, waiting for one, and
// the func that gives it back (nil, without GPUs shared out).
func (s *Subprocess) gpuSet(ctx context.Context) (gpus []string, free func(), err error) {
	if len(s.GPUs) == 0 {
		return nil, func() {}, nil
	}
	sets := &s.owner().gpus
	if gpus, err = sets.take(ctx, s.GPUs, s.waitingFor("gpus")); err != nil {
		return nil, nil, err
	}
	return gpus, func() { sets.give(gpus) }, nil
}

// MachineGPUs counts the machine's NVIDIA GPUs by their device files
// (/dev/nvidia0, /dev/nvidia1, ...), for a run's log.
func MachineGPUs() int {
	n := 0
	devs, _ := filepath.Glob("/dev/nvidia[0-9]*")
	for _, d := range devs {
		if _, err := strconv.Atoi(strings.TrimPrefix(d, "/dev/nvidia")); err == nil {
			n++
		}
	}
	return n
}

// killUser kills every process of uid, until none is left: what an
// execution with a user of its own left running (a process that left its
// group with setsid, say) must not meet the next execution as that user.
func killUser(uid uint32) {
	for range 50 {
		found := false
		entries, _ := os.ReadDir("/proc")
		for _, e := range entries {
			pid, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			// Its real uid, from status: /proc/PID itself belongs to root
			// for a process that changed its user, as the code's did.
			status, err := os.ReadFile("/proc/" + e.Name() + "/status")
			if err != nil || !hasUID(status, uid) {
				continue // gone, or another user's
			}
			// A zombie is dead already, and waits for a parent (wmrl, in a
			// container where it is PID 1) to reap it.
			stat, _ := os.ReadFile("/proc/" + e.Name() + "/stat")
			if i := bytes.LastIndexByte(stat, ')'); i >= 0 && i+2 < len(stat) && (stat[i+2] == 'Z' || stat[i+2] == 'X') {
				continue
			}
			found = true
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		if !found {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// hasUID reports whether a /proc/PID/status names uid as the process's
// real user ("Uid:\treal\teffective\tsaved\tfs").
func hasUID(status []byte, uid uint32) bool {
	for line := range bytes.Lines(status) {
		if rest, ok := bytes.CutPrefix(line, []byte("Uid:")); ok {
			f := bytes.Fields(rest)
			return len(f) > 0 && string(f[0]) == strconv.FormatUint(uint64(uid), 10)
		}
	}
	return false
}

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
// root; isolate puts it in network, PID and IPC namespaces of its own.
func (s *Subprocess) start(ctx context.Context, dir string, argv []string, isolate bool, uid uint32, gpus []string) (Run, error) {
	attr := &syscall.SysProcAttr{Setpgid: true}
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
	timer := time.NewTimer(l.Timeout)
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

// diskEvery is how often watchDisk measures: code writing a GB/s passes
// its limit by about half a GB before it is stopped.
const diskEvery = 500 * time.Millisecond

// watchDisk measures what is on disk in dir, its data/ apart (read-only to
// the code), every diskEvery, and sends the size on full once it is over
// limit (< 0: none). It stops when the returned func is called.
func watchDisk(dir string, limit int64, full chan<- int64) (stop func()) {
	if limit < 0 {
		return func() {}
	}
	quit := make(chan struct{})
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		tick := time.NewTicker(diskEvery)
		defer tick.Stop()
		for {
			select {
			case <-quit:
				return
			case <-tick.C:
				if n := diskUse(dir); n > limit {
					full <- n
					return
				}
			}
		}
	}()
	return func() { close(quit); <-ended }
}

// diskUse is the disk space the files under dir take (their blocks: a
// sparse file counts what it holds), but for dir's data/.
func diskUse(dir string) int64 {
	var n int64
	data := filepath.Join(dir, "data")
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		switch {
		case err != nil:
			return nil // gone while walked, or unreadable: what is left counts
		case d.IsDir() && path == data:
			return filepath.SkipDir
		}
		if info, err := d.Info(); err == nil {
			if st, ok := info.Sys().(*syscall.Stat_t); ok {
				n += st.Blocks * 512
			}
		}
		return nil
	})
	return n
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

// unshareFlags puts the code in PID, network, mount and IPC namespaces of
// its own, with a /proc of its PID namespace. The mount namespace's mounts
// are private (unshare's default propagation): none of them reaches the
// host. The IPC namespace holds the System V shared memory, semaphores and
// message queues the code makes, which outlive their process: on the
// host's, what code killed at its limit left stayed for as long as the
// machine ran, and the next execution found it by its key. The namespace
// goes, with all of them, when the code's last process ends.
var unshareFlags = []string{"--pid", "--net", "--mount", "--ipc", "--fork", "--kill-child", "--mount-proc", "--"}

// privateTmpScript runs as root in the new mount namespace, before the
// drop to the code's user: the work directory ($1) becomes the code's
// /tmp and /var/tmp, /dev/shm a tmpfs of its own (of $3 bytes, when set),
// and the directory the work directories are made in ($2) an empty,
// read-only one. Code that writes a fixed path such as /tmp/model.pt
// (solutions often do) then writes into its own directory, where two
// executions at once cannot overwrite each other's file, and it is
// removed with that directory: a run of days leaves nothing in the
// host's /tmp or /dev/shm, where nothing would clean it. It cannot reach
// another execution's directory even knowing its path, as the same user.
// The $4 paths after those are what the code needs of the host's /tmp
// and /var/tmp (keptInTmp: an interpreter there): each is bound into the
// work directory under its name there first, and comes along with it.
// The work directory may itself be under /tmp: it is bound there first,
// and its old path is gone from view with the parent. The count and the
// directories after those are what the code must not see (hidden): each
// that exists becomes an empty, read-only one too. The count and the
// directories after those are the host's other directories every user
// may write (sharedDirs): each becomes an empty one of the code's own, of
// 16 MiB. Why a mount fails
// is said on fd 3, as the code's shell says why the code did not start.
// The mounts are private to the namespace (unshare's default): none of
// them reaches the host, where the work directory is then removed.
// privateTmpArgs is its command line.
const privateTmpScript = `w=$1 parent=$2 shm=$3 n=$4; shift 4
m() { what=$1; shift; out=$(mount "$@" 2>&1) || { echo "its own $what could not be mounted: ${out%%
*}" >&3; exit 1; }; }
while [ "$n" -gt 0 ]; do
  k=$1 n=$((n - 1)); shift
  at=$w/${k##*/}
  { if [ -d "$k" ]; then mkdir "$at"; else : >"$at"; fi; } 2>/dev/null || { echo "its own /tmp cannot show $k: its work directory has a ${at##*/}" >&3; exit 1; }
  m "view of $k" --bind "$k" "$at"
done
n=$1; shift
m /tmp --rbind "$w" /tmp
[ ! -d /var/tmp ] || m /var/tmp --rbind /tmp /var/tmp
[ ! -d /dev/shm ] || m /dev/shm -t tmpfs -o "nosuid,nodev,mode=1777${shm:+,size=$shm}" wmrl-shm /dev/shm
[ ! -d "$parent" ] || m "view of $parent" -t tmpfs -o ro,mode=0755,size=4k wmrl-hidden "$parent"
while [ "$n" -gt 0 ]; do
  h=$1 n=$((n - 1)); shift
  [ ! -d "$h" ] || m "view of $h" -t tmpfs -o ro,mode=0755,size=4k wmrl-hidden "$h"
done
n=$1; shift
while [ "$n" -gt 0 ]; do
  d=$1 n=$((n - 1)); shift
  [ ! -d "$d" ] || m "$d" -t tmpfs -o "nosuid,nodev,mode=1777,size=16m" wmrl-shared "$d"
done
cd /tmp && exec "$@"`

// privateTmpArgs runs privateTmpScript, and then the command that follows
// them, with work as the code's /tmp, parent hidden, a /dev/shm of shm
// bytes ("": tmpfs's default), keep in view and hide out of it.
func privateTmpArgs(work, parent, shm string, keep, hide, shared []string) []string {
	args := []string{"/bin/sh", "-c", privateTmpScript, "wmrl-private-tmp", work, parent, shm, strconv.Itoa(len(keep))}
	args = append(append(args, keep...), strconv.Itoa(len(hide)))
	args = append(append(args, hide...), strconv.Itoa(len(shared)))
	return append(args, shared...)
}

// sharedDirs are the host's directories, beside /tmp, /var/tmp and
// /dev/shm, that every user may write: /run/lock, /var/crash and the
// like, looked for among the entries of the places they are made in.
// Code wrote there past its disk limit, which counts only its own
// directory, and what it left stayed for the next execution to find.
func sharedDirs() []string {
	var dirs []string
	for _, parent := range []string{"/", "/run", "/var", "/var/lib", "/var/cache", "/dev", "/srv", "/opt", "/home", "/mnt", "/media"} {
		entries, _ := os.ReadDir(parent)
		for _, e := range entries {
			path := filepath.Join(parent, e.Name())
			if !e.IsDir() || slices.Contains([]string{"/tmp", "/var/tmp", "/dev/shm", "/proc", "/sys"}, path) {
				continue // a symlink is not a directory here: where it leads is looked at, or not, as itself
			}
			if fi, err := e.Info(); err == nil && fi.Mode().Perm()&0o002 != 0 {
				dirs = append(dirs, path)
			}
		}
	}
	return dirs
}

// hidden is what the code must not see, as absolute paths: the task's
// private/ (its answers) and Hide.
func (s *Subprocess) hidden() []string {
	dirs := slices.Clone(s.Hide)
	if s.Task != nil && s.Task.Dir != "" {
		dirs = append(dirs, filepath.Join(s.Task.Dir, "private"))
	}
	var abs []string
	for _, d := range dirs {
		if a, err := filepath.Abs(d); err == nil && !slices.Contains(abs, a) {
			abs = append(abs, a)
		}
	}
	return abs
}

// keptInTmp is what of the host's /tmp and /var/tmp the code needs in its
// own: the top directory there that holds its interpreter (Command's
// first word, and where a symlink there points), such as a virtualenv
// made in /tmp. The code sees it at the same path.
func (s *Subprocess) keptInTmp() []string {
	if len(s.Command) == 0 || !filepath.IsAbs(s.Command[0]) {
		return nil
	}
	paths := []string{filepath.Clean(s.Command[0])}
	if real, err := filepath.EvalSymlinks(paths[0]); err == nil {
		paths = append(paths, real)
	}
	var keep []string
	for _, p := range paths {
		for _, root := range []string{"/tmp/", "/var/tmp/"} {
			if rest, ok := strings.CutPrefix(p, root); ok {
				top, _, _ := strings.Cut(rest, "/")
				if k := root + top; !slices.ContainsFunc(keep, func(have string) bool { return filepath.Base(have) == top }) {
					keep = append(keep, k)
				}
			}
		}
	}
	return keep
}

// shmSize is the size of the code's own /dev/shm: its memory limit, when
// it has one ("" leaves tmpfs's default, half the machine's memory).
func (l Limits) shmSize() string {
	if l.MemoryBytes > 0 {
		return strconv.FormatInt(l.MemoryBytes, 10)
	}
	return ""
}

// namespaceTools finds util-linux's unshare and setpriv, and tries them
// once: as root, and otherwise in a user namespace of their own, where the
// kernel (or container) allows that. It tries the private /tmp as well
// (mount, in the new mount namespace), and without it when that fails.
func namespaceTools() *nsSupport {
	nsTools.once.Do(func() {
		unshare, err1 := exec.LookPath("unshare")
		setpriv, err2 := exec.LookPath("setpriv")
		if err1 != nil || err2 != nil {
			return
		}
		ns := &nsTools
		ns.unshare, ns.setpriv, ns.userNS = unshare, setpriv, os.Geteuid() != 0
		try := func(argv ...string) bool {
			argv = append(append(append(ns.flags(), argv...), ns.drop(65534)...), "/bin/sh", "-c", "exit 0")
			return exec.Command(unshare, argv...).Run() == nil
		}
		if dir, err := os.MkdirTemp("", "wmrl-ns-probe-"); err == nil {
			ns.privateTmp = try(privateTmpArgs(dir, filepath.Join(dir, "parent"), "1048576", nil, nil, nil)...)
			os.Remove(dir)
		}
		ns.ok = ns.privateTmp || try()
	})
	return &nsTools
}

// nsSupport is what namespaceTools found.
type nsSupport struct {
	once             sync.Once
	unshare, setpriv string
	ok               bool // namespaces, through unshare and setpriv
	privateTmp       bool // and the code's own /tmp, /var/tmp and /dev/shm
	// userNS: wmrl is not root, and the namespaces are those of a user
	// namespace of their own, where the code runs as its root, which is
	// wmrl's user outside, with no capabilities: it cannot undo the
	// mounts that hide the host's /tmp.
	userNS bool
}

// flags are unshare's flags for an execution's namespaces.
func (ns *nsSupport) flags() []string {
	if ns.userNS {
		return append([]string{"--user", "--map-root-user"}, unshareFlags...)
	}
	return slices.Clone(unshareFlags)
}

// drop is setpriv's command line that runs the code as uid (as root), or
// as the user namespace's root without capabilities (not root), with
// no_new_privs either way: no setuid program gives privileges back.
func (ns *nsSupport) drop(uid uint32) []string {
	if ns.userNS {
		return []string{ns.setpriv, "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--"}
	}
	u := strconv.FormatUint(uint64(uid), 10)
	return []string{ns.setpriv, "--reuid", u, "--regid", u, "--clear-groups", "--no-new-privs", "--"}
}

var nsTools nsSupport

// Isolation says how executions are kept apart on this machine, for a
// run's log.
func Isolation() string {
	ns := namespaceTools()
	where := "in namespaces of its own"
	if ns.userNS {
		where = "in namespaces of its own, in a user namespace (as its root, which is this user outside, without capabilities)"
	}
	switch {
	case ns.privateTmp:
		return where + ": no network, its own processes and /proc, its own System V IPC, its directory as /tmp and /var/tmp, its own /dev/shm and other directories every user may write, the task's answers and wmrl's data out of view"
	case ns.ok:
		return where + ": no network, its own processes and /proc, its own System V IPC; the host's /tmp and /dev/shm, and the task's answers and wmrl's data where permissions let it (mount refused)"
	case os.Geteuid() == 0:
		return "in network, PID and IPC namespaces where the kernel allows them (no util-linux unshare and setpriv): the host's /proc, /tmp and /dev/shm"
	}
	return "not isolated (not root, and no user namespaces through util-linux unshare and setpriv here): network reachable, the host's /tmp and /dev/shm"
}
