package sandbox

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
)

func TestLimitsComeFromTheRunTheTaskOrTheDefaults(t *testing.T) {
	task := &Task{TimeLimitSeconds: 1200, MemoryMB: 8192}
	cores := runtime.NumCPU()
	for _, tc := range []struct {
		name string
		l    Limits
		task *Task
		want Limits
	}{
		{"defaults", Limits{}, nil, Limits{Timeout: time.Minute, MemoryBytes: 1 << 30, CPUSeconds: 60*cores + 1}},
		{"the task's", Limits{}, task, Limits{Timeout: 20 * time.Minute, MemoryBytes: 8 << 30, CPUSeconds: 1200*cores + 1}},
		{"the run's over the task's", Limits{Timeout: 90 * time.Second, MemoryBytes: 2 << 30, CPUSeconds: 7}, task,
			Limits{Timeout: 90 * time.Second, MemoryBytes: 2 << 30, CPUSeconds: 7}},
		{"the CPU time follows the wall clock", Limits{Timeout: 1500 * time.Millisecond}, task,
			Limits{Timeout: 1500 * time.Millisecond, MemoryBytes: 8 << 30, CPUSeconds: 2*cores + 1}},
		{"no address-space limit, from the task", Limits{}, &Task{MemoryMB: -1}, Limits{Timeout: time.Minute, MemoryBytes: -1 << 20, CPUSeconds: 60*cores + 1}},
	} {
		got := tc.l.For(tc.task)
		if got.Timeout != tc.want.Timeout || got.MemoryBytes != tc.want.MemoryBytes || got.CPUSeconds != tc.want.CPUSeconds {
			t.Errorf("%s: %v; want %v", tc.name, got, tc.want)
		}
	}

	if s := (Limits{MemoryBytes: -1}).For(nil).String(); !strings.Contains(s, "address space unlimited,") {
		t.Errorf("no address-space limit reads %q", s)
	}
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "task.json"), []byte(`{"name":"x","metric":"rmse","time_limit_seconds":-1}`), 0o644)
	if _, err := LoadTask(dir); err == nil || !strings.Contains(err.Error(), "time_limit_seconds -1") {
		t.Errorf("a negative time limit: %v; want an error naming it", err)
	}
}

// TestExecutionsTakeTheTasksLimitsAndSayWhichOneEndedThem runs code into
// each limit: the task's wall clock, the CPU time, the address space.
func TestExecutionsTakeTheTasksLimitsAndSayWhichOneEndedThem(t *testing.T) {
	task := housing(t)
	task.TimeLimitSeconds = 1
	start := time.Now()
	r := run1(t, &Subprocess{Task: task}, "import time\ntime.sleep(30)\n")
	if r.status != schemas.ExecTimedOut || r.detail != "killed after 1s, its wall-clock limit" || time.Since(start) > 20*time.Second {
		t.Fatalf("the task's 1 s: %+v after %v", r, time.Since(start))
	}

	// 1.2 GiB: over the default address-space limit, and fine without one.
	// Touching it takes 4 s of this VM's page faults when the machine is
	// quiet, and failed a 20 s limit once, under a rehearsal's load
	// (killed after 20s): a minute leaves room, and costs nothing where
	// it runs fast.
	hog := "x = bytearray(1200 * 1024**2)\n" + solution(t, "01_mean.py")
	roomy := Limits{Timeout: time.Minute}
	if r := run1(t, &Subprocess{Task: task, Limits: roomy}, hog); r.status != schemas.ExecCrashed || !strings.Contains(r.detail, "limited to 1024 MiB") {
		t.Fatalf("1.2 GiB under the default limit: %+v", r)
	}
	task.MemoryMB = -1
	if r := run1(t, &Subprocess{Task: task, Limits: roomy}, hog); r.status != schemas.ExecScored {
		t.Fatalf("1.2 GiB with memory_mb -1: %+v; want it scored", r)
	}

	r = run1(t, &Subprocess{Task: task, Limits: Limits{Timeout: 20 * time.Second, CPUSeconds: 1}}, "while True:\n    pass\n")
	if r.status != schemas.ExecTimedOut || !strings.HasPrefix(r.detail, "killed after 1 s of CPU time, its limit") {
		t.Fatalf("1 s of CPU time: %+v; want timed out, saying it was the CPU time", r)
	}
	t.Logf("1 s of CPU time: %s", r.detail)

	r = run1(t, &Subprocess{Task: task, Limits: Limits{Timeout: 20 * time.Second}}, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
	if r.status != schemas.ExecCrashed || !strings.HasPrefix(r.detail, "killed by signal 11 (segmentation fault)") {
		t.Fatalf("a segmentation fault: %+v; want crashed, naming the signal", r)
	}
}

// TestCodeOnEveryCoreMeetsItsWallClockFirst: the CPU limit counts all of a
// process's threads, so code that trains on every core (BLAS, n_jobs) must
// not be cut at a fraction of its wall clock.
func TestCodeOnEveryCoreMeetsItsWallClockFirst(t *testing.T) {
	if runtime.NumCPU() < 2 {
		t.Skip("one core")
	}
	task := housing(t)
	// Two threads hashing (hashlib lets go of the GIL) for 3.5 s of wall
	// clock: up to 7 s of CPU time, over a limit of the 5 s wall clock + 1.
	// The 1.5 s left is for the sandbox and Python to start on a loaded
	// machine.
	code := `import hashlib, threading, time
buf = b"x" * (1 << 20)
def burn():
    end = time.time() + 3.5
    while time.time() < end:
        hashlib.sha256(buf).digest()
ts = [threading.Thread(target=burn) for _ in range(2)]
[x.start() for x in ts]
[x.join() for x in ts]
open("submission.csv", "w").write("id,price\n")
`
	r := run1(t, &Subprocess{Task: task, Limits: Limits{Timeout: 5 * time.Second}}, code)
	if r.status != schemas.ExecInvalid || !strings.Contains(r.detail, "0 of 200 rows") {
		t.Fatalf("%+v; want it to run to its end (and write an empty submission)", r)
	}
}

// TestCodeThatFillsTheDiskIsKilled: a solution that writes in a loop
// used to fill the disk its directory is on, which the executions share
// with whatever else is there (the NATS store, on one disk). It is killed
// past its disk limit, a crash that says so, and its directory removed;
// the task's data, copied in, does not count, nor does a sparse file's
// size beyond what it holds.
func TestCodeThatFillsTheDiskIsKilled(t *testing.T) {
	task := housing(t)
	s := exe(task)
	s.Limits.DiskBytes = 16 << 20
	into := "x"
	if namespaceTools().privateTmp {
		into = "/tmp/x" // its own /tmp is its directory
	}
	filler := fmt.Sprintf("import os, time\nwith open(%q, 'wb') as f:\n", into) +
		"    for i in range(400):\n        f.write(os.urandom(1 << 20)); f.flush(); os.fsync(f.fileno()); time.sleep(0.01)\n"
	start := time.Now()
	r := run1(t, s, filler)
	if want := "over its disk limit of 16 MiB"; r.status != schemas.ExecCrashed || !strings.Contains(r.detail, want) {
		t.Fatalf("%s: %s; want it killed (%q)", r.status, r.detail, want)
	}
	t.Logf("%s in %v", r.detail, time.Since(start).Round(time.Millisecond))
	// Under the limit: 8 MiB written, and a sparse file of 1 GiB; the
	// task's data, 24 MiB of it, is not the code's.
	if err := os.WriteFile(filepath.Join(task.PublicDir(), "big.bin"), bytes.Repeat([]byte{1}, 24<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	within := "import os, time\nopen('some.bin', 'wb').write(os.urandom(8 << 20))\n" +
		"with open('sparse', 'wb') as f:\n    f.seek(1 << 30); f.write(b'x')\ntime.sleep(1.5)\n"
	if r := run1(t, s, within); r.status != schemas.ExecInvalid {
		t.Fatalf("%s: %s; want it to run to its end (and write no submission)", r.status, r.detail)
	}
	if left, _ := filepath.Glob(filepath.Join(WorkParent(), "wmrl-exec-*")); len(left) > 0 {
		t.Fatalf("work directories left behind: %v", left)
	}
}

// A process that does not grade (the world model's, told the limits) reads
// task.json alone: it needs no private answers, which LoadTask does.
func TestTaskJSONAloneGivesTheLimits(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "task.json"), []byte(`{"name":"x","metric":"rmse","time_limit_seconds":1200,"memory_mb":4096}`), 0o644)
	task, err := ReadTaskJSON(dir)
	if err != nil || task.TimeLimitSeconds != 1200 || task.MemoryMB != 4096 || task.Submission != "submission.csv" {
		t.Fatalf("ReadTaskJSON: %+v, %v", task, err)
	}
	if _, err := LoadTask(dir); err == nil || !strings.Contains(err.Error(), "answers") {
		t.Fatalf("LoadTask without private answers: %v; want an error naming them", err)
	}
	os.WriteFile(filepath.Join(dir, "task.json"), []byte(`{"name":"x","metric":"mse"}`), 0o644)
	if _, err := ReadTaskJSON(dir); err == nil || !strings.Contains(err.Error(), `metric "mse"`) {
		t.Fatalf("a bad metric: %v", err)
	}
}
