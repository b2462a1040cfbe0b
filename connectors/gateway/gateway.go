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
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
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
func (g *Gateway) calibrated(r natsjs.Record) {
	var c schemas.Calibration
	if schemas.Decode(r.Data, g.cfg.Run, &c) != nil {
		return
	}
	st := &calState{c: c}
	if c.Map != nil {
		m, err := calibrate.NewIsotonic(c.Map.X, c.Map.Y)
		if err != nil {
			return
		}
		st.m = m
	}
	g.cal.Store(st)
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
	errc := make(chan error, 5)
	s := g.cfg.Subjects
	go func() { errc <- follow(ctx, g.js, g.cfg.Stream, s.Update, g.updates.add) }()
	go func() { errc <- follow(ctx, g.js, g.cfg.Stream, s.Plan, g.planned.add) }()
	go func() { errc <- follow(ctx, g.js, g.cfg.Stream, s.Calibration, g.calibrated) }()
	go func() {
		errc <- follow(ctx, g.js, g.cfg.Stream, s.Exec, func(r natsjs.Record) {
			var gr schemas.Group
			if json.Unmarshal(r.Data, &gr) == nil {
				g.truths.addAnchor(gr)
			}
		})
	}()
	go func() {
		errc <- follow(ctx, g.js, g.cfg.Stream, s.Execution, func(r natsjs.Record) {
			var e schemas.Execution
			if json.Unmarshal(r.Data, &e) == nil {
				g.truths.addExecution(e)
			}
		})
	}()
	var first error
	for range 5 {
		if err := <-errc; err != nil && first == nil {
			first = err
		}
	}
	return first
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
		fail(w, http.StatusBadRequest, "malformed JSON body: %v", err)
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

// postTrajectories validates every trajectory first and publishes only if
// all are valid: a bad request changes nothing.
func (g *Gateway) postTrajectories(w http.ResponseWriter, r *http.Request) {
	var raw []json.RawMessage
	if !readBody(w, r, &raw) {
		return
	}
	if len(raw) == 0 {
		fail(w, http.StatusBadRequest, "no trajectories: want a non-empty JSON array")
		return
	}
	msgs, trajs := make([]*message.Message, len(raw)), make([]schemas.Trajectory, len(raw))
	groupOf, idOf := map[trajKey]string{}, map[trajKey]string{}
	for i, b := range raw {
		t, err := schemas.DecodeTrajectory(b)
		if err == nil {
			err = schemas.CheckRun(t.Run, g.cfg.Run)
		}
		if err != nil {
			fail(w, http.StatusBadRequest, "trajectory %d: %v", i, err)
			return
		}
		if other, ok := groupOf[trajKey{t.Step, t.TrajID}]; ok && other != t.GroupID {
			fail(w, http.StatusBadRequest, "trajectory %d: %v", i, schemas.TrajIDTaken(t.TrajID, t.GroupID, other, t.Step))
			return
		}
		groupOf[trajKey{t.Step, t.TrajID}] = t.GroupID
		if g.planned.has(t.Step) {
			// Route would dead-letter it, and the step's update is (or will
			// be) of the trajectories it planned, not of these.
			next, _ := g.next(r.Context()) // without the stream's answer, past the newest planned or fused
			fail(w, http.StatusConflict, "trajectory %d: step %d was planned already, from the trajectories that came before its close; "+
				"a trainer resumed from a checkpoint numbers its steps on from the run's next, %d (GET /v1/runs/%s/steps), or starts a new --run",
				i, t.Step, next, g.cfg.Run)
			return
		}
		m, err := schemas.NewTrajMessage(t)
		if err != nil {
			fail(w, http.StatusInternalServerError, "trajectory %d: %v", i, err)
			return
		}
		id := m.Metadata.Get(schemas.MsgIDKey)
		if prev, ok := idOf[trajKey{t.Step, t.TrajID}]; ok && prev != id {
			fail(w, http.StatusBadRequest, "trajectory %d: %s of step %d is in the request twice, with other content", i, t.TrajID, t.Step)
			return
		}
		idOf[trajKey{t.Step, t.TrajID}] = id
		// Route would dead-letter either, and the step's update would give
		// the first one's advantage under this one's id.
		switch before, ok := g.sent.of(t.Step, t.TrajID); {
		case ok && before.group != t.GroupID:
			fail(w, http.StatusBadRequest, "trajectory %d: %v", i, schemas.TrajIDTaken(t.TrajID, t.GroupID, before.group, t.Step))
			return
		case ok && before.id != id:
			next, _ := g.next(r.Context())
			fail(w, http.StatusConflict, "trajectory %d: %s of group %s of step %d was sent before with other content; "+
				"a trainer resumed from a checkpoint numbers its steps on from the run's next, %d (GET /v1/runs/%s/steps), or starts a new --run",
				i, t.TrajID, t.GroupID, t.Step, next, g.cfg.Run)
			return
		}
		if size := natsjs.WireSize(m); g.cfg.MaxPayload > 0 && size > g.cfg.MaxPayload {
			fail(w, http.StatusRequestEntityTooLarge, "trajectory %d (%s) is %d bytes of JSON and headers, and the NATS server takes messages of at most %d bytes (its max_payload): "+
				"raise it (--nats-max-payload-mb for the embedded server, up to 64), or send shorter prompts and solutions", i, t.TrajID, size, g.cfg.MaxPayload)
			return
		}
		msgs[i], trajs[i] = m, t
	}
	alone, batched := g.byGroup(trajs, msgs)
	for _, out := range []struct {
		subject string
		msgs    []*message.Message
	}{{g.cfg.Subjects.Traj, alone}, {g.cfg.Subjects.Trajs, batched}} {
		if len(out.msgs) == 0 {
			continue
		}
		if err := g.pub.Publish(out.subject, out.msgs...); err != nil {
			notStored(w, "trajectories", err)
			return
		}
	}
	g.sent.add(trajs, msgs, g.planned)
	writeJSON(w, http.StatusAccepted, map[string]int{"accepted": len(msgs)})
}

// byGroup is what a request's trajectories (trajs, each encoded alone in
// msgs) are stored as: those of one group in one trajs message, in the
// order the group first comes in the request, as a trainer that sends a
// group at once would (route then handles one message where it handled G,
// and the count of messages is what bounds the pipeline's rate); a
// trajectory without others of its group in the request, alone. A group
// whose message would be over the server's max_payload goes one by one,
// as does everything without a trajs subject. A request sent again alike
// is stored as the same messages, under the same IDs: the server stores
// it once.
func (g *Gateway) byGroup(trajs []schemas.Trajectory, msgs []*message.Message) (alone, batched []*message.Message) {
	if g.cfg.Subjects.Trajs == "" {
		return msgs, nil
	}
	type key struct {
		step  int64
		group string
	}
	var order []key
	of := map[key][]int{}
	for i, t := range trajs {
		k := key{t.Step, t.GroupID}
		if of[k] == nil {
			order = append(order, k)
		}
		of[k] = append(of[k], i)
	}
	for _, k := range order {
		idx := of[k]
		if len(idx) == 1 {
			alone = append(alone, msgs[idx[0]])
			continue
		}
		group, payloads := make([]schemas.Trajectory, len(idx)), make([][]byte, len(idx))
		for j, i := range idx {
			group[j], payloads[j] = trajs[i], msgs[i].Payload
		}
		m := schemas.JoinTrajs(group, payloads)
		if g.cfg.MaxPayload > 0 && natsjs.WireSize(m) > g.cfg.MaxPayload {
			for _, i := range idx {
				alone = append(alone, msgs[i])
			}
			continue
		}
		batched = append(batched, m)
	}
	return alone, batched
}

// sent is what this gateway stored of the steps route has not planned:
// by step and trajectory id, the trajectory's group and de-duplication ID
// (run, step, group, id and a digest of its content). A trajectory sent
// again alike is stored once. Under the same id with other content (a
// trainer resumed from a checkpoint that sends its new rollouts as the
// step it crashed in) or in another group, route refuses it, and the
// update would carry the first one's advantage under its id: refused here
// at once, the trainer hears of it. What another gateway, or this one
// before a restart, stored only route refuses (dead-lettered, saying why).
type sent struct {
	mu  sync.Mutex
	ids map[int64]map[string]sentAs
}

type sentAs struct{ group, id string }

// of is how trajectory id of step was stored, if it was.
func (s *sent) of(step int64, id string) (sentAs, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	as, ok := s.ids[step][id]
	return as, ok
}

// add notes trajs, stored as msgs, and forgets the steps route has
// planned since.
func (s *sent) add(trajs []schemas.Trajectory, msgs []*message.Message, planned *planned) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for step := range s.ids {
		if planned.has(step) {
			delete(s.ids, step)
		}
	}
	for i, t := range trajs {
		if planned.has(t.Step) {
			continue
		}
		if s.ids[t.Step] == nil {
			s.ids[t.Step] = map[string]sentAs{}
		}
		s.ids[t.Step][t.TrajID] = sentAs{t.GroupID, msgs[i].Metadata.Get(schemas.MsgIDKey)}
	}
}

func (g *Gateway) closeStep(w http.ResponseWriter, r *http.Request) {
	step, ok := stepParam(w, r)
	if !ok {
		return
	}
	var body struct {
		Groups *int `json:"groups"`
	}
	if !readBody(w, r, &body) {
		return
	}
	if body.Groups == nil || *body.Groups < 0 {
		fail(w, http.StatusBadRequest, `body must be {"groups": n} with n >= 0`)
		return
	}
	sc := schemas.StepClose{Schema: schemas.Version, Run: g.cfg.Run, Step: step, Groups: *body.Groups}
	m, _ := schemas.NewMessage(fmt.Sprintf("%s/step/%d", g.cfg.Run, step), sc)
	if err := g.pub.Publish(g.cfg.Subjects.Step, m); err != nil {
		notStored(w, "watermark", err)
		return
	}
	writeJSON(w, http.StatusAccepted, sc)
}

func (g *Gateway) getUpdate(w http.ResponseWriter, r *http.Request) {
	step, ok := stepParam(w, r)
	if !ok {
		return
	}
	wait := time.Duration(0)
	if s := r.URL.Query().Get("wait"); s != "" {
		secs, err := strconv.ParseFloat(s, 64)
		if err != nil || secs < 0 || math.IsNaN(secs) {
			fail(w, http.StatusBadRequest, "wait %q: want seconds >= 0", s)
			return
		}
		wait = min(time.Duration(secs*float64(time.Second)), g.cfg.MaxWait)
	}
	data, seq, ready := g.updates.get(step)
	if ready != nil && wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-ready:
			data, seq, _ = g.updates.get(step)
		case <-t.C:
		case <-r.Context().Done():
			return
		case <-g.closing.Done():
			// The process stops: its server lets requests in flight end
			// before it closes, and a long poll would hold it up.
			unavailable(w, "the gateway is stopping: ask again for step %d's update (another gateway of the run, or this one once it is back)", step)
			return
		}
	}
	if data == nil && seq > 0 {
		st, err := g.js.Stream(r.Context(), g.cfg.Stream)
		var m *jetstream.RawStreamMsg
		if err == nil {
			m, err = st.GetMsg(r.Context(), seq)
		}
		if err != nil {
			unavailable(w, "read update of step %d: %v", step, err)
			return
		}
		data = m.Data
	}
	if data == nil {
		if last, ok := g.updates.newest(); ok && last.Step > step {
			// A step behind a fused one waits for an anchor group within
			// its deadline, or for a prediction, which has none.
			fail(w, http.StatusNotFound, "step %d has no update yet (waited %v), while step %d's is out: it is held back, waiting for an anchor group's execution "+
				"(up to --anchor-deadline) or for a group's prediction, which has no deadline; wmrl status shows it, and if a stage between predict and fuse "+
				"gave the prediction up, wmrl dlq --resend sends it back", step, wait, last.Step)
			return
		}
		fail(w, http.StatusNotFound, "step %d has no update yet (waited %v)", step, wait)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(data)
}

// StepsView is GET .../steps: where the run is, for a trainer that starts
// or resumes.
type StepsView struct {
	Run     string `json:"run"`
	Planned *int64 `json:"planned"` // the newest step planned (closed); null before any
	Fused   *int64 `json:"fused"`   // the newest step fused; null before any
	Next    int64  `json:"next"`    // the first step number no trajectory has used: past the newest planned, fused or sent to
}

func (g *Gateway) getSteps(w http.ResponseWriter, r *http.Request) {
	next, err := g.next(r.Context())
	if err != nil {
		unavailable(w, "read the newest trajectory: %v", err)
		return
	}
	v := StepsView{Run: g.cfg.Run, Next: next}
	if n, ok := g.planned.newest(); ok {
		v.Planned = &n
	}
	if u, ok := g.updates.newest(); ok {
		step := u.Step
		v.Fused = &step
	}
	writeJSON(w, http.StatusOK, v)
}

// newestSent is one past the step of the newest trajectory stored, alone
// or in a trajs message (0: none, or it names no step). A trainer that
// crashed during a step, after sending some of its trajectories, resumes
// past it: that step is not planned yet, and the same ids in it with other
// rollouts are refused.
func (g *Gateway) newestSent(ctx context.Context) (int64, error) {
	if g.js == nil {
		return 0, nil
	}
	stream, err := g.js.Stream(ctx, g.cfg.Stream)
	if err != nil {
		return 0, err
	}
	var next int64
	for kind, subject := range map[schemas.Kind]string{schemas.KindTraj: g.cfg.Subjects.Traj, schemas.KindTrajs: g.cfg.Subjects.Trajs} {
		if subject == "" {
			continue
		}
		m, err := stream.GetLastMsgForSubject(ctx, subject)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return 0, err
		}
		if step, ok := schemas.NewestStep(kind, m.Data); ok {
			next = max(next, step+1)
		}
	}
	return next, nil
}

// next is the first step number no trajectory has used: past the newest
// step planned, fused or sent a trajectory (0 before any). Without the
// stream's answer, it is past the newest planned or fused, with the error.
func (g *Gateway) next(ctx context.Context) (int64, error) {
	next, err := g.newestSent(ctx)
	if n, ok := g.planned.newest(); ok {
		next = max(next, n+1)
	}
	if u, ok := g.updates.newest(); ok {
		next = max(next, u.Step+1)
	}
	return next, err
}

// CalibrationView is GET .../calibration.
type CalibrationView struct {
	Run        string              `json:"run"`
	Version    int64               `json:"version"`
	Map        *schemas.Thresholds `json:"map"` // null: identity
	PairsTotal int64               `json:"pairs_total"`
	Rho        float64             `json:"rho"`
	D          float64             `json:"d"`
	Step       *int64              `json:"step"` // the newest update's step; null before any
}

func (g *Gateway) getCalibration(w http.ResponseWriter, _ *http.Request) {
	v := CalibrationView{Run: g.cfg.Run, Rho: 1}
	if st := g.cal.Load(); st != nil {
		v.Version, v.Map, v.PairsTotal = st.c.Version, st.c.Map, st.c.PairsTotal
	}
	if u, ok := g.updates.newest(); ok {
		step := u.Step
		v.Rho, v.D, v.Step = u.Rho, u.D, &step
	}
	writeJSON(w, http.StatusOK, v)
}
