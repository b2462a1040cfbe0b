package pipeline

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/connectors/gateway"
	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/fuse"
)

const token = "s3cret"

type httpTrainer struct {
	t    *testing.T
	base string
}

func (h httpTrainer) do(method, path string, body []byte, tok string) (int, []byte) {
	h.t.Helper()
	req, _ := http.NewRequest(method, h.base+path, bytes.NewReader(body))
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		h.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

func (h httpTrainer) want(code int, method, path string, body []byte, tok, msg string) []byte {
	h.t.Helper()
	got, b := h.do(method, path, body, tok)
	if got != code || (msg != "" && !strings.Contains(string(b), msg)) {
		h.t.Fatalf("%s %s: %d %s; want %d with %q", method, path, got, b, code, msg)
	}
	return b
}

// checkAnchors compares anchor rewards with the simulated executor's score
// of the same trajectories, computed here independently of the pipeline.
func checkAnchors(t *testing.T, u schemas.Update, trajs []schemas.Trajectory) {
	t.Helper()
	byID := map[string]schemas.Trajectory{}
	for _, tr := range trajs {
		byID[tr.TrajID] = tr
	}
	exe := &sim.Executor{Noise: 0.02}
	n := 0
	for _, it := range u.Items {
		if it.Source != "anchor" {
			continue
		}
		r, _ := exe.Execute(context.Background(), byID[it.TrajID])
		if it.Reward == nil || *it.Reward != r.Score {
			t.Fatalf("step %d %s: anchor reward %v, the executor gives %v", u.Step, it.TrajID, it.Reward, r.Score)
		}
		n++
	}
	if n == 0 {
		t.Fatalf("step %d has no anchor items", u.Step)
	}
}

// trainedOverHTTP starts a pipeline that waits for a trainer's
// trajectories, with its gateway, and a trainer of the gateway; both stop
// when the test ends.
func trainedOverHTTP(t *testing.T, anchorFraction float64) (context.Context, *Pipeline, httpTrainer) {
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPAddr, cfg.HTTPToken = SourceExternal, "127.0.0.1:0", token
	cfg.Anchors.Fraction = anchorFraction
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	p := started(t, ctx, cfg)
	return ctx, p, httpTrainer{t: t, base: p.HTTPURL() + "/v1/runs/default"}
}

func TestTrainerOverHTTPAndNATS(t *testing.T) {
	ctx, p, h := trainedOverHTTP(t, 0.25)
	pol := sim.Policy{Run: "default", Tasks: 8, Groups: 8, GroupSize: 8}

	var last schemas.Update
	for step := int64(0); step < 4; step++ {
		trajs, wm := pol.Step(step)
		body, _ := json.Marshal(trajs)
		h.want(http.StatusAccepted, "POST", "/trajectories", body, token, `"accepted":64`)
		h.want(http.StatusAccepted, "POST", fmt.Sprintf("/steps/%d/close", step), []byte(fmt.Sprintf(`{"groups": %d}`, wm.Groups)), token, "")
		b := h.want(http.StatusOK, "GET", fmt.Sprintf("/steps/%d/update?wait=60", step), nil, token, "")
		if err := json.Unmarshal(b, &last); err != nil || last.Step != step || len(last.Items) != len(trajs) {
			t.Fatalf("step %d: update %s (%v)", step, b, err)
		}
		checkFusion(t, last)
		checkAnchors(t, last, trajs)
	}

	// The same trainer over NATS.
	nc, err := nats.Connect(p.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	updates, err := natsjs.NewReader(ctx, js, StreamName("wmrl"), "wmrl.default.update", false)
	if err != nil {
		t.Fatal(err)
	}
	defer updates.Close()
	for step := int64(4); step < 6; step++ {
		publishStep(t, ctx, js, pol, step)
		trajs, _ := pol.Step(step)
		for {
			rec, err := updates.Next(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var u schemas.Update
			json.Unmarshal(rec.Data, &u)
			if u.Step == step {
				checkFusion(t, u)
				checkAnchors(t, u, trajs)
				break
			}
		}
	}

	// Calibration: the current map and the newest update's rho.
	var cal struct {
		Version int64
		Rho     float64
		Step    int64
		Map     *schemas.Thresholds
	}
	// The gateway follows the updates on its own; it may see step 5's a
	// moment after this test did.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		json.Unmarshal(h.want(http.StatusOK, "GET", "/calibration", nil, token, ""), &cal)
		if cal.Step == 5 || time.Now().After(deadline) {
			break
		}
	}
	if cal.Version == 0 || cal.Map == nil || cal.Step != 5 {
		t.Fatalf("calibration %+v: want a fitted map and the rho of step 5", cal)
	}

	// Reward endpoints: an executed anchor gets its real score.
	trajs, _ := pol.Step(3)
	var anchor schemas.Trajectory
	var truth float64
	for _, it := range last.Items {
		if it.Source == "anchor" {
			for _, tr := range trajs {
				if tr.TrajID == it.TrajID {
					anchor, truth = tr, *it.Reward
				}
			}
		}
	}
	q, _ := json.Marshal(map[string]any{"query": []string{anchor.Prompt + anchor.Response, "Solve task 1.print(2)"},
		"prompts": []string{anchor.Prompt, "Solve task 1."}, "labels": []any{anchor.TaskID, "task-1"}})
	var rr struct{ Rewards []*float64 }
	json.Unmarshal(h.want(http.StatusOK, "POST", "/rewards/openrlhf", q, token, ""), &rr)
	if len(rr.Rewards) != 2 || rr.Rewards[0] == nil || *rr.Rewards[0] != truth || rr.Rewards[1] == nil || *rr.Rewards[1] < 0 || *rr.Rewards[1] > 1 {
		t.Fatalf("openrlhf rewards %v; want the anchor's real score %v first", rr.Rewards, truth)
	}
	var one *float64
	json.Unmarshal(h.want(http.StatusOK, "POST", "/rewards/slime", []byte(`{"prompt":"p","response":"print(3)","label":"task-2"}`), token, ""), &one)
	if one == nil || *one < 0 || *one > 1 {
		t.Fatalf("slime reward %v", one)
	}
	// Asked again (a trainer that gave up waiting), the same solution is
	// answered from the world model's score it already gave.
	var again *float64
	json.Unmarshal(h.want(http.StatusOK, "POST", "/rewards/slime", []byte(`{"prompt":"p","response":"print(3)","label":"task-2"}`), token, ""), &again)
	if again == nil || *again != *one {
		t.Fatalf("slime reward asked again: %v; want %v", again, *one)
	}
	for answer, want := range map[gateway.Answer]float64{gateway.AnsweredByExecution: 1, gateway.AnsweredByWorldModel: 2, gateway.AnsweredRemembered: 1} {
		if got := testutil.ToFloat64(p.Metrics().RewardAnswers.WithLabelValues(string(answer))); got != want {
			t.Errorf("wmrl_reward_solutions_total{answer=%q} = %v, want %v", answer, got, want)
		}
	}
}

func TestGatewayRejectsBadRequestsAndChangesNothing(t *testing.T) {
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPAddr, cfg.HTTPToken = SourceExternal, "127.0.0.1:0", token
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := started(t, ctx, cfg)
	h := httpTrainer{t: t, base: p.HTTPURL() + "/v1/runs/default"}
	small := sim.Policy{Run: "default", Tasks: 2, Groups: 1, GroupSize: 2}
	trajs, _ := small.Step(0)
	good, _ := json.Marshal(trajs)
	var arr []map[string]any
	json.Unmarshal(good, &arr)
	delete(arr[1], "traj_id")
	oneBad, _ := json.Marshal(arr)
	twin := trajs[0] // another group of the step, naming its trajectory as the first group's does
	twin.GroupID = "other"
	twins, _ := json.Marshal(append(trajs, twin))

	h.want(http.StatusUnauthorized, "POST", "/trajectories", good, "", "bearer token")
	h.want(http.StatusUnauthorized, "POST", "/trajectories", good, "wrong", "bearer token")
	h.want(http.StatusBadRequest, "POST", "/trajectories", []byte(`[{"schema":1,`), token, "malformed JSON")
	h.want(http.StatusBadRequest, "POST", "/trajectories", oneBad, token, "trajectory 1: invalid message: missing field(s): traj_id")
	h.want(http.StatusBadRequest, "POST", "/trajectories", []byte(`[]`), token, "no trajectories")
	h.want(http.StatusBadRequest, "POST", "/trajectories", []byte(`{"schema":1}`), token, "malformed JSON body: want an array of trajectories, got an object")
	h.want(http.StatusBadRequest, "POST", "/trajectories", twins, token, "trajectory 2: invalid message: trajectory id \\\"s0-g0-t0\\\" of group other is taken by group s0-g0 of step 0: trajectory ids must be unique within a step")
	h.want(http.StatusRequestEntityTooLarge, "POST", "/trajectories", bytes.Repeat([]byte(" "), 17<<20), token, "over")
	h.want(http.StatusBadRequest, "POST", "/steps/x/close", []byte(`{"groups":1}`), token, "want a non-negative integer")
	h.want(http.StatusBadRequest, "POST", "/steps/0/close", []byte(`{}`), token, `n >= 0`)
	h.want(http.StatusNotFound, "GET", "/steps/7/update?wait=0", nil, token, "step 7 has no update yet")
	h.want(http.StatusBadRequest, "GET", "/steps/7/update?wait=soon", nil, token, "wait")
	h.want(http.StatusBadRequest, "POST", "/rewards/openrlhf", []byte(`{"query":["a"],"prompts":["a","b"]}`), token, "differ in length")
	h.want(http.StatusBadRequest, "POST", "/rewards/slime", []byte(`{"prompt":"p"}`), token, "response")
	other := httpTrainer{t: t, base: p.HTTPURL() + "/v1/runs/other"}
	other.want(http.StatusNotFound, "GET", "/calibration", nil, token, `unknown run \"other\"`)

	// Every answer is counted under its endpoint and code, the refused ones
	// too, and timed.
	for _, c := range []struct {
		endpoint, code string
		n              float64
	}{{"trajectories", "401", 2}, {"trajectories", "400", 5}, {"trajectories", "413", 1}, {"trajectories", "200", 0},
		{"close_step", "400", 2}, {"update", "404", 1}, {"update", "400", 1}, {"rewards_openrlhf", "400", 1},
		{"rewards_slime", "400", 1}, {"calibration", "404", 1}} {
		if got := testutil.ToFloat64(p.Metrics().HTTPRequests.WithLabelValues(c.endpoint, c.code)); got != c.n {
			t.Errorf("wmrl_http_requests_total{endpoint=%q,code=%q} = %v, want %v", c.endpoint, c.code, got, c.n)
		}
	}
	if n := testutil.CollectAndCount(p.Metrics().HTTPSeconds); n != len(gateway.Endpoints) {
		t.Errorf("%d wmrl_http_request_seconds series; want one per endpoint, %d", n, len(gateway.Endpoints))
	}

	nc, _ := nats.Connect(p.URL())
	defer nc.Close()
	for _, subject := range []string{"wmrl.default.traj", "wmrl.default.step"} {
		if n := len(scanAll(t, nc, subject)); n != 0 {
			t.Fatalf("%d messages on %s after only bad requests", n, subject)
		}
	}
}

// A run started for Dr. GRPO (--advantage-norm center) says so in its
// updates: the example trainer, recomputing the fused advantages as the
// update says they were formed, finds them all, and verl's example takes
// them when verl is set for Dr. GRPO and refuses them when it is not.
func TestAPythonTrainerTakesDrGRPOAdvantages(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPAddr, cfg.HTTPToken, cfg.AdvantageNorm = SourceExternal, "127.0.0.1:0", token, fuse.CenterOnly
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p := started(t, ctx, cfg)
	out, err := exec.CommandContext(ctx, py, "../examples/python/trainer_demo.py", "--url", p.HTTPURL(), "--token", token, "--steps", "2").CombinedOutput()
	t.Logf("%s", out)
	if err != nil || !strings.Contains(string(out), "step 1: 32 fused advantages match (center)") {
		t.Fatalf("the python trainer on a Dr. GRPO run: %v", err)
	}
	verl := `
import sys
sys.path.insert(0, "../examples/verl")
import wmrl_verl
from wmrl_client import WMRLClient
u = WMRLClient(sys.argv[1], token=sys.argv[2]).update(1, wait=0)
wmrl_verl.check_advantage_norm(u, norm_adv_by_std_in_grpo=False)
try:
    wmrl_verl.check_advantage_norm(u, norm_adv_by_std_in_grpo=True)
    raise SystemExit("verl's GRPO took Dr. GRPO's advantages")
except ValueError as e:
    print(e)
`
	out, err = exec.CommandContext(ctx, py, "-c", verl, p.HTTPURL(), token).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "forms its advantages as 'center'; verl's norm_adv_by_std_in_grpo=True wants 'std': start the run with --advantage-norm std") {
		t.Errorf("verl's check of a Dr. GRPO run's update (%v):\n%s", err, out)
	}
}

// TestPythonClient runs the standard-library Python client as a trainer,
// over HTTP and over HTTPS under a CA of the test's own.
func TestPythonClient(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	pki := natstest.NewPKI(t)
	for _, https := range []bool{false, true} {
		cfg := testConfig(t)
		cfg.Source, cfg.HTTPAddr, cfg.HTTPToken = SourceExternal, "127.0.0.1:0", token
		var ca []string
		if https {
			cfg.HTTPCert, cfg.HTTPKey, ca = pki.ServerCert, pki.ServerKey, []string{pki.CA}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		p := started(t, ctx, cfg)
		if got := strings.HasPrefix(p.HTTPURL(), "https://"); got != https {
			t.Fatalf("https %v: gateway at %s", https, p.HTTPURL())
		}
		trainer := func(steps string, more ...string) *exec.Cmd {
			args := append([]string{"../examples/python/trainer_demo.py", "--url", p.HTTPURL(), "--token", token, "--steps", steps}, more...)
			if https {
				args = append(args, "--ca", pki.CA)
			}
			return exec.CommandContext(ctx, py, args...)
		}
		out, err := trainer("3").CombinedOutput()
		t.Logf("%s", out)
		if err != nil {
			t.Fatalf("https %v: python trainer: %v", https, err)
		}
		if !strings.Contains(string(out), "step 2: 32 fused advantages match") || !strings.HasSuffix(strings.TrimSpace(string(out)), "ok") {
			t.Fatalf("https %v: the python trainer did not finish its three steps", https)
		}
		// A trainer resumed from a checkpoint starts at the run's next step.
		out, err = trainer("1").CombinedOutput()
		t.Logf("%s", out)
		if err != nil || !strings.Contains(string(out), "starting at step 3, the run's next") || !strings.Contains(string(out), "step 3: 32 fused advantages match") {
			t.Fatalf("https %v: a python trainer resumed: %v", https, err)
		}
		// Given a gateway that is down first, as a run's stopped process
		// would be, they ask the next.
		down := fmt.Sprintf("%s://127.0.0.1:%d", strings.Split(p.HTTPURL(), ":")[0], natstest.FreePort(t))
		out, err = exec.CommandContext(ctx, py, append([]string{"../examples/python/check_integrations.py", down + "," + p.HTTPURL(), token}, ca...)...).CombinedOutput()
		t.Logf("%s", out)
		if err != nil || !strings.HasSuffix(strings.TrimSpace(string(out)), "ok") {
			t.Fatalf("https %v: verl and TRL reward functions: %v", https, err)
		}
		// TRL's batch and verl's batch were a request each.
		if n := testutil.ToFloat64(p.Metrics().HTTPRequests.WithLabelValues("rewards_openrlhf", "200")); n != 2 {
			t.Errorf("https %v: %v OpenRLHF reward requests for TRL's batch and verl's; want 2", https, n)
		}
		// A trainer whose rollouts fail now and then sends their groups
		// short (send_step): no step waits out --step-timeout for them.
		out, err = trainer("2", "--drop-one").CombinedOutput()
		t.Logf("%s", out)
		if err != nil || !strings.Contains(string(out), "31 fused advantages match") {
			t.Fatalf("https %v: a python trainer dropping a rollout a step: %v", https, err)
		}
		if n := testutil.ToFloat64(p.Metrics().ShortSteps); n != 0 {
			t.Errorf("https %v: %v steps closed short of their watermark, want none", https, n)
		}
		if https {
			// Without the CA, the client does not trust the gateway.
			out, err := exec.CommandContext(ctx, py, "../examples/python/trainer_demo.py", "--url", p.HTTPURL(), "--token", token, "--steps", "1").CombinedOutput()
			if err == nil || !strings.Contains(string(out), "CERTIFICATE_VERIFY_FAILED") {
				t.Errorf("a client without the CA: %v\n%s", err, out)
			}
		}
		p.Stop()
	}
}

// A Python trainer keeps training through a restart of the run under it:
// the gateway goes away mid-run (its requests refused or cut off), comes
// back on the same data and address, and the trainer finishes every step
// with every fused advantage as it recomputes it, having said the wait
// once.
func TestAPythonTrainerOutlivesARestartOfTheRun(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPToken = SourceExternal, token
	cfg.HTTPAddr = fmt.Sprintf("127.0.0.1:%d", natstest.FreePort(t))
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	p, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	d := startDemoTrainer(t, ctx, py, "http://"+cfg.HTTPAddr, 30)
	d.until("step 4: ")
	if err := p.Stop(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // the trainer finds nothing there
	p, err = Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	d.finish("across the restart")
	if n := strings.Count(d.stderr.String(), "asking again for up to"); n != 1 {
		t.Errorf("the trainer said its wait %d times, want once:\n%s", n, d.stderr.String())
	}
}

// demoTrainer is examples/python/trainer_demo.py training a run through
// the gateways at urls, with the lines it printed so far.
type demoTrainer struct {
	t      *testing.T
	cmd    *exec.Cmd
	read   *bufio.Scanner
	lines  []string
	stderr syncBuffer
	steps  int
}

func startDemoTrainer(t *testing.T, ctx context.Context, py, urls string, steps int) *demoTrainer {
	t.Helper()
	d := &demoTrainer{t: t, steps: steps}
	d.cmd = exec.CommandContext(ctx, py, "../examples/python/trainer_demo.py", "--url", urls, "--token", token, "--steps", strconv.Itoa(steps))
	d.cmd.Stderr = &d.stderr
	stdout, err := d.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	d.read = bufio.NewScanner(stdout)
	return d
}

// until reads the trainer's lines up to one that starts with prefix.
func (d *demoTrainer) until(prefix string) {
	for d.read.Scan() {
		d.lines = append(d.lines, d.read.Text())
		if strings.HasPrefix(d.read.Text(), prefix) {
			return
		}
	}
}

// finish reads the trainer's lines to its end and checks that it trained
// every step, each step's fused advantages matching its own.
func (d *demoTrainer) finish(what string) {
	d.t.Helper()
	for d.read.Scan() {
		d.lines = append(d.lines, d.read.Text())
	}
	if err := d.cmd.Wait(); err != nil {
		d.t.Fatalf("the trainer failed %s: %v\n%s\n%s", what, err, strings.Join(d.lines, "\n"), d.stderr.String())
	}
	for step := range d.steps {
		if want := fmt.Sprintf("step %d: 32 fused advantages match", step); !slices.ContainsFunc(d.lines, func(l string) bool { return strings.HasPrefix(l, want) }) {
			d.t.Errorf("no %q:\n%s", want, strings.Join(d.lines, "\n"))
		}
	}
}

// A trainer resumed from a checkpoint that sends trajectories for a step
// the run planned already is refused at once (409), told the run's next
// step, and nothing is stored; from the next step on it trains as before.
func TestATrainerResumedFromACheckpointIsToldTheNextStep(t *testing.T) {
	_, p, h := trainedOverHTTP(t, DefaultConfig().Anchors.Fraction)
	var steps struct {
		Planned, Fused *int64
		Next           int64
	}
	json.Unmarshal(h.want(http.StatusOK, "GET", "/steps", nil, token, ""), &steps)
	if steps.Planned != nil || steps.Fused != nil || steps.Next != 0 {
		t.Fatalf("a new run's steps: %+v; want none and next 0", steps)
	}
	pol := sim.Policy{Run: "default", Tasks: 8, Groups: 4, GroupSize: 4}
	train := func(step int64, suffix string) {
		trajs, wm := pol.Step(step)
		for i := range trajs {
			trajs[i].TrajID += suffix
			trajs[i].GroupID += suffix
		}
		body, _ := json.Marshal(trajs)
		h.want(http.StatusAccepted, "POST", "/trajectories", body, token, "")
		h.want(http.StatusAccepted, "POST", fmt.Sprintf("/steps/%d/close", step), []byte(fmt.Sprintf(`{"groups": %d}`, wm.Groups)), token, "")
		h.want(http.StatusOK, "GET", fmt.Sprintf("/steps/%d/update?wait=60", step), nil, token, "")
	}
	for step := range int64(3) {
		train(step, "")
	}
	// The gateway follows the plans on its own; it may see step 2's a
	// moment after the update this test waited for.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		json.Unmarshal(h.want(http.StatusOK, "GET", "/steps", nil, token, ""), &steps)
		if steps.Planned != nil && *steps.Planned == 2 || time.Now().After(deadline) {
			break
		}
	}
	if steps.Planned == nil || *steps.Planned != 2 || steps.Fused == nil || *steps.Fused != 2 || steps.Next != 3 {
		t.Fatalf("steps after 3: planned %v, fused %v, next %d; want 2, 2 and 3", steps.Planned, steps.Fused, steps.Next)
	}
	// The trainer crashed and resumed from its checkpoint of step 1.
	nc, err := nats.Connect(p.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	before := storedTrajectories(t, nc)
	trajs, _ := pol.Step(1)
	for i := range trajs {
		trajs[i].TrajID += "-resumed"
		trajs[i].GroupID += "-resumed"
	}
	body, _ := json.Marshal(trajs)
	h.want(http.StatusConflict, "POST", "/trajectories", body, token, "step 1 was planned already")
	h.want(http.StatusConflict, "POST", "/trajectories", body, token, "numbers its steps on from the run's next, 3")
	if after := storedTrajectories(t, nc); after != before {
		t.Fatalf("%d trajectories stored by refused requests", after-before)
	}
	train(steps.Next, "-resumed")
}

// A trainer that names its groups and trajectories alike every step
// ("g0", "g0-t0") has every step fused, each from its own trajectories: a
// trajectory's de-duplication ID holds its step, so a later step's are not
// dropped as copies of the first's (they were, and step 1 waited for ever).
func TestATrainerMayReuseItsIdsEveryStep(t *testing.T) {
	_, _, h := trainedOverHTTP(t, 0.25)
	pol := sim.Policy{Run: "default", Tasks: 8, Groups: 4, GroupSize: 4}
	for step := int64(0); step < 3; step++ {
		trajs, wm := pol.Step(step)
		prefix := fmt.Sprintf("s%d-", step)
		for i := range trajs {
			trajs[i].TrajID = strings.TrimPrefix(trajs[i].TrajID, prefix)
			trajs[i].GroupID = strings.TrimPrefix(trajs[i].GroupID, prefix)
		}
		if trajs[0].TrajID != "g0-t0" {
			t.Fatalf("ids %q: want them alike every step", trajs[0].TrajID)
		}
		body, _ := json.Marshal(trajs)
		h.want(http.StatusAccepted, "POST", "/trajectories", body, token, "")
		h.want(http.StatusAccepted, "POST", fmt.Sprintf("/steps/%d/close", step), []byte(fmt.Sprintf(`{"groups": %d}`, wm.Groups)), token, "")
		var u schemas.Update
		if err := json.Unmarshal(h.want(http.StatusOK, "GET", fmt.Sprintf("/steps/%d/update?wait=30", step), nil, token, ""), &u); err != nil {
			t.Fatal(err)
		}
		if u.Step != step || len(u.Items) != len(trajs) {
			t.Fatalf("step %d: update of step %d with %d items, want %d", step, u.Step, len(u.Items), len(trajs))
		}
		checkFusion(t, u)
		checkAnchors(t, u, trajs)
	}
}

// The gateway stores a request's trajectories of one group as one trajs
// message, wherever they are in the request, a trajectory without others
// of its group alone, and a request sent again as the same messages,
// stored once.
func TestTheGatewayStoresAGroupAsOneMessage(t *testing.T) {
	_, nc, _, h := startTrainerRun(t)
	pol := sim.Policy{Run: "default", Tasks: 8, Groups: 3, GroupSize: 4}
	trajs, wm := pol.Step(0)
	// Group 0, group 1 but its last, and group 2's first; then the rest,
	// group 2's apart.
	first, _ := json.Marshal(append(slices.Clone(trajs[:7]), trajs[8]))
	second, _ := json.Marshal([]schemas.Trajectory{trajs[9], trajs[7], trajs[10], trajs[11]})
	h.want(http.StatusAccepted, "POST", "/trajectories", first, "", `"accepted":8`)
	h.want(http.StatusAccepted, "POST", "/trajectories", first, "", `"accepted":8`) // a retry
	h.want(http.StatusAccepted, "POST", "/trajectories", second, "", `"accepted":4`)
	sizes := func(subject string) []int {
		var n []int
		for _, b := range scanAll(t, nc, subject) {
			var group []json.RawMessage
			if err := json.Unmarshal(b, &group); err != nil {
				n = append(n, 1) // a trajectory alone
				continue
			}
			n = append(n, len(group))
		}
		return n
	}
	if got, alone := sizes("wmrl.default.trajs"), sizes("wmrl.default.traj"); !slices.Equal(got, []int{4, 3, 3}) || len(alone) != 2 {
		t.Errorf("stored trajs messages of %v trajectories and %d alone; want 4, 3 and 3 (groups 0, 1 and 2's last) and 2 (group 2's first, group 1's last)",
			got, len(alone))
	}
	h.want(http.StatusAccepted, "POST", "/steps/0/close", []byte(fmt.Sprintf(`{"groups": %d}`, wm.Groups)), "", "")
	var u schemas.Update
	if err := json.Unmarshal(h.want(http.StatusOK, "GET", "/steps/0/update?wait=30", nil, "", ""), &u); err != nil {
		t.Fatal(err)
	}
	if len(u.Items) != len(trajs) || u.Groups != wm.Groups {
		t.Errorf("step 0 fused %d trajectories in %d groups, want %d in %d", len(u.Items), u.Groups, len(trajs), wm.Groups)
	}
}

// startTrainerRun starts a pipeline that waits for a trainer, with the
// gateway, for a minute at most; a client of its server and an HTTP
// trainer of run default.
func startTrainerRun(t *testing.T) (context.Context, *nats.Conn, jetstream.JetStream, httpTrainer) {
	t.Helper()
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPAddr = SourceExternal, "127.0.0.1:0"
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	p, nc, js := startClient(t, ctx, cfg)
	return ctx, nc, js, httpTrainer{t: t, base: p.HTTPURL() + "/v1/runs/default"}
}

// storedTrajectories counts the trajectories stored for run default,
// alone and in trajs messages.
func storedTrajectories(t *testing.T, nc *nats.Conn) int {
	t.Helper()
	n := len(scanAll(t, nc, "wmrl.default.traj"))
	for _, b := range scanAll(t, nc, "wmrl.default.trajs") {
		var group []json.RawMessage
		if err := json.Unmarshal(b, &group); err != nil {
			t.Fatal(err)
		}
		n += len(group)
	}
	return n
}

// publishAsAnotherGateway stores trajs as a gateway that has not seen
// the ones before would: with their de-duplication IDs, refused by route
// alone.
func publishAsAnotherGateway(t *testing.T, ctx context.Context, js jetstream.JetStream, trajs []schemas.Trajectory) {
	t.Helper()
	for _, tr := range trajs {
		m, err := schemas.NewTrajMessage(tr)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := js.Publish(ctx, "wmrl.default.traj", m.Payload, jetstream.WithMsgID(m.Metadata.Get(schemas.MsgIDKey))); err != nil {
			t.Fatal(err)
		}
	}
}

// The gateway's next step is past the newest trajectory sent, whether it
// came alone or in a trajs message (the newest step among its
// trajectories): a trainer that sends its groups straight to NATS and asks
// the gateway where to resume is not told to resume into a step it sent.
func TestTheNextStepCountsTrajsMessages(t *testing.T) {
	ctx, _, js, h := startTrainerRun(t)
	pol := sim.Policy{Run: "default", Tasks: 8, Groups: 2, GroupSize: 2}
	stepOf := func(n int64) []schemas.Trajectory { trajs, _ := pol.Step(n); return trajs[:2] }
	next := func() int64 {
		var steps gateway.StepsView
		if err := json.Unmarshal(h.want(http.StatusOK, "GET", "/steps", nil, "", ""), &steps); err != nil {
			t.Fatal(err)
		}
		return steps.Next
	}
	send := func(subject string, v any) {
		b, _ := json.Marshal(v)
		if _, err := js.Publish(ctx, subject, b); err != nil {
			t.Fatal(err)
		}
	}
	send("wmrl.default.trajs", append(stepOf(5), stepOf(3)...))
	if n := next(); n != 6 {
		t.Errorf("next %d after a trajs message of steps 5 and 3, want 6", n)
	}
	send("wmrl.default.traj", stepOf(7)[0])
	send("wmrl.default.trajs", stepOf(2))
	if n := next(); n != 8 {
		t.Errorf("next %d after a trajectory of step 7 alone and a trajs message of step 2, want 8", n)
	}
}

// A trainer that numbers the trajectories of each group alike ("t0",
// "t1", ...), one request per group, breaks the contract that ids are a
// step's: the update tells its items apart by them. The server's
// de-duplication used to drop the later groups' trajectories as copies of
// the first's, without a word, and the step waited out --step-timeout
// short of them; published without the header, they reached fuse, which
// gave each group's items the last group's task and scores in the update.
// Now the gateway that stored the first group's refuses the others' (400),
// and route, which hears of them through another gateway, refuses all but
// the first to reach it, naming its group.
func TestATrajectoryIdTwoGroupsOfAStepShareIsRefused(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPAddr, cfg.StepTimeout = SourceExternal, "127.0.0.1:0", 2*time.Second
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, nc, js := startClient(t, ctx, cfg)
	h := httpTrainer{t: t, base: p.HTTPURL() + "/v1/runs/default"}
	pol := sim.Policy{Run: "default", Tasks: 8, Groups: 3, GroupSize: 4}
	trajs, wm := pol.Step(0)
	for g := range wm.Groups {
		group := trajs[g*pol.GroupSize : (g+1)*pol.GroupSize]
		for i := range group {
			group[i].TrajID = fmt.Sprintf("t%d", i)
		}
		body, _ := json.Marshal(group)
		if g == 0 {
			h.want(http.StatusAccepted, "POST", "/trajectories", body, "", "")
			continue
		}
		h.want(http.StatusBadRequest, "POST", "/trajectories", body, "", fmt.Sprintf("of group %s is taken by group %s of step 0", group[0].GroupID, trajs[0].GroupID))
		publishAsAnotherGateway(t, ctx, js, group)
	}
	h.want(http.StatusAccepted, "POST", "/steps/0/close", []byte(fmt.Sprintf(`{"groups": %d}`, wm.Groups)), "", "")
	var u schemas.Update
	if err := json.Unmarshal(h.want(http.StatusOK, "GET", "/steps/0/update?wait=30", nil, "", ""), &u); err != nil {
		t.Fatal(err)
	}
	// Route takes each id from the group whose trajectory reaches it first
	// and refuses the others, naming that group; each item keeps its own
	// group's record.
	taskOf := map[string]string{}
	for _, tr := range trajs {
		taskOf[tr.GroupID] = tr.TaskID
	}
	owner := map[string]string{} // trajectory id -> the group it was taken for
	for _, it := range u.Items {
		if owner[it.TrajID] != "" || it.TaskID != taskOf[it.GroupID] {
			t.Errorf("item %s of group %s, task %s (its group's: %s; id taken for group %q before)", it.TrajID, it.GroupID, it.TaskID, taskOf[it.GroupID], owner[it.TrajID])
		}
		owner[it.TrajID] = it.GroupID
	}
	if len(owner) != pol.GroupSize {
		t.Fatalf("step 0 has %d items, ids %v; want each of the %d ids once", len(u.Items), owner, pol.GroupSize)
	}
	refused := 0
	for _, b := range scanAll(t, nc, "wmrl.default.dlq") {
		var dl schemas.DeadLetter
		var tr schemas.Trajectory
		json.Unmarshal(b, &dl)
		json.Unmarshal([]byte(dl.Payload), &tr)
		if dl.Stage == StageRoute && tr.GroupID != owner[tr.TrajID] &&
			strings.Contains(dl.Reason, "is taken by group "+owner[tr.TrajID]+" of step 0: trajectory ids must be unique within a step") {
			refused++
		}
	}
	if want := (wm.Groups - 1) * pol.GroupSize; refused != want {
		t.Errorf("route refused %d trajectories naming the group that has the id, want %d", refused, want)
	}
}

// --reward-memory 0 asks the world model again for a solution asked
// before (a world model sampled anew each time); the default answers it
// from the score given (TestTrainerOverHTTPAndNATS).
func TestARewardMemoryOfNothingAsksEachTime(t *testing.T) {
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPAddr, cfg.RewardMemory = SourceExternal, "127.0.0.1:0", 0
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := started(t, ctx, cfg)
	h := httpTrainer{t: t, base: p.HTTPURL() + "/v1/runs/default"}
	for range 2 {
		h.want(http.StatusOK, "POST", "/rewards/slime", []byte(`{"prompt":"p","response":"print(3)","label":"task-2"}`), "", "")
	}
	asked := testutil.ToFloat64(p.Metrics().RewardAnswers.WithLabelValues(string(gateway.AnsweredByWorldModel)))
	remembered := testutil.ToFloat64(p.Metrics().RewardAnswers.WithLabelValues(string(gateway.AnsweredRemembered)))
	if asked != 2 || remembered != 0 {
		t.Errorf("the same solution twice: asked %v, remembered %v; want asked 2, remembered 0", asked, remembered)
	}
}

// A trainer that crashed after sending part of a step is told to resume
// past it. One that sends its new rollouts as that step anyway, under the
// same ids, is refused by the gateway that stored the first ones (409,
// naming the id and the step to go on from), and nothing of the request
// is stored; what it sends through another gateway (here, straight to the
// stream) route refuses, each id that came before dead-lettered, naming
// it: the step's update gives the advantage by id, and it holds the first
// trajectory under it.
// Before, the server dropped the new ones as copies (their de-duplication
// ID was the same) and the trainer got 202 and an update whose advantages
// for those ids were the old rollouts', without a word anywhere; then the
// gateway answered 202 and only route's dead letters said so.
func TestATrainerResentIntoAStepWithOtherRolloutsIsRefused(t *testing.T) {
	ctx, nc, js, h := startTrainerRun(t)
	pol := sim.Policy{Run: "default", Tasks: 8, Groups: 2, GroupSize: 4}
	before, wm := pol.Step(0)
	body, _ := json.Marshal(before[:3]) // then it crashed
	h.want(http.StatusAccepted, "POST", "/trajectories", body, "", "")
	body, _ = json.Marshal(before[:3]) // a retry of the same request is no one's business
	h.want(http.StatusAccepted, "POST", "/trajectories", body, "", "")

	// Resumed, the trainer is told to number its steps on from 1: step 0
	// is not planned, but it has trajectories.
	var steps gateway.StepsView
	if err := json.Unmarshal(h.want(http.StatusOK, "GET", "/steps", nil, "", ""), &steps); err != nil || steps.Next != 1 || steps.Planned != nil {
		t.Fatalf("steps after part of step 0: %+v (%v); want next 1, none planned", steps, err)
	}
	after := slices.Clone(before) // this one sends its new rollouts as step 0, the same ids
	for i := range after {
		after[i].Response += "\n# resumed"
	}
	body, _ = json.Marshal(after)
	h.want(http.StatusConflict, "POST", "/trajectories", body, "",
		fmt.Sprintf("trajectory 0: %s of group %s of step 0 was sent before with other content; a trainer resumed from a checkpoint numbers its steps on from the run's next, 1", before[0].TrajID, before[0].GroupID))
	// Neither is a request that holds an id twice, or one under an id
	// another group of the step has.
	body, _ = json.Marshal([]schemas.Trajectory{before[3], after[3]})
	h.want(http.StatusBadRequest, "POST", "/trajectories", body, "", fmt.Sprintf("trajectory 1: %s of step 0 is in the request twice, with other content", before[3].TrajID))
	moved := before[4] // of the second group
	moved.TrajID = before[0].TrajID
	body, _ = json.Marshal([]schemas.Trajectory{moved})
	h.want(http.StatusBadRequest, "POST", "/trajectories", body, "", fmt.Sprintf("of group %s is taken by group %s of step 0", moved.GroupID, before[0].GroupID))
	if n := storedTrajectories(t, nc); n != 3 {
		t.Fatalf("%d trajectories stored; want the 3 before the crash alone", n)
	}
	publishAsAnotherGateway(t, ctx, js, after)
	// Closed before route met them, they would be refused as late.
	waitFor(t, 30*time.Second, func() bool { return len(scanAll(t, nc, "wmrl.default.dlq")) >= 3 })
	h.want(http.StatusAccepted, "POST", "/steps/0/close", []byte(fmt.Sprintf(`{"groups": %d}`, wm.Groups)), "", "")
	var u schemas.Update
	if err := json.Unmarshal(h.want(http.StatusOK, "GET", "/steps/0/update?wait=30", nil, "", ""), &u); err != nil {
		t.Fatal(err)
	}
	if len(u.Items) != len(before) {
		t.Fatalf("step 0 has %d items, want %d", len(u.Items), len(before))
	}
	refused := map[string]bool{}
	for _, b := range scanAll(t, nc, "wmrl.default.dlq") {
		var dl schemas.DeadLetter
		var tr schemas.Trajectory
		if json.Unmarshal(b, &dl) != nil || json.Unmarshal([]byte(dl.Payload), &tr) != nil {
			t.Fatalf("dead letter %s", b)
		}
		if dl.Stage != StageRoute || !strings.HasSuffix(tr.Response, "# resumed") ||
			!strings.Contains(dl.Reason, fmt.Sprintf("trajectory %q of group %s of step 0 came before with another prompt, solution or field; the first one stays", tr.TrajID, tr.GroupID)) {
			t.Errorf("dead letter from %s of %s: %s", dl.Stage, tr.TrajID, dl.Reason)
		}
		refused[tr.TrajID] = true
	}
	if len(refused) != 3 || !refused[before[0].TrajID] || !refused[before[2].TrajID] {
		t.Errorf("route refused %v, want the 3 ids sent before the crash", refused)
	}
}

// A step of long solutions, larger than one request may be (the gateway
// takes 16 MiB), goes through the Python client in several requests and is
// fused whole: 1,024 trajectories of 20 kB.
func TestPythonClientSendsAStepLargerThanARequest(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	_, p, _ := trainedOverHTTP(t, DefaultConfig().Anchors.Fraction)
	out, err := exec.Command(py, "../examples/python/trainer_demo.py", "--url", p.HTTPURL(), "--token", token,
		"--steps", "1", "--groups", "128", "--group-size", "8", "--response-bytes", "20000").CombinedOutput()
	t.Logf("%s", out)
	if err != nil {
		t.Fatalf("python trainer: %v", err)
	}
	m := regexp.MustCompile(`step 0: 1024 fused advantages match \(std\), .*, ([\d.]+) MB of trajectories`).FindSubmatch(out)
	if m == nil {
		t.Fatal("the python trainer did not have its step of 1024 fused")
	}
	if mb, _ := strconv.ParseFloat(string(m[1]), 64); mb < 16.8 {
		t.Fatalf("the step was %v MB, not over one request's 16 MiB", mb)
	}
}

// watchedOverHTTP starts a pipeline for a trainer over HTTP, as edit
// changes it, whose output the test reads.
func watchedOverHTTP(t *testing.T, edit func(*Config)) (*Pipeline, httpTrainer, *syncBuffer) {
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPAddr, cfg.HTTPToken = SourceExternal, "127.0.0.1:0", token
	out := &syncBuffer{}
	cfg.Out, cfg.Quiet = out, false
	edit(&cfg)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	p := started(t, ctx, cfg)
	return p, httpTrainer{t: t, base: p.HTTPURL() + "/v1/runs/default"}, out
}

// A trainer that drops a failed rollout but declares the group's full
// size, or sends fewer groups than its watermark says, has its step
// planned on --step-timeout with what came: the step is fused, and the
// run says what was short and how to stop waiting, and counts it.
func TestAStepShortOfItsWatermarkIsSaid(t *testing.T) {
	p, h, out := watchedOverHTTP(t, func(cfg *Config) { cfg.StepTimeout = time.Second })
	pol := sim.Policy{Run: "default", Tasks: 8, Groups: 4, GroupSize: 4}
	trajs, wm := pol.Step(0)
	dropped := trajs[1] // one rollout of the first group failed
	trajs = slices.Delete(trajs, 1, 2)
	body, _ := json.Marshal(trajs)
	h.want(http.StatusAccepted, "POST", "/trajectories", body, token, "")
	h.want(http.StatusAccepted, "POST", "/steps/0/close", []byte(fmt.Sprintf(`{"groups": %d}`, wm.Groups+1)), token, "")
	var u schemas.Update
	if err := json.Unmarshal(h.want(http.StatusOK, "GET", "/steps/0/update?wait=30", nil, token, ""), &u); err != nil {
		t.Fatal(err)
	}
	if len(u.Items) != len(trajs) {
		t.Fatalf("update of %d items, want the %d that came", len(u.Items), len(trajs))
	}
	said := out.String()
	if !regexp.MustCompile(`route: step 0 closed 1(\.\d+)?s after its watermark`).MatchString(said) || !strings.Contains(said, "on --step-timeout, with 4 of the 5 groups its watermark declared came and 1 group(s) with fewer trajectories than their group_size ("+dropped.GroupID+" 3 of 4)") {
		t.Errorf("the run said:\n%s", said)
	}
	if n := testutil.ToFloat64(p.Metrics().ShortSteps); n != 1 {
		t.Errorf("wmrl_steps_closed_short_total %v, want 1", n)
	}
}

// A step whose trajectories came without a watermark is said once after
// --stuck-after, naming the subject to send it on; it is planned once the
// watermark comes.
func TestAStepWithoutItsWatermarkIsSaid(t *testing.T) {
	_, h, out := watchedOverHTTP(t, func(cfg *Config) { cfg.StuckAfter = time.Second })
	pol := sim.Policy{Run: "default", Tasks: 8, Groups: 4, GroupSize: 4}
	trajs, wm := pol.Step(0)
	body, _ := json.Marshal(trajs)
	h.want(http.StatusAccepted, "POST", "/trajectories", body, token, "")
	said := regexp.MustCompile(`route: step 0 has had 16 trajectories in 4 groups for \d+s and no watermark: it is planned only once one comes \(wmrl\.default\.step,`)
	waitFor(t, 30*time.Second, func() bool { return said.MatchString(out.String()) })
	h.want(http.StatusAccepted, "POST", "/steps/0/close", []byte(fmt.Sprintf(`{"groups": %d}`, wm.Groups)), token, "")
	h.want(http.StatusOK, "GET", "/steps/0/update?wait=30", nil, token, "")
	if n := strings.Count(out.String(), "no watermark"); n != 1 {
		t.Errorf("said %d times, want once:\n%s", n, out.String())
	}
}

// A stopping process's gateway takes no new connection and lets the
// requests in flight end: a trainer's POST whose body is still coming is
// stored and answered 202, a reward request gets its world model's score
// once the model answers, and a long poll answers 503 at once, saying
// why. Before, the three were cut off (the reward request, later, with a
// 503), and the trainer had to send again.
func TestAStoppingGatewayLetsItsRequestsEnd(t *testing.T) {
	gate := make(chan struct{})
	judge := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-gate
		content := `{"status":"scored","score":0.4,"rationale":"read"}`
		json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"message": map[string]any{"content": content}}}})
	}))
	defer judge.Close()
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPAddr = SourceExternal, "127.0.0.1:0"
	cfg.WorldModel, cfg.WMURL, cfg.WMModel = "openai", judge.URL+"/v1", "judge"
	var active atomic.Int32 // connections whose request the server has read
	cfg.gatewayConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateActive {
			active.Add(1)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := started(t, ctx, cfg)
	base := p.HTTPURL() + "/v1/runs/default"

	type answer struct {
		code int
		body string
		err  error
	}
	ask := func(req *http.Request) <-chan answer {
		out := make(chan answer, 1)
		sent := make(chan struct{})
		req = req.WithContext(httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{WroteHeaders: func() { close(sent) }}))
		go func() {
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				out <- answer{err: err}
				return
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			out <- answer{code: resp.StatusCode, body: string(b)}
		}()
		<-sent
		return out
	}
	pol := &sim.Policy{Run: "default", Tasks: 4, Groups: 2, GroupSize: 4}
	trajs, _ := pol.Step(0)
	body, _ := json.Marshal(trajs)
	rest, more := io.Pipe()
	req, _ := http.NewRequest(http.MethodPost, base+"/trajectories", io.MultiReader(bytes.NewReader(body[:len(body)/2]), rest))
	posted := ask(req)
	req, _ = http.NewRequest(http.MethodGet, base+"/steps/5/update?wait=60", nil)
	polled := ask(req)
	req, _ = http.NewRequest(http.MethodPost, base+"/rewards/slime", strings.NewReader(`{"prompt":"Task 3.","response":"print(1)"}`))
	rewarded := ask(req)

	// A request read after the stop began is dropped, as it must be
	// (its client sends it again elsewhere): these three are in before.
	waitFor(t, 30*time.Second, func() bool { return active.Load() == 3 })
	stopped := make(chan error, 1)
	go func() { stopped <- p.Stop() }()
	addr := strings.TrimPrefix(p.HTTPURL(), "http://")
	waitFor(t, 30*time.Second, func() bool {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
		}
		return err != nil // no new connection
	})
	if _, err := more.Write(body[len(body)/2:]); err != nil {
		t.Fatal(err)
	}
	more.Close()
	if a := <-posted; a.err != nil || a.code != http.StatusAccepted || !strings.Contains(a.body, fmt.Sprintf(`"accepted":%d`, len(trajs))) {
		t.Errorf("a POST in flight as the process stopped: %d %s (%v); want it taken, 202", a.code, a.body, a.err)
	}
	if a := <-polled; a.err != nil || a.code != http.StatusServiceUnavailable || !strings.Contains(a.body, "the gateway is stopping: ask again for step 5's update") {
		t.Errorf("a long poll as the process stopped: %d %s (%v); want 503 saying why", a.code, a.body, a.err)
	}
	close(gate) // the world model answers after the gateway knows of the stop (the poll's 503), while the server drains
	if a := <-rewarded; a.err != nil || a.code != http.StatusOK || strings.TrimSpace(a.body) != "0.4" {
		t.Errorf("a reward request in flight as the process stopped: %d %s (%v); want its world model's 0.4", a.code, a.body, a.err)
	}
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, b := range readStored(t, cfg.DataDir, "wmrl.default.trajs") {
		var group []json.RawMessage
		if err := json.Unmarshal(b, &group); err != nil {
			t.Fatal(err)
		}
		n += len(group)
	}
	if n != len(trajs) {
		t.Errorf("%d trajectories stored, want the POST's %d", n, len(trajs))
	}
}

// A reward request whose world model has not answered when the drain
// (--http-drain) runs out is answered 503, saying why, which its client
// asks again elsewhere, rather than have its connection cut.
func TestARewardTheDrainOutlastsIsA503(t *testing.T) {
	gate := make(chan struct{})
	judge := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-gate:
		case <-r.Context().Done():
		}
	}))
	defer judge.Close()
	defer close(gate) // before the judge closes: it waits for its handlers
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPAddr, cfg.HTTPDrain = SourceExternal, "127.0.0.1:0", 200*time.Millisecond
	cfg.WorldModel, cfg.WMURL, cfg.WMModel = "openai", judge.URL+"/v1", "judge"
	var out syncBuffer
	cfg.Quiet, cfg.Out = false, &out
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := started(t, ctx, cfg)
	rewarded := make(chan string, 1)
	go func() {
		resp, err := http.Post(p.HTTPURL()+"/v1/runs/default/rewards/slime", "application/json",
			strings.NewReader(`{"prompt":"Task 3.","response":"print(1)"}`))
		if err != nil {
			rewarded <- err.Error()
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		rewarded <- fmt.Sprintf("%d %s", resp.StatusCode, b)
	}()
	waitFor(t, 30*time.Second, func() bool {
		return testutil.ToFloat64(p.Metrics().RewardAnswers.WithLabelValues(string(gateway.AnsweredByWorldModel))) == 1
	})
	if err := p.Stop(); err != nil {
		t.Fatal(err)
	}
	if got := <-rewarded; !strings.HasPrefix(got, "503 ") || !strings.Contains(got, "the gateway is stopping: ask again") {
		t.Errorf("a reward request still waiting for its world model when the drain ran out: %s; want 503 saying the gateway is stopping", got)
	}
	if strings.Contains(out.String(), "cut off") {
		t.Errorf("the stop cut a request off:\n%s", out.String())
	}
}

// A Python trainer given the gateways of a run's two processes, the one
// that runs the stages and its standby, trains on when the first stops
// (a rolling update, a node drained): its requests go to the standby's
// gateway, which takes over the stages, and every step's fused
// advantages still match, with nothing started again.
func TestAPythonTrainerOutlivesItsActiveProcess(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	srv, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	process := func(out io.Writer) Config {
		c := testConfig(t)
		c.NATSURL, c.Source, c.HTTPToken = srv.URL(), SourceExternal, token
		c.HTTPAddr = fmt.Sprintf("127.0.0.1:%d", natstest.FreePort(t))
		c.Quiet, c.Out = false, out
		return c
	}
	var out1, out2 syncBuffer
	cfg1, cfg2 := process(&out1), process(&out2)
	first, err := Start(ctx, cfg1)
	if err != nil {
		t.Fatal(err)
	}
	standby := make(chan *Pipeline, 1)
	go func() {
		p, err := Start(ctx, cfg2)
		if err != nil {
			t.Errorf("the standby: %v", err)
		}
		standby <- p
	}()
	waitFor(t, time.Minute, func() bool { return strings.Contains(out2.String(), "another process runs this stage") })

	d := startDemoTrainer(t, ctx, py, "http://"+cfg1.HTTPAddr+",http://"+cfg2.HTTPAddr, 30)
	d.until("step 4: ")
	if err := first.Stop(); err != nil {
		t.Fatal(err)
	}
	d.finish("as its process stopped")
	if p := <-standby; p != nil {
		defer p.Stop()
	}
	if !strings.Contains(d.stderr.String(), "; asking http://"+cfg2.HTTPAddr+"/v1/runs/default") {
		t.Errorf("the trainer did not say it went to the standby's gateway:\n%s", d.stderr.String())
	}
}
