//go:build linux

package natsjs

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"testing"
	"time"
)

// runningHolder starts a real process (sleep) and writes key into l as
// held by it, in the pid space given; stop kills it and waits it out.
func runningHolder(t *testing.T, ctx context.Context, l *Leases, key, space string) (h Holder, stop func()) {
	t.Helper()
	cmd := exec.Command("sleep", "300")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stop = func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }
	t.Cleanup(stop)
	h = NewHolder()
	h.PID, h.PIDSpace, h.ID = cmd.Process.Pid, space, "sleep"
	value, err := json.Marshal(h)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.b.kv.Create(ctx, key, value); err != nil {
		t.Fatal(err)
	}
	return h, stop
}

// A lease whose holder was killed on this machine is taken at once,
// rather than a TTL after its last renewal: a waiter's Wait returns, and
// its take drops the holder's lease and says whose it was. While the
// holder runs, it keeps its lease.
func TestALeaseWhoseHolderNoLongerRunsIsTakenAtOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	l := leases(t, ctx, 10*time.Minute, 1)[0] // a lapse would come long after the test's end
	var heard []Holder
	l.OnEnded(func(key string, h Holder, _ string) { heard = append(heard, h) })
	h, stop := runningHolder(t, ctx, l, "run.fuse", pidSpace())
	if h.PIDSpace == "" {
		t.Fatal("this process's pid space is unknown: /proc/sys/kernel/random/boot_id or /proc/self/ns/pid unreadable")
	}
	le, other, err := l.TryAcquire(ctx, "run.fuse", NewHolder())
	if err != nil || le != nil || other == nil || other.ID != h.ID {
		t.Fatalf("a lease held by a running process: took %v, other %v, %v; want it left to that process", le != nil, other, err)
	}
	waited := make(chan error, 1)
	go func() { waited <- l.Wait(ctx, "run.fuse") }()
	select {
	case err := <-waited:
		t.Fatalf("Wait returned %v while the holder runs", err)
	case <-time.After(3 * l.poll):
	}
	stop()
	if err := <-waited; err != nil {
		t.Fatalf("Wait, the holder killed: %v; want it to return before the lease lapses", err)
	}
	le, other, err = l.TryAcquire(ctx, "run.fuse", NewHolder())
	if err != nil || le == nil {
		t.Fatalf("the holder killed: took %v, other %v, %v; want the lease taken", le != nil, other, err)
	}
	defer le.Release(ctx)
	if len(heard) != 1 || heard[0].PID != h.PID {
		t.Errorf("OnEnded heard %v; want the killed holder, pid %d", heard, h.PID)
	}
}

// A pid means nothing outside its pid space: a holder of another machine
// (or container) whose pid is free here, and which names no subject to be
// asked on (answers.go), is left its lease until it lapses.
func TestAHolderOfAnotherPIDSpaceIsNotJudgedHere(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	l := leases(t, ctx, 10*time.Minute, 1)[0]
	h, stop := runningHolder(t, ctx, l, "run.fuse", "another-boot pid:[1]")
	stop() // its pid is free here
	le, other, err := l.TryAcquire(ctx, "run.fuse", NewHolder())
	if err != nil || le != nil || other == nil || other.ID != h.ID {
		t.Fatalf("took %v, other %v, %v; want the lease left to its holder", le != nil, other, err)
	}
	h.PIDSpace = ""
	if h.Ended() {
		t.Error("a holder with no pid space (written off Linux, or before it was kept) reads as ended")
	}
}

// A lease that lapsed while the store was full is left to its holder
// (lapsedHolder) only while that holder may still write it: once it no
// longer runs, the lease is free.
func TestALapsedLeaseOfAHolderThatNoLongerRunsIsFree(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	l := leases(t, ctx, 10*time.Minute, 1)[0]
	h, stop := runningHolder(t, ctx, l, "run.fuse", pidSpace())
	l.saw("run.fuse", h, 1)
	l.refusedFull("run.fuse") // as a take of the lapsed lease, refused
	if got := l.lapsedHolder(ctx, "run.fuse"); got == nil || got.ID != h.ID {
		t.Fatalf("lapsed on a full store, its holder running: %v; want it the holder's", got)
	}
	stop()
	if got := l.lapsedHolder(ctx, "run.fuse"); got != nil {
		t.Errorf("lapsed on a full store, its holder killed: %v; want nobody", got)
	}
}

// MachineEnv splits this machine's pid space: a process started with it
// is in a space of its own, which only adds to this process's, so that
// it can never make two machines one.
func TestMachineEnvSplitsThePIDSpace(t *testing.T) {
	if os.Getenv("NATSJS_TEST_PRINT_SPACE") != "" {
		fmt.Print(pidSpace())
		os.Exit(0)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestMachineEnvSplitsThePIDSpace$")
	cmd.Env = append(os.Environ(), "NATSJS_TEST_PRINT_SPACE=1", MachineEnv+"=route-2")
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	if want := pidSpace() + " route-2"; string(out) != want || os.Getenv(MachineEnv) != "" {
		t.Errorf("with %s=route-2, the pid space is %q; want %q", MachineEnv, out, want)
	}
}
