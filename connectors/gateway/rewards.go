package gateway

import (
	"fmt"
	"net/http"
	"strings"

	"github.com/wmrl/wmrl/schemas"
)

// Reward endpoints for trainers that take only rewards. They return the
// world model's score through the current isotonic map (debiased), or the
// real score once that exact solution was executed as an anchor. GRPO
// normalises rewards within a group, which cancels any per-group weight: these
// endpoints give debiasing only; denoising needs the fused advantages of the
// update. An ungraded trajectory gets null, never an invented score.

// reward scores one solution.
func (g *Gateway) reward(r *http.Request, task, prompt, response string) (*float64, error) {
	if s, ok := g.truths.lookup(prompt, response); ok {
		return &s, nil
	}
	t := schemas.Trajectory{Schema: schemas.Version, Run: g.cfg.Run, TaskID: task, Prompt: prompt, Response: response}
	scores, err := g.cfg.WorldModel.Predict(r.Context(), []schemas.Trajectory{t})
	if err != nil {
		return nil, err
	}
	if len(scores) != 1 || !scores[0].Graded {
		return nil, nil
	}
	v := scores[0].Value
	if st := g.cal.Load(); st != nil && st.m != nil {
		v = st.m.Predict(v)
	}
	return &v, nil
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
	rewards := make([]*float64, len(body.Query))
	for i, q := range body.Query {
		prompt, task := "", "openrlhf"
		if body.Prompts != nil {
			prompt = body.Prompts[i]
		}
		if body.Labels != nil && body.Labels[i] != nil {
			task = fmt.Sprint(body.Labels[i])
		}
		v, err := g.reward(r, task, prompt, strings.TrimPrefix(q, prompt))
		if err != nil {
			fail(w, http.StatusBadGateway, "world model on query %d: %v", i, err)
			return
		}
		rewards[i] = v
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
	task := "slime"
	if body.Label != nil {
		task = fmt.Sprint(body.Label)
	}
	v, err := g.reward(r, task, *body.Prompt, *body.Response)
	if err != nil {
		fail(w, http.StatusBadGateway, "world model: %v", err)
		return
	}
	writeJSON(w, http.StatusOK, v)
}
