package sandbox

import (
	"bytes"
	"context"
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
