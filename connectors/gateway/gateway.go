// Package gateway is wmrl's HTTP front door for trainers: submit a step's
// trajectories and close it, fetch its fused update (long poll), read the
// current calibration, and reward endpoints compatible with OpenRLHF's
// --remote_rm_url and slime's --rm-url. Everything it accepts goes through
// the same validation and onto the same subjects as the NATS path.
package gateway

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/breaker"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/predict"
)

// Subjects the gateway reads and writes.
type Subjects struct {
	// Trajs is where a trainer sends several trajectories in one message
	// (the gateway reads only its newest, for the next step; "": none).
	Traj, Trajs, Step, Update, Calibration, Exec, Execution, Plan string
}

// Config configures a Gateway.
type Config struct {
	Run      string
	Stream   string
	Subjects Subjects
	// Token, when set, is required as "Authorization: Bearer <token>".
	Token string
	// MaxBody caps request bodies (default 16 MiB).
	MaxBody int64
	// MaxPayload, if set, is the largest message the NATS server takes: a
	// trajectory over it is refused with 413, as no retry stores it.
	MaxPayload int
	// MaxWait caps ?wait= (default 10 minutes).
	MaxWait time.Duration
	// WorldModel scores the reward endpoints' requests.
	WorldModel predict.WorldModel
	// Breaker, if set, stops asking a world model that keeps failing: the
	// reward endpoints answer 503 with a Retry-After at once instead of
	// each waiting out the connector's retries. In one process it is the
	// predict stage's, so a world model either finds down is down for both.
	Breaker *breaker.Breaker
	// KeepUpdates whole in memory (default 256; older ones are read back
	// from the stream).
	KeepUpdates int
	// Remember is how long the reward endpoints keep the world model's
	// score of a solution, so that the same solution asked again (a trainer
	// retrying a request it gave up on) is not scored again (default 15
	// minutes; negative: never kept past its call).
	Remember time.Duration
	// Answered, if set, hears how the reward endpoints answered each
	// request's solutions: n of them by Answer.
	Answered func(how Answer, n int)
	// Predicted, if set, is told of the scores of every call the world
	// model answered, graded or not.
	Predicted func([]predict.Score)
	// Instrument, if set, wraps each endpoint's handler (named as in
	// Endpoints) to count and time its requests, refused ones included.
	Instrument func(endpoint string, h http.Handler) http.Handler
}

// Answer is where a reward endpoint's score of a solution came from.
type Answer string

const (
	// AnsweredByExecution: the solution was executed as an anchor; its real score.
	AnsweredByExecution Answer = "execution"
	// AnsweredByWorldModel: the world model was asked.
	AnsweredByWorldModel Answer = "world_model"
	// AnsweredRemembered: the world model's score from a call under way or
	// come within Config.Remember, for the same solution; not asked again.
	AnsweredRemembered Answer = "remembered"
)

// Answers are the Answer values, for a metric's series.
var Answers = []Answer{AnsweredByExecution, AnsweredByWorldModel, AnsweredRemembered}

// Endpoints names the API's endpoints for Config.Instrument: the route
// patterns, and "other" for whatever matches none.
var Endpoints = map[string]string{
	"POST /v1/runs/{run}/trajectories":       "trajectories",
	"POST /v1/runs/{run}/steps/{step}/close": "close_step",
	"GET /v1/runs/{run}/steps/{step}/update": "update",
	"GET /v1/runs/{run}/calibration":         "calibration",
	"GET /v1/runs/{run}/steps":               "steps",
	"POST /v1/runs/{run}/rewards/openrlhf":   "rewards_openrlhf",
	"POST /v1/runs/{run}/rewards/slime":      "rewards_slime",
	"GET /healthz":                           "health",
	"/":                                      "other",
}

func (c *Config) setDefaults() {
	if c.MaxBody == 0 {
		c.MaxBody = 16 << 20
	}
	if c.MaxWait == 0 {
		c.MaxWait = 10 * time.Minute
	}
	if c.KeepUpdates == 0 {
		c.KeepUpdates = 256
	}
	if c.Remember == 0 {
		c.Remember = 15 * time.Minute
	}
}

// Gateway serves the HTTP API. Create it with New, start its followers with
// Run, serve Handler.
type Gateway struct {
	cfg     Config
	js      jetstream.JetStream
	pub     message.Publisher
	updates *updates
	truths  *truths
	planned *planned
	sent    *sent
	cal     atomic.Pointer[calState]

	predictions *predictions
	// closing ends when Run returns (the process stops): long polls
	// answer at once, and a reward request that would need a new
	// world-model call is refused, while the calls under way go on.
	closing context.Context
	closed  context.CancelFunc
	// life ends with Close: the world-model calls of the reward endpoints
	// outlive their requests, not the gateway.
	life context.Context
	stop context.CancelFunc
}

type calState struct {
	c schemas.Calibration
	m *calibrate.Isotonic // nil: identity
}

// calibrated puts a calibration's map in force. One that fuse refuses
// (and dead-letters) is skipped here too, so that the map in force stays
// fuse's: before, a map that goes down put the identity in force.
func (g *Gateway) calibrated(r natsjs.Record) { g.calibratedBy(r.Data) }

// calibratedBy is calibrated of an encoded calibration; it reports whether
// the calibration was put in force.
func (g *Gateway) calibratedBy(data []byte) bool {
	var c schemas.Calibration
	if schemas.Decode(data, g.cfg.Run, &c) != nil {
		return false
	}
	st := &calState{c: c}
	if c.Map != nil {
		m, err := calibrate.NewIsotonic(c.Map.X, c.Map.Y)
		if err != nil {
			return false
		}
		st.m = m
	}
	g.cal.Store(st)
	return true
}

// New builds a gateway; it does no I/O.
func New(cfg Config, js jetstream.JetStream, pub message.Publisher) (*Gateway, error) {
	cfg.setDefaults()
	if cfg.WorldModel == nil {
		return nil, errors.New("gateway: a world model is required for the reward endpoints")
	}
	life, stop := context.WithCancel(context.Background())
	closing, closed := context.WithCancel(life)
	return &Gateway{cfg: cfg, js: js, pub: pub, updates: newUpdates(cfg.KeepUpdates), truths: newTruths(100_000), planned: &planned{}, sent: &sent{ids: map[int64]map[string]sentAs{}},
		predictions: newPredictions(100_000, cfg.Remember), closing: closing, closed: closed, life: life, stop: stop}, nil
}

// Close ends the world-model calls of the reward endpoints still under
// way. Call it once the HTTP server has stopped: between the end of Run
// and Close, the requests in flight get their answers (a server's
// Shutdown lets them end), and no new call is made.
func (g *Gateway) Close() { g.stop() }

// Run follows the update, plan, calibration and anchor subjects until ctx
// is done. Then the gateway is closing: long polls answer 503 at once, and
// reward requests are answered only where no new world-model call is
// needed, until Close.
func (g *Gateway) Run(ctx context.Context) error {
	defer g.closed()
	errc := make(chan error, 6)
	s := g.cfg.Subjects
	g.updates.setLoading(true)
	g.planned.setLoading(true)
	go func() { errc <- g.followUpdates(ctx, errc) }()
	go func() { errc <- g.followPlans(ctx) }()
	go func() { errc <- g.followCalibrations(ctx) }()
	go func() {
		after := g.truthsAfter(ctx)
		go func() {
			errc <- follow(ctx, g.js, g.cfg.Stream, s.Execution, after, false, func(r natsjs.Record) {
				var e schemas.Execution
				if json.Unmarshal(r.Data, &e) == nil {
					g.truths.addExecution(e)
				}
			})
		}()
		errc <- follow(ctx, g.js, g.cfg.Stream, s.Exec, after, false, func(r natsjs.Record) {
			var gr schemas.Group
			if json.Unmarshal(r.Data, &gr) == nil {
				g.truths.addAnchor(gr)
			}
		})
	}()
	var first error
	for range 6 {
		if err := <-errc; err != nil && first == nil {
			first = err
		}
	}
	return first
}

// followUpdates reads the updates from the newest stored on, whole, until
// ctx is done. Those stored before it are indexed from their IDs alone
// (their payloads are read when a trainer asks for one), newest first
// (those a trainer that restarted a few steps behind asks for), and that
// read's end goes to done: reading every update of a long run whole held
// the new ones back at each start.
func (g *Gateway) followUpdates(ctx context.Context, done chan<- error) error {
	subject := g.cfg.Subjects.Update
	last, data, err := newestOn(ctx, g.js, g.cfg.Stream, subject)
	if err != nil {
		g.updates.setLoading(false)
		done <- nil
		return err
	}
	go func() {
		defer g.updates.setLoading(false)
		if last <= 1 {
			done <- nil
			return
		}
		if err := g.indexUpdates(ctx, subject, last, data); err != nil && ctx.Err() == nil {
			done <- fmt.Errorf("gateway: index the updates stored before the start: %w", err)
			return
		}
		done <- nil
	}()
	return follow(ctx, g.js, g.cfg.Stream, subject, max(last, 1)-1, false, g.updates.add)
}

// indexUpdates indexes the updates stored before the newest, at stream
// sequence last, whose payload is newest.
func (g *Gateway) indexUpdates(ctx context.Context, subject string, last uint64, newest []byte) error {
	return g.newestFirst(ctx, subject, natsjs.Record{Seq: last, Data: newest}, last-1, func(r natsjs.Record) {
		if step, ok := stepOf(ctx, g.js, g.cfg.Stream, r); ok {
			g.updates.index(step, r.Seq)
		}
	})
}

// newestFirst hands fn, without their payloads, the messages on subject
// up to stream sequence through: first those of the newest
// Config.KeepUpdates steps back from newest's (after the sequence
// SeekAfter finds), then those before them. Where the seek lands changes
// only the order, not what fn is handed.
func (g *Gateway) newestFirst(ctx context.Context, subject string, newest natsjs.Record, through uint64, fn func(natsjs.Record)) error {
	split := uint64(0)
	if step, ok := stepOf(ctx, g.js, g.cfg.Stream, newest); ok && step > int64(g.cfg.KeepUpdates) {
		from := step - int64(g.cfg.KeepUpdates)
		split, _ = natsjs.SeekAfter(ctx, g.js, g.cfg.Stream, subject, newest.Seq, func(r natsjs.Record) bool {
			s, ok := stepOf(ctx, g.js, g.cfg.Stream, r)
			return ok && s >= from
		}) // 0 when it fails: everything in one read, from the first
	}
	split = min(split, through)
	for _, part := range [][2]uint64{{split, through}, {0, split}} {
		if part[0] >= part[1] {
			continue
		}
		err := natsjs.ScanAfter(ctx, g.js, g.cfg.Stream, subject, part[0], true, func(r natsjs.Record) error {
			if r.Seq > part[1] {
				return errPartRead
			}
			fn(r)
			return nil
		})
		if err != nil && !errors.Is(err, errPartRead) {
			return fmt.Errorf("gateway: read %s: %w", subject, err)
		}
	}
	return nil
}

// errPartRead ends a scan of newestFirst at the end of its part.
var errPartRead = errors.New("gateway: read through the part's end")

// followPlans records the steps planned, from the plans' IDs: those
// stored before the start newest first, then the new ones as they come.
// Until those stored are read, a trajectory for a step at or before the
// newest plan is answered 503, not taken: its step may be planned.
func (g *Gateway) followPlans(ctx context.Context) error {
	subject := g.cfg.Subjects.Plan
	last, data, err := newestOn(ctx, g.js, g.cfg.Stream, subject)
	if err != nil {
		g.planned.setLoading(false)
		return err
	}
	add := func(r natsjs.Record) {
		if step, ok := stepOf(ctx, g.js, g.cfg.Stream, r); ok {
			g.planned.add(step)
		}
	}
	if last > 0 {
		add(natsjs.Record{Seq: last, Data: data})
		if err := g.newestFirst(ctx, subject, natsjs.Record{Seq: last, Data: data}, last-1, add); err != nil {
			g.planned.setLoading(false)
			if ctx.Err() != nil {
				return nil // the gateway stops
			}
			return err
		}
	}
	g.planned.setLoading(false)
	return follow(ctx, g.js, g.cfg.Stream, subject, last, true, add)
}

// followCalibrations puts the newest calibration in force and follows
// the new ones. Only when the newest is one fuse refuses are the earlier
// ones read, for the last it took.
func (g *Gateway) followCalibrations(ctx context.Context) error {
	subject := g.cfg.Subjects.Calibration
	last, data, err := newestOn(ctx, g.js, g.cfg.Stream, subject)
	if err != nil {
		return err
	}
	after := uint64(0)
	if last > 0 && g.calibratedBy(data) {
		after = last
	}
	return follow(ctx, g.js, g.cfg.Stream, subject, after, false, g.calibrated)
}

// Handler routes the API. Each endpoint checks the token, the run and the
// body size first (guard), inside its instrumentation; the health check,
// which probes call without a token, is instrumented only.
func (g *Gateway) Handler() http.Handler {
	mux := http.NewServeMux()
	instrumented := func(pattern string, h http.Handler) {
		if g.cfg.Instrument != nil {
			h = g.cfg.Instrument(Endpoints[pattern], h)
		}
		mux.Handle(pattern, h)
	}
	route := func(pattern string, h http.HandlerFunc) { instrumented(pattern, g.guard(h)) }
	route("POST /v1/runs/{run}/trajectories", g.postTrajectories)
	route("POST /v1/runs/{run}/steps/{step}/close", g.closeStep)
	route("GET /v1/runs/{run}/steps/{step}/update", g.getUpdate)
	route("GET /v1/runs/{run}/calibration", g.getCalibration)
	route("GET /v1/runs/{run}/steps", g.getSteps)
	route("POST /v1/runs/{run}/rewards/openrlhf", g.openrlhf)
	route("POST /v1/runs/{run}/rewards/slime", g.slime)
	instrumented("GET /healthz", http.HandlerFunc(g.health))
	route("/", func(w http.ResponseWriter, r *http.Request) {
		fail(w, http.StatusNotFound, "no such endpoint: %s %s", r.Method, r.URL.Path)
	})
	return mux
}

// health answers a load balancer's or an orchestrator's probe, without a
// token: 200 while the gateway's NATS connection is up, 503 with a
// Retry-After while it is not (trajectories would be refused then).
func (g *Gateway) health(w http.ResponseWriter, _ *http.Request) {
	if err := natsjs.Health(g.js.Conn()); err != nil {
		w.Header().Set("Retry-After", "1")
		fail(w, http.StatusServiceUnavailable, "%v", err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok", "run": g.cfg.Run})
}

// guard checks the token, the run and the body size before any handler.
func (g *Gateway) guard(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if g.cfg.Token != "" {
			got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
			if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(g.cfg.Token)) != 1 {
				fail(w, http.StatusUnauthorized, "missing or wrong bearer token")
				return
			}
		}
		if rest, ok := strings.CutPrefix(r.URL.Path, "/v1/runs/"); ok {
			if run, _, _ := strings.Cut(rest, "/"); run != g.cfg.Run {
				fail(w, http.StatusNotFound, "unknown run %q (this gateway serves run %q)", run, g.cfg.Run)
				return
			}
		}
		r.Body = http.MaxBytesReader(w, r.Body, g.cfg.MaxBody)
		next.ServeHTTP(w, r)
	})
}

type apiError struct {
	Error string `json:"error"`
}

// unavailable answers 503 for NATS failing a store or a read, with a
// Retry-After of a second: such a failure is usually a leader election or
// a reconnect, over in seconds, and asking again is safe (a message sent
// twice within the dedup window is stored once).
func unavailable(w http.ResponseWriter, format string, args ...any) {
	w.Header().Set("Retry-After", "1")
	fail(w, http.StatusServiceUnavailable, format, args...)
}

// notStored answers 503 for a message NATS did not store. One refused
// for lack of room waits for someone to make it, which takes longer than
// an election: the trainer is told so, and to ask again in 10 s.
func notStored(w http.ResponseWriter, what string, err error) {
	if natsjs.StoreFull(err) {
		w.Header().Set("Retry-After", "10")
		fail(w, http.StatusServiceUnavailable, "store %s: %s: %v", what, natsjs.StoreFullHint, err)
		return
	}
	unavailable(w, "store %s: %v", what, err)
}

func fail(w http.ResponseWriter, code int, format string, args ...any) {
	writeJSON(w, code, apiError{Error: fmt.Sprintf(format, args...)})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false) // messages read as written: "n >= 0", not "n \u003e= 0"
	_ = enc.Encode(v)
}

// readBody decodes the JSON body into v, answering the error itself.
func readBody(w http.ResponseWriter, r *http.Request, v any) bool {
	err := json.NewDecoder(r.Body).Decode(v)
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		fail(w, http.StatusRequestEntityTooLarge, "request body over %d bytes", tooBig.Limit)
		return false
	case err != nil:
		fail(w, http.StatusBadRequest, "malformed JSON body: %v", schemas.ReadableJSON(err))
		return false
	}
	return true
}

func stepParam(w http.ResponseWriter, r *http.Request) (int64, bool) {
	n, err := strconv.ParseInt(r.PathValue("step"), 10, 64)
	if err != nil || n < 0 {
		fail(w, http.StatusBadRequest, "step %q: want a non-negative integer", r.PathValue("step"))
		return 0, false
	}
	return n, true
}
