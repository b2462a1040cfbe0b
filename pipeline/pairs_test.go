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

// storedPairs is a subject's pairs IDs, at sequences 1, 2, ..., read as
// natsjs.ScanAfter reads them; read counts what each scan delivered;
// failAt, when set, makes a scan fail at that sequence.
type storedPairs struct {
	recs   []natsjs.Record
	read   []int
	failAt uint64
}

func (s *storedPairs) add(n int) {
	for range n {
		i := len(s.recs)
		s.recs = append(s.recs, natsjs.Record{MsgID: fmt.Sprintf("r/pairs/%d/g", i), Seq: uint64(i + 1)})
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
		after: func(_ context.Context, seq uint64, fn func(natsjs.Record) error) error {
			return s.scan(func(r natsjs.Record) bool { return r.Seq > seq }, fn)
		},
	}
}

// The sides a restart brings back ask in any order, each after its own
// stream sequence; the index reads each pairs message once, back to the
// oldest side asking and on from the newest read, and answers from what it
// read.
func TestThePairsStoredAreReadOnceForEverySideThatAsks(t *testing.T) {
	ctx := context.Background()
	s := &storedPairs{}
	s.add(10) // at sequences 1 to 10
	x := s.index()
	ask := func(seq uint64, id string, want bool, reads ...int) {
		t.Helper()
		got, err := x.stored(ctx, seq, id)
		if err != nil || got != want {
			t.Fatalf("stored(%d, %s) = %v, %v; want %v", seq, id, got, err, want)
		}
		if fmt.Sprint(s.read) != fmt.Sprint(reads) {
			t.Fatalf("after stored(%d, %s) the scans read %v; want %v", seq, id, s.read, reads)
		}
	}
	// The first asks after 7: read from then on.
	ask(7, "r/pairs/8/g", true, 3)
	// A side stored earlier: back to it, up to the first one read (which
	// ends that scan).
	ask(2, "r/pairs/3/g", true, 3, 6)
	// Asked of what is read already: nothing is read, whatever the side
	// (a group's pairs are stored once, after both its sides).
	ask(3, "r/pairs/9/g", true, 3, 6)
	ask(4, "r/pairs/2/g", true, 3, 6)
	// Not read: what came after the newest read is read (here none).
	ask(3, "r/pairs/10/g", false, 3, 6, 0)
	s.add(1)
	ask(3, "r/pairs/10/g", true, 3, 6, 0, 1)
	// A scan back that fails keeps nothing of it (what is held has no
	// gap), and the next asks again.
	s.failAt = 2
	if _, err := x.stored(ctx, 0, "r/pairs/0/g"); err == nil || err.Error() != "nats: timeout" {
		t.Fatalf("a scan that fails: %v", err)
	}
	s.failAt = 0
	ask(0, "r/pairs/1/g", true, 3, 6, 0, 1, 1, 3)
	// Once no side asked for idle, the IDs are let go, and read anew.
	x.asked = x.asked.Add(-2 * time.Hour)
	ask(8, "r/pairs/9/g", true, 3, 6, 0, 1, 1, 3, 3)
	if len(x.ids) != 3 {
		t.Errorf("%d IDs held after the index was let go and read anew after 8; want 3", len(x.ids))
	}
}

// Before any pairs are stored after the side asking, the next question
// reads on from it (not the subject's whole past), and finds those stored
// since.
func TestPairsStoredLaterAreFoundWhenNoneWereAtFirst(t *testing.T) {
	ctx := context.Background()
	s := &storedPairs{}
	s.add(3) // at 1 to 3
	x := s.index()
	if ok, err := x.stored(ctx, 3, "r/pairs/3/g"); ok || err != nil {
		t.Fatalf("stored before any: %v, %v", ok, err)
	}
	s.add(4) // at 4 to 7
	if ok, err := x.stored(ctx, 3, "r/pairs/6/g"); !ok || err != nil {
		t.Fatalf("stored once there: %v, %v", ok, err)
	}
	if fmt.Sprint(s.read) != "[0 0 4]" {
		t.Errorf("the scans read %v; want nothing (after the side, and on), then the 4 stored since", s.read)
	}
}

// BenchmarkPairsAskedAfterARestart: 100 sides held by a stopped pair
// process come again and ask whether their groups' pairs were stored, on
// a stream of 40,000 trajectories (1 KiB) and 1,000 pair groups. Each
// read on its own (the first build of the fix) makes the server read the
// stream from the side on; the index reads it once. x_each is how many
// times longer the reads on their own take.
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
	rng := rand.New(rand.NewPCG(1, 2))
	ids := make([]string, 100) // half stored, half not
	for i := range ids {
		ids[i] = fmt.Sprintf("r/pairs/%d/g", rng.IntN(1000)+1000*(i%2))
	}
	index := func() *pairsIndex {
		return &pairsIndex{idle: time.Hour,
			after: func(ctx context.Context, seq uint64, fn func(natsjs.Record) error) error {
				return natsjs.ScanAfter(ctx, js, "B", "b.r.pairs", seq, true, fn)
			},
		}
	}
	each := func(id string) bool { // the first build's read
		found := false
		natsjs.ScanAfter(ctx, js, "B", "b.r.pairs", 0, true, func(r natsjs.Record) error {
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
			if ok, err := x.stored(ctx, 0, id); err != nil || ok != (i%2 == 0) {
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
