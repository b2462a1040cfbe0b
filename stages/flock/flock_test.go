package flock

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
)

// A lock given up while a child process holds a copy of its descriptor
// (one forked elsewhere in the process, an execution's sandbox, not yet
// at its exec; here one given the descriptor to keep) is free all the
// same: another open of the file takes it at once. Closed without the
// unlock, it stayed held as long as the child lived.
func TestAReleasedLockIsFreeWhateverAChildHolds(t *testing.T) {
	path := filepath.Join(t.TempDir(), "lock")
	f, err := Open(path, os.O_RDONLY|os.O_CREATE, 0o644, syscall.LOCK_EX|syscall.LOCK_NB)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Open(path, os.O_RDONLY, 0, syscall.LOCK_EX|syscall.LOCK_NB); !errors.Is(err, syscall.EWOULDBLOCK) {
		t.Fatalf("a second lock while the first is held: %v; want EWOULDBLOCK", err)
	}
	child := exec.Command("sleep", "60")
	child.ExtraFiles = []*os.File{f}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { child.Process.Kill(); child.Wait() }()
	Release(f)
	g, err := Open(path, os.O_RDONLY, 0, syscall.LOCK_EX|syscall.LOCK_NB)
	if err != nil {
		t.Fatalf("a lock, once the first was released with a child holding its descriptor: %v", err)
	}
	Release(g)
}
