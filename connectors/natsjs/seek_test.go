package natsjs

import (
	"context"
	"math"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// SeekAfter finds the first message of a step on a subject whose steps
// rise, among other subjects' messages and past a purged head, from a few
// messages, not a read of them all.
func TestSeekAfterFindsTheFirstMessageOfAStepFromAFew(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, st := streamS(t, ctx)
	seekSteps(t, ctx, js, st, "s")
}

// ... and on a stream replicated on three servers, whose leader answers.
func TestSeekAfterOnAReplicatedStream(t *testing.T) {
	t.Parallel()
	_, _, js, ctx := replicatedStream(t, "SEEK", "seek.>")
	st, err := js.Stream(ctx, "SEEK")
	if err != nil {
		t.Fatal(err)
	}
	seekSteps(t, ctx, js, st, "seek")
}

// seekSteps stores 900 messages of 300 steps on <prefix>.a among others on
// <prefix>.b, purges the stream's head, and seeks steps on <prefix>.a.
func seekSteps(t *testing.T, ctx context.Context, js jetstream.JetStream, st jetstream.Stream, prefix string) {
	t.Helper()
	a, b := prefix+".a", prefix+".b"
	name := st.CachedInfo().Config.Name
	rng := rand.New(rand.NewPCG(5, 7))
	type msg struct {
		seq  uint64
		step int
	}
	var onA []msg
	for i := range 900 {
		step := i / 3
		ack, err := js.Publish(ctx, a, []byte(strconv.Itoa(step)))
		if err != nil {
			t.Fatal(err)
		}
		onA = append(onA, msg{ack.Sequence, step})
		for range rng.IntN(4) {
			if _, err := js.Publish(ctx, b, []byte("other")); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := st.Purge(ctx, jetstream.WithPurgeSequence(200)); err != nil { // as --retention ages the head out
		t.Fatal(err)
	}
	for len(onA) > 0 && onA[0].seq < 200 {
		onA = onA[1:]
	}
	through := onA[len(onA)-1].seq
	for _, target := range []int{-1, 0, onA[0].step, onA[0].step + 1, 150, 151, 299, 300} {
		gets := 0
		after, err := SeekAfter(ctx, js, name, a, through, func(r Record) bool {
			gets++
			step, err := strconv.Atoi(string(r.Data))
			if err != nil {
				t.Fatalf("message %d: %q", r.Seq, r.Data)
			}
			return step >= target
		})
		if err != nil {
			t.Fatal(err)
		}
		want := through // no message of the step or later
		for _, m := range onA {
			if m.step >= target {
				want = m.seq - 1
				break
			}
		}
		// Several sequences before the first message of the step are
		// right: those of other subjects' messages between it and the one
		// before it on a.
		first := func(after uint64) (msg, bool) {
			for _, m := range onA {
				if m.seq > after {
					return m, true
				}
			}
			return msg{}, false
		}
		got, gotOK := first(after)
		wanted, wantOK := first(want)
		if got != wanted || gotOK != wantOK {
			t.Errorf("steps from %d: read after %d starts at %+v (%v); want after %d, at %+v (%v)", target, after, got, gotOK, want, wanted, wantOK)
		}
		if most := 2*int(math.Log2(float64(through))) + 2; gets > most {
			t.Errorf("steps from %d: %d messages got; want %d at most of %d", target, gets, most, through)
		}
	}
}
