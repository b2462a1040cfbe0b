package sandbox

import (
	"fmt"
	"math"
	"runtime"
	"strconv"
	"time"
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

// shmSize is the size of the code's own /dev/shm: its memory limit, when
// it has one ("" leaves tmpfs's default, half the machine's memory).
func (l Limits) shmSize() string {
	if l.MemoryBytes > 0 {
		return strconv.FormatInt(l.MemoryBytes, 10)
	}
	return ""
}
