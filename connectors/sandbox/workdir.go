package sandbox

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/wmrl/wmrl/stages/flock"
)

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

// newWorkDir makes an execution's directory in WorkParent and holds it:
// held keeps an exclusive flock on the directory until it is closed
// (after the directory is removed), which tells RemoveLeftovers, in this
// process or another, that it is in use. It is made under a shared flock
// of the parent, which a sweep takes exclusively, so that a sweep never
// finds a directory made and not yet held.
func newWorkDir() (dir string, held *os.File, err error) {
	parent, err := workParent()
	if err != nil {
		return "", nil, err
	}
	p, err := lockDir(parent, syscall.LOCK_SH)
	if err != nil {
		return "", nil, err
	}
	defer p.Close() // and its flock with it
	var name [16]byte
	rand.Read(name[:])
	dir = filepath.Join(parent, workDirPrefix+hex.EncodeToString(name[:]))
	if err := os.Mkdir(dir, 0o700); err != nil {
		return "", nil, err
	}
	if held, err = lockDir(dir, syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		os.Remove(dir)
		return "", nil, err
	}
	return dir, held, nil
}

// workDirPrefix begins the name of every execution's directory.
const workDirPrefix = "wmrl-exec-"

// workParent makes WorkParent when it is not there, and checks that it is
// this user's own, listable by no other.
func workParent() (string, error) {
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
	return parent, nil
}

// lockDir opens the directory path (not a symlink) and takes its flock
// how, again when a signal interrupts the wait; closing the file
// releases it.
func lockDir(path string, how int) (*os.File, error) {
	f, err := flock.Open(path, os.O_RDONLY|syscall.O_DIRECTORY|syscall.O_NOFOLLOW, 0, how)
	if errno := syscall.Errno(0); errors.As(err, &errno) { // the lock's (the open's names the path)
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return f, err
}

// RemoveLeftovers removes the work directories in WorkParent that no
// process holds: those whose wmrl was killed (SIGKILL, the OOM killer, a
// preempted node) before it could remove them, each with a copy of its
// task's data and up to the disk limit of what its code wrote. Nothing
// else removes them, and a run of days restarted now and then would fill
// the disk with them. The directories of other wmrl processes running on
// this machine as this user (`wmrl stage execute` started twice) are
// left alone: each process holds its own. It returns how many it removed
// and the disk space they took.
func RemoveLeftovers() (removed int, size int64, err error) {
	if _, err := os.Lstat(WorkParent()); errors.Is(err, fs.ErrNotExist) {
		return 0, 0, nil
	}
	parent, err := workParent()
	if err != nil {
		return 0, 0, err
	}
	p, err := lockDir(parent, syscall.LOCK_EX)
	if err != nil {
		return 0, 0, err
	}
	names, err := p.Readdirnames(-1)
	var stale []string
	for _, name := range names {
		if !strings.HasPrefix(name, workDirPrefix) {
			continue
		}
		dir := filepath.Join(parent, name)
		d, err := lockDir(dir, syscall.LOCK_EX|syscall.LOCK_NB)
		if err != nil {
			continue // held (an execution under way), gone, or not an execution's
		}
		defer d.Close() // held by this sweep until it is removed
		stale = append(stale, dir)
	}
	p.Close() // executions may start again while the sweep removes
	errs := []error{err}
	for _, dir := range stale {
		n := blocksUnder(dir, "")
		if err := removeWorkDir(dir); err != nil {
			errs = append(errs, err)
			continue
		}
		removed, size = removed+1, size+n
	}
	return removed, size, errors.Join(errs...)
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

// diskUse is the disk space the files under dir take, but for dir's data/.
func diskUse(dir string) int64 { return blocksUnder(dir, filepath.Join(dir, "data")) }

// blocksUnder is the disk space the files under dir take (their blocks: a
// sparse file counts what it holds), but for the directory except.
func blocksUnder(dir, except string) int64 {
	var n int64
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		switch {
		case err != nil:
			return nil // gone while walked, or unreadable: what is left counts
		case d.IsDir() && path == except:
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
