package natsjs

import (
	"context"
	"fmt"
	"testing"
	"time"
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
