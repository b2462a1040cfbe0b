package pipeline

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// A process whose stream, or one of whose consumers, is deleted from the
// server stops, saying what is gone and what to do. Before, its stages
// waited for messages for ever, printing "stream not found (reading on)"
// (or nothing, for a consumer), and a stop said it had lost nothing.
// Each input says "not found" once while the process makes sure, not at
// each read (28 lines in the 5 s of a try by hand).
func TestAStreamOrConsumerGoneStopsTheProcess(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	for _, consumer := range []bool{false, true} {
		name := map[bool]string{false: "the stream", true: "a consumer"}[consumer]
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			cfg := testConfig(t)
			cfg.Source, cfg.streamCheck, cfg.streamRecheck = SourceExternal, 200*time.Millisecond, 2*time.Second
			var out syncBuffer
			cfg.Quiet, cfg.Out = false, &out
			p, _, js := startClient(t, ctx, cfg)
			want := "the stream WMRL_WMRL is no longer on the NATS server"
			if consumer {
				s, err := js.Stream(ctx, StreamName(cfg.Prefix))
				if err != nil {
					t.Fatal(err)
				}
				gone := consumerName(StagePredict, cfg.Run, schemas.KindGroup)
				if err := s.DeleteConsumer(ctx, gone); err != nil {
					t.Fatal(err)
				}
				want = "the consumer " + gone + " of stream WMRL_WMRL is no longer on the NATS server"
			} else if err := js.DeleteStream(ctx, StreamName(cfg.Prefix)); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- p.Wait() }()
			select {
			case err := <-done:
				if err == nil || !strings.Contains(err.Error(), want) {
					t.Errorf("the process ended with %v; want %q", err, want)
				}
			case <-time.After(30 * time.Second):
				t.Fatalf("the process did not stop within 30 s of %s's deletion", name)
			}
			told := map[string]int{}
			for line := range strings.Lines(out.String()) {
				if strings.Contains(line, "not found") && strings.Contains(line, "reading on") {
					input, _, _ := strings.Cut(line, ": nats")
					told[input]++
				}
			}
			for input, n := range told {
				if n > 1 {
					t.Errorf("%s said it was not found %d times in the %v before the process stopped; want once", input, n, cfg.goneAgain())
				}
			}
		})
	}
}

// The lease bucket deleted under a running process is made anew: the
// process says so, counts it, and holds its stages' leases again (the
// store's mechanics are natsjs's tests; this is the pipeline's wiring).
func TestADeletedLeaseBucketIsMadeAnewSaidAndCounted(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := testConfig(t)
	cfg.Source, cfg.leaseTTL = SourceExternal, 6*time.Second // renewed every second
	var out syncBuffer
	cfg.Quiet, cfg.Out = false, &out
	p, _, js := startClient(t, ctx, cfg)
	bucket := LeaseBucket(cfg.Prefix)
	remade := p.Metrics().BucketsRemade.WithLabelValues(bucket)
	if err := js.DeleteKeyValue(ctx, bucket); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, func() bool { return testutil.ToFloat64(remade) == 1 })
	if want := "the key-value bucket " + bucket + " was gone from the NATS server"; !strings.Contains(out.String(), want) {
		t.Errorf("the process's output lacks %q:\n%s", want, out.String())
	}
	ls, err := natsjs.ReadLeases(ctx, js, bucket)
	if err != nil || ls == nil {
		t.Fatalf("the lease bucket after it was made anew: %v, %v", ls, err)
	}
	waitFor(t, 10*time.Second, func() bool {
		for _, st := range onePerRun {
			if h, _, err := ls.Held(ctx, leaseKey(cfg.Run, st)); err != nil || h == nil {
				return false
			}
		}
		return true
	})
}
