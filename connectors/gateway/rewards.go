package gateway

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/breaker"
	"github.com/wmrl/wmrl/stages/predict"
)

// Reward endpoints for trainers that take only rewards. They return the
// world model's score through the current isotonic map (debiased), or the
// real score once that exact solution was executed as an anchor. GRPO
// normalises rewards within a group, which cancels any per-group weight: these
// endpoints give debiasing only; denoising needs the fused advantages of the
// update. An ungraded trajectory gets null, never an invented score.

// ask is one solution to score.
type ask struct{ task, prompt, response string }

// key names a solution by its content, as the world model sees it.
func (a ask) key() digest { return digestOf(a.task, a.prompt, a.response) }

// rewards scores solutions: the real score of those executed as anchors, the
// world model's through the current map for the rest. The rest go to the
// world model in one call, which an HTTP world model answers concurrently: a
// trainer's batch costs one round trip, not one per solution. A solution is
// named by a hash of its content, so the same solution gets the same score
// wherever it sits in a batch, and a solution the world model is scoring or
// scored lately (Config.Remember) is not asked again: a trainer that gave
// up waiting and asks again (its client's timeout, a load balancer's) waits
// for the call it paid for. The call goes on when the trainer hangs up; its
// world-model scores are remembered raw and mapped when answered, so a
// refit since is applied.
func (g *Gateway) rewards(ctx context.Context, asks []ask) ([]*float64, error) {
	out := make([]*float64, len(asks))
	waits := make([]*prediction, len(asks))
	var mine []*prediction
	var trajs []schemas.Trajectory
	for i, a := range asks {
		if s, ok := g.truths.lookup(a.prompt, a.response); ok {
			out[i] = &s
			continue
		}
		k := a.key()
		p, asked := g.predictions.get(k)
		waits[i] = p
		if !asked {
			mine = append(mine, p)
			trajs = append(trajs, schemas.Trajectory{Schema: schemas.Version, Run: g.cfg.Run, TrajID: "rm-" + hex.EncodeToString(k[:8]),
				TaskID: a.task, Prompt: a.prompt, Response: a.response})
		}
	}
	if len(mine) > 0 && g.closing.Err() != nil {
		// A call begun now might not end before the server closes: the
		// client asks another gateway of the run at once instead.
		g.predictions.settle(mine, nil, errClosing)
		return nil, errClosing
	}
	g.answered(asks, waits, len(mine))
	if len(mine) > 0 {
		call, err := g.cfg.Breaker.Ask()
		if err != nil {
			g.predictions.settle(mine, nil, err)
			return nil, err
		}
		go g.predict(call, mine, trajs)
	}
	st := g.cal.Load()
	for i, p := range waits {
		if p == nil {
			continue
		}
		select {
		case <-p.done:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		if p.err != nil {
			return nil, p.err
		}
		if !p.score.Graded {
			continue
		}
		v := p.score.Value
		if st != nil && st.m != nil {
			v = st.m.Predict(v)
		}
		out[i] = &v
	}
	return out, nil
}

// answered tells Config.Answered how asks are answered: those without a
// prediction to wait for by their execution, the rest by the world model,
// asked for the first mine of them.
func (g *Gateway) answered(asks []ask, waits []*prediction, mine int) {
	if g.cfg.Answered == nil {
		return
	}
	waiting := 0
	for _, p := range waits {
		if p != nil {
			waiting++
		}
	}
	for how, n := range [...]int{len(asks) - waiting, mine, waiting - mine} { // in the order of Answers
		if n > 0 {
			g.cfg.Answered(Answers[how], n)
		}
	}
}

// predict asks the world model for ps, until it answers or the gateway
// stops, whoever still waits for them.
func (g *Gateway) predict(call breaker.Call, ps []*prediction, trajs []schemas.Trajectory) {
	ctx, cancel := call.Context(g.life)
	scores, err := g.askWorldModel(ctx, trajs)
	cancel()
	if err == nil && len(scores) != len(trajs) {
		err = fmt.Errorf("world model %s returned %d scores for %d solutions", g.cfg.WorldModel.Name(), len(scores), len(trajs))
	}
	if down := call.End(g.life, err); down != nil { // life done: the gateway stopped, which says nothing of the world model
		err = down
	}
	if err == nil && g.cfg.Predicted != nil {
		g.cfg.Predicted(scores)
	}
	g.predictions.settle(ps, scores, err)
}

// askWorldModel is the world model's Predict, a panic in it an error: the
// call runs apart from the request (net/http would have recovered it there),
// and a panic would end the process.
func (g *Gateway) askWorldModel(ctx context.Context, trajs []schemas.Trajectory) (scores []predict.Score, err error) {
	defer func() {
		if r := recover(); r != nil {
			scores, err = nil, fmt.Errorf("world model %s panicked: %v", g.cfg.WorldModel.Name(), r)
		}
	}()
	return g.cfg.WorldModel.Predict(ctx, trajs)
}

// digest names a solution's content in 32 bytes (schemas.Digest): what
// the gateway keeps of solutions for a run of days is their digests, not
// their text.
type digest [sha256.Size]byte

func digestOf(parts ...string) digest { return schemas.Digest(parts...) }

// prediction is the world model's score of one solution: done closes when
// the call ends, with score or err.
type prediction struct {
	key   digest
	done  chan struct{}
	score predict.Score
	err   error
	at    time.Time // when it ended
}

// predictions remembers the world model's scores of the reward endpoints'
// solutions for a while (keep at most, each for ttl after it came), and the
// calls under way. A failed call, or a reply the world model gave that could
// not be read, is not remembered: the next ask calls again.
type predictions struct {
	mu    sync.Mutex
	byKey map[digest]*prediction
	order []*prediction // oldest first
	keep  int
	ttl   time.Duration
	now   func() time.Time
}

func newPredictions(keep int, ttl time.Duration) *predictions {
	return &predictions{byKey: map[digest]*prediction{}, keep: keep, ttl: ttl, now: time.Now}
}

// get returns k's prediction, and whether it was asked for already (under
// way, or come within ttl); if not, the caller must ask and settle it.
func (ps *predictions) get(k digest) (p *prediction, asked bool) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	now := ps.now()
	if p := ps.byKey[k]; p != nil && !ps.stale(p, now) {
		return p, true
	}
	p = &prediction{key: k, done: make(chan struct{})}
	ps.byKey[k] = p
	ps.order = append(ps.order, p)
	for len(ps.order) > 0 {
		old := ps.order[0]
		current := ps.byKey[old.key] == old
		if current && len(ps.order) <= ps.keep && !ps.stale(old, now) {
			break
		}
		if current {
			delete(ps.byKey, old.key) // one under way still answers who waits for it
		}
		ps.order[0] = nil
		ps.order = ps.order[1:]
	}
	return p, false
}

// stale: p came more than ttl ago. The lock is held.
func (ps *predictions) stale(p *prediction, now time.Time) bool {
	return !p.at.IsZero() && now.Sub(p.at) > ps.ttl
}

// settle ends the calls of ps with scores (in the same order) or err.
func (ps *predictions) settle(preds []*prediction, scores []predict.Score, err error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	now := ps.now()
	for i, p := range preds {
		if p.err = err; err == nil {
			p.score = scores[i]
		}
		p.at = now
		close(p.done)
		if (err != nil || !p.score.Graded) && ps.byKey[p.key] == p {
			delete(ps.byKey, p.key)
		}
	}
}

// openrlhf serves OpenRLHF's --remote_rm_url:
// {"query": [...], "prompts": [...], "labels": [...]} -> {"rewards": [...]}.
// query[i] is the full text; the prompt prefix is cut off when it is there.
func (g *Gateway) openrlhf(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Query   []string `json:"query"`
		Prompts []string `json:"prompts"`
		Labels  []any    `json:"labels"`
	}
	if !readBody(w, r, &body) {
		return
	}
	if len(body.Query) == 0 {
		fail(w, http.StatusBadRequest, `"query" must be a non-empty array of strings`)
		return
	}
	if (body.Prompts != nil && len(body.Prompts) != len(body.Query)) || (body.Labels != nil && len(body.Labels) != len(body.Query)) {
		fail(w, http.StatusBadRequest, "query, prompts and labels differ in length (%d, %d, %d)", len(body.Query), len(body.Prompts), len(body.Labels))
		return
	}
	asks := make([]ask, len(body.Query))
	for i, q := range body.Query {
		a := ask{task: "openrlhf"}
		if body.Prompts != nil {
			a.prompt = body.Prompts[i]
		}
		if body.Labels != nil && body.Labels[i] != nil {
			a.task = fmt.Sprint(body.Labels[i])
		}
		a.response = strings.TrimPrefix(q, a.prompt)
		asks[i] = a
	}
	rewards, err := g.rewards(r.Context(), asks)
	if err != nil {
		g.rewardFailed(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"rewards": rewards})
}

// slime serves slime's --rm-url: {"prompt", "response", "label"} -> number.
func (g *Gateway) slime(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Prompt   *string `json:"prompt"`
		Response *string `json:"response"`
		Label    any     `json:"label"`
	}
	if !readBody(w, r, &body) {
		return
	}
	if body.Prompt == nil || body.Response == nil {
		fail(w, http.StatusBadRequest, `body must have "prompt" and "response" strings`)
		return
	}
	a := ask{task: "slime", prompt: *body.Prompt, response: *body.Response}
	if body.Label != nil {
		a.task = fmt.Sprint(body.Label)
	}
	v, err := g.rewards(r.Context(), []ask{a})
	if err != nil {
		g.rewardFailed(w, err)
		return
	}
	writeJSON(w, http.StatusOK, v[0])
}

// errClosing: a reward request the stopping gateway would need a new
// world-model call for.
var errClosing = errors.New("gateway: closing")

// rewardFailed answers a reward request whose scores failed. A stopping
// gateway makes no new world-model call, and the calls cut off at its
// Close end with it: 503, so that the client asks again (another gateway
// of the run, or this one once it is back) rather than take a 502 for a
// world model that did not fail.
func (g *Gateway) rewardFailed(w http.ResponseWriter, err error) {
	if errors.Is(err, errClosing) || g.life.Err() != nil {
		unavailable(w, "the gateway is stopping: ask again (another gateway of the run, or this one once it is back)")
		return
	}
	worldModelFailed(w, err)
}

// worldModelFailed answers a reward request the world model could not
// score: 502 when it failed, 503 with a Retry-After (when the breaker will
// try it again) while it is known to be down.
func worldModelFailed(w http.ResponseWriter, err error) {
	var down *breaker.DownError
	if !errors.As(err, &down) {
		fail(w, http.StatusBadGateway, "world model: %v", err)
		return
	}
	wait := max(1, int(math.Ceil(time.Until(down.Next).Seconds())))
	w.Header().Set("Retry-After", strconv.Itoa(wait))
	fail(w, http.StatusServiceUnavailable, "world model: %v", err)
}
