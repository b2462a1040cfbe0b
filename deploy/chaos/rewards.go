package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
)

// This file asks the trainer gateways' reward endpoints, while the
// processes are killed, for the reward of solutions the run executed as
// anchors: a gateway answers those with their real score, not the world
// model's, once it has read the execution, and a restarted one reads the
// newest steps' executions at its start. Before the rehearsal asked, none
// could have seen a restarted gateway answer the world model's score for
// the anchors it read at its start (found by hand, and mended).

// rewardProbe is what the reward endpoints answered.
type rewardProbe struct {
	// asked: anchors asked for; again: of them, anchors asked for once
	// before, a while ago (the gateways restarted since, most likely).
	asked, again, real int
	// unanswered: asked for and never answered (every gateway down or
	// refusing all that time).
	unanswered int
	// wrong: answered, never with the real score; each a problem.
	wrong []string
}

// prober asks the reward endpoints of gw (slime's and OpenRLHF's in
// turn), every round, for one anchor of
// the newest update of the run (one the update names an anchor with a
// reward, its solution made again by policy) and for one asked for before,
// at least again ago and at most back steps behind the newest (a gateway
// keeps the newest 100,000 real scores: 6,250 steps of a rehearsal's 16
// anchored trajectories). Each is asked for until a gateway answers its
// real score, or for wait.
type prober struct {
	tr     *runConn
	gw     *gateways
	policy *sim.Policy

	round, wait, again time.Duration
	back               int64

	asked []anchorAsked // to ask for again, oldest first
}

// rehearsalProber is the rehearsal's prober.
func rehearsalProber(tr *runConn, gw *gateways, policy *sim.Policy) *prober {
	return &prober{tr: tr, gw: gw, policy: policy, round: 5 * time.Second, wait: time.Minute, again: time.Minute, back: 2000}
}

// anchorAsked is an anchor asked for, and when.
type anchorAsked struct {
	t    schemas.Trajectory
	real float64
	at   time.Time
}

// run asks for d.
func (pr *prober) run(ctx context.Context, d time.Duration) rewardProbe {
	var p rewardProbe
	end := time.Now().Add(d)
	probed := int64(-1)
	for time.Now().Add(pr.round).Before(end) && sleepCtx(ctx, pr.round) == nil {
		u, ok := newestUpdate(ctx, pr.tr)
		if !ok || u.Step == probed {
			continue
		}
		probed = u.Step
		// One asked before, the oldest within back that is old enough.
		for i, a := range pr.asked {
			if a.t.Step >= u.Step-pr.back && time.Since(a.at) >= pr.again {
				p.again++
				pr.ask(ctx, &p, a, 1, " again, "+time.Since(a.at).Round(time.Second).String()+" after its update")
				pr.asked = pr.asked[i+1:]
				break
			}
		}
		var anchors []schemas.UpdateItem
		for _, it := range u.Items {
			if it.Source == "anchor" && it.Reward != nil {
				anchors = append(anchors, it)
			}
		}
		if len(anchors) == 0 {
			continue
		}
		it := anchors[p.asked%len(anchors)]
		t, ok := trajectory(pr.policy, u.Step, it.TrajID)
		if !ok {
			p.asked++
			p.wrong = append(p.wrong, fmt.Sprintf("step %d's update names anchor %s, which the trainer never sent", u.Step, it.TrajID))
			continue
		}
		a := anchorAsked{t: t, real: *it.Reward, at: time.Now()}
		pr.ask(ctx, &p, a, 0, "")
		pr.asked = append(pr.asked, a)
	}
	return p
}

// ask asks for a's reward, the nth time, and counts the answer in p. The
// endpoint goes by the step and n: an anchor asked again is asked of the
// other.
func (pr *prober) ask(ctx context.Context, p *rewardProbe, a anchorAsked, n int, when string) {
	endpoint := rewardEndpoints[(int(a.t.Step)+n)%len(rewardEndpoints)]
	p.asked++
	got, answered := askReward(ctx, pr.gw, endpoint, a.t, a.real, pr.wait)
	switch {
	case answered && got != nil && *got == a.real:
		p.real++
	case answered:
		p.wrong = append(p.wrong, fmt.Sprintf("step %d's anchor %s, asked%s: %s answered %s for %v, not its real score %v",
			a.t.Step, a.t.TrajID, when, endpoint.path, show(got), pr.wait, a.real))
	case ctx.Err() == nil:
		p.unanswered++
	}
}

func show(v *float64) string {
	if v == nil {
		return "null"
	}
	return fmt.Sprint(*v)
}

// newestUpdate is the run's newest update; ok is false when there is none
// or the server does not answer (it starts again).
func newestUpdate(ctx context.Context, tr *runConn) (schemas.Update, bool) {
	var u schemas.Update
	ask, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	data, ok, err := tr.lastMsg(ask, schemas.KindUpdate)
	if !ok || err != nil || json.Unmarshal(data, &u) != nil {
		return u, false
	}
	return u, true
}

// trajectory is trajectory id of step as the trainer sent it.
func trajectory(policy *sim.Policy, step int64, id string) (schemas.Trajectory, bool) {
	trajs, _ := policy.Step(step)
	for _, t := range trajs {
		if t.TrajID == id {
			return t, true
		}
	}
	return schemas.Trajectory{}, false
}

// rewardEndpoint is a reward endpoint the probe asks: how a solution is
// asked for, and how its reward is read from the answer.
type rewardEndpoint struct {
	path string
	body func(t schemas.Trajectory) any
	read func(b []byte) (*float64, error)
}

// rewardEndpoints are the gateway's, asked for in turn: slime's, one
// solution a request, and OpenRLHF's, a batch (of one here) whose queries
// are the prompt and the solution together.
var rewardEndpoints = []rewardEndpoint{
	{
		path: "/rewards/slime",
		body: func(t schemas.Trajectory) any {
			return map[string]string{"prompt": t.Prompt, "response": t.Response, "label": t.TaskID}
		},
		read: func(b []byte) (*float64, error) {
			var v *float64
			return v, json.Unmarshal(b, &v)
		},
	},
	{
		path: "/rewards/openrlhf",
		body: func(t schemas.Trajectory) any {
			return map[string][]string{"query": {t.Prompt + t.Response}, "prompts": {t.Prompt}, "labels": {t.TaskID}}
		},
		read: func(b []byte) (*float64, error) {
			var v struct{ Rewards []*float64 }
			if err := json.Unmarshal(b, &v); err != nil {
				return nil, err
			}
			if len(v.Rewards) != 1 {
				return nil, fmt.Errorf("%d rewards for one query", len(v.Rewards))
			}
			return v.Rewards[0], nil
		},
	},
}

// askReward asks the gateways' endpoint in turn, a second apart, for t's
// reward until one answers real, or for wait. It returns the last answer,
// and whether any came.
func askReward(ctx context.Context, gw *gateways, endpoint rewardEndpoint, t schemas.Trajectory, real float64, wait time.Duration) (last *float64, answered bool) {
	body, _ := json.Marshal(endpoint.body(t))
	end := time.Now().Add(wait)
	for {
		b, err := gw.ask(ctx, endpoint.path, body)
		var v *float64
		if err == nil {
			v, err = endpoint.read(b)
		}
		if err == nil {
			last, answered = v, true
			if v != nil && *v == real {
				return last, true
			}
		}
		if !time.Now().Add(time.Second).Before(end) || sleepCtx(ctx, time.Second) != nil {
			return last, answered
		}
	}
}

// ask posts body to path of the next gateway and returns its 200 answer.
func (g *gateways) ask(ctx context.Context, path string, body []byte) ([]byte, error) {
	url, resp, b, err := g.send(ctx, path, body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("POST %s: %s: %s", url, resp.Status, bytes.TrimSpace(b))
	}
	return b, nil
}
