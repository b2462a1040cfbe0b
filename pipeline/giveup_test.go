package pipeline

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
	"github.com/wmrl/wmrl/stages/predict"
	"github.com/wmrl/wmrl/stages/route"
)

// oneBrokenGroup is a policy of groups groups of 4 a step, the ID of step
// 0's first group (the one a test breaks), and a pipeline that waits for
// trajectories from outside.
func oneBrokenGroup(t *testing.T, groups int) (sim.Policy, string, Config) {
	pol := sim.Policy{Run: "default", Tasks: 4, Groups: groups, GroupSize: 4}
	trajs, _ := pol.Step(0)
	cfg := testConfig(t)
	cfg.Source = SourceExternal
	return pol, trajs[0].GroupID, cfg
}

// brokenExecutor fails every trajectory of one group, as a sandbox service
// that is down fails a request, and scores the rest.
type brokenExecutor struct{ group string }

func (e brokenExecutor) Execute(_ context.Context, t schemas.Trajectory) (execute.Result, error) {
	if t.GroupID == e.group {
		return execute.Result{}, errors.New("sandbox service unreachable")
	}
	return execute.Result{Status: schemas.ExecScored, Score: 0.5}, nil
}

// An anchor group whose execution is dead-lettered leaves its prediction in
// the pair stage with nothing to join. It goes to the dead letters after
// --pair-wait, saying what it waited for, instead of being held (and
// redelivered after every restart) for good; the other anchor group pairs
// as usual and the step is fused.
func TestOrphanedAnchorSideIsDeadLetteredAfterPairWait(t *testing.T) {
	pol, broken, cfg := oneBrokenGroup(t, 2)
	cfg.Anchors = route.SchedulerConfig{Fraction: 1, MinPerStep: 1}
	cfg.ExecutorImpl = brokenExecutor{group: broken}
	cfg.MaxAttempts = 2
	cfg.AnchorDeadline = 500 * time.Millisecond
	cfg.PairWait = 2 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, nc, js := startClient(t, ctx, cfg)
	letters := make(chan *nats.Msg, 16)
	sub, err := nc.ChanSubscribe("wmrl.default.dlq", letters)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	publishStep(t, ctx, js, pol, 0)

	byStage := map[string]schemas.DeadLetter{}
	timeout := time.After(60 * time.Second)
	for len(byStage) < 2 {
		select {
		case m := <-letters:
			var d schemas.DeadLetter
			json.Unmarshal(m.Data, &d)
			byStage[d.Stage] = d
		case <-timeout:
			var got []string
			for stage, d := range byStage {
				got = append(got, stage+": "+d.Reason)
			}
			t.Fatalf("dead letters after 60s: %q; want one from execute and one from pair", got)
		}
	}
	ex, pr := byStage[StageExecute], byStage[StagePair]
	if !strings.Contains(ex.Reason, "sandbox service unreachable") || ex.Subject != "wmrl.default.exec" {
		t.Errorf("execute's dead letter: %+v", ex)
	}
	var pred schemas.Prediction
	json.Unmarshal([]byte(pr.Payload), &pred)
	if pr.Subject != "wmrl.default.pred" || pred.GroupID != broken || !strings.Contains(pr.Reason, "no execution within 2s") {
		t.Errorf("pair's dead letter: subject %s, group %s (want %s), reason %q", pr.Subject, pred.GroupID, broken, pr.Reason)
	}

	// Nothing is held any more, the other group paired, the step fused.
	cons, err := js.Consumer(ctx, "WMRL_WMRL", consumerName(StagePair, "default", schemas.KindPred))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0
	})
	if n := len(scanAll(t, nc, "wmrl.default.pairs")); n != 1 {
		t.Errorf("%d pairs messages, want 1 (the group that executed)", n)
	}
	waitFor(t, 30*time.Second, func() bool { return len(scanAll(t, nc, "wmrl.default.update")) == 1 })
	if err := p.Stop(); err != nil {
		t.Fatalf("pipeline: %v", err)
	}
}

// brokenWorldModel fails on every call for one group, as a world-model
// server that is down for longer than the retries last.
type brokenWorldModel struct{ group string }

func (w brokenWorldModel) Name() string { return "sim" }

func (w brokenWorldModel) Predict(ctx context.Context, trajs []schemas.Trajectory) ([]predict.Score, error) {
	if trajs[0].GroupID == w.group {
		return nil, errors.New("connection refused")
	}
	return sim.DefaultWorldModel().Predict(ctx, trajs)
}

// A group the world model fails on at every attempt is dead-lettered and
// recorded as ungraded, so that its step is still fused (without that
// group's world-model signal) instead of waiting for good for a prediction.
func TestStepIsFusedWhenTheWorldModelGivesUpOnAGroup(t *testing.T) {
	pol, broken, cfg := oneBrokenGroup(t, 3)
	cfg.WorldModelImpl = brokenWorldModel{group: broken}
	cfg.MaxAttempts = 2
	var out syncBuffer
	cfg.Out, cfg.Quiet = &out, false
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, nc, js := startClient(t, ctx, cfg)
	publishStep(t, ctx, js, pol, 0)

	var raw [][]byte
	waitFor(t, 60*time.Second, func() bool { raw = scanAll(t, nc, "wmrl.default.update"); return len(raw) == 1 })
	u := decodeUpdates(t, raw)[0]
	n := 0
	for _, it := range u.Items {
		if it.GroupID != broken {
			continue
		}
		n++
		if it.WMStatus != schemas.PredUngraded || it.Predicted != nil || (it.Source != "anchor" && it.Reward != nil) {
			t.Errorf("item %s of the failed group: %+v; want ungraded, no prediction, no world-model reward", it.TrajID, it)
		}
	}
	if n != 4 {
		t.Errorf("%d items of group %s in the update, want 4", n, broken)
	}
	var pred schemas.Prediction
	for _, b := range scanAll(t, nc, "wmrl.default.pred") {
		if json.Unmarshal(b, &pred); pred.GroupID == broken {
			break
		}
	}
	if pred.GroupID != broken || !strings.Contains(pred.Items[0].Reason, "world model failed on every attempt") || !strings.Contains(pred.Items[0].Reason, "connection refused") {
		t.Errorf("prediction of the failed group: %+v", pred)
	}
	var dl schemas.DeadLetter
	waitFor(t, 30*time.Second, func() bool {
		for _, b := range scanAll(t, nc, "wmrl.default.dlq") {
			json.Unmarshal(b, &dl)
		}
		return dl.Stage == StagePredict
	})
	if !strings.Contains(dl.Reason, "gave up after 2 deliveries") || !strings.Contains(dl.Reason, "recorded the group as ungraded") {
		t.Errorf("dead letter: %q", dl.Reason)
	}
	// The run's output says what happened, once each.
	for _, want := range []string{
		"predict: world model on group " + broken + ": connection refused (delivery 1 of 2; retrying)",
		"predict: dead-lettered to wmrl.default.dlq: gave up after 2 deliveries",
	} {
		if strings.Count(out.String(), want) != 1 {
			t.Errorf("output has %q %d times, want once:\n%s", want, strings.Count(out.String(), want), out.String())
		}
	}
	if err := p.Stop(); err != nil {
		t.Fatalf("pipeline: %v", err)
	}
}
