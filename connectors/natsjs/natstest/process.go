package natstest

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"sync"
	"syscall"
	"testing"
	"time"
)

var (
	buildOnce sync.Once
	binary    string
	buildErr  error
)

// Binary is a nats-server executable of the version this module pins,
// built from the module cache (no network) into the temporary directory
// once per version and shared by test processes.
func Binary(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		version := "unknown"
		if bi, ok := debug.ReadBuildInfo(); ok {
			for _, d := range bi.Deps {
				if d.Path == "github.com/nats-io/nats-server/v2" {
					version = d.Version
				}
			}
		}
		dir := filepath.Join(os.TempDir(), "wmrl-natstest")
		binary = filepath.Join(dir, "nats-server-"+version)
		if _, err := os.Stat(binary); err == nil && version != "unknown" {
			return
		}
		if buildErr = os.MkdirAll(dir, 0o755); buildErr != nil {
			return
		}
		// Built under a name of its own, then renamed: test processes of
		// other packages may be building it at the same time.
		tmp := fmt.Sprintf("%s.%d", binary, os.Getpid())
		// The go on the PATH, as the other tests' builds: a test built
		// with -trimpath has no GOROOT of its own (runtime.GOROOT is "").
		cmd := exec.Command("go", "build", "-o", tmp, "github.com/nats-io/nats-server/v2")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build nats-server: %v\n%s", err, out)
			return
		}
		buildErr = os.Rename(tmp, binary)
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binary
}

// Process is a nats-server running as a process of its own, so that it can
// be killed the way a machine fails: no goodbye to its peers.
type Process struct {
	name, conf, log, addr string
	cmd                   *exec.Cmd
}

// Name is the server name from the configuration.
func (p *Process) Name() string { return p.name }

// StartProcess writes conf (a nats-server configuration) to a file and
// runs the server on it until the test ends. name is its server_name,
// addr its client host:port, which StartProcess waits for.
func StartProcess(t testing.TB, name, addr, conf string) *Process {
	t.Helper()
	dir := t.TempDir()
	p := &Process{name: name, addr: addr, conf: filepath.Join(dir, name+".conf"), log: filepath.Join(dir, name+".log")}
	if err := os.WriteFile(p.conf, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	p.Start(t)
	t.Cleanup(p.Kill)
	return p
}

// Start runs the server (again, after Kill: on the same store).
func (p *Process) Start(t testing.TB) {
	t.Helper()
	log, err := os.OpenFile(p.log, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close() // the process has its own descriptor
	p.cmd = exec.Command(Binary(t), "-c", p.conf)
	p.cmd.Stdout, p.cmd.Stderr = log, log
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", p.addr, time.Second)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			p.Kill()
			out, _ := os.ReadFile(p.log)
			t.Fatalf("%s: no clients accepted on %s after 30s:\n%s", p.name, p.addr, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Kill ends the process with SIGKILL and waits for it.
func (p *Process) Kill() {
	if p.cmd != nil && p.cmd.Process != nil {
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
		_ = p.cmd.Wait()
		p.cmd = nil
	}
}
