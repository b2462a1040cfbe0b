package natsjs

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// deleteBucket deletes a key-value bucket from under its users, as
// `nats kv rm` does, through a connection of its own.
func deleteBucket(t *testing.T, ctx context.Context, srv *Server, name string) {
	t.Helper()
	if err := jsOn(t, srv, "bucket-remover").DeleteKeyValue(ctx, name); err != nil {
		t.Fatal(err)
	}
}

// remadeCount counts what a bucket's Remade hears.
func remadeCount(b *kvBucket) *atomic.Int32 {
	var n atomic.Int32
	b.cfg.Remade = func(string) { n.Add(1) }
	return &n
}

// A lease bucket deleted under a running holder is made anew by the
// holder, which writes its lease again: a process waiting for the lease
// goes on waiting, and takes it once the holder releases it. Before, the
// holder's renewals went unanswered for ever without a word, the waiter
// hung, and the bucket stayed gone.
func TestAHolderMakesItsDeletedLeaseBucketAnew(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv := testServer(t, ctx)
	// The holder makes the bucket anew 2 s after its first renewal to
	// find it gone, the waiter not before the TTL after its first read:
	// 6 s leaves room for a slow renewal (one to a bucket that is gone
	// takes half a second, as the client asks again).
	ls := leasesOn(t, ctx, srv, 6*time.Second, 2)
	remade, waiterRemade := remadeCount(ls[0].b), remadeCount(ls[1].b)
	a := NewHolder()
	first, err := ls[0].Acquire(ctx, "run.fuse", a, nil)
	if err != nil {
		t.Fatal(err)
	}
	got, busy := acquireAsync(ctx, ls[1], "run.fuse", NewHolder())
	if h := <-busy; h.ID != a.ID {
		t.Fatalf("the waiter was told %+v holds the lease, want %+v", h, a)
	}
	deleteBucket(t, ctx, srv, "TEST_LEASES")

	deadline := time.Now().Add(20 * time.Second)
	for {
		h, _, err := ls[1].Held(ctx, "run.fuse")
		if err == nil && h != nil && h.ID == a.ID {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("20 s after its bucket was deleted, the lease is held by %+v (%v); want its holder to have written it again", h, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Its maker leaves a lease missing from it to its holder too, should
	// its mark not be written.
	if ls[0].backHolder() == nil {
		t.Error("the process that made the bucket anew would take a lease missing from it at once")
	}
	// Longer than the TTL: the holder keeps it, the waiter waits (it
	// would have made the bucket anew and taken the lease by then).
	select {
	case le := <-got:
		t.Fatalf("the waiter took the lease its holder wrote again: %+v", le.Holder())
	case <-first.Lost():
		t.Fatalf("the holder lost its lease: %v", first.Err())
	case <-time.After(3 * ls[0].TTL() / 2):
	}
	if n := remade.Load(); n != 1 {
		t.Errorf("the holder's process heard its bucket made anew %d times; want once", n)
	}
	if n := waiterRemade.Load(); n != 0 {
		t.Errorf("the waiter made the bucket anew %d times while the holder had; want never", n)
	}
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if second := <-got; second == nil {
		t.Fatal("the waiter never took the released lease")
	}
}

// A lease bucket deleted while nobody holds a lease any more (the holder
// died) is made anew by the process waiting for it, once it has been gone
// for the TTL, and the waiter takes the lease: it did not hang, and did
// not take it at once (a live holder would have written it by then). An
// earlier deletion, which the holder made good, does not count towards
// the TTL: it did, and the waiter made the bucket anew and took the lease
// at once at the next (a rehearsal, seed 30).
func TestAWaiterMakesAGoneLeaseBucketAnewAfterTheTTL(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv := testServer(t, ctx)
	ls := leasesOn(t, ctx, srv, 4*time.Second, 2)
	remade := remadeCount(ls[1].b)
	first, err := ls[0].Acquire(ctx, "run.route", NewHolder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	got, busy := acquireAsync(ctx, ls[1], "run.route", NewHolder())
	<-busy
	// Deleted while the holder lives: it makes the bucket anew, and its
	// mark ages out while it keeps the lease.
	deleteBucket(t, ctx, srv, "TEST_LEASES")
	for {
		h, _, err := ls[0].Held(ctx, "run.route")
		if err == nil && h != nil && h.ID == first.Holder().ID {
			break
		}
		if ctx.Err() != nil {
			t.Fatal("the holder never wrote its lease again")
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(ls[0].TTL() + time.Second)
	if n := remade.Load(); n != 0 {
		t.Fatalf("the waiter made the bucket anew %d times while its holder lived", n)
	}
	first.Abandon() // dies
	deleted := time.Now()
	deleteBucket(t, ctx, srv, "TEST_LEASES")
	var second *Lease
	select {
	case second = <-got:
	case <-time.After(30 * time.Second):
	}
	if second == nil {
		t.Fatal("30 s after the bucket was deleted and its holder died, the waiter still waits")
	}
	if took := time.Since(deleted); took < ls[1].TTL() {
		t.Errorf("the waiter took the lease %v after its bucket was deleted; want no sooner than the TTL %v", took.Round(time.Millisecond), ls[1].TTL())
	}
	if n := remade.Load(); n != 1 {
		t.Errorf("the waiter's process heard the bucket made anew %d times; want once", n)
	}
	if err := second.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// A checkpoint bucket deleted under a running stage is made anew by its
// next save, which is stored: before, the save was asked again until its
// context ended, and the stage waited without a word.
func TestACheckpointBucketDeletedIsMadeAnew(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv := testServer(t, ctx)
	var remade []string
	st, err := OpenStore(ctx, jsOn(t, srv, "state-test"), StoreConfig{Bucket: "TEST_STATE", Replicas: 1, Remade: func(b string) { remade = append(remade, b) }})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Save(ctx, "run.fuse", 1); err != nil {
		t.Fatal(err)
	}
	deleteBucket(t, ctx, srv, "TEST_STATE")
	save, cancelSave := context.WithTimeout(ctx, 20*time.Second)
	defer cancelSave()
	if err := st.Save(save, "run.fuse", 2); err != nil {
		t.Fatalf("a save after the bucket was deleted: %v", err)
	}
	var got int
	if ok, err := st.Load(ctx, "run.fuse", &got); !ok || err != nil || got != 2 {
		t.Fatalf("read back %d (found %v, %v); want the save after the deletion, 2", got, ok, err)
	}
	if len(remade) != 1 || remade[0] != "TEST_STATE" {
		t.Errorf("Remade heard %q; want TEST_STATE once", remade)
	}
}

// A lease bucket made anew by the holder of one lease bears a mark for
// the TTL: a lease missing from it (its holder has not written it again
// yet, here never) is not free until the mark ages out, neither to a
// process waiting for it nor to one just started. Before, a standby took
// its stage's lease as soon as another stage's holder had made the bucket
// anew, and the stage's holder lost it at its next renewal (a rehearsal,
// seed 30).
func TestALeaseMissingFromABucketMadeAnewIsNotFreeAtOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv := testServer(t, ctx)
	ls := leasesOn(t, ctx, srv, 4*time.Second, 3)
	fuse, err := ls[0].Acquire(ctx, "run.fuse", NewHolder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	archive, err := ls[1].Acquire(ctx, "run.archive", NewHolder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	got, busy := acquireAsync(ctx, ls[2], "run.archive", NewHolder())
	<-busy
	archive.Abandon() // its holder writes it again late: here, never
	deleteBucket(t, ctx, srv, "TEST_LEASES")
	var remade time.Time
	for remade.IsZero() {
		if _, err := ls[0].b.js.KeyValue(ctx, "TEST_LEASES"); err == nil {
			remade = time.Now()
		} else if ctx.Err() != nil {
			t.Fatal("the fuse lease's holder never made its bucket anew")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, other, err := ls[1].TryAcquire(ctx, "run.archive", NewHolder()); err != nil || other == nil || other.ID != remadeID {
		t.Errorf("a process started after the bucket was made anew: holder %v (%v); want one not known yet", other, err)
	} else if !strings.Contains(other.String(), "not known yet") {
		t.Errorf("the lease's holder reads %q", other)
	}
	var second *Lease
	select {
	case second = <-got:
	case <-time.After(30 * time.Second):
		t.Fatal("the waiter never took the lease nobody wrote again")
	}
	if took := time.Since(remade); took < ls[2].TTL()/2 {
		t.Errorf("the waiter took the lease %v after its bucket was made anew; want it left to its holder until the mark ages out, the TTL %v",
			took.Round(time.Millisecond), ls[2].TTL())
	}
	select {
	case <-fuse.Lost():
		t.Errorf("the fuse lease, written again by its holder, was lost: %v", fuse.Err())
	default:
	}
	for _, le := range []*Lease{second, fuse} {
		if err := le.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// A lease bucket made anew with no mark in it yet (its maker's mark is
// written after the bucket; or its maker's request went unanswered while
// the server made it all the same) is not free for a waiter that read it
// gone: the lease's holder writes it again within the TTL. Before, the
// waiter took the lease at its next read, from a holder that lived (a
// rehearsal on a cluster, seed 34).
func TestAWaiterThatSawTheBucketGoneLeavesAMissingLeaseToItsHolder(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv := testServer(t, ctx)
	ls := leasesOn(t, ctx, srv, 4*time.Second, 2)
	holder, err := ls[0].Acquire(ctx, "run.archive", NewHolder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	got, busy := acquireAsync(ctx, ls[1], "run.archive", NewHolder())
	<-busy
	holder.Abandon() // slow to write it again: here, never
	deleteBucket(t, ctx, srv, "TEST_LEASES")
	for ls[1].b.goneSince.Load() == 0 {
		if ctx.Err() != nil {
			t.Fatal("the waiter never read the bucket as gone")
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Made anew by another of its users, before any mark.
	if _, err := openKV(ctx, jsOn(t, srv, "another-user"), ls[0].b.cfg); err != nil {
		t.Fatal(err)
	}
	remade := time.Now()
	le, other, err := ls[1].TryAcquire(ctx, "run.archive", NewHolder())
	switch {
	case err != nil:
		t.Fatal(err)
	case le != nil:
		_ = le.Release(ctx)
		t.Fatal("the lease was taken once its bucket was back, its holder alive; want it left to the holder for the TTL")
	case other.ID != backID || !strings.Contains(other.String(), "not known yet"):
		t.Errorf("the lease is held by %q; want a process not known yet", other)
	}
	var second *Lease
	select {
	case second = <-got:
	case <-time.After(30 * time.Second):
		t.Fatal("the waiter never took the lease nobody wrote again")
	}
	if took := time.Since(remade); took < ls[1].TTL()/2 {
		t.Errorf("the waiter took the lease %v after its bucket came back; want it left to its holder for the TTL %v",
			took.Round(time.Millisecond), ls[1].TTL())
	}
	if err := second.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// A holder whose request to make its deleted bucket anew was refused or
// went unanswered, and who then finds the bucket there (a cluster that
// made it all the same, its answer lost), counts it as made anew and
// marks it: before, nobody said the bucket had been made anew, and no
// mark was written (a rehearsal on a cluster, seed 34).
func TestABucketMadeAnewThoughTheRequestFailedIsSaidAndMarked(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv := testServer(t, ctx)
	ls := leasesOn(t, ctx, srv, 6*time.Second, 1)
	remade := remadeCount(ls[0].b)
	le, err := ls[0].Acquire(ctx, "run.fuse", NewHolder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer le.Abandon()
	// A full store refuses the holder's requests to make it anew (a limit
	// of 1 byte still lets a stream be made).
	if err := srv.LimitAccountStore(0); err != nil {
		t.Fatal(err)
	}
	deleteBucket(t, ctx, srv, "TEST_LEASES")
	for !ls[0].b.remakeSent.Load() {
		if ctx.Err() != nil {
			t.Fatal("the holder never asked to make its bucket anew")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if n := remade.Load(); n != 0 {
		t.Fatalf("the bucket was said made anew %d times while the store refused it", n)
	}
	// The server makes it after all.
	if err := srv.LimitAccountStore(srv.StoreLimit()); err != nil {
		t.Fatal(err)
	}
	if _, err := openKV(ctx, jsOn(t, srv, "late-answer"), ls[0].b.cfg); err != nil {
		t.Fatal(err)
	}
	for remade.Load() == 0 {
		if ctx.Err() != nil {
			t.Fatal("the holder found its bucket back and never said it was made anew")
		}
		time.Sleep(20 * time.Millisecond)
	}
	mark, err := ls[0].markOf(ctx, 0)
	if err != nil || mark == nil {
		t.Errorf("the holder wrote no mark in the bucket made anew: %v, %v", mark, err)
	}
	if n := remade.Load(); n != 1 {
		t.Errorf("the bucket was said made anew %d times; want once", n)
	}
}

// A lease bucket deleted just before the store fills cannot be made anew
// by its holder until there is room, nor by a waiter. A waiter whose
// remake was refused for the full store, and which makes the bucket once
// there is room, marks it as a holder would, and leaves the missing lease
// to its holder: it took the stage from its living holder before, the
// bucket having been gone for longer than the TTL (a rehearsal on a
// cluster, seed 41).
func TestAWaiterThatMakesTheBucketAfterAFullStoreLeavesLeasesToTheirHolders(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv, _, waiter, le := heldAndSeen(t, ctx, 4*time.Second)
	me := NewHolder()
	deleteBucket(t, ctx, srv, "TEST_LEASES")
	if err := srv.LimitAccountStore(0); err != nil { // no room for a bucket either
		t.Fatal(err)
	}
	waitUntil(t, ctx, func() bool { // the waiter asks to make it anew, refused
		try, cancel := context.WithTimeout(ctx, time.Second) // it asks on while the bucket is gone
		defer cancel()
		_, _, _ = waiter.TryAcquire(try, "run.fuse", me)
		return waiter.b.remakeFull.Load()
	})
	if err := srv.LimitAccountStore(srv.StoreLimit()); err != nil {
		t.Fatal(err)
	}
	got, other, err := waiter.TryAcquire(ctx, "run.fuse", me)
	if err != nil || got != nil || other == nil {
		t.Fatalf("the waiter, as room came back: took %v, other %v, %v; want the lease left to its holder", got != nil, other, err)
	}
	keptByItsHolder(t, ctx, waiter, le)
}
