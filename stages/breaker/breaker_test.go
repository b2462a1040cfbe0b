package breaker

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
)

// clock is a time that moves only when told.
type clock struct{ t time.Time }

func (c *clock) now() time.Time             { return c.t }
func (c *clock) add(d time.Duration)        { c.t = c.t.Add(d) }
func newClock() *clock                      { return &clock{t: time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)} }
func refused(t *testing.T, b *Breaker) bool { t.Helper(); _, err := b.Ask(); return err != nil }

// The breaker opens after After calls in a row have failed, not after as
// many failures with a success between them; while open it lets one probe
// through per Probe, and the first success closes it.
func TestBreakerOpensOnFailuresInARowAndProbes(t *testing.T) {
	clk := newClock()
	var changes []State
	b := &Breaker{Name: "the world model", After: 3, Probe: 30 * time.Second, Now: clk.now, OnChange: func(s State) { changes = append(changes, s) }}
	down := errors.New("connection refused")
	fail := func() *DownError {
		t.Helper()
		c, err := b.Ask()
		if err != nil {
			t.Fatalf("refused while closed: %v", err)
		}
		return c.Failed(down)
	}

	fail()
	fail()
	c, _ := b.Ask()
	c.Succeeded() // two failures, then an answer: not in a row
	fail()
	if fail() != nil || refused(t, b) || len(changes) != 0 {
		t.Fatalf("open after 2 failures in a row (After 3); changes %+v", changes)
	}
	if opened := fail(); opened == nil || !opened.Next.Equal(clk.t.Add(30*time.Second)) {
		t.Fatalf("the failure that opened it was told %+v; want down, the next probe 30s on", opened)
	}
	if len(changes) != 1 || !changes[0].Open || changes[0].Failures != 3 || changes[0].Last != down || !changes[0].Since.Equal(clk.t) {
		t.Fatalf("changes after 3 failures in a row: %+v; want one, open", changes)
	}
	_, err := b.Ask()
	var de *DownError
	if !errors.As(err, &de) || !errors.Is(err, schemas.ErrDown) || !strings.Contains(err.Error(), "down since 2026-12-03T10:00:00Z") ||
		!strings.Contains(err.Error(), "connection refused") ||
		!strings.Contains(err.Error(), "the world model is down") ||
		!strings.Contains(err.Error(), "3 calls in a row failed") || !strings.Contains(err.Error(), "one call every 30s") {
		t.Fatalf("open: %v; want a DownError naming the failures, the last error and the probe", err)
	}

	if st := b.State(); !st.Open || st.Failures != 3 || st.Refused != 1 || !st.Since.Equal(clk.t) {
		t.Fatalf("state while open: %+v; want open since now, 3 failures, 1 call refused", st)
	}

	// A call let through before it opened still counts.
	clk.add(29 * time.Second)
	if _, err := b.Ask(); !errors.As(err, &de) || !de.Next.Equal(clk.t.Add(time.Second)) {
		t.Fatalf("29s after opening: %v (next %v); want refused, the next probe in 1s", err, de.Next)
	}
	clk.add(time.Second)
	probe, err := b.Ask()
	if err != nil || !probe.probe {
		t.Fatalf("no probe after Probe: %v", err)
	}
	if !refused(t, b) {
		t.Fatal("a second call let through while the probe is out")
	}
	if still := probe.Failed(down); still == nil || !still.Next.Equal(clk.t.Add(30*time.Second)) { // the next probe a Probe later
		t.Fatalf("a failed probe was told %+v; want down, the next probe 30s on", still)
	}
	clk.add(29 * time.Second)
	if !refused(t, b) {
		t.Fatal("a probe sooner than Probe after a failed one")
	}
	clk.add(time.Second)
	probe, _ = b.Ask()
	probe.Abandoned() // the process stopped: says nothing, frees the probe
	probe, err = b.Ask()
	if err != nil || !probe.probe {
		t.Fatalf("no probe after an abandoned one: %v", err)
	}
	clk.add(5 * time.Second)
	probe.Succeeded()
	if len(changes) != 2 || changes[1].Open || changes[1].Refused != 4 || changes[1].At.Sub(changes[1].Since) != 65*time.Second {
		t.Fatalf("changes after the probe succeeded: %+v; want closed after 65s with 4 groups refused", changes)
	}
	if refused(t, b) || b.State().Open || b.State().Refused != 0 {
		t.Fatalf("after it closed: %+v", b.State())
	}
	fail()
	if fail() != nil || refused(t, b) {
		t.Fatal("closed but still counting the failures from before")
	}
}

// A nil breaker, or one with After 0, lets everything through.
func TestBreakerOff(t *testing.T) {
	var nilB *Breaker
	off := &Breaker{}
	for _, b := range []*Breaker{nilB, off} {
		for range 10 {
			c, err := b.Ask()
			if err != nil {
				t.Fatalf("%+v refused: %v", b, err)
			}
			c.Failed(errors.New("down"))
		}
	}
}

// Requests reported one by one (Attempt) open it after AttemptsAfter
// failures in a row with no answer between them, though no call has
// failed yet; the calls under way are cut short, and requests say nothing
// while it is open.
func TestBreakerOpensOnRequestsInARow(t *testing.T) {
	clk := newClock()
	var changes []State
	b := &Breaker{Name: "the world model", After: 5, AttemptsAfter: 4, Probe: time.Minute, Now: clk.now,
		OnChange: func(s State) { changes = append(changes, s) }}
	timeout := errors.New("context deadline exceeded")
	under, err := b.Ask()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := under.Context(context.Background())
	defer cancel()

	for range 3 {
		b.Attempt(timeout)
	}
	b.Attempt(nil) // an answer: not in a row
	for range 3 {
		b.Attempt(timeout)
	}
	if b.State().Open || ctx.Err() != nil {
		t.Fatalf("open after 3 failed requests in a row (AttemptsAfter 4): %+v", b.State())
	}
	b.Attempt(timeout)
	if st := b.State(); !st.Open || st.Requests != 4 || st.Failures != 0 || len(changes) != 1 || changes[0].Requests != 4 {
		t.Fatalf("after 4 failed requests in a row: %+v, changes %+v; want open on 4 requests", st, changes)
	}
	select {
	case <-ctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the call under way was not cut short")
	}
	if down := under.Failed(ctx.Err()); down == nil || !strings.Contains(down.Error(), "4 requests in a row failed, the last: context deadline exceeded") {
		t.Fatalf("the call cut short was told %v; want down, on 4 requests", down)
	}
	b.Attempt(nil) // a request finishing while open: the probe decides
	if !refused(t, b) {
		t.Fatal("a request's answer closed it")
	}
	// A request of the probe that fails cuts the probe short: its call
	// need not wait out every retry of a service known to be down.
	clk.add(time.Minute)
	probe, err := b.Ask()
	if err != nil {
		t.Fatal(err)
	}
	pctx, pcancel := probe.Context(context.Background())
	defer pcancel()
	b.Attempt(timeout)
	select {
	case <-pctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a failed request of the probe did not cut it short")
	}
	if probe.Failed(pctx.Err()) == nil || !refused(t, b) {
		t.Fatal("the probe cut short did not leave it open")
	}
	clk.add(time.Minute)
	probe, err = b.Ask()
	if err != nil {
		t.Fatal(err)
	}
	probe.Succeeded()
	if st := b.State(); st.Open || st.Requests != 0 || st.Refused != 0 || len(changes) != 2 || changes[1].Open || changes[1].Refused != 2 {
		t.Fatalf("after the probe: %+v, changes %+v", st, changes)
	}
	for range 3 {
		b.Attempt(timeout)
	}
	if b.State().Open {
		t.Fatal("closed, but still counting the requests from before")
	}
}

// End reports a call as abandoned when its caller has gone, else as
// succeeded or failed by its error.
func TestEndReportsHowACallEnded(t *testing.T) {
	clk := newClock()
	b := &Breaker{After: 1, Probe: time.Minute, Now: clk.now}
	c, _ := b.Ask()
	if down := c.End(context.Background(), errors.New("503")); down == nil || !b.State().Open {
		t.Fatalf("a failed call: %v, %+v; want it open", down, b.State())
	}
	clk.add(time.Minute)
	probe, _ := b.Ask()
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	if down := probe.End(gone, nil); down != nil || !b.State().Open {
		t.Fatalf("a probe whose caller left: %v, %+v; want nothing said, still open", down, b.State())
	}
	probe, err := b.Ask() // the abandoned probe freed its turn
	if err != nil {
		t.Fatalf("no probe after an abandoned one: %v", err)
	}
	if down := probe.End(context.Background(), nil); down != nil || b.State().Open {
		t.Fatalf("a probe answered: %v, %+v; want it closed", down, b.State())
	}
}
