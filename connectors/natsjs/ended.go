//go:build linux

package natsjs

import (
	"errors"
	"os"
	"strings"
	"sync"
	"syscall"
)

// pidSpace names where this process's pid means something: the kernel's
// boot (a random id each boot) and the pid namespace (a container has its
// own), and MachineEnv's value if set. "" when /proc cannot say.
var pidSpace = sync.OnceValue(func() string {
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	ns, err := os.Readlink("/proc/self/ns/pid")
	if err != nil {
		return ""
	}
	space := strings.TrimSpace(string(boot)) + " " + ns
	if m := os.Getenv(MachineEnv); m != "" {
		space += " " + m
	}
	return space
})

// Ended reports whether h is a process of this process's pid space that
// is no longer running (false where that cannot be told): a holder
// killed (SIGKILL, the OOM killer) and started again on the same machine
// by its supervisor, or killed beside its standby. Its lease could only
// lapse, TTL after its last renewal, and until then the stage stood
// still. A pid taken by another process since reads as running: the
// lease lapses as before.
func (h Holder) Ended() bool {
	if h.PIDSpace == "" || h.PIDSpace != pidSpace() || h.PID <= 0 || h.PID == os.Getpid() {
		return false
	}
	return errors.Is(syscall.Kill(h.PID, 0), syscall.ESRCH)
}
