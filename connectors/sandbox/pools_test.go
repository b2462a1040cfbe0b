package sandbox

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
)

// TestExecutionsAtOnceShareTheGPUsOut: with GPUs given, each execution
// sees one set of them, and no two executions at once the same set;
// executions past the sets wait for one. Without it, every execution at
// once saw every GPU, and CUDA put them all on the first.
func TestExecutionsAtOnceShareTheGPUsOut(t *testing.T) {
	task := housing(t)
	s := exe(task)
	s.GPUs = [][]string{{"10", "11"}, {"GPU-5f0c3e9a"}} // none of another package's tests (a GPU is claimed machine-wide)
	code := "import os, time\nstart = time.time()\ntime.sleep(0.5)\n" +
		"raise SystemExit('gpus %s from %.3f to %.3f' % (os.environ.get('CUDA_VISIBLE_DEVICES'), start, time.time()))\n"
	type held struct {
		gpus       string
		start, end float64
	}
	runs := make([]held, 5)
	var wg sync.WaitGroup
	for i := range runs {
		wg.Go(func() {
			res, err := s.Execute(context.Background(), schemas.Trajectory{TrajID: fmt.Sprint(i), Response: code})
			if err != nil {
				t.Error(err)
				return
			}
			d := res.Detail[strings.Index(res.Detail, "gpus "):]
			if _, err := fmt.Sscanf(d, "gpus %s from %f to %f", &runs[i].gpus, &runs[i].start, &runs[i].end); err != nil {
				t.Errorf("execution %d: %q: %v", i, res.Detail, err)
			}
		})
	}
	wg.Wait()
	sets := map[string]int{}
	for i, a := range runs {
		sets[a.gpus]++
		if a.gpus != "10,11" && a.gpus != "GPU-5f0c3e9a" {
			t.Errorf("execution %d saw GPUs %q", i, a.gpus)
		}
		for j, b := range runs[:i] {
			if a.gpus == b.gpus && a.start < b.end && b.start < a.end {
				t.Errorf("executions %d and %d had GPUs %s at once: %+v %+v", j, i, a.gpus, b, a)
			}
		}
	}
	if len(sets) != 2 {
		t.Errorf("sets used: %v; want both", sets)
	}
	if got := (exe(task)).environ("/w", nil); slices.ContainsFunc(got, func(e string) bool { return strings.HasPrefix(e, "CUDA_VISIBLE_DEVICES=") }) {
		t.Errorf("without GPUs shared out, the code is told %q", got)
	}
}

// TestExecutionsWaitingForGPUsAreTold: with every set of GPUs taken, an
// execution waits, and the executor says so (the metric that tells the
// GPUs, not the slots, hold executions back).
func TestExecutionsWaitingForGPUsAreTold(t *testing.T) {
	task := housing(t)
	s := exe(task)
	s.GPUs = [][]string{{"0"}, {"1"}}
	var mu sync.Mutex
	waiting, most := 0, 0
	s.Waiting = func(what string, d int) {
		mu.Lock()
		defer mu.Unlock()
		if what != "gpus" {
			t.Errorf("waiting for %q", what)
		}
		waiting += d
		most = max(most, waiting)
	}
	// The test holds both sets, so every execution has to wait.
	var held [][]string
	for range 2 {
		set, err := s.gpus.take(context.Background(), s.GPUs, nil)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, set)
	}
	var wg sync.WaitGroup
	for i := range 3 {
		wg.Go(func() {
			if r, err := s.Execute(context.Background(), schemas.Trajectory{TrajID: fmt.Sprint(i), Response: "pass\n"}); err != nil || r.Status != schemas.ExecInvalid {
				t.Errorf("execution %d: %+v %v", i, r, err)
			}
		})
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		mu.Lock()
		n := waiting
		mu.Unlock()
		if n == 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("%d of the 3 executions told waiting in 20 s", n)
			break
		}
	}
	for _, set := range held {
		s.gpus.give(set)
	}
	wg.Wait()
	if waiting != 0 || most != 3 {
		t.Errorf("waiting %d at the end, at most %d; want 0, and 3", waiting, most)
	}
}

// TestWhatAnotherProcessHoldsIsFound: HeldElsewhere lists the users (as
// root) and the GPUs that another process has claimed, each GPU once
// however many sets it is in, and leaves nothing claimed itself.
func TestWhatAnotherProcessHoldsIsFound(t *testing.T) {
	s := &Subprocess{UIDs: []uint32{2000000114, 2000000115},
		GPUs: [][]string{{"wmrl-test-gpu-c", "wmrl-test-gpu-d"}, {"wmrl-test-gpu-d"}, {"wmrl-test-gpu-e"}}}
	heldUser, err := claimAll("uids", uidNames(2000000115))
	if err != nil {
		t.Fatal(err)
	}
	heldGPU, err := claimAll("gpus", []string{"wmrl-test-gpu-d"})
	if err != nil {
		t.Fatal(err)
	}
	var wantUsers []uint32
	if os.Geteuid() == 0 {
		wantUsers = []uint32{2000000115}
	}
	users, gpus, err := s.HeldElsewhere()
	if err != nil || !slices.Equal(users, wantUsers) || !slices.Equal(gpus, []string{"wmrl-test-gpu-d"}) {
		t.Fatalf("held elsewhere: users %v, GPUs %v (%v); want users %v, GPUs [wmrl-test-gpu-d]", users, gpus, err, wantUsers)
	}
	unclaim(heldUser)
	unclaim(heldGPU)
	if users, gpus, err := s.HeldElsewhere(); err != nil || len(users)+len(gpus) > 0 {
		t.Fatalf("once given up: users %v, GPUs %v (%v); want none", users, gpus, err)
	}
	all, err := claimAll("gpus", []string{"wmrl-test-gpu-c", "wmrl-test-gpu-d", "wmrl-test-gpu-e"})
	if err != nil || all == nil {
		t.Fatalf("after HeldElsewhere, claiming every GPU: %v (%v); want each free", all, err)
	}
	unclaim(all)
}

// TestAGPUHeldByAnotherProcessIsWaitedFor: a claim is a flock on a file,
// so another process holds one as wmrl's do, and util-linux's flock(1)
// holds one for a command of an operator's own (a GPU kept for a job run
// by hand): an execution given that GPU starts once the command ends. As
// root it runs again as nobody: GPUs are shared out without root too,
// and such a user's claims are in a directory it makes itself.
func TestAGPUHeldByAnotherProcessIsWaitedFor(t *testing.T) {
	flock, err := exec.LookPath("flock")
	if err != nil {
		t.Skip("no flock(1) here")
	}
	if os.Geteuid() == 0 {
		asNobody(t, "TestAGPUHeldByAnotherProcessIsWaitedFor")
	}
	dir, err := claimsDir("gpus")
	if err != nil {
		t.Fatal(err)
	}
	const gpu = "wmrl-test-gpu-f"
	s := exe(housing(t))
	s.GPUs = [][]string{{gpu}}
	held := time.Now()
	other := exec.Command(flock, filepath.Join(dir, gpu), "sleep", "3")
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	defer other.Wait()
	defer other.Process.Kill()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, gpus, _ := s.HeldElsewhere(); len(gpus) == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("flock(1) had not taken the GPU's claim after 10 s")
		}
	}
	if at := runUntil(t, s, "import time\nprint(time.time())\n"); at.Before(held.Add(3 * time.Second)) {
		t.Errorf("the execution started %v after flock(1) took the GPU for 3 s; want after it let go", at.Sub(held).Round(time.Millisecond))
	}
}

// TestTheAccountsInARangeOfUsersAreFound: every process of an execution's
// user is killed when it ends, so a range of --exec-uids over an account's
// id would kill its processes; Accounts finds them in a passwd file.
func TestTheAccountsInARangeOfUsersAreFound(t *testing.T) {
	passwd := filepath.Join(t.TempDir(), "passwd")
	os.WriteFile(passwd, []byte("root:x:0:0:root:/root:/bin/bash\n"+
		"alice:x:1000:1000:Alice:/home/alice:/bin/bash\n"+
		"broken line\n"+
		"+nis::::::\n"+
		"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin"), 0o644) // no newline at the end
	got, err := accountsIn(passwd, []uint32{999, 1000, 1001, 65534})
	if err != nil || len(got) != 2 || got[1000] != "alice" || got[65534] != "nobody" {
		t.Fatalf("accounts among 999, 1000, 1001 and 65534: %v (%v); want 1000 alice and 65534 nobody", got, err)
	}
	if got, err := accountsIn(passwd, []uint32{2000000201, 2000000202}); err != nil || len(got) != 0 {
		t.Fatalf("accounts among unused ids: %v (%v); want none", got, err)
	}
	if _, err := accountsIn(filepath.Join(t.TempDir(), "none"), []uint32{1000}); err == nil {
		t.Fatal("no passwd file: no error")
	}
}

// TestWhatAKilledWmrlLeftAsAUserIsKilledFirst: a wmrl killed with an
// execution under way leaves, where there is no PID namespace, what the
// code started outside its process group, running as the execution's
// user. The next execution as that user met it (it could read what that
// one wrote) until the execution ended. The user is now cleared when it is
// claimed, before the code starts.
func TestWhatAKilledWmrlLeftAsAUserIsKilledFirst(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("users of their own need root")
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Skip("no setpriv(1) here")
	}
	const uid = "2000000117"
	left := exec.Command(setpriv, "--reuid="+uid, "--regid="+uid, "--clear-groups", "sleep", "60")
	if err := left.Start(); err != nil {
		t.Fatal(err)
	}
	gone := make(chan time.Time, 1)
	go func() { left.Wait(); gone <- time.Now() }()
	defer left.Process.Kill()
	s := exe(housing(t))
	s.UIDs = []uint32{2000000117}
	end := runUntil(t, s, "import time\ntime.sleep(1)\nprint(time.time())\n")
	select {
	case at := <-gone:
		if !at.Before(end) {
			t.Errorf("the process left as the user ended %v after the execution; want it killed before the code ran", at.Sub(end).Round(time.Millisecond))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the process left as the user outlived the execution by 10 s")
	}
}

// runUntil runs code, which prints time.time() once, in s, and returns
// that time: when, by the machine's clock, the code got there.
func runUntil(t *testing.T, s *Subprocess, code string) time.Time {
	t.Helper()
	run, err := s.Run(context.Background(), code)
	if err != nil {
		t.Fatal(err)
	}
	var at float64
	if _, err := fmt.Sscan(run.Stdout, &at); err != nil {
		t.Fatalf("the execution printed %q: %v", run.Stdout, err)
	}
	return time.Unix(0, int64(at*1e9))
}
