package pipeline

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/schemas"
)

// outsideStage stands for a stage in another process between predict and
// fuse (as examples/node-abstain is): it hands every prediction from
// pred_raw to judge and publishes what judge returns on pred, or, when judge
// returns nil, dead-letters the prediction, as a stage of its own does when
// what it calls is down.
func outsideStage(t *testing.T, ctx context.Context, js jetstream.JetStream, judge func(p schemas.Prediction, data []byte) []byte) {
	t.Helper()
	stream, err := js.Stream(ctx, StreamName("wmrl"))
	if err != nil {
		t.Fatal(err)
	}
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "judge",
		FilterSubject: "wmrl.default.pred_raw", AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	cc, err := cons.Consume(func(m jetstream.Msg) {
		var p schemas.Prediction
		if err := json.Unmarshal(m.Data(), &p); err != nil {
			t.Error(err)
			return
		}
		if out := judge(p, m.Data()); out == nil {
			dl, _ := json.Marshal(schemas.DeadLetter{Schema: 1, Subject: m.Subject(), Stage: "judge",
				Reason: "gave up after 10 deliveries: judge unreachable", Payload: string(m.Data()), Time: time.Now().UTC()})
			if _, err := js.Publish(ctx, "wmrl.default.dlq", dl); err != nil {
				t.Error(err)
			}
		} else if _, err := js.Publish(ctx, "wmrl.default.pred", out, jetstream.WithMsgID("judge/"+p.GroupID+"/"+m.Headers().Get(jetstream.MsgIDHeader))); err != nil {
			t.Error(err)
			return
		}
		m.Ack()
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cc.Stop)
}

// resendAll has ResendDeadLetters send run default's dead letters given
// up back from p's server, and counts what it did with them.
func resendAll(t *testing.T, ctx context.Context, p *Pipeline) map[Resend]int {
	t.Helper()
	got := map[Resend]int{}
	if err := ResendDeadLetters(ctx, StreamSource{NATSURL: p.URL(), Prefix: "wmrl"}, "default", ResendOptions{}, func(_ schemas.DeadLetter, r Resend) error {
		got[r]++
		return nil
	}); err != nil {
		t.Fatalf("resend: %v", err)
	}
	return got
}

// TestAStepHeldByAPredictionGivenUpIsFusedOnceItIsSentAgain: a stage
// between predict and fuse that dead-letters a prediction (as a stage of
// its own should, when what it calls stays down) holds that step for good,
// since fuse waits for every group's prediction: later steps are fused,
// that one never. The run says so after --stuck-after, and the gauge shows
// the wait; ResendDeadLetters sends the prediction back and the step is
// fused whole, while it keeps rejected input and a dead letter of a step
// fused already.
func TestAStepHeldByAPredictionGivenUpIsFusedOnceItIsSentAgain(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	cfg := testConfig(t)
	cfg.Steps = 4
	// Long enough for every other group of step 1 to be predicted on a
	// loaded machine: at 1 s, one CI run found 10 of 16 still on their way.
	cfg.StuckAfter = 3 * time.Second
	var out syncBuffer
	cfg.Quiet, cfg.Out = false, &out
	top := filepath.Join(t.TempDir(), "topology.yaml")
	if err := os.WriteFile(top, []byte("stages:\n  predict:\n    out:\n      pred: \"{prefix}.{run}.pred_raw\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg.TopologyFile = top
	cfg.HTTPAddr = "127.0.0.1:0"
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, nc, js := startClient(t, ctx, cfg)
	// The stage gives up on the first prediction of step 1 it is handed.
	var mu sync.Mutex
	var dropped string
	gaveUp := func() string { mu.Lock(); defer mu.Unlock(); return dropped }
	outsideStage(t, ctx, js, func(p schemas.Prediction, data []byte) []byte {
		mu.Lock()
		defer mu.Unlock()
		if p.Step == 1 && dropped == "" {
			dropped = p.GroupID
			return nil
		}
		return data
	})

	updates := func() map[int64]schemas.Update { return decodeUpdates(t, scanAll(t, nc, "wmrl.default.update")) }
	waitFor(t, 60*time.Second, func() bool { return strings.Contains(out.String(), "fuse: step 1 has waited") })
	waitFor(t, 60*time.Second, func() bool { time.Sleep(200 * time.Millisecond); return len(updates()) == 3 })
	if _, ok := updates()[1]; ok {
		t.Fatal("step 1 was fused without its group's prediction")
	}
	note := fmt.Sprintf("fuse: step 1 has waited 3s for the predictions of 1 of its %d groups (%s), which nothing has published", cfg.Groups, gaveUp())
	if !strings.Contains(out.String(), note) {
		t.Fatalf("no %q in the run's output:\n%s", note, out.String())
	}
	if w := testutil.ToFloat64(p.Metrics().PredictionWait); w < 3 {
		t.Errorf("wmrl_prediction_wait_seconds %v while step 1 has waited over 3 seconds", w)
	}

	// A trainer asking the gateway for step 1 hears why it waits.
	resp, err := http.Get(p.HTTPURL() + "/v1/runs/default/steps/1/update?wait=0")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound || !strings.Contains(string(body), "while step 3's is out: it is held back") {
		t.Errorf("the gateway answers a trainer asking for step 1 %d %s", resp.StatusCode, body)
	}
	st, err := ReadStatus(ctx, StreamSource{NATSURL: p.URL(), Prefix: "wmrl"}, "default")
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Unfused) != 1 || st.Unfused[0].Step != 1 || st.Unfused[0].Planned.IsZero() || st.LastUpdate == nil || st.LastUpdate.Step != 3 {
		t.Errorf("status: unfused %+v, last update %+v; want step 1 unfused behind step 3", st.Unfused, st.LastUpdate)
	}

	// Beside it, what a resend must keep: a group the pipeline's predict
	// gave up for step 0 (fused) and rejected input.
	fused, _ := json.Marshal(schemas.DeadLetter{Schema: 1, Subject: "wmrl.default.group", Stage: StagePredict,
		Reason: "gave up at once: predict: the world model is down", Payload: `{"schema":1,"run":"default","step":0,"group_id":"s0-g3"}`, Time: time.Now().UTC()})
	rejected, _ := json.Marshal(schemas.DeadLetter{Schema: 1, Subject: "wmrl.default.traj", Stage: StageRoute,
		Reason: "route: invalid message: malformed JSON", Payload: `{"schema": 1`, Time: time.Now().UTC()})
	for _, b := range [][]byte{fused, rejected} {
		if _, err := js.Publish(ctx, "wmrl.default.dlq", b); err != nil {
			t.Fatal(err)
		}
	}
	src := StreamSource{NATSURL: p.URL(), Prefix: "wmrl"}
	resend := func(src StreamSource, dry bool) map[Resend][]string {
		t.Helper()
		got := map[Resend][]string{}
		if err := ResendDeadLetters(ctx, src, "default", ResendOptions{DryRun: dry}, func(dl schemas.DeadLetter, r Resend) error {
			got[r] = append(got[r], dl.Stage)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return got
	}
	want := map[Resend][]string{Resent: {"judge"}, KeptFused: {StagePredict}, KeptRejected: {StageRoute}}
	if got := resend(src, true); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("dry run: %v, want %v", got, want)
	}
	time.Sleep(2 * time.Second)
	if _, ok := updates()[1]; ok || len(scanAll(t, nc, "wmrl.default.dlq")) != 3 {
		t.Fatal("a dry run sent something")
	}
	if got := resend(src, false); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("resend: %v, want %v", got, want)
	}
	if err := p.Wait(); err != nil { // returns once all 4 steps are fused
		t.Fatal(err)
	}
	if w := testutil.ToFloat64(p.Metrics().PredictionWait); w != 0 {
		t.Errorf("wmrl_prediction_wait_seconds %v with every step fused", w)
	}
	p.Stop()
	ups := decodeUpdates(t, readStored(t, cfg.DataDir, "wmrl.default.update"))
	if len(ups) != 4 || ups[1].Groups != ups[0].Groups || len(ups[1].Skipped) != 0 {
		t.Fatalf("step 1 fused with %d groups (step 0: %d), skipped %v", ups[1].Groups, ups[0].Groups, ups[1].Skipped)
	}
	if !strings.Contains(out.String(), "fuse: step 1 got its last prediction and was fused") {
		t.Errorf("the run did not say step 1 was fused at last:\n%s", out.String())
	}
	// Step 1's update is the newest stored; status still says the run
	// fused up to step 3.
	if st, err := ReadStatus(ctx, StreamSource{DataDir: cfg.DataDir, Prefix: "wmrl"}, "default"); err != nil {
		t.Fatal(err)
	} else if len(st.Unfused) != 0 || st.LastUpdate == nil || st.LastUpdate.Step != 3 {
		top := int64(-1)
		if st.LastUpdate != nil {
			top = st.LastUpdate.Step
		}
		t.Errorf("status of the stopped run: unfused %+v, fused up to step %d; want every step fused, up to 3", st.Unfused, top)
	}
	if n := len(readStored(t, cfg.DataDir, "wmrl.default.dlq")); n != 2 {
		t.Errorf("%d dead letters left, want the 2 kept", n)
	}
	// The stopped pipeline's store: what is left is kept again.
	if got := resend(StreamSource{DataDir: cfg.DataDir, Prefix: "wmrl"}, false); len(got[Resent]) != 0 || len(got[KeptFused]) != 1 {
		t.Errorf("a second resend sent %v again", got[Resent])
	}
}

// TestAScoreOutOfRangeFromAnOutsideStageIsDeadLettered: a shaping stage
// between predict and fuse with a bug (it scales one world-model group's
// scores of step 1 by 1e300, finite numbers JSON carries) must not stop
// the run. Before scores were bounded (schemas.MaxScore), fuse fused that
// step into advantages of NaN, could not encode the update, and failed
// every later message on it: no step after 0 was ever published. Now fuse
// and pair refuse the prediction, naming the score, and the step waits
// for it as for any prediction an outside stage did not send.
func TestAScoreOutOfRangeFromAnOutsideStageIsDeadLettered(t *testing.T) {
	cfg := testConfig(t)
	cfg.Steps = 4
	top := filepath.Join(t.TempDir(), "topology.yaml")
	if err := os.WriteFile(top, []byte("stages:\n  predict:\n    out:\n      pred: \"{prefix}.{run}.pred_raw\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg.TopologyFile = top
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_, nc, js := startClient(t, ctx, cfg)
	var mu sync.Mutex
	var scaled string
	outsideStage(t, ctx, js, func(p schemas.Prediction, data []byte) []byte {
		mu.Lock()
		defer mu.Unlock()
		if p.Step != 1 || p.Anchor || scaled != "" {
			return data
		}
		scaled = p.GroupID
		for _, it := range p.Items {
			if it.Score != nil {
				*it.Score *= 1e300
			}
		}
		out, err := json.Marshal(p)
		if err != nil {
			t.Error(err)
		}
		return out
	})

	updates := func() map[int64]schemas.Update { return decodeUpdates(t, scanAll(t, nc, "wmrl.default.update")) }
	waitFor(t, 60*time.Second, func() bool { time.Sleep(200 * time.Millisecond); return len(updates()) == 3 })
	if _, ok := updates()[1]; ok {
		t.Fatal("step 1 was fused with a prediction the pipeline refuses")
	}
	stages := map[string]bool{}
	for _, b := range scanAll(t, nc, "wmrl.default.dlq") {
		var dl schemas.DeadLetter
		if err := json.Unmarshal(b, &dl); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(dl.Reason, "is beyond ±1e+100, the largest score the pipeline takes") || GivenUp(dl) {
			t.Errorf("dead letter from %s: %q", dl.Stage, dl.Reason)
		}
		stages[dl.Stage] = true
	}
	if !stages[StageFuse] || !stages[StagePair] || len(stages) != 2 {
		t.Errorf("dead letters from %v, want fuse and pair (both read pred)", stages)
	}
}

// A dead letter must fit the server's max_payload, or it is never stored
// and its message is handed back for ever. A message near the limit,
// escaped into the dead letter's JSON string, can double: its payload is
// cut to fit, saying so, with the whole at its stream sequence, which a
// resend sends (or, once the stream no longer has it, keeps the letter).
// Before, a rejected trajectory of 1 MB on a 1 MiB server was never
// dead-lettered, and nothing was said.
func TestADeadLetterOverMaxPayloadIsCutAndResentWhole(t *testing.T) {
	cfg := testConfig(t)
	cfg.Source, cfg.MaxPayloadMB = SourceExternal, 1
	var out syncBuffer
	cfg.Out, cfg.Quiet = &out, false
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, nc, js := startClient(t, ctx, cfg)
	big := func(schema int, step int64) []byte {
		tr := schemas.Trajectory{Schema: schema, Run: "default", Step: step, GroupID: "g", TrajID: "t", GroupSize: 2, TaskID: "x",
			Prompt: "p", Response: strings.Repeat(`"`, 500<<10)} // 1 MB of JSON; 2 MB escaped again
		b, _ := json.Marshal(tr)
		return b
	}
	rejected := big(2, 0)
	if _, err := js.Publish(ctx, "wmrl.default.traj", rejected); err != nil {
		t.Fatal(err)
	}
	var dl schemas.DeadLetter
	waitFor(t, 30*time.Second, func() bool {
		dls := scanAll(t, nc, "wmrl.default.dlq")
		return len(dls) == 1 && json.Unmarshal(dls[0], &dl) == nil
	})
	if dl.PayloadBytes != len(rejected) || dl.Seq == 0 || !strings.HasPrefix(string(rejected), dl.Payload) || len(dl.Payload) < len(rejected)/3 ||
		!strings.Contains(dl.Reason, "schema 2") {
		t.Fatalf("dead letter: %d of %d bytes at seq %d, reason %q", len(dl.Payload), dl.PayloadBytes, dl.Seq, dl.Reason)
	}
	if want := fmt.Sprintf("(its payload cut to %d of %d bytes to fit the server's max_payload; the whole is at stream sequence %d)", len(dl.Payload), len(rejected), dl.Seq); !strings.Contains(out.String(), want) {
		t.Errorf("the run did not say %q:\n%s", want, out.String())
	}

	// Given up (an outside stage's, say): sent back whole from the stream;
	// one whose whole is gone is kept.
	whole := big(1, 5)
	ack, err := js.Publish(ctx, "wmrl.default.traj", whole)
	if err != nil {
		t.Fatal(err)
	}
	for _, seq := range []uint64{ack.Sequence, ack.Sequence + 1000} {
		b, _ := json.Marshal(schemas.DeadLetter{Schema: 1, Subject: "wmrl.default.traj", Stage: "judge", Reason: "gave up after 10 deliveries: judge unreachable",
			Payload: string(whole[:100]), PayloadBytes: len(whole), Seq: seq, Time: time.Now().UTC()})
		if _, err := js.Publish(ctx, "wmrl.default.dlq", b); err != nil {
			t.Fatal(err)
		}
	}
	got := resendAll(t, ctx, p)
	if got[Resent] != 1 || got[KeptCut] != 1 || got[KeptRejected] != 1 {
		t.Fatalf("resend: %v; want one resent whole, one kept (its whole gone), the rejected one kept", got)
	}
	trajs := scanAll(t, nc, "wmrl.default.traj")
	if last := trajs[len(trajs)-1]; string(last) != string(whole) {
		t.Errorf("resent %d bytes, want the whole %d", len(last), len(whole))
	}
}
