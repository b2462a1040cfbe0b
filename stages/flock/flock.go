// Package flock takes and gives up advisory file locks (flock(2)): the
// embedded server's store, the archive's merges and reads, and the
// sandbox's work directories and claimed users and GPUs. The kernel
// releases them when the process dies, so a killed wmrl leaves none.
package flock

import (
	"os"
	"syscall"
)

// Open opens path with flag (os.O_CREATE among them to make it, as perm)
// and takes its flock how (syscall.LOCK_SH or LOCK_EX, with LOCK_NB not
// to wait). The error is the system's, unwrapped, so that a caller can
// tell a lock another holds (syscall.EWOULDBLOCK, with LOCK_NB).
func Open(path string, flag int, perm os.FileMode, how int) (*os.File, error) {
	f, err := os.OpenFile(path, flag, perm)
	if err != nil {
		return nil, err
	}
	if err := Lock(f, how); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// Lock takes f's flock how, again when a signal interrupts the wait.
func Lock(f *os.File, how int) error {
	for {
		if err := syscall.Flock(int(f.Fd()), how); err != syscall.EINTR {
			return err
		}
	}
}

// Release gives f's flock up and closes f. The unlock is explicit: a
// child forked anywhere in this process (a sandboxed execution) holds a
// copy of every descriptor from its fork until its exec, and a close
// alone would leave the lock held until then.
func Release(f *os.File) {
	_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	f.Close()
}
