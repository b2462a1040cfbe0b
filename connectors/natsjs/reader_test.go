package natsjs

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// TestReaderSinceStartsAtItsTime: a reader since t reads the messages
// stored at or after t, ends its catching up at the newest, and says when
// each was stored; since after the newest, there is nothing to catch up.
func TestReaderSinceStartsAtItsTime(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, _ := streamS(t, ctx)
	var newest uint64 // on s.a
	publish := func(from, to int) {
		for i := from; i < to; i++ {
			ack, err := js.Publish(ctx, "s.a", fmt.Appendf(nil, "%d", i))
			if err != nil {
				t.Fatal(err)
			}
			newest = ack.Sequence
			js.Publish(ctx, "s.b", []byte("other subject"))
		}
	}
	publish(0, 3)
	time.Sleep(20 * time.Millisecond)
	since := time.Now()
	publish(3, 5)
	r, err := NewReaderSince(ctx, js, "S", "s.a", since, false)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Last != newest {
		t.Fatalf("Last %d; want %d, the newest on s.a", r.Last, newest)
	}
	for want := 3; want < 5; want++ {
		rec, err := r.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if string(rec.Data) != fmt.Sprint(want) || rec.Time.Before(since) || time.Since(rec.Time) > time.Minute {
			t.Fatalf("read %q stored at %v; want %d, stored after %v", rec.Data, rec.Time, want, since)
		}
		if through, err := r.ReadThrough(ctx, rec); err != nil || through != (want == 4) {
			t.Fatalf("read through at %d: %v, %v; want it at 4 alone", want, through, err)
		}
	}
	time.Sleep(20 * time.Millisecond)
	later, err := NewReaderSince(ctx, js, "S", "s.a", time.Now(), false)
	if err != nil {
		t.Fatal(err)
	}
	defer later.Close()
	if later.Last != 0 {
		t.Fatalf("Last %d since after the newest message; want 0", later.Last)
	}
}

// ScanAfter reads a subject's messages after a stream sequence, headers
// only when asked, and reads nothing (at once) when none came after it.
func TestScanAfterReadsOnWhereAScanEnded(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, _ := streamS(t, ctx)
	var seqs []uint64 // on s.a
	for i := range 5 {
		ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: "s.a", Data: fmt.Appendf(nil, "%d", i), Header: nats.Header{HeaderMsgID: {fmt.Sprint("a", i)}}})
		if err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, ack.Sequence)
		js.Publish(ctx, "s.b", []byte("other subject"))
	}
	scan := func(after uint64) (ids []string) {
		t.Helper()
		if err := ScanAfter(ctx, js, "S", "s.a", after, true, func(r Record) error {
			if len(r.Data) != 0 {
				t.Errorf("%s read with its payload %q; want its headers only", r.MsgID, r.Data)
			}
			ids = append(ids, r.MsgID)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return ids
	}
	if got := fmt.Sprint(scan(seqs[2])); got != "[a3 a4]" {
		t.Errorf("after a2's sequence: %s; want [a3 a4]", got)
	}
	if got := fmt.Sprint(scan(seqs[2] + 1)); got != "[a3 a4]" {
		t.Errorf("after the s.b message after a2: %s; want [a3 a4]", got)
	}
	if got := fmt.Sprint(scan(0)); got != "[a0 a1 a2 a3 a4]" {
		t.Errorf("after 0: %s; want all", got)
	}
	if got := scan(seqs[4]); len(got) != 0 {
		t.Errorf("after the newest: %v; want none", got)
	}
	if got := scan(seqs[4] + 100); len(got) != 0 {
		t.Errorf("after a sequence not stored yet: %v; want none", got)
	}
}

// A reader that starts after a stream sequence reads what came after it,
// and its Last is 0 when nothing did: a stage resuming from a checkpoint
// at the subject's newest message is caught up at once, not waiting for
// a message that may not come.
func TestAReaderAfterASequenceIsCaughtUpWhenNothingCameAfter(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, _ := streamS(t, ctx)
	var seqs []uint64 // on s.a
	for i := range 3 {
		ack, err := js.Publish(ctx, "s.a", fmt.Appendf(nil, "%d", i))
		if err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, ack.Sequence)
		js.Publish(ctx, "s.b", []byte("other subject"))
	}
	r, err := NewReaderAfter(ctx, js, "S", "s.a", seqs[0], false)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Last != seqs[2] {
		t.Fatalf("Last %d after a0; want %d, a2's", r.Last, seqs[2])
	}
	for want := 1; want < 3; want++ {
		rec, err := r.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if string(rec.Data) != fmt.Sprint(want) {
			t.Fatalf("read %q; want %d", rec.Data, want)
		}
	}
	for _, after := range []uint64{seqs[2], seqs[2] + 1} {
		caught, err := NewReaderAfter(ctx, js, "S", "s.a", after, false)
		if err != nil {
			t.Fatal(err)
		}
		if caught.Last != 0 {
			t.Errorf("Last %d after sequence %d, with nothing on s.a after it; want 0", caught.Last, after)
		}
		caught.Close()
	}
}

// TestReaderEndsOnAConnectionClosedForGood: a reader whose connection was
// closed for good (nats.go closes it once its reconnections run out)
// says so at once, instead of retrying for ever on it: `wmrl dlq
// --follow` and the gateway's followers would otherwise hang silently.
func TestReaderEndsOnAConnectionClosedForGood(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, _ := streamS(t, ctx)
	if _, err := js.Publish(ctx, "s.a", []byte("0")); err != nil {
		t.Fatal(err)
	}
	r, err := NewReader(ctx, js, "S", "s.a", false)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, err := r.Next(ctx); err != nil {
		t.Fatal(err)
	}
	js.Conn().Close()
	start := time.Now()
	_, err = r.Next(ctx)
	if !errors.Is(err, nats.ErrConnectionClosed) {
		t.Fatalf("Next on a closed connection: %v after %v; want it said, not retried", err, time.Since(start))
	}
}

// ReadThrough: a message with nothing pending after it short of Last is
// read through only if the leader no longer holds anything past it (the
// newest was deleted since the reader started, as wmrl dlq --resend
// deletes what it sent back), not if the consumer's replica merely lags.
func TestReadThroughAsksTheLeaderAgainWhenNothingIsPending(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, st := streamS(t, ctx)
	for i := range 3 {
		if _, err := js.Publish(ctx, "s.a", fmt.Appendf(nil, "%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	r, err := NewReader(ctx, js, "S", "s.a", false)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Last != 3 {
		t.Fatalf("Last %d; want 3", r.Last)
	}
	for _, c := range []struct {
		rec  Record
		want bool
	}{
		{Record{Seq: 1, Pending: 2}, false},
		{Record{Seq: 2, Pending: 0}, false}, // a replica that lags: 3 is still to come
		{Record{Seq: 3, Pending: 0}, true},
	} {
		if got, err := r.ReadThrough(ctx, c.rec); err != nil || got != c.want {
			t.Fatalf("read through %+v: %v, %v; want %v", c.rec, got, err, c.want)
		}
	}
	if err := st.DeleteMsg(ctx, 3); err != nil {
		t.Fatal(err)
	}
	if got, err := r.ReadThrough(ctx, Record{Seq: 2, Pending: 0}); err != nil || !got || r.Last != 2 {
		t.Fatalf("read through 2 with 3 deleted: %v, %v, Last %d; want through, Last 2", got, err, r.Last)
	}
}
