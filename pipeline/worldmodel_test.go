package pipeline

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/connectors/openai"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
)

// TestPipelineWithAnOpenAIWorldModel runs every stage with the world model
// behind a real HTTP server speaking /v1/chat/completions, one reply in
// seven of which is garbage, and at most --wm-concurrency requests in
// flight: the first requests wait until one more than that are in flight
// (or a second passes), so a limit not passed on shows up as one too many.
func TestPipelineWithAnOpenAIWorldModel(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	const concurrency = 3
	var mu sync.Mutex
	calls, inflight, maxIn := 0, 0, 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		calls++
		first := calls <= concurrency+1
		inflight++
		maxIn = max(maxIn, inflight)
		mu.Unlock()
		for wait := 0; first && wait < 1000; wait++ {
			mu.Lock()
			open := maxIn > concurrency
			mu.Unlock()
			if open {
				break
			}
			time.Sleep(time.Millisecond)
		}
		defer func() { mu.Lock(); inflight--; mu.Unlock() }()
		var req struct {
			Messages []struct{ Content string } `json:"messages"`
		}
		json.NewDecoder(r.Body).Decode(&req)
		h := fnv.New32a()
		h.Write([]byte(req.Messages[0].Content))
		content := fmt.Sprintf(`{"status":"scored","score":%.3f,"rationale":"by hash"}`, float64(h.Sum32()%1000)/1000)
		if h.Sum32()%7 == 0 {
			content = "I am not sure."
		}
		json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"message": map[string]any{"content": content}}},
			"usage": map[string]any{"prompt_tokens": 100, "completion_tokens": 20}})
	}))
	defer srv.Close()
	cfg := testConfig(t)
	cfg.Steps = 4
	var out syncBuffer
	cfg.Quiet, cfg.Out = false, &out
	cfg.WorldModel, cfg.WMURL, cfg.WMModel, cfg.WMConcurrency = "openai", srv.URL+"/v1", "judge", concurrency
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := started(t, ctx, cfg)
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	// Every request is counted, timed and weighed by the usage it reported.
	mu.Lock()
	asked := float64(calls)
	mu.Unlock()
	m := p.Metrics()
	if n := testutil.ToFloat64(m.WMRequests.WithLabelValues("answered")); n != asked || testutil.ToFloat64(m.WMRequests.WithLabelValues("failed")) != 0 {
		t.Errorf("wmrl_wm_requests_total{outcome=answered} = %v for %v requests answered", n, asked)
	}
	if pt, ct := testutil.ToFloat64(m.WMTokens.WithLabelValues("prompt")), testutil.ToFloat64(m.WMTokens.WithLabelValues("completion")); pt != 100*asked || ct != 20*asked {
		t.Errorf("wmrl_wm_tokens_total: %v prompt, %v completion for %v requests of 100 and 20", pt, ct, asked)
	}
	if n := testutil.CollectAndCount(m.WMRequestSeconds); n != 1 {
		t.Errorf("%d wmrl_wm_request_seconds series", n)
	}
	ungraded, graded := 0, 0
	for _, b := range readStored(t, cfg.DataDir, "wmrl.default.pred") {
		var p schemas.Prediction
		json.Unmarshal(b, &p)
		if p.Model != "judge" {
			t.Fatalf("prediction from model %q", p.Model)
		}
		for _, it := range p.Items {
			if it.Score == nil {
				if it.Status != schemas.PredUngraded || it.Reason == "" {
					t.Fatalf("ungraded item without status or reason: %+v", it)
				}
				ungraded++
			} else {
				graded++
			}
		}
	}
	ups := decodeUpdates(t, readStored(t, cfg.DataDir, "wmrl.default.update"))
	if len(ups) != 4 || ungraded == 0 || graded == 0 {
		t.Fatalf("%d updates; %d graded and %d ungraded predictions", len(ups), graded, ungraded)
	}
	// Every step's line says how many world-model scores it lost, as the
	// update records them.
	lines := map[string]string{}
	for _, l := range strings.Split(out.String(), "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "step" {
			lines[f[1]] = l
		}
	}
	nulls := 0
	for _, u := range ups {
		checkFusion(t, u)
		n := 0
		for _, it := range u.Items {
			if it.Source == "world_model" && it.Reward == nil {
				n++
			}
		}
		nulls += n
		line := lines[strconv.FormatInt(u.Step, 10)]
		said := strings.Contains(line, "wm ungraded")
		if n > 0 {
			said = strings.Contains(line+"  ", fmt.Sprintf("  wm ungraded %d  ", n))
		}
		if !strings.Contains(line, "latency") || said != (n > 0) {
			t.Errorf("step %d lost %d world-model scores; its line says %q", u.Step, n, line)
		}
	}
	if nulls == 0 {
		t.Fatal("no ungraded world-model reward reached the updates as null")
	}
	// A reply now and then that cannot be read is not the setup: nothing
	// is said of it beyond the step lines' counts.
	if strings.Contains(out.String(), "graded none of the last") || strings.Contains(out.String(), "refused") {
		t.Errorf("a world model answering most requests was said to fail:\n%s", out.String())
	}
	// The run's closing line adds them up.
	lost := regexp.MustCompile(fmt.Sprintf(`; lost (.*, )?wm ungraded %d(,|\n)`, nulls))
	if want := "done: steps 0-3 fused and archived, 4 of them by this process in "; !strings.Contains(out.String(), want) ||
		!lost.MatchString(out.String()) {
		t.Errorf("no closing line with %d ungraded scores lost:\n%s", nulls, out.String())
	}
	if mu.Lock(); maxIn != concurrency {
		t.Fatalf("%d world-model requests in flight at most; want --wm-concurrency %d", maxIn, concurrency)
	}
	mu.Unlock()
	// The archive has what the world model said, on the anchor groups'
	// graded rows.
	rows, err := archive.ReadAll(cfg.ArchiveRoot(), cfg.Run)
	if err != nil {
		t.Fatal(err)
	}
	reasons := 0
	for _, r := range rows {
		verdict, reason := r.WMVerdict != nil && *r.WMVerdict == schemas.ExecScored, r.WMRationale != nil && *r.WMRationale == "by hash"
		switch {
		case r.Source == archive.SourceLateAnchor:
		case verdict != (r.Predicted != nil && r.IsAnchor) || reason != verdict:
			t.Fatalf("archived row %s/%s (%s, anchor %v, predicted %v): verdict %v, reason %v", r.GroupID, r.TrajID, r.Source, r.IsAnchor, r.Predicted != nil, verdict, reason)
		case reason:
			reasons++
		}
	}
	if reasons == 0 {
		t.Fatal("no anchor row has the world model's reason")
	}
	t.Logf("%d graded, %d ungraded predictions; %d null rewards in updates", graded, ungraded, nulls)
}

// A world model that goes down is given up at once after --wm-down-after
// calls in a row failed, instead of each group waiting out its retries
// (10 deliveries with backoff, minutes a step): the steps go on, on their
// anchors. Once it is back, a probe finds it and its predictions return.
// The world model is a real openai connector against a real HTTP server
// that answers 503 while down.
func TestPipelineGivesUpOnADownWorldModelUntilItIsBack(t *testing.T) {
	var down atomic.Bool
	var requests atomic.Int32
	down.Store(true)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if down.Load() {
			requests.Add(1)
			http.Error(w, "overloaded", http.StatusServiceUnavailable)
			return
		}
		content := `{"status":"scored","score":0.5,"rationale":"up"}`
		json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"message": map[string]any{"content": content}}}})
	}))
	defer srv.Close()
	wm, err := openai.New(openai.Config{BaseURL: srv.URL + "/v1", Model: "judge", Retries: 1, Backoff: time.Millisecond, CacheSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t)
	cfg.Steps = 20
	cfg.WorldModelImpl = wm
	cfg.WMDownAfter, cfg.WMProbeEvery = 3, 100*time.Millisecond
	cfg.HTTPAddr = "127.0.0.1:0"
	// While it is down, the gateway's reward endpoints, asking the same
	// world model through the same breaker, answer 503 at once: with a
	// breaker of their own they would ask it and answer 502.
	var gatewayCode int
	var gatewayRetry, gatewayBody string
	var counted503 float64
	ups, out := downUntilStep2(t, cfg, func(m *Metrics) prometheus.Gauge { return m.WMDown }, func(p *Pipeline) {
		resp, err := http.Post(p.HTTPURL()+"/v1/runs/default/rewards/slime", "application/json", strings.NewReader(`{"prompt":"p","response":"r"}`))
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			gatewayCode, gatewayRetry, gatewayBody = resp.StatusCode, resp.Header.Get("Retry-After"), string(b)
		} else {
			gatewayBody = err.Error()
		}
		counted503 = testutil.ToFloat64(p.Metrics().HTTPRequests.WithLabelValues("rewards_slime", "503"))
		down.Store(false)
	})
	if gatewayCode != http.StatusServiceUnavailable || gatewayRetry != "1" || !strings.Contains(gatewayBody, "the world model is down since") {
		t.Errorf("the gateway's reward endpoint while predict found the world model down: %d, Retry-After %q, %s; want 503 saying it is down, Retry-After 1",
			gatewayCode, gatewayRetry, gatewayBody)
	}
	if counted503 != 1 {
		t.Errorf("wmrl_http_requests_total{endpoint=\"rewards_slime\",code=\"503\"} = %v after one 503; want 1", counted503)
	}
	wmRewards := func(u schemas.Update) (graded, ungraded int) {
		for _, it := range u.Items {
			if it.Source != "world_model" {
				continue
			}
			if it.Reward == nil {
				ungraded++
			} else {
				graded++
			}
		}
		return
	}
	// A group that failed before the breaker opened may come back after it
	// closed: its step is the only one that can mix.
	whileDown := 0
	for _, u := range ups {
		if g, n := wmRewards(u); g == 0 && n > 0 {
			whileDown++
		}
	}
	if len(ups) != 20 || whileDown == 0 {
		t.Fatalf("%d updates, %d of them without world-model rewards; want 20, some", len(ups), whileDown)
	}
	if g, n := wmRewards(ups[19]); g == 0 || n != 0 {
		t.Fatalf("step 19 has %d world-model rewards and %d ungraded; want all of them once it is back", g, n)
	}
	checkFusion(t, ups[19])

	atOnce, pred := givenUpAtOnce(t, cfg.DataDir, StagePredict, "the world model", "503"), 0
	for _, b := range readStored(t, cfg.DataDir, "wmrl.default.pred") {
		var p schemas.Prediction
		json.Unmarshal(b, &p)
		if strings.Contains(p.Items[0].Reason, "the world model is down since") {
			pred++
		}
	}
	// The server saw the calls before the breaker opened (3, and those
	// under way, cut short when it opened) and the probes; the groups given
	// up at once cost none: fewer requests than one per trajectory of them.
	if atOnce == 0 || pred != atOnce {
		t.Fatalf("%d groups given up at once in the dead letters, %d recorded so; want the same, and some", atOnce, pred)
	}
	if n := requests.Load(); int(n) >= atOnce*cfg.GroupSize {
		t.Errorf("%d requests while down; %d groups were given up, %d trajectories", n, atOnce, atOnce*cfg.GroupSize)
	}
	for _, want := range []string{"predict: the world model is down: 3 calls in a row failed", "predict: the world model is back after "} {
		if strings.Count(out, want) != 1 {
			t.Errorf("output has %q %d times, want once:\n%s", want, strings.Count(out, want), out)
		}
	}
	t.Logf("%d groups given up at once, %d requests while down", atOnce, requests.Load())
}

// TestPipelineGivesUpOnAWorldModelThatNeverAnswers: a server that takes
// requests and never answers fails calls only once every retry of every
// request has timed out, and with all of a step's groups sharing the
// requests in flight they would all fail together, many timeouts later.
// The client reports each request to the breaker, which opens after two
// waves of them (2 x --wm-concurrency) fail with no answer between: the
// run goes on, and once the server answers again, so does the world model.
func TestPipelineGivesUpOnAWorldModelThatNeverAnswers(t *testing.T) {
	var hung atomic.Bool
	hung.Store(true)
	stop := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hung.Load() {
			select {
			case <-r.Context().Done(): // the client's timeout
			case <-stop:
			}
			return
		}
		content := `{"status":"scored","score":0.5,"rationale":"up"}`
		json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"message": map[string]any{"content": content}}}})
	}))
	defer srv.Close()
	defer close(stop)
	cfg := testConfig(t)
	cfg.Steps = 12
	cfg.WorldModel, cfg.WMURL, cfg.WMModel = "openai", srv.URL+"/v1", "judge"
	cfg.WMTimeout, cfg.WMRetries, cfg.WMConcurrency = 200*time.Millisecond, 5, 4
	cfg.WMProbeEvery = 100 * time.Millisecond
	ups, out := downUntilStep2(t, cfg, func(m *Metrics) prometheus.Gauge { return m.WMDown }, func(*Pipeline) { hung.Store(false) })
	if len(ups) != 12 {
		t.Fatalf("%d updates; want 12", len(ups))
	}
	if want := "predict: the world model is down: 8 requests in a row failed, the last: "; strings.Count(out, want) != 1 || !strings.Contains(out, "deadline exceeded") {
		t.Errorf("output does not say once %q (a timeout):\n%s", want, out)
	}
	graded := 0
	for _, it := range ups[11].Items {
		if it.Source == "world_model" && it.Reward != nil {
			graded++
		}
	}
	if graded == 0 || !strings.Contains(out, "predict: the world model is back after ") {
		t.Errorf("step 11 has %d world-model rewards; want some once the server answers again:\n%s", graded, out)
	}
}

// A world model that refuses every request (here: an unknown model name,
// as vLLM answers it) leaves every trajectory ungraded; the run says why,
// with the server's answer, rather than only counting them.
func TestAWorldModelRefusingEveryRequestIsSaid(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusNotFound)
		w.Write([]byte(`{"object":"error","message":"The model ` + "`qwen-typo`" + ` does not exist.","type":"NotFoundError","code":404}`))
	}))
	defer srv.Close()
	cfg := testConfig(t)
	cfg.Steps = 2
	var out syncBuffer
	cfg.Quiet, cfg.Out = false, &out
	cfg.WorldModel, cfg.WMURL, cfg.WMModel = "openai", srv.URL+"/v1", "qwen-typo"
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"world model refused the request: HTTP 404: {\"object\":\"error\",\"message\":\"The model `qwen-typo` does not exist.\"",
		"world model: graded none of the last 64 trajectories (world model refused the request: HTTP 404: 64); the newest: ",
	} {
		if n := linesStarting(out.String(), want); n != 1 {
			t.Errorf("%q said %d times, want once:\n%s", want, n, out.String())
		}
	}
	if !strings.Contains(out.String(), "the model's name (--wm-model)") {
		t.Errorf("no hint at what to check:\n%s", out.String())
	}
}

// The gateway's reward endpoints say it too: a trainer whose every reward
// comes back null learns why from the run.
func TestAWorldModelRefusingTheGatewayIsSaid(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, `{"error":"invalid api key"}`, http.StatusUnauthorized)
	}))
	defer srv.Close()
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPAddr = SourceExternal, "127.0.0.1:0"
	var out syncBuffer
	cfg.Quiet, cfg.Out = false, &out
	cfg.WorldModel, cfg.WMURL, cfg.WMModel = "openai", srv.URL+"/v1", "judge"
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := started(t, ctx, cfg)
	for range 2 {
		resp, err := http.Post(p.HTTPURL()+"/v1/runs/default/rewards/slime", "application/json", strings.NewReader(`{"prompt":"p","response":"print(1)"}`))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || strings.TrimSpace(string(b)) != "null" {
			t.Fatalf("a reward the world model refused: %d %s; want null", resp.StatusCode, b)
		}
	}
	want := `world model refused the request: HTTP 401: {"error":"invalid api key"}`
	if n := linesStarting(out.String(), want); n != 1 {
		t.Errorf("%q said %d times, want once:\n%s", want, n, out.String())
	}
}

// linesStarting counts the lines of out that begin with prefix.
func linesStarting(out, prefix string) int {
	n := 0
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, prefix) {
			n++
		}
	}
	return n
}
