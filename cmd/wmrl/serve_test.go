package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os/exec"
	"strings"
	"testing"
	"time"
)

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func waitHTTP(t *testing.T, url string) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if resp, err := http.Get(url); err == nil {
			resp.Body.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never answered", url)
		}
	}
}

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
	run := exec.CommandContext(ctx, bin, "run", "--source", "external", "--data", t.TempDir(), "--listen", natsAddr, "--http", runHTTP, "--quiet")
	if err := run.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { run.Process.Kill(); run.Wait() }()
	waitHTTP(t, "http://"+runHTTP+"/v1/runs/default/calibration")
	serve := exec.CommandContext(ctx, bin, "serve", "--nats", "nats://"+natsAddr, "--http", serveHTTP)
	if err := serve.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { serve.Process.Kill(); serve.Wait() }()
	waitHTTP(t, "http://"+serveHTTP+"/v1/runs/default/calibration")

	for i, base := range []string{runHTTP, serveHTTP} {
		out, err := exec.CommandContext(ctx, py, "../../examples/python/trainer_demo.py",
			"--url", "http://"+base, "--steps", "3", "--first-step", fmt.Sprint(3*i)).CombinedOutput()
		t.Logf("%s", out)
		if err != nil || !strings.HasSuffix(strings.TrimSpace(string(out)), "ok") {
			t.Fatalf("python trainer against %s: %v", base, err)
		}
	}
}
