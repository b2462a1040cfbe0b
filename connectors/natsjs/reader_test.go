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
// stored at or after t, counts only them as its backlog, and says when
// each was stored.
func TestReaderSinceStartsAtItsTime(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, _ := streamS(t, ctx)
	publish := func(from, to int) {
		for i := from; i < to; i++ {
			if _, err := js.Publish(ctx, "s.a", fmt.Appendf(nil, "%d", i)); err != nil {
				t.Fatal(err)
			}
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
	if r.Backlog != 2 {
		t.Fatalf("backlog %d; want the 2 messages since", r.Backlog)
	}
	for want := 3; want < 5; want++ {
		rec, err := r.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if string(rec.Data) != fmt.Sprint(want) || rec.Time.Before(since) || time.Since(rec.Time) > time.Minute {
			t.Fatalf("read %q stored at %v; want %d, stored after %v", rec.Data, rec.Time, want, since)
		}
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
