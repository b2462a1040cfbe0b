package pipeline

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
)

// storedPairs is a subject's pairs IDs, one every 10 minutes, read as
// natsjs.ScanSince and ScanAfter read them; read counts what each scan
// delivered; failAt, when set, makes a scan fail at that sequence.
type storedPairs struct {
	recs   []natsjs.Record
	read   []int
	failAt uint64
}

var t0 = time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)

func (s *storedPairs) add(n int) {
	for range n {
		i := len(s.recs)
		s.recs = append(s.recs, natsjs.Record{MsgID: fmt.Sprintf("r/pairs/%d/g", i), Seq: uint64(i + 1), Time: t0.Add(time.Duration(i) * 10 * time.Minute)})
	}
}

func (s *storedPairs) scan(from func(natsjs.Record) bool, fn func(natsjs.Record) error) error {
	s.read = append(s.read, 0)
	for _, r := range s.recs {
		if !from(r) {
			continue
		}
		if r.Seq == s.failAt {
			return errors.New("nats: timeout")
		}
		s.read[len(s.read)-1]++
		if err := fn(r); err != nil {
			return err
		}
	}
	return nil
}

func (s *storedPairs) index() *pairsIndex {
	return &pairsIndex{idle: time.Hour,
		since: func(_ context.Context, since time.Time, fn func(natsjs.Record) error) error {
			return s.scan(func(r natsjs.Record) bool { return !r.Time.Before(since) }, fn)
		},
		after: func(_ context.Context, seq uint64, fn func(natsjs.Record) error) error {
			return s.scan(func(r natsjs.Record) bool { return r.Seq > seq }, fn)
		},
	}
}

// The sides a restart brings back ask in any order, each since its own
// time; the index reads each pairs message once, back to the oldest time
// asked and on from the newest read, and answers from what it read.
func TestThePairsStoredAreReadOnceForEverySideThatAsks(t *testing.T) {
	ctx := context.Background()
	s := &storedPairs{}
	s.add(10) // at t0, t0+10m, ..., t0+90m
	x := s.index()
	ask := func(since time.Time, id string, want bool, reads ...int) {
		t.Helper()
		got, err := x.stored(ctx, since, id)
		if err != nil || got != want {
			t.Fatalf("stored(%v, %s) = %v, %v; want %v", since.Sub(t0), id, got, err, want)
		}
		if fmt.Sprint(s.read) != fmt.Sprint(reads) {
			t.Fatalf("after stored(%v, %s) the scans read %v; want %v", since.Sub(t0), id, s.read, reads)
		}
	}
	// The first asks since 70m: read from then on (less a minute).
	ask(t0.Add(70*time.Minute), "r/pairs/8/g", true, 3)
	// A side stored earlier: back to its time, up to the first one read
	// (which ends that scan).
	ask(t0.Add(20*time.Minute), "r/pairs/3/g", true, 3, 6)
	// Asked of what is read already: nothing is read, whatever the time
	// (a group's pairs are stored once, after both its sides).
	ask(t0.Add(30*time.Minute), "r/pairs/9/g", true, 3, 6)
	ask(t0.Add(45*time.Minute), "r/pairs/2/g", true, 3, 6)
	// Not read: what came after the newest read is read (here none).
	ask(t0.Add(30*time.Minute), "r/pairs/10/g", false, 3, 6, 0)
	s.add(1)
	ask(t0.Add(30*time.Minute), "r/pairs/10/g", true, 3, 6, 0, 1)
	// A scan back that fails keeps nothing of it (what is held has no
	// gap), and the next asks again.
	s.failAt = 2
	if _, err := x.stored(ctx, t0, "r/pairs/0/g"); err == nil || err.Error() != "nats: timeout" {
		t.Fatalf("a scan that fails: %v", err)
	}
	s.failAt = 0
	ask(t0, "r/pairs/1/g", true, 3, 6, 0, 1, 1, 3)
	// Once no side asked for idle, the IDs are let go, and read anew.
	x.asked = x.asked.Add(-2 * time.Hour)
	ask(t0.Add(80*time.Minute), "r/pairs/9/g", true, 3, 6, 0, 1, 1, 3, 3)
	if len(x.ids) != 3 {
		t.Errorf("%d IDs held after the index was let go and read anew from 79m; want 3", len(x.ids))
	}
}

// Before any pairs are stored from the time asked, the next question
// reads from that time again (not the subject's whole past), and finds
// those stored since.
func TestPairsStoredLaterAreFoundWhenNoneWereAtFirst(t *testing.T) {
	ctx := context.Background()
	s := &storedPairs{}
	s.add(3) // at t0, 10m, 20m
	x := s.index()
	if ok, err := x.stored(ctx, t0.Add(time.Hour), "r/pairs/3/g"); ok || err != nil {
		t.Fatalf("stored before any: %v, %v", ok, err)
	}
	s.add(4) // at 30m ... 60m: the last after the time asked, less a minute
	if ok, err := x.stored(ctx, t0.Add(time.Hour), "r/pairs/6/g"); !ok || err != nil {
		t.Fatalf("stored once there: %v, %v", ok, err)
	}
	if fmt.Sprint(s.read) != "[0 0 1]" {
		t.Errorf("the scans read %v; want nothing until the one stored since", s.read)
	}
}

// BenchmarkPairsAskedAfterARestart: 100 sides held by a stopped pair
// process come again and ask whether their groups' pairs were stored, on
// a stream of 40,000 trajectories (1 KiB) and 1,000 pair groups. Each
// read on its own (the first build of the fix) makes the server read the
// stream from the side's time on; the index reads it once. x_each is
// how many times longer the reads on their own take.
func BenchmarkPairsAskedAfterARestart(b *testing.B) {
	ctx := context.Background()
	srv, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	defer srv.Shutdown()
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "B", Subjects: []string{"b.>"}}); err != nil {
		b.Fatal(err)
	}
	payload := make([]byte, 1024)
	for i := range 40_000 {
		if _, err := js.PublishAsync("b.r.traj", payload); err != nil {
			b.Fatal(err)
		}
		if i%40 == 0 {
			m := &nats.Msg{Subject: "b.r.pairs", Data: []byte("{}"), Header: nats.Header{jetstream.MsgIDHeader: {fmt.Sprintf("r/pairs/%d/g", i/40)}}}
			if _, err := js.PublishMsgAsync(m); err != nil {
				b.Fatal(err)
			}
		}
	}
	<-js.PublishAsyncComplete()
	since := time.Now().Add(-time.Hour)
	rng := rand.New(rand.NewPCG(1, 2))
	ids := make([]string, 100) // half stored, half not
	for i := range ids {
		ids[i] = fmt.Sprintf("r/pairs/%d/g", rng.IntN(1000)+1000*(i%2))
	}
	index := func() *pairsIndex {
		return &pairsIndex{idle: time.Hour,
			since: func(ctx context.Context, since time.Time, fn func(natsjs.Record) error) error {
				return natsjs.ScanSince(ctx, js, "B", "b.r.pairs", since, true, fn)
			},
			after: func(ctx context.Context, seq uint64, fn func(natsjs.Record) error) error {
				return natsjs.ScanAfter(ctx, js, "B", "b.r.pairs", seq, true, fn)
			},
		}
	}
	each := func(id string) bool { // the first build's read
		found := false
		natsjs.ScanSince(ctx, js, "B", "b.r.pairs", since, true, func(r natsjs.Record) error {
			if r.MsgID == id {
				found = true
				return errEnough
			}
			return nil
		})
		return found
	}
	var indexed, alone time.Duration
	for b.Loop() {
		start := time.Now()
		x := index()
		for i, id := range ids {
			if ok, err := x.stored(ctx, since, id); err != nil || ok != (i%2 == 0) {
				b.Fatalf("%s: stored %v, %v", id, ok, err)
			}
		}
		indexed += time.Since(start)
		start = time.Now()
		for i, id := range ids {
			if each(id) != (i%2 == 0) {
				b.Fatalf("%s: read alone, wrong", id)
			}
		}
		alone += time.Since(start)
	}
	b.ReportMetric(float64(indexed.Milliseconds())/float64(b.N), "ms/100_sides")
	b.ReportMetric(float64(alone.Milliseconds())/float64(b.N), "ms_each/100_sides")
	b.ReportMetric(float64(alone)/float64(indexed), "x_each")
}
