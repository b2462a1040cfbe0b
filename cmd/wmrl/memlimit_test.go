package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// memoryCgroup makes a cgroup v1 memory cgroup allowing limit bytes, or
// skips: it takes root and a writable cgroup file system. A process moves
// into it by writing its PID to the returned cgroup.procs.
func memoryCgroup(t *testing.T, limit int64) (procs string) {
	t.Helper()
	root := "/sys/fs/cgroup/memory"
	if os.Geteuid() != 0 {
		t.Skip("making a cgroup takes root")
	}
	if _, err := os.Stat(filepath.Join(root, "memory.limit_in_bytes")); err != nil {
		t.Skip("no cgroup v1 memory hierarchy at " + root)
	}
	dir := filepath.Join(root, fmt.Sprintf("wmrl-test-%d", os.Getpid()))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Skipf("cannot make a cgroup: %v", err)
	}
	t.Cleanup(func() {
		for range 50 { // its processes may take a moment to leave
			if os.Remove(dir) == nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Errorf("cgroup %s left behind", dir)
	})
	if err := os.WriteFile(filepath.Join(dir, "memory.limit_in_bytes"), []byte(strconv.FormatInt(limit, 10)), 0o644); err != nil {
		t.Fatal(err)
	}
	return filepath.Join(dir, "cgroup.procs")
}

// A run in a container (a cgroup with a memory limit) gives the Go runtime
// a soft limit of 90% of it and says so; AUTOMEMLIMIT sets another share,
// and GOMEMLIMIT set by hand is left as it is.
func TestARunFollowsItsContainersMemoryLimit(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	procs := memoryCgroup(t, 512<<20)
	bin := buildBinary(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	metrics := l.Addr().String()
	l.Close()
	run := func(env ...string) (first string, limit float64) {
		cmd := exec.Command("sh", "-c", `echo $$ > "$0" && exec "$@"`, procs, bin, "run", "--steps", "100000",
			"--data", t.TempDir(), "--listen", "127.0.0.1:0", "--metrics", metrics)
		cmd.Env = append(os.Environ(), env...)
		stdout, _ := cmd.StdoutPipe()
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { cmd.Process.Kill(); cmd.Wait() }()
		lines := bufio.NewScanner(stdout)
		if !lines.Scan() {
			t.Fatal("the run printed nothing")
		}
		first = lines.Text()
		go io.Copy(io.Discard, stdout)
		deadline := time.Now().Add(30 * time.Second)
		for limit == 0 && time.Now().Before(deadline) {
			resp, err := http.Get("http://" + metrics + "/metrics")
			if err != nil {
				time.Sleep(100 * time.Millisecond)
				continue
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			for _, l := range strings.Split(string(body), "\n") {
				if v, ok := strings.CutPrefix(l, "go_gc_gomemlimit_bytes "); ok {
					limit, _ = strconv.ParseFloat(v, 64)
				}
			}
		}
		return first, limit
	}
	first, limit := run()
	if want := 0.9 * (512 << 20); limit != float64(int64(want)) {
		t.Errorf("go_gc_gomemlimit_bytes %v in a cgroup of 512 MiB; want 90%%, %v", limit, int64(want))
	}
	if !strings.HasPrefix(first, "memory: the cgroup allows 512 MiB; the Go runtime collects garbage harder rather than grow its heap past 461 MiB") {
		t.Errorf("first line %q; want it to say the limit", first)
	}
	first, limit = run("AUTOMEMLIMIT=0.5")
	if limit != 256<<20 || !strings.Contains(first, "past 256 MiB (GOMEMLIMIT, 50% of it;") {
		t.Errorf("with AUTOMEMLIMIT=0.5: limit %v, first line %q; want half of 512 MiB, said so", limit, first)
	}
	first, limit = run("GOMEMLIMIT=300MiB")
	if limit != 300<<20 || strings.HasPrefix(first, "memory:") {
		t.Errorf("with GOMEMLIMIT=300MiB: limit %v, first line %q; want it left alone and nothing said", limit, first)
	}
}
