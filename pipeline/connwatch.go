package pipeline

import (
	"fmt"
	"io"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
)

// connWatch says what happens to the connection to an external server.
// nats.go reconnects on its own, and its default handler wrote only the
// server's asynchronous errors to stderr, bare ("write: broken pipe on
// connection [47]"), and nothing when the server was lost or back. It
// prints a line when the connection is lost and one when it is back, the
// asynchronous errors (the same one once a minute at most), and keeps
// wmrl_nats_connected and wmrl_nats_reconnects_total; a connection closed
// for good fails the pipeline.
type connWatch struct {
	url string
	out io.Writer // nil: quiet

	mu         sync.Mutex
	lostAt     time.Time
	printed    sayOnce // asynchronous errors
	stopping   bool
	connected  prometheus.Gauge   // nil until the pipeline's metrics exist
	reconnects prometheus.Counter // nil likewise
	closed     func(error)        // the pipeline's fail, nil likewise
	disrupted  func()             // the pipeline's disruption, nil likewise
}

// sameErrorEvery is how often the same asynchronous error is printed.
const sameErrorEvery = time.Minute

func (w *connWatch) options() []nats.Option {
	return []nats.Option{
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) { w.lost(err, time.Now()) }),
		nats.ReconnectHandler(func(nc *nats.Conn) { w.back(nc.ConnectedUrlRedacted(), time.Now()) }),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) { w.asyncError(sub, err, time.Now()) }),
		nats.ReconnectErrHandler(func(_ *nats.Conn, err error) {
			w.asyncError(nil, fmt.Errorf("reconnecting to %s: %w", w.url, err), time.Now())
		}),
		nats.ClosedHandler(func(nc *nats.Conn) { w.closedForGood(nc.LastError()) }),
	}
}

// attach hands the watch the pipeline's metrics, its fail, and what to
// call when the connection is lost or back.
func (w *connWatch) attach(m *Metrics, fail func(error), disrupted func()) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.connected, w.reconnects, w.closed, w.disrupted = m.NATSConnected, m.NATSReconnects, fail, disrupted
	if w.lostAt.IsZero() {
		w.connected.Set(1)
	}
}

func (w *connWatch) printf(format string, args ...any) {
	if w.out != nil {
		fmt.Fprintf(w.out, format+"\n", args...)
	}
}

func (w *connWatch) lost(err error, now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopping || !w.lostAt.IsZero() {
		return
	}
	if w.disrupted != nil {
		w.disrupted()
	}
	w.lostAt = now
	if w.connected != nil {
		w.connected.Set(0)
	}
	why := ""
	if err != nil {
		why = ": " + err.Error()
	}
	w.printf("nats: lost the server at %s%s; reconnecting, and the stages wait (what they hold is handed back or redelivered, nothing is lost)", w.url, why)
}

func (w *connWatch) back(url string, now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.disrupted != nil {
		w.disrupted()
	}
	if w.connected != nil {
		w.connected.Set(1)
		w.reconnects.Inc()
	}
	away := ""
	if !w.lostAt.IsZero() {
		away = fmt.Sprintf(" after %v", now.Sub(w.lostAt).Round(time.Second))
	}
	w.lostAt = time.Time{}
	w.printf("nats: reconnected to %s%s", url, away)
}

func (w *connWatch) asyncError(sub *nats.Subscription, err error, now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	msg := err.Error()
	if sub != nil {
		msg += fmt.Sprintf(" (subscription on %s)", sub.Subject)
	}
	if w.stopping || !w.printed.allow(msg, now) {
		return
	}
	w.printf("nats: %s", msg)
}

// sayOnce lets the same message through once every sameErrorEvery. It is
// not safe for concurrent use.
type sayOnce map[string]time.Time // message -> when last let through

func (s *sayOnce) allow(msg string, now time.Time) bool {
	if at, ok := (*s)[msg]; ok && now.Sub(at) < sameErrorEvery {
		return false
	}
	if *s == nil {
		*s = sayOnce{}
	}
	for m, at := range *s {
		if now.Sub(at) >= sameErrorEvery {
			delete(*s, m)
		}
	}
	(*s)[msg] = now
	return true
}

// httpErrorLog is the gateway's http.Server error log: a health check or a
// scanner that opens a TCP connection to an HTTPS port and closes it makes
// Go's server log a TLS handshake error each time, which over a run of days
// would bury everything else. The same error from the same host is printed
// once a minute at most.
type httpErrorLog struct {
	out io.Writer

	mu      sync.Mutex
	printed sayOnce
}

// remotePort is the client's port in a net/http error line ("from
// 10.0.0.7:53122:"), which changes with every connection.
var remotePort = regexp.MustCompile(`(from \S+):\d+:`)

func (l *httpErrorLog) Write(b []byte) (int, error) {
	msg := strings.TrimSpace(string(b))
	l.mu.Lock()
	ok := l.printed.allow(remotePort.ReplaceAllString(msg, "$1:"), time.Now())
	l.mu.Unlock()
	if ok {
		fmt.Fprintf(l.out, "gateway: %s (the same from there at most once a minute)\n", msg)
	}
	return len(b), nil
}

// closedForGood hears the connection closed: by stop, or by nats.go,
// which gives up on a server that refuses the credentials twice in a row.
// Nothing reaches the server after that, so the pipeline stops with why,
// for its supervisor to restart it.
func (w *connWatch) closedForGood(last error) {
	w.mu.Lock()
	stopping, fail := w.stopping, w.closed
	w.mu.Unlock()
	if stopping || fail == nil {
		return
	}
	fail(w.closedError(last))
}

// closedError is why the pipeline stops when its connection was closed
// for good. A stage that reads on the connection can hear of the close
// before the watch does (nats.go calls the watch from its own goroutine):
// the pipeline stops with this then too, not with the stage's "connection
// closed".
func (w *connWatch) closedError(last error) error {
	return fmt.Errorf("pipeline: the connection to NATS at %s was closed for good (its last error: %v); start the process again once the cause is fixed", w.url, last)
}

func (w *connWatch) isStopping() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.stopping
}

// stop marks what follows as the pipeline's own closing.
func (w *connWatch) stop() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stopping = true
}
