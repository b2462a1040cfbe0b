// Package breaker stops a stage from asking a service that is down (a
// world model, a sandbox service) and gives its work up at once instead,
// so that steps go on without it rather than each waiting out every retry.
package breaker

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/wmrl/wmrl/schemas"
)

// Breaker counts a service's calls that fail in a row. Each call is
// already retried by its connector, and its message redelivered up to the
// pipeline's attempts, so a service down for good costs every step minutes
// before its work is given up. After After calls in a row have failed, the
// breaker opens: Ask refuses calls, and the stage gives their work up at
// once, as it would after the retries. Calls under way when it opens are
// cut short if they were made with Call.Context. While it is open one call
// every Probe goes through; the first call that succeeds closes it. Safe
// for concurrent use; the zero Probe probes every DefaultProbe.
//
// A service that takes requests and never answers fails a call only once
// each of its requests has timed out on every retry; with many calls under
// way, sharing the client's requests in flight, they all fail at about the
// same time, hours later at a world model's timeouts. A client that
// reports each request (Attempt) opens the breaker after AttemptsAfter
// requests in a row have failed, with no answer between them.
type Breaker struct {
	// Name is what the service is called in errors: "the world model".
	Name  string
	After int
	// AttemptsAfter: requests in a row failed (Attempt) that open it too
	// (0: requests are not counted). Set it well above the failures a
	// flaky service gives in a row: twice the requests in flight fails
	// only a whole wave of them twice.
	AttemptsAfter int
	Probe         time.Duration
	Now           func() time.Time // default time.Now
	// OnChange, if set, is told when the breaker opens and when it closes,
	// with what it has seen. It is called with the breaker's lock held, so
	// that its calls come in the order of the changes; it must not call
	// the breaker.
	OnChange func(State)

	mu         sync.Mutex
	failures   int  // calls in a row that failed
	attempts   int  // requests in a row that failed (Attempt)
	byAttempts bool // it opened on requests, not calls
	last       error
	since      time.Time // opened at; zero while closed
	next       time.Time // the next probe may start then
	probing    bool
	refused    int           // calls refused while open
	opening    chan struct{} // closed when it opens: cuts short the calls under way
	probeStop  chan struct{} // closed when a request of the probe fails: cuts the probe short
}

// DefaultProbe is how often an open breaker lets a call through.
const DefaultProbe = 30 * time.Second

// State is what a breaker says when it opens or closes, or is asked.
type State struct {
	Open     bool
	Failures int       // calls in a row that failed
	Requests int       // requests in a row that failed, when it opened on them (Attempt)
	Last     error     // the last failure
	Since    time.Time // opened at
	Refused  int       // calls refused while it was open (on closing)
	At       time.Time
}

// DownError says that the service is down: a call the breaker refused,
// or one that failed while it was open. Its work is given up at once. It
// wraps schemas.ErrDown.
type DownError struct {
	Name     string
	Failures int
	Requests int // when it opened on requests in a row (Attempt), not calls
	Last     error
	Since    time.Time
	Probe    time.Duration
	// Next is when the next probe may start: a caller answering someone
	// else (an HTTP Retry-After) can say when to ask again.
	Next time.Time
}

func (e *DownError) Error() string {
	failed := fmt.Sprintf("%d calls in a row failed", e.Failures)
	if e.Requests > 0 {
		failed = fmt.Sprintf("%d requests in a row failed", e.Requests)
	}
	return fmt.Sprintf("%s is down since %s (%s, the last: %v; one call every %v tries it)",
		e.Name, e.Since.UTC().Format(time.RFC3339), failed, e.Last, e.Probe)
}

func (e *DownError) Unwrap() error { return schemas.ErrDown }

// Call is one call the breaker let through. Make it with Context's
// context, and report how it ended with exactly one of Succeeded, Failed
// and Abandoned.
type Call struct {
	b     *Breaker
	probe bool
	stop  chan struct{} // closed if the breaker opens while the call is out
}

// Context is parent, also cancelled if the breaker opens while the call is
// under way. Call cancel when the call is over.
func (c Call) Context(parent context.Context) (ctx context.Context, cancel context.CancelFunc) {
	ctx, cancel = context.WithCancel(parent)
	if c.stop != nil {
		go func() {
			select {
			case <-c.stop:
				cancel()
			case <-ctx.Done():
			}
		}()
	}
	return ctx, cancel
}

func (c Call) cutShort() bool {
	if c.stop == nil {
		return false
	}
	select {
	case <-c.stop:
		return true
	default:
		return false
	}
}

// Ask lets a call through, or refuses it with a *DownError while the
// breaker is open and the next probe is not due. A nil Breaker lets
// every call through.
func (b *Breaker) Ask() (Call, error) {
	if b == nil || b.After <= 0 {
		return Call{}, nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.since.IsZero() {
		if b.opening == nil {
			b.opening = make(chan struct{})
		}
		return Call{b: b, stop: b.opening}, nil
	}
	if now := b.now(); !b.probing && !now.Before(b.next) {
		b.probing = true
		b.probeStop = make(chan struct{})
		return Call{b: b, probe: true, stop: b.probeStop}, nil
	}
	b.refused++
	return Call{}, b.down()
}

// State is what the breaker has seen up to now: whether it is open, since
// when, the failures in a row and the calls refused since it opened.
func (b *Breaker) State() State {
	if b == nil {
		return State{}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return State{Open: !b.since.IsZero(), Failures: b.failures, Requests: b.requests(), Last: b.last, Since: b.since, Refused: b.refused, At: b.now()}
}

func (b *Breaker) down() *DownError {
	return &DownError{Name: b.name(), Failures: b.failures, Requests: b.requests(), Last: b.last, Since: b.since, Probe: b.probe(), Next: b.next}
}

// requests is the requests in a row that opened it (0: it opened on calls,
// or is closed).
func (b *Breaker) requests() int {
	if !b.byAttempts {
		return 0
	}
	return b.attempts
}

// Attempt reports one request of a call, from a client that retries
// inside its calls: nil when the service answered it, else the failure
// (a timeout, a refused connection, a 5xx). AttemptsAfter failures in a
// row open the breaker, and cut short the calls under way. While it is
// open the only requests are the probe's: one that fails cuts the probe
// short, rather than letting it wait out every retry of a service known
// to be down; the probe's call itself says whether it is back.
func (b *Breaker) Attempt(err error) {
	if b == nil || b.After <= 0 || b.AttemptsAfter <= 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.since.IsZero() {
		if err != nil && b.probeStop != nil {
			close(b.probeStop)
			b.probeStop = nil
		}
		return
	}
	if err == nil {
		b.attempts = 0
		return
	}
	b.attempts++
	b.last = err
	if b.attempts >= b.AttemptsAfter {
		b.byAttempts = true
		b.open(b.now(), err)
	}
}

// open opens the closed breaker at now, on err. The lock is held.
func (b *Breaker) open(now time.Time, err error) {
	b.since = now
	b.next = now.Add(b.probe())
	if b.opening != nil {
		close(b.opening)
		b.opening = nil
	}
	if b.OnChange != nil {
		b.OnChange(State{Open: true, Failures: b.failures, Requests: b.requests(), Last: err, Since: b.since, At: now})
	}
}

// Succeeded reports an answer: the service is up.
func (c Call) Succeeded() {
	if c.b == nil {
		return
	}
	b := c.b
	b.mu.Lock()
	if c.probe {
		b.probing, b.probeStop = false, nil
	}
	if !b.since.IsZero() && b.OnChange != nil {
		b.OnChange(State{Failures: b.failures, Requests: b.requests(), Last: b.last, Since: b.since, Refused: b.refused, At: b.now()})
	}
	b.failures, b.attempts, b.byAttempts, b.since, b.refused = 0, 0, false, time.Time{}, 0
	b.mu.Unlock()
}

// Failed reports a call that failed after its connector's own retries.
// If the breaker is open now (this failure opened it, or it was a probe,
// or a call let through before it opened), it says so: the work is to
// be given up at once rather than retried. A call cut short by the
// breaker's opening is not counted: its error says nothing new.
func (c Call) Failed(err error) *DownError {
	if c.b == nil {
		return nil
	}
	b := c.b
	b.mu.Lock()
	now := b.now()
	if !c.cutShort() {
		b.failures++
		b.last = err
	}
	if c.probe {
		b.probing, b.probeStop = false, nil
	}
	switch {
	case b.since.IsZero() && b.failures >= b.After:
		b.open(now, err)
	case !b.since.IsZero() && c.probe:
		b.next = now.Add(b.probe())
	}
	var down *DownError
	if !b.since.IsZero() {
		down = b.down()
	}
	b.mu.Unlock()
	return down
}

// End reports how a call ended, for a caller whose own context is ctx:
// abandoned when ctx is done (the caller left, which says nothing of the
// service), else succeeded when err is nil, else failed. It returns
// Failed's verdict: non-nil while the service is down, when the work is
// to be given up at once.
func (c Call) End(ctx context.Context, err error) *DownError {
	switch {
	case ctx.Err() != nil:
		c.Abandoned()
		return nil
	case err != nil:
		return c.Failed(err)
	}
	c.Succeeded()
	return nil
}

// Abandoned reports a call given up before an answer (the process is
// stopping): it says nothing of the service.
func (c Call) Abandoned() {
	if c.b == nil || !c.probe {
		return
	}
	c.b.mu.Lock()
	c.b.probing, c.b.probeStop = false, nil
	c.b.mu.Unlock()
}

func (b *Breaker) name() string {
	if b.Name != "" {
		return b.Name
	}
	return "the service"
}

func (b *Breaker) now() time.Time {
	if b.Now != nil {
		return b.Now()
	}
	return time.Now()
}

func (b *Breaker) probe() time.Duration {
	if b.Probe > 0 {
		return b.Probe
	}
	return DefaultProbe
}
