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
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/breaker"
)

// Reward endpoints for trainers that take only rewards. They return the
// world model's score through the current isotonic map (debiased), or the
// real score once that exact solution was executed as an anchor. GRPO
// normalises rewards within a group, which cancels any per-group weight: these
// endpoints give debiasing only; denoising needs the fused advantages of the
// update. An ungraded trajectory gets null, never an invented score.

// ask is one solution to score.
type ask struct{ task, prompt, response string }

// rewards scores solutions: the real score of those executed as anchors, the
// world model's through the current map for the rest. The rest go to the
// world model in one call, which an HTTP world model answers concurrently: a
// trainer's batch costs one round trip, not one per solution. A solution is
// named by a hash of its content, so the same solution gets the same score
// wherever it sits in a batch.
func (g *Gateway) rewards(ctx context.Context, asks []ask) ([]*float64, error) {
	out := make([]*float64, len(asks))
	var trajs []schemas.Trajectory
	var at []int
	for i, a := range asks {
		if s, ok := g.truths.lookup(a.prompt, a.response); ok {
			out[i] = &s
			continue
		}
		sum := sha256.Sum256([]byte(contentKey(a.prompt, a.response)))
		trajs = append(trajs, schemas.Trajectory{Schema: schemas.Version, Run: g.cfg.Run, TrajID: "rm-" + hex.EncodeToString(sum[:8]),
			TaskID: a.task, Prompt: a.prompt, Response: a.response})
		at = append(at, i)
	}
	if len(trajs) == 0 {
		return out, nil
	}
	call, err := g.cfg.Breaker.Ask()
	if err != nil {
		return nil, err
	}
	cctx, cancel := call.Context(ctx)
	scores, err := g.cfg.WorldModel.Predict(cctx, trajs)
	cancel()
	if err == nil && len(scores) != len(trajs) {
		err = fmt.Errorf("world model %s returned %d scores for %d solutions", g.cfg.WorldModel.Name(), len(scores), len(trajs))
	}
	if down := call.End(ctx, err); down != nil { // ctx done: the trainer hung up, which says nothing of the world model
		return nil, down
	}
	if err != nil {
		return nil, err
	}
	st := g.cal.Load()
	for j, s := range scores {
		if !s.Graded {
			continue
		}
		v := s.Value
		if st != nil && st.m != nil {
			v = st.m.Predict(v)
		}
		out[at[j]] = &v
	}
	return out, nil
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
		worldModelFailed(w, err)
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
		worldModelFailed(w, err)
		return
	}
	writeJSON(w, http.StatusOK, v[0])
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
