package main

import (
	"context"
	"encoding/json"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/gateway"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
)

// The reward probe asks a real trainer gateway, on an embedded server, for
// an anchor of the newest update: one the gateway read the execution of
// is answered with its real score; an update whose anchor's reward is not
// what the gateway answers (as when a gateway answers the world model for
// an executed solution) is a wrong answer, named; a gateway that never
// answers is counted apart.
func TestTheRewardProbeTellsTheRealScoreFromAnother(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, tr := rehearsalServer(t, ctx)
	stream := streamName("rehearse")
	if _, err := tr.js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{"rehearse.>"}}); err != nil {
		t.Fatal(err)
	}
	sub := tr.subject
	g, err := gateway.New(gateway.Config{Run: "r", Stream: stream, WorldModel: sim.DefaultWorldModel(), Subjects: gateway.Subjects{
		Update: sub(schemas.KindUpdate), Plan: sub(schemas.KindPlan), Calibration: sub(schemas.KindCalibration),
		Exec: sub(schemas.KindExec), Execution: sub(schemas.KindExecution)}}, tr.js, nil)
	if err != nil {
		t.Fatal(err)
	}
	go g.Run(ctx)
	srv := httptest.NewServer(g.Handler())
	defer srv.Close()
	publish := func(k schemas.Kind, v any) {
		t.Helper()
		b, _ := json.Marshal(v)
		if _, err := tr.js.Publish(ctx, sub(k), b); err != nil {
			t.Fatal(err)
		}
	}
	policy := trainerPolicy("r", 4, 4)
	// step's first group executed as an anchor, and an update naming its
	// rewards as the executed scores plus off.
	anchored := func(step int64, off float64) {
		trajs, _ := policy.Step(step)
		group := trajs[:4]
		publish(schemas.KindExec, schemas.Group{Schema: schemas.Version, Run: "r", Step: step, GroupID: group[0].GroupID, Anchor: true, Trajectories: group})
		e := schemas.Execution{Schema: schemas.Version, Run: "r", Step: step, GroupID: group[0].GroupID}
		u := schemas.Update{Schema: schemas.Version, Run: "r", Step: step}
		for i, tj := range group {
			score, reward := 0.1*float64(i)+0.05, 0.1*float64(i)+0.05+off
			e.Items = append(e.Items, schemas.ExecItem{TrajID: tj.TrajID, Score: &score, Status: "ok"})
			u.Items = append(u.Items, schemas.UpdateItem{TrajID: tj.TrajID, GroupID: tj.GroupID, Source: "anchor", Reward: &reward})
		}
		publish(schemas.KindExecution, e)
		publish(schemas.KindUpdate, u)
	}
	pr := &prober{tr: tr, gw: newGateways([]string{srv.URL}, "r"), policy: policy, round: 100 * time.Millisecond, wait: 3 * time.Second, back: 1}
	probe := func() rewardProbe { return pr.run(ctx, time.Second) }

	anchored(3, 0)
	if p := probe(); p.asked != 1 || p.real != 1 || len(p.wrong) != 0 || p.unanswered != 0 {
		t.Errorf("an anchor the gateway has the execution of: %+v; want asked once, answered with its real score", p)
	}
	// Step 3's anchor is asked for again, of the other endpoint, with
	// step 4's (the endpoints go by the step: odd OpenRLHF's, even
	// slime's, and the other when asked again).
	anchored(4, 0)
	if p := probe(); p.asked != 2 || p.again != 1 || p.real != 2 || len(p.wrong) != 0 {
		t.Errorf("a new anchor and one asked before: %+v; want both asked, one again, each answered with its real score", p)
	}
	// Step 4's anchor again, and step 5's, whose update says other than
	// the gateway.
	anchored(5, 0.5)
	p := probe()
	if p.asked != 2 || p.again != 1 || p.real != 1 || len(p.wrong) != 1 || p.unanswered != 0 {
		t.Fatalf("an anchor whose update says other than the gateway: %+v; want two asked, one answered wrong", p)
	}
	if !strings.Contains(p.wrong[0], "step 5's anchor s5-g0-t") || !strings.Contains(p.wrong[0], "/rewards/openrlhf answered") || !strings.Contains(p.wrong[0], "not its real score 0.") {
		t.Errorf("the wrong answer is told as %q; want the step, the anchor and its real score", p.wrong[0])
	}
	// An anchor further back than back steps is not asked again.
	anchored(7, 0)
	if p := probe(); p.asked != 1 || p.again != 0 || p.real != 1 {
		t.Errorf("anchors of steps 5 and 7 asked before, 2 steps back: %+v; want only step 7's asked", p)
	}
	anchored(8, 0)
	pr.gw = newGateways([]string{"http://127.0.0.1:1"}, "r")
	if p := probe(); p.asked != 2 || p.real != 0 || len(p.wrong) != 0 || p.unanswered != 2 {
		t.Errorf("no gateway answering: %+v; want two asked, unanswered", p)
	}
}
