package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/wmrl/wmrl/stages/flock"
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
// free: one of UIDs to itself, which no other wmrl process on the machine
// holds either (takeClaimed), else RunAs.
//
// A user is taken back by killing whatever runs as it (killUser). Two
// processes drawing on one range of --exec-uids (two runs on one machine,
// a stage's two replicas) each took the whole range as their own: the
// first execution to end as a user killed the other's, a solution that
// scored 0 as crashed, and the two ran as one user at once, each able to
// read the other's files.
func (s *Subprocess) user(ctx context.Context) (uid uint32, free func(), err error) {
	if len(s.UIDs) == 0 || os.Geteuid() != 0 {
		if s.RunAs == 0 {
			return 65534, func() {}, nil
		}
		return s.RunAs, func() {}, nil
	}
	uid, release, err := takeClaimed(ctx, &s.owner().uids, s.UIDs, s.waitingFor("user"), "uids", uidNames)
	if err != nil {
		return 0, nil, err
	}
	// Whatever runs as uid now was left by a wmrl killed with an execution
	// under way (a process that left its group outlives it where there is
	// no PID namespace): the claim says no execution is running as uid.
	// It would otherwise run beside the next execution, as its user, able
	// to read what that one writes.
	killUser(uid)
	return uid, func() { killUser(uid); release() }, nil
}

// gpuSet takes a free set of GPUs for an execution, waiting for one, and
// the func that gives it back (nil, without GPUs shared out). Another
// wmrl process on the machine given the same GPUs (another run) gave them
// out too: two trainings on one GPU, where one running out of the GPU's
// memory crashes and scores 0. A GPU is claimed on the machine
// (takeClaimed), each of a set's, so that processes that set them out
// differently ("0,1 | 2,3" and "0 | 1 | 2 | 3") wait for each other too.
func (s *Subprocess) gpuSet(ctx context.Context) (gpus []string, free func(), err error) {
	if len(s.GPUs) == 0 {
		return nil, func() {}, nil
	}
	return takeClaimed(ctx, &s.owner().gpus, s.GPUs, s.waitingFor("gpus"), "gpus", func(set []string) []string { return set })
}

// uidNames names uid's claim.
func uidNames(uid uint32) []string { return []string{strconv.FormatUint(uint64(uid), 10)} }

// Accounts names the accounts of /etc/passwd among uids. A user of UIDs
// must be one no account uses: every process of an execution's user is
// killed when the execution ends, so a range over an account's id (1000,
// or nobody's 65534) would kill its login's processes, or a service's.
func Accounts(uids []uint32) (map[uint32]string, error) {
	return accountsIn("/etc/passwd", uids)
}

// accountsIn is Accounts, from the passwd file at path.
func accountsIn(path string, uids []uint32) (map[uint32]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("sandbox: the accounts: %w", err)
	}
	in := map[uint32]bool{}
	for _, u := range uids {
		in[u] = true
	}
	found := map[uint32]string{}
	for line := range strings.Lines(string(b)) {
		f := strings.Split(strings.TrimSpace(line), ":") // name:password:uid:...
		if len(f) < 3 {
			continue
		}
		if u, err := strconv.ParseUint(f[2], 10, 32); err == nil && in[uint32(u)] {
			found[uint32(u)] = f[0]
		}
	}
	return found, nil
}

// HeldElsewhere lists the users of UIDs (as root) and the GPUs of GPUs
// that another wmrl process on this machine holds at this moment, for an
// execution of its own: executions here wait for them while it does. It
// is for a run's start, before its own executions hold any (those it
// would count too). An error says claims cannot be made at all.
func (s *Subprocess) HeldElsewhere() (users []uint32, gpus []string, err error) {
	heldElsewhere := func(kind, name string) (bool, error) {
		held, err := claimAll(kind, []string{name})
		unclaim(held)
		return held == nil && err == nil, err
	}
	if os.Geteuid() == 0 {
		for _, uid := range s.UIDs {
			switch held, err := heldElsewhere("uids", uidNames(uid)[0]); {
			case err != nil:
				return nil, nil, err
			case held:
				users = append(users, uid)
			}
		}
	}
	seen := map[string]bool{}
	for _, set := range s.GPUs {
		for _, g := range set {
			if seen[g] {
				continue
			}
			seen[g] = true
			switch held, err := heldElsewhere("gpus", g); {
			case err != nil:
				return nil, nil, err
			case held:
				gpus = append(gpus, g)
			}
		}
	}
	return users, gpus, nil
}

// takeClaimed takes a free item of p (whose list is items) that no other
// wmrl process of this user on the machine holds either: each of names(it)
// is claimed with a flock on its file in claimsDir(kind). It waits for
// one until ctx ends, telling waiting (if set) when it has to wait (+1)
// and when that ends (-1); release gives the claims up and the item back.
func takeClaimed[T any](ctx context.Context, p *pool[T], items []T, waiting func(int), kind string, names func(T) []string) (it T, release func(), err error) {
	counted := false
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
		if it, err = p.take(ctx, items, tell); err != nil {
			return it, nil, err
		}
		held, cerr := claimAll(kind, names(it))
		if cerr != nil {
			p.give(it)
			return it, nil, cerr
		}
		if held != nil {
			return it, func() { unclaim(held); p.give(it) }, nil
		}
		// Another process on the machine holds it.
		p.give(it)
		if tried%len(items) == 0 { // as many as there are: wait, try again
			if waiting != nil && !counted {
				waiting(1)
				counted = true
			}
			select {
			case <-ctx.Done():
				return it, nil, ctx.Err()
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
}

// claimAll claims every one of names, or none: nil, and no error, when
// another process holds one.
func claimAll(kind string, names []string) ([]*os.File, error) {
	dir, err := claimsDir(kind)
	if err != nil {
		return nil, err
	}
	held := make([]*os.File, 0, len(names))
	for _, name := range names {
		f, err := claim(filepath.Join(dir, url.PathEscape(name)))
		if err != nil || f == nil {
			unclaim(held)
			return nil, err
		}
		held = append(held, f)
	}
	return held, nil
}

// claim takes the flock of the file path, made if need be: nil, and no
// error, when another holds it.
func claim(path string) (*os.File, error) {
	f, err := flock.Open(path, os.O_RDONLY|os.O_CREATE|syscall.O_NOFOLLOW, 0o600, syscall.LOCK_EX|syscall.LOCK_NB)
	switch {
	case err == nil:
		return f, nil
	case errors.Is(err, syscall.EWOULDBLOCK):
		return nil, nil
	default:
		return nil, fmt.Errorf("sandbox: claim %s: %w", path, err)
	}
}

// unclaim gives claims up (flock.Release).
func unclaim(held []*os.File) {
	for _, f := range held {
		flock.Release(f)
	}
}

// claimsDir is the directory where the wmrl processes of this user on the
// machine claim what executions share out (kind: "uids", "gpus"), a file
// each: wmrl-<kind>-<euid> in /run/lock, the same for every process
// whatever its TMPDIR, else in /tmp where /run/lock is not there or not
// writable. It is made when it is not there, and refused when it is not
// this user's own: one made by another user could be emptied by them.
func claimsDir(kind string) (string, error) {
	name := fmt.Sprintf("wmrl-%s-%d", kind, os.Geteuid())
	var err error
	for _, base := range []string{"/run/lock", "/tmp"} {
		dir := filepath.Join(base, name)
		if err = os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
			continue // not there, or not writable: the next
		}
		fi, err := os.Lstat(dir)
		if err != nil {
			return dir, fmt.Errorf("sandbox: %w", err)
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); !fi.IsDir() || !ok || int(st.Uid) != os.Geteuid() {
			return dir, fmt.Errorf("sandbox: %s, where wmrl processes claim the %s they share out, is not a directory of this process's user (uid %d): remove it", dir, kind, os.Geteuid())
		}
		return dir, nil
	}
	return "", fmt.Errorf("sandbox: no directory to claim %s in: %w", kind, err)
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
