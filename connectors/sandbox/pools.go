package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

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

// user is the uid an execution runs as (as root), and gives it back with
// free: one of UIDs to itself, claimed among every wmrl process on this
// machine (claimUID), else RunAs.
func (s *Subprocess) user(ctx context.Context) (uid uint32, free func(), err error) {
	if len(s.UIDs) == 0 || os.Geteuid() != 0 {
		if s.RunAs == 0 {
			return 65534, func() {}, nil
		}
		return s.RunAs, func() {}, nil
	}
	uids := &s.owner().uids
	waiting, counted := s.waitingFor("user"), false
	defer func() {
		if counted {
			waiting(-1)
		}
	}()
	for tried := 1; ; tried++ {
		tell := waiting
		if counted {
			tell = nil // counted as waiting already
		}
		if uid, err = uids.take(ctx, s.UIDs, tell); err != nil {
			return 0, nil, err
		}
		claim, err := claimUID(uid)
		if err != nil {
			uids.give(uid)
			return 0, nil, err
		}
		if claim != nil {
			return uid, func() { killUser(uid); unclaim(claim); uids.give(uid) }, nil
		}
		// Another process on this machine runs an execution as uid.
		uids.give(uid)
		if tried%len(s.UIDs) == 0 { // as many as there are: wait, try again
			if waiting != nil && !counted {
				waiting(1)
				counted = true
			}
			select {
			case <-ctx.Done():
				return 0, nil, ctx.Err()
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
}

// claimUID claims uid for an execution among every wmrl process on this
// machine: a flock on its file in UIDClaims, held until unclaim. It
// returns nil, and no error, when another process holds it.
//
// Users are taken back by killing whatever runs as them (killUser), so two
// processes drawing on one range of --exec-uids (two runs on one machine,
// a stage's two replicas) killed each other's executions when one ended,
// and a solution killed so scored 0 as crashed; running as one user at
// once, they could also read each other's files.
func claimUID(uid uint32) (*os.File, error) {
	dir := UIDClaims()
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, fmt.Errorf("sandbox: claiming a user: %w", err)
	}
	// One made by another user (under a /run/lock every user writes)
	// could be emptied by them.
	if fi, err := os.Lstat(dir); err != nil {
		return nil, fmt.Errorf("sandbox: claiming a user: %w", err)
	} else if st, ok := fi.Sys().(*syscall.Stat_t); !fi.IsDir() || !ok || int(st.Uid) != os.Geteuid() {
		return nil, fmt.Errorf("sandbox: %s, where wmrl processes claim the users of --exec-uids, is not a directory of this process's user (uid %d): remove it", dir, os.Geteuid())
	}
	path := filepath.Join(dir, strconv.FormatUint(uint64(uid), 10))
	f, err := os.OpenFile(path, os.O_RDONLY|os.O_CREATE|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("sandbox: claiming user %d: %w", uid, err)
	}
	for {
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err != syscall.EINTR {
			break
		}
	}
	switch {
	case err == nil:
		return f, nil
	case errors.Is(err, syscall.EWOULDBLOCK):
		f.Close()
		return nil, nil
	default:
		f.Close()
		return nil, fmt.Errorf("sandbox: claiming user %d: %w", uid, err)
	}
}

// unclaim gives a claimed user back. The flock goes with LOCK_UN, not only
// with the close: a child forked elsewhere in this process holds a copy
// of the descriptor until its exec.
func unclaim(f *os.File) {
	_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	f.Close()
}

// UIDClaims is the directory where wmrl processes on this machine claim
// the users of --exec-uids, a file each: /run/lock/wmrl-uids, the same for
// every process whatever its TMPDIR (/tmp/wmrl-uids without /run/lock).
func UIDClaims() string {
	if fi, err := os.Stat("/run/lock"); err == nil && fi.IsDir() {
		return "/run/lock/wmrl-uids"
	}
	return "/tmp/wmrl-uids"
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
