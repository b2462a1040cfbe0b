package natsjs

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// A holder of another machine, whose pid cannot be looked up here, is
// asked instead. While its process answers, it keeps its lease, even with
// its renewals overdue; once nothing answers (the process was killed, and
// its connection went with it) and the lease is not renewed for
// silentAfter, the lease is dropped and taken at once, well before it
// would have lapsed, and OnEnded says how that was told.
func TestASilentHolderOfAnotherMachineIsTakenAtOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ls := leasesOn(t, ctx, testServer(t, ctx), 20*time.Second, 2)
	holder, waiter := ls[0], ls[1]
	waiter.silentAfter = time.Second
	if holder.answers == "" {
		t.Fatal("a process's leases answer on no subject")
	}
	// The lease as a process of another machine wrote it, not renewed since.
	h := NewHolder()
	h.PIDSpace, h.ID, h.Answers = "another-boot pid:[1]", "elsewhere", holder.answers
	value, err := json.Marshal(h)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := waiter.b.kv.Create(ctx, "run.fuse", value); err != nil {
		t.Fatal(err)
	}
	var heard []string
	waiter.OnEnded(func(key string, _ Holder, how string) { heard = append(heard, key+" "+how) })
	waited := make(chan error, 1)
	go func() { waited <- waiter.Wait(ctx, "run.fuse") }()
	select {
	case err := <-waited:
		t.Fatalf("Wait returned %v while the holder's process answers", err)
	case <-time.After(9 * time.Second): // overdue from TTL/6 + a poll, 4.3 s, and asked every poll since
	}
	waiter.mu.Lock()
	s := waiter.seen["run.fuse"]
	waiter.mu.Unlock()
	if !waiter.overdue("run.fuse") || s.pings != 0 {
		t.Fatalf("overdue %v, %d requests unanswered; want the holder overdue, and asked, and answering", waiter.overdue("run.fuse"), s.pings)
	}
	holder.nc.Close()
	select {
	case err := <-waited:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(8 * time.Second): // the lease would lapse 11 s from now
		t.Fatal("Wait did not return once the holder went silent")
	}
	le, other, err := waiter.TryAcquire(ctx, "run.fuse", NewHolder())
	if err != nil || le == nil {
		t.Fatalf("the holder silent: took %v, other %v, %v; want the lease taken", le != nil, other, err)
	}
	defer le.Release(ctx)
	if len(heard) != 1 || !strings.Contains(heard[0], "neither answered nor renewed") {
		t.Errorf("OnEnded heard %q; want the lease dropped once, the holder silent", heard)
	}
}
