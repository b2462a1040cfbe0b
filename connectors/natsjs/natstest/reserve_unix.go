//go:build unix

package natstest

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
)

// reserve claims port for this process against the other test processes
// of the same run (go test runs packages at once, each in a process of its
// own, each drawing ports from the same range): an exclusive lock on a file
// named after the port in the temporary directory, held until the process
// ends. It reports false when another process holds it. Without the
// claim, a port one package's test had found free and not bound yet was
// bound by another package's test: "address already in use" (once in CI,
// TestFollowOutlivesARestartOfTheRun).
func reserve(port int) bool {
	dir := filepath.Join(os.TempDir(), "natstest-ports")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return true // no claims to be had: as before them
	}
	f, err := os.OpenFile(filepath.Join(dir, fmt.Sprint(port)), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return true
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return false
	}
	claims = append(claims, f) // kept open: the lock lasts as long as the process
	return true
}

var claims []*os.File
