package main

import (
	"context"
	"fmt"
	"net/http"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
	"github.com/wmrl/wmrl/stages/stagetest"
)

// freePort is a loopback address nothing listens on, below the ephemeral
// range (natstest.FreePort says why).
func freePort(t *testing.T) string {
	t.Helper()
	return fmt.Sprintf("127.0.0.1:%d", natstest.FreePort(t))
}

// proc is a started process of the binary: its output, and done closed
// (with err set) when it ends.
type proc struct {
	out  lockedBuffer
	done chan struct{}
	err  error
}

// started runs cmd with its output in a buffer; the test kills it when it
// ends.
func started(t *testing.T, cmd *exec.Cmd) *proc {
	t.Helper()
	p := &proc{done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = &p.out, &p.out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-p.done })
	return p
}

// waitHTTP waits up to a minute for url to answer, failing at once if the
// process serving it ends, with that process's output.
func waitHTTP(t *testing.T, url string, p *proc) {
	t.Helper()
	client := http.Client{Timeout: 10 * time.Second}
	deadline := time.Now().Add(time.Minute)
	for {
		resp, err := client.Get(url)
		if err == nil {
			resp.Body.Close()
			return
		}
		select {
		case <-p.done:
			t.Fatalf("%s: the process ended (%v) before answering; its output:\n%s", url, p.err, p.out.String())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never answered (%v); its output:\n%s", url, err, p.out.String())
		}
	}
}

// lockedBuffer collects a process's output while the test reads it.
type lockedBuffer = stagetest.Output

// TestPythonTrainerAgainstTheBinary runs the Python client as a trainer
// against `wmrl run --source external --http`, then through `wmrl serve`
// fronting the same pipeline from another process.
func TestPythonTrainerAgainstTheBinary(t *testing.T) {
	py, err := exec.LookPath("python3")
	if testing.Short() || err != nil {
		t.Skip("needs the binary and python3")
	}
	bin := buildBinary(t)
	natsAddr, runHTTP, serveHTTP := freePort(t), freePort(t), freePort(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	run := started(t, exec.CommandContext(ctx, bin, "run", "--source", "external", "--data", t.TempDir(), "--listen", natsAddr, "--http", runHTTP, "--quiet"))
	waitHTTP(t, "http://"+runHTTP+"/v1/runs/default/calibration", run)
	serve := started(t, exec.CommandContext(ctx, bin, "serve", "--nats", "nats://"+natsAddr, "--http", serveHTTP))
	waitHTTP(t, "http://"+serveHTTP+"/v1/runs/default/calibration", serve)

	for i, base := range []string{runHTTP, serveHTTP} {
		out, err := exec.CommandContext(ctx, py, "../../examples/python/trainer_demo.py",
			"--url", "http://"+base, "--steps", "3", "--first-step", fmt.Sprint(3*i)).CombinedOutput()
		t.Logf("%s", out)
		if err != nil || !strings.HasSuffix(strings.TrimSpace(string(out)), "ok") {
			t.Fatalf("python trainer against %s: %v", base, err)
		}
	}
}
