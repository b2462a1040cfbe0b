package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/openai"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/breaker"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/predict"
)

// judge speaks /v1/chat/completions. It scores a solution by the "score=X"
// written in its code and cannot read one that says "garbage". Each request
// waits until barrier requests are in flight (or a second passes), so a
// gateway asking one solution at a time shows up as one request in flight.
type judge struct {
	*httptest.Server
	barrier int
	gate    chan struct{} // if set, each answer waits for it to close

	mu       sync.Mutex
	cond     *sync.Cond
	inflight int
	maxIn    int
	calls    int
}

var scoreInCode = regexp.MustCompile(`score=([0-9.]+)`)

func newJudge(t *testing.T, barrier int) *judge { return newGatedJudge(t, barrier, nil) }

func newGatedJudge(t *testing.T, barrier int, gate chan struct{}) *judge {
	j := &judge{barrier: barrier, gate: gate}
	j.cond = sync.NewCond(&j.mu)
	j.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Messages []struct{ Content string } `json:"messages"`
		}
		if r.URL.Path != "/v1/chat/completions" || json.NewDecoder(r.Body).Decode(&req) != nil || len(req.Messages) == 0 {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		j.enter()
		defer j.leave()
		if j.gate != nil {
			<-j.gate
		}
		content := `{"status":"scored","score":` + scoreOf(req.Messages[len(req.Messages)-1].Content) + `,"rationale":"read"}`
		if bytes.Contains([]byte(req.Messages[len(req.Messages)-1].Content), []byte("garbage")) {
			content = "I cannot tell."
		}
		json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"message": map[string]any{"role": "assistant", "content": content}}}})
	}))
	t.Cleanup(j.Close)
	return j
}

func scoreOf(msg string) string {
	if m := scoreInCode.FindStringSubmatch(msg); m != nil {
		return m[1]
	}
	return "0"
}

func (j *judge) enter() {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.calls++
	j.inflight++
	j.maxIn = max(j.maxIn, j.inflight)
	j.cond.Broadcast()
	give := time.AfterFunc(time.Second, func() { j.mu.Lock(); j.cond.Broadcast(); j.mu.Unlock() })
	defer give.Stop()
	deadline := time.Now().Add(time.Second)
	for j.maxIn < j.barrier && time.Now().Before(deadline) {
		j.cond.Wait()
	}
}

func (j *judge) leave() {
	j.mu.Lock()
	j.inflight--
	j.mu.Unlock()
}

func (j *judge) seen() (calls, maxIn int) {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.calls, j.maxIn
}

// newGateway serves a gateway for run "r" whose world model is an HTTP
// judge, asked through b (nil: no breaker). The reward endpoints touch
// neither NATS nor the publisher.
func newGateway(t *testing.T, judgeURL string, b *breaker.Breaker) (*Gateway, string) {
	wm, err := openai.New(openai.Config{BaseURL: judgeURL + "/v1", Model: "judge", Backoff: time.Millisecond, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	g, err := New(Config{Run: "r", WorldModel: wm, Breaker: b}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(g.Handler())
	t.Cleanup(srv.Close)
	return g, srv.URL + "/v1/runs/r"
}

func post(t *testing.T, url string, body any) (int, []byte) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, out
}

// TestOpenRLHFBatchReachesTheWorldModelAtOnce: a trainer's batch is scored
// concurrently (every solution not yet executed is in flight together), each
// reward lands at its query's index, through the current map, an executed
// anchor gets its real score without asking the world model, and an
// unreadable verdict is null.
func TestOpenRLHFBatchReachesTheWorldModelAtOnce(t *testing.T) {
	const n = 8
	j := newJudge(t, n-1) // one of the n is an executed anchor
	g, base := newGateway(t, j.URL, nil)

	// The current map doubles scores below 0.5 and caps at 1.
	m, err := calibrate.NewIsotonic([]float64{0, 0.5, 1}, []float64{0, 1, 1})
	if err != nil {
		t.Fatal(err)
	}
	g.cal.Store(&calState{c: schemas.Calibration{Version: 3}, m: m})

	// Solution 2 was executed as an anchor and scored 0.77.
	g.truths.addAnchor(schemas.Group{Trajectories: []schemas.Trajectory{{TrajID: "a-2", Prompt: "Task 2.", Response: "score=0.3"}}})
	truth := 0.77
	g.truths.addExecution(schemas.Execution{Items: []schemas.ExecItem{{TrajID: "a-2", Score: &truth}}})

	var query, prompts []string
	var labels []any
	want := make([]*float64, n)
	for i := range n {
		p := fmt.Sprintf("Task %d.", i)
		code := fmt.Sprintf("score=0.%d", i+1)
		if i == 5 {
			code = "garbage"
		}
		query, prompts, labels = append(query, p+code), append(prompts, p), append(labels, i)
		switch i {
		case 2:
			want[i] = &truth
		case 5:
		default:
			v := m.Predict(float64(i+1) / 10)
			want[i] = &v
		}
	}
	code, body := post(t, base+"/rewards/openrlhf", map[string]any{"query": query, "prompts": prompts, "labels": labels})
	if code != http.StatusOK {
		t.Fatalf("openrlhf: %d %s", code, body)
	}
	var got struct{ Rewards []*float64 }
	if err := json.Unmarshal(body, &got); err != nil || len(got.Rewards) != n {
		t.Fatalf("openrlhf answer %s: %v", body, err)
	}
	for i := range n {
		w, r := want[i], got.Rewards[i]
		if (w == nil) != (r == nil) || (w != nil && math.Abs(*w-*r) > 1e-12) {
			t.Fatalf("reward %d = %s, want %s (all: %s)", i, show(r), show(w), body)
		}
	}
	calls, maxIn := j.seen()
	if calls != n-1 || maxIn != n-1 {
		t.Fatalf("world model saw %d requests, at most %d at once; want %d, all at once", calls, maxIn, n-1)
	}
}

func show(v *float64) string {
	if v == nil {
		return "null"
	}
	return strconv.FormatFloat(*v, 'g', -1, 64)
}

// TestRewardsDependOnContentOnly: the same solution scores the same alone
// (slime) and at any index of a batch (OpenRLHF).
func TestRewardsDependOnContentOnly(t *testing.T) {
	j := newJudge(t, 1)
	_, base := newGateway(t, j.URL, nil)
	code, one := post(t, base+"/rewards/slime", map[string]any{"prompt": "Task 9.", "response": "score=0.42", "label": "t9"})
	if code != http.StatusOK || string(bytes.TrimSpace(one)) != "0.42" {
		t.Fatalf("slime: %d %s, want 0.42 (no map yet: the identity)", code, one)
	}
	code, batch := post(t, base+"/rewards/openrlhf", map[string]any{"query": []string{"Task 8.score=0.3", "Task 9.score=0.42"}, "prompts": []string{"Task 8.", "Task 9."}})
	var got struct{ Rewards []*float64 }
	if json.Unmarshal(batch, &got); code != http.StatusOK || len(got.Rewards) != 2 || got.Rewards[1] == nil || *got.Rewards[1] != 0.42 {
		t.Fatalf("openrlhf: %d %s, want 0.42 second", code, batch)
	}
}

// TestWorldModelFailureIsABadGateway: a world model that cannot be reached
// fails the request with 502 and says so; nothing is invented.
func TestWorldModelFailureIsABadGateway(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	url := dead.URL
	dead.Close()
	_, base := newGateway(t, url, nil)
	code, body := post(t, base+"/rewards/openrlhf", map[string]any{"query": []string{"a", "b"}})
	if code != http.StatusBadGateway || !bytes.Contains(body, []byte("world model")) {
		t.Fatalf("dead world model: %d %s; want 502 naming the world model", code, body)
	}
}

// TestWorldModelDownAnswers503AtOnce: once a world model has failed the
// breaker's count of requests in a row, reward requests are answered 503
// with a Retry-After without asking it (rather than each waiting out the
// connector's retries, minutes against a world model that hangs), and the
// first request after the Retry-After that gets an answer brings 200s back.
func TestWorldModelDownAnswers503AtOnce(t *testing.T) {
	wm, up, calls := failingWorldModel(t, "0.7")
	const probe = 2 * time.Second
	_, base := newGateway(t, wm.URL, &breaker.Breaker{Name: "the world model", After: 2, Probe: probe})
	ask := func() (int, string, string) {
		t.Helper()
		resp, err := http.Post(base+"/rewards/slime", "application/json", strings.NewReader(`{"prompt":"Task 1.","response":"print(1)"}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header.Get("Retry-After"), string(body)
	}

	if code, _, body := ask(); code != http.StatusBadGateway {
		t.Fatalf("first failure: %d %s; want 502", code, body)
	}
	code, retry, body := ask()
	if code != http.StatusServiceUnavailable || retry != strconv.Itoa(int(probe.Seconds())) ||
		!strings.Contains(body, "world model: the world model is down since") || !strings.Contains(body, "overloaded") {
		t.Fatalf("second failure in a row: %d, Retry-After %q, %s; want 503 saying it is down and why, Retry-After 2", code, retry, body)
	}
	before := calls.Load()
	for range 5 {
		if code, retry, body := ask(); code != http.StatusServiceUnavailable || !within(retry, 1, 2) {
			t.Fatalf("while down: %d, Retry-After %q, %s; want 503 with a Retry-After of at most 2", code, retry, body)
		}
	}
	if n := calls.Load() - before; n != 0 {
		t.Fatalf("the world model was asked %d times while it was known to be down", n)
	}

	up.Store(true)
	deadline := time.Now().Add(10 * probe)
	for {
		code, _, body := ask()
		if code == http.StatusOK {
			if strings.TrimSpace(body) != "0.7" {
				t.Fatalf("after the world model came back: %s; want 0.7", body)
			}
			break
		}
		if code != http.StatusServiceUnavailable || time.Now().After(deadline) {
			t.Fatalf("waiting for the probe: %d %s", code, body)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if code, _, body := ask(); code != http.StatusOK {
		t.Fatalf("after a probe got an answer: %d %s; want 200", code, body)
	}
}

// failingWorldModel speaks /v1/chat/completions: 500 "overloaded" until up
// is set, then score for every solution. calls counts its requests.
func failingWorldModel(t *testing.T, score string) (srv *httptest.Server, up *atomic.Bool, calls *atomic.Int64) {
	up, calls = new(atomic.Bool), new(atomic.Int64)
	srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if !up.Load() {
			http.Error(w, "overloaded", http.StatusInternalServerError)
			return
		}
		content := `{"status":"scored","score":` + score + `,"rationale":"read"}`
		json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"message": map[string]any{"role": "assistant", "content": content}}}})
	}))
	t.Cleanup(srv.Close)
	return srv, up, calls
}

// refusing is a publisher whose store is unavailable.
type refusing struct{}

func (refusing) Publish(string, ...*message.Message) error {
	return errors.New("nats: no responders available for request")
}
func (refusing) Close() error { return nil }

// TestStoreUnavailableIsA503WithRetryAfter: when NATS cannot store a
// trajectory or a watermark, the gateway answers 503 with a Retry-After of
// a second and the store's error, so a client asks again shortly.
func TestStoreUnavailableIsA503WithRetryAfter(t *testing.T) {
	g, err := New(Config{Run: "r", WorldModel: &openai.WorldModel{}}, nil, refusing{})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(g.Handler())
	defer srv.Close()
	for path, body := range map[string]string{
		"/v1/runs/r/trajectories":  `[{"schema":1,"run":"r","step":0,"group_id":"g","traj_id":"t","group_size":1,"task_id":"x","prompt":"p","response":"r","policy_version":0}]`,
		"/v1/runs/r/steps/0/close": `{"groups":1}`,
	} {
		resp, err := http.Post(srv.URL+path, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "1" || !bytes.Contains(b, []byte("no responders")) {
			t.Errorf("POST %s with NATS refusing: %d, Retry-After %q, %s; want 503, 1, the store's error", path, resp.StatusCode, resp.Header.Get("Retry-After"), b)
		}
	}
}

// within tells whether a Retry-After is a whole number of seconds in [lo, hi].
func within(retry string, lo, hi int) bool {
	n, err := strconv.Atoi(retry)
	return err == nil && n >= lo && n <= hi
}

// TestTruthsStayBounded: a run of days sends anchors forever, and some
// executions never come or are ungraded; neither map may grow without end,
// and an ungraded item is not awaited any longer.
func TestTruthsStayBounded(t *testing.T) {
	tr := newTruths(10)
	score := 0.5
	for i := range 1000 {
		id := fmt.Sprintf("t%d", i)
		tr.addAnchor(schemas.Group{Trajectories: []schemas.Trajectory{{TrajID: id, Prompt: "p", Response: id}}})
		switch i % 3 {
		case 0: // graded
			tr.addExecution(schemas.Execution{Items: []schemas.ExecItem{{TrajID: id, Score: &score}}})
		case 1: // ungraded
			tr.addExecution(schemas.Execution{Items: []schemas.ExecItem{{TrajID: id}}})
			if _, waiting := tr.byTraj[trajKey{0, id}]; waiting {
				t.Fatalf("%s still awaited after its ungraded execution", id)
			}
		} // 2: never executed
	}
	if len(tr.byTraj) > 10 || len(tr.pending) > 10 || tr.score.Len() > 10 {
		t.Fatalf("sizes %d awaited, %d pending, %d scores; want at most 10 each", len(tr.byTraj), len(tr.pending), tr.score.Len())
	}
	if s, ok := tr.lookup("p", "t998"); ok || tr.score.Len() != 10 {
		t.Fatalf("t998 (never executed) scored %v, %v; %d scores kept", s, ok, tr.score.Len())
	}
	if s, ok := tr.lookup("p", "t999"); !ok || s != 0.5 {
		t.Fatalf("the newest graded anchor t999: %v, %v", s, ok)
	}
	if _, ok := tr.lookup("p", "t0"); ok {
		t.Fatal("the oldest score was not evicted")
	}
	// The same content scored twice is kept once, with the newer score.
	again := 0.9
	tr.addAnchor(schemas.Group{Trajectories: []schemas.Trajectory{{TrajID: "x", Prompt: "p", Response: "t999"}}})
	tr.addExecution(schemas.Execution{Items: []schemas.ExecItem{{TrajID: "x", Score: &again}}})
	if s, _ := tr.lookup("p", "t999"); s != 0.9 || tr.score.Len() != 10 {
		t.Fatalf("rescored content: %v with %d scores kept", s, tr.score.Len())
	}
}

// TestAPollLeavesNoWaiterBehind: a trainer that polls for a step whose
// update does not come (one it never sent, or one held for good) leaves
// nothing behind, with a wait or without, whether the wait ran out or the
// trainer went away; one still waiting gets the update when it comes.
// Before, every such request left a channel for the life of the process.
func TestAPollLeavesNoWaiterBehind(t *testing.T) {
	g, url := newGateway(t, "http://127.0.0.1:1", nil)
	waiting := func(step int64) int {
		g.updates.mu.Lock()
		defer g.updates.mu.Unlock()
		if step < 0 {
			return len(g.updates.waiters)
		}
		return len(g.updates.waiters[step])
	}
	get := func(ctx context.Context, query string) (int, string, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url+query, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), nil
	}
	for _, q := range []string{"/steps/7/update?wait=0.01", "/steps/7/update", "/steps/9/update?wait=0"} {
		for range 5 {
			if code, body, err := get(context.Background(), q); err != nil || code != http.StatusNotFound {
				t.Fatalf("GET %s: %d %s %v; want 404", q, code, body, err)
			}
		}
	}
	if n := waiting(-1); n != 0 {
		t.Fatalf("%d steps still have waiters after polls that ended", n)
	}

	// A trainer that goes away in the middle of a long poll.
	ctx, cancel := context.WithCancel(context.Background())
	gone := make(chan error, 1)
	go func() { _, _, err := get(ctx, "/steps/7/update?wait=30"); gone <- err }()
	until(t, "the long poll waits", func() bool { return waiting(7) == 1 })
	cancel()
	if err := <-gone; err == nil {
		t.Fatal("a cancelled request ended without an error")
	}
	until(t, "the cancelled poll's waiter is given back", func() bool { return waiting(-1) == 0 })

	// Two waiting, one of them gone: the other gets the update.
	ctx, cancel = context.WithCancel(context.Background())
	go func() { _, _, err := get(ctx, "/steps/8/update?wait=30"); gone <- err }()
	type answer struct {
		code int
		body string
		err  error
	}
	got := make(chan answer, 1)
	go func() { c, b, err := get(context.Background(), "/steps/8/update?wait=30"); got <- answer{c, b, err} }()
	until(t, "both long polls wait", func() bool { return waiting(8) == 2 })
	cancel()
	<-gone
	until(t, "the cancelled one is given back", func() bool { return waiting(8) == 1 })
	g.updates.add(natsjs.Record{Data: []byte(`{"step":8,"rho":1.5}`), Seq: 3})
	a := <-got
	if a.err != nil || a.code != http.StatusOK || !strings.Contains(a.body, `"rho":1.5`) {
		t.Fatalf("the poll still waiting: %d %s %v; want step 8's update", a.code, a.body, a.err)
	}
	if n := waiting(-1); n != 0 {
		t.Fatalf("%d steps still have waiters after the update came", n)
	}
}

// until polls cond every 5 ms for up to 10 s.
func until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("after 10s: not yet: %s", what)
		}
	}
}

// A trainer may name its trajectories alike every step: an execution is
// the score of its own step's trajectory, not of another step's of the
// same id that came in between.
func TestTruthsTellStepsApart(t *testing.T) {
	tr := newTruths(10)
	score := 0.25
	tr.addAnchor(schemas.Group{Step: 0, Trajectories: []schemas.Trajectory{{TrajID: "g0-t0", Prompt: "p", Response: "step 0's"}}})
	tr.addAnchor(schemas.Group{Step: 1, Trajectories: []schemas.Trajectory{{TrajID: "g0-t0", Prompt: "p", Response: "step 1's"}}})
	tr.addExecution(schemas.Execution{Step: 0, Items: []schemas.ExecItem{{TrajID: "g0-t0", Score: &score}}})
	if s, ok := tr.lookup("p", "step 0's"); !ok || s != score {
		t.Errorf("step 0's solution: %v, %v; want its execution's %v", s, ok, score)
	}
	if s, ok := tr.lookup("p", "step 1's"); ok {
		t.Errorf("step 1's solution, not executed yet, scored %v", s)
	}
}

// The anchor groups and their executions are read apart: an execution read
// before its group (at a start, both readers going through what was
// stored) still gives the group's solutions their real scores. Before,
// it was passed over.
func TestAnExecutionReadBeforeItsGroupScoresIt(t *testing.T) {
	tr := newTruths(2)
	score := func(s float64) *float64 { return &s }
	tr.addExecution(schemas.Execution{Step: 3, Items: []schemas.ExecItem{{TrajID: "a", Score: score(0.25)}, {TrajID: "b", Score: nil}}})
	tr.addExecution(schemas.Execution{Step: 4, Items: []schemas.ExecItem{{TrajID: "a", Score: score(0.5)}}})
	tr.addAnchor(schemas.Group{Step: 4, Trajectories: []schemas.Trajectory{{TrajID: "a", Prompt: "p", Response: "step 4's"}}})
	tr.addAnchor(schemas.Group{Step: 3, Trajectories: []schemas.Trajectory{{TrajID: "a", Prompt: "p", Response: "step 3's"}, {TrajID: "b", Prompt: "p", Response: "ungraded"}}})
	for response, want := range map[string]float64{"step 3's": 0.25, "step 4's": 0.5} {
		if s, ok := tr.lookup("p", response); !ok || s != want {
			t.Errorf("%s solution: %v, %v; want its execution's %v", response, s, ok, want)
		}
	}
	if s, ok := tr.lookup("p", "ungraded"); ok {
		t.Errorf("a solution its execution did not score was scored %v", s)
	}
	// What waits for its group is bounded as the scores are.
	for step := range int64(5) {
		tr.addExecution(schemas.Execution{Step: 10 + step, Items: []schemas.ExecItem{{TrajID: "a", Score: score(0.75)}}})
	}
	if len(tr.early) != 2 || len(tr.waiting) != 2 {
		t.Errorf("%d scores (%d keys) wait for their groups; want 2, as many as kept", len(tr.early), len(tr.waiting))
	}
}

// TestARetriedRewardWaitsForTheCallUnderWay: a trainer whose client gave up
// waiting for a slow world model (its timeout, a load balancer's) and asks
// again is answered from the call it already paid for, not by a second
// call; the same request later is answered without asking, through the map
// current then.
func TestARetriedRewardWaitsForTheCallUnderWay(t *testing.T) {
	gate := make(chan struct{})
	j := newGatedJudge(t, 1, gate)
	g, base := newGateway(t, j.URL, nil)
	body := `{"prompt":"Task 3.","response":"score=0.4","label":"t3"}`

	impatient := &http.Client{Timeout: 200 * time.Millisecond}
	if resp, err := impatient.Post(base+"/rewards/slime", "application/json", strings.NewReader(body)); err == nil {
		resp.Body.Close()
		t.Fatalf("the first request was answered %d while the world model was still scoring", resp.StatusCode)
	}
	type answer struct {
		code int
		body string
	}
	again := make(chan answer)
	go func() {
		code, b := post(t, base+"/rewards/slime", json.RawMessage(body))
		again <- answer{code, strings.TrimSpace(string(b))}
	}()
	time.Sleep(200 * time.Millisecond) // the retry is waiting too
	close(gate)
	if a := <-again; a.code != http.StatusOK || a.body != "0.4" {
		t.Fatalf("the retry: %d %s; want 0.4", a.code, a.body)
	}
	if calls, _ := j.seen(); calls != 1 {
		t.Fatalf("the world model was asked %d times for one solution asked twice; want once", calls)
	}

	m, err := calibrate.NewIsotonic([]float64{0, 1}, []float64{0.5, 1})
	if err != nil {
		t.Fatal(err)
	}
	g.cal.Store(&calState{c: schemas.Calibration{Version: 1}, m: m})
	if code, b := post(t, base+"/rewards/slime", json.RawMessage(body)); code != http.StatusOK || strings.TrimSpace(string(b)) != "0.7" {
		t.Fatalf("asked again after a refit: %d %s; want 0.7, the remembered 0.4 through the new map", code, b)
	}
	if calls, _ := j.seen(); calls != 1 {
		t.Fatalf("the world model was asked %d times; want once", calls)
	}
	// The same response to another task is another solution.
	if code, b := post(t, base+"/rewards/slime", map[string]any{"prompt": "Task 3.", "response": "score=0.4", "label": "t4"}); code != http.StatusOK || strings.TrimSpace(string(b)) != "0.7" {
		t.Fatalf("another task: %d %s", code, b)
	}
	if calls, _ := j.seen(); calls != 2 {
		t.Fatalf("the world model was asked %d times after another task's solution; want 2", calls)
	}
}

// TestASolutionTwiceInABatchIsAskedOnce: a group of identical completions
// (common once a policy converges on a task) costs one world-model call.
func TestASolutionTwiceInABatchIsAskedOnce(t *testing.T) {
	j := newJudge(t, 1)
	_, base := newGateway(t, j.URL, nil)
	code, b := post(t, base+"/rewards/openrlhf", map[string]any{
		"query":   []string{"Task 1.score=0.2", "Task 1.score=0.3", "Task 1.score=0.2", "Task 1.score=0.2"},
		"prompts": []string{"Task 1.", "Task 1.", "Task 1.", "Task 1."}})
	var got struct{ Rewards []*float64 }
	if json.Unmarshal(b, &got); code != http.StatusOK || len(got.Rewards) != 4 {
		t.Fatalf("openrlhf: %d %s", code, b)
	}
	for i, want := range []float64{0.2, 0.3, 0.2, 0.2} {
		if got.Rewards[i] == nil || *got.Rewards[i] != want {
			t.Fatalf("reward %d = %s, want %v (all: %s)", i, show(got.Rewards[i]), want, b)
		}
	}
	if calls, _ := j.seen(); calls != 2 {
		t.Fatalf("the world model was asked %d times for 2 distinct solutions", calls)
	}
}

// TestAFailedCallIsNotRemembered: a world model that failed is asked again
// by the next request for the same solution.
func TestAFailedCallIsNotRemembered(t *testing.T) {
	wm, up, calls := failingWorldModel(t, "0.6")
	_, base := newGateway(t, wm.URL, nil)
	body := json.RawMessage(`{"prompt":"Task 1.","response":"print(1)"}`)
	if code, b := post(t, base+"/rewards/slime", body); code != http.StatusBadGateway {
		t.Fatalf("while the world model fails: %d %s; want 502", code, b)
	}
	failed := calls.Load()
	up.Store(true)
	if code, b := post(t, base+"/rewards/slime", body); code != http.StatusOK || strings.TrimSpace(string(b)) != "0.6" {
		t.Fatalf("once it answers: %d %s; want 0.6", code, b)
	}
	if calls.Load() == failed {
		t.Fatal("the failed call was remembered: the world model was not asked again")
	}
}

// TestPredictionsStayBoundedAndExpire: what the reward endpoints remember
// is bounded in count and in age; a call under way is joined, whatever its
// age.
func TestPredictionsStayBoundedAndExpire(t *testing.T) {
	now := time.Unix(1000, 0)
	ps := newPredictions(3, time.Minute)
	ps.now = func() time.Time { return now }
	key := func(i int) digest { return digestOf("task", "p", strconv.Itoa(i)) }
	for i := range 10 {
		p, asked := ps.get(key(i))
		if asked {
			t.Fatalf("solution %d: asked before", i)
		}
		ps.settle([]*prediction{p}, []predict.Score{{Value: float64(i), Graded: true}}, nil)
	}
	if len(ps.byKey) > 3 || len(ps.order) > 3 {
		t.Fatalf("remembers %d (%d in order); want at most 3", len(ps.byKey), len(ps.order))
	}
	if p, asked := ps.get(key(9)); !asked || p.score.Value != 9 {
		t.Fatalf("the newest: asked %v, %v", asked, p.score)
	}
	if _, asked := ps.get(key(0)); asked {
		t.Fatal("the oldest was still remembered past the bound")
	}
	under, _ := ps.get(key(100)) // under way for longer than the ttl
	now = now.Add(2 * time.Minute)
	if _, asked := ps.get(key(9)); asked {
		t.Fatal("a score older than the ttl was remembered")
	}
	if p, asked := ps.get(key(100)); !asked || p != under {
		t.Fatal("a call under way was not joined")
	}
}

// TestWhatTheGatewayKeepsOfASolutionIsSmall: over days the gateway sees
// hundreds of thousands of executed anchors and scored solutions, of tens
// of kilobytes each; what it keeps of each is a digest, not the text.
func TestWhatTheGatewayKeepsOfASolutionIsSmall(t *testing.T) {
	const n, size = 2000, 32 << 10
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	tr := newTruths(n)
	ps := newPredictions(n, time.Hour)
	score := 0.5
	before := heap()
	for i := range n {
		code := strconv.Itoa(i) + strings.Repeat("x", size)
		tr.addAnchor(schemas.Group{Step: int64(i), Trajectories: []schemas.Trajectory{{TrajID: "t", Prompt: "p", Response: code}}})
		tr.addExecution(schemas.Execution{Step: int64(i), Items: []schemas.ExecItem{{TrajID: "t", Score: &score}}})
		p, _ := ps.get(ask{task: "x", prompt: "p", response: code}.key())
		ps.settle([]*prediction{p}, []predict.Score{{Value: score, Graded: true}}, nil)
	}
	after := heap()
	grew := after - min(before, after)
	if s, ok := tr.lookup("p", strconv.Itoa(n-1)+strings.Repeat("x", size)); !ok || s != score {
		t.Fatalf("the newest anchor's score: %v, %v", s, ok)
	}
	t.Logf("grew %.2f MB", float64(grew)/(1<<20))
	if grew > n*size/16 {
		t.Fatalf("keeping %d solutions of %d kB grew the heap by %.1f MB; want a digest of each, not its text", n, size>>10, float64(grew)/(1<<20))
	}
	runtime.KeepAlive(tr)
	runtime.KeepAlive(ps)
}

// TestAnUnreadableReplyIsNotRemembered: a solution the world model's reply
// could not grade is null, and asked again next time.
func TestAnUnreadableReplyIsNotRemembered(t *testing.T) {
	j := newJudge(t, 1)
	_, base := newGateway(t, j.URL, nil)
	for range 2 {
		if code, b := post(t, base+"/rewards/slime", map[string]any{"prompt": "Task 1.", "response": "garbage"}); code != http.StatusOK || strings.TrimSpace(string(b)) != "null" {
			t.Fatalf("unreadable: %d %s; want null", code, b)
		}
	}
	if calls, _ := j.seen(); calls != 2 {
		t.Fatalf("the world model was asked %d times for an ungraded solution asked twice; want 2", calls)
	}
}

// TestPlannedStepsStayFew: a run of days plans a step at a time; the
// gateway keeps ranges of consecutive steps, not a set growing by one a
// step, and still knows each step, in order or not.
func TestPlannedStepsStayFew(t *testing.T) {
	p := &planned{}
	plan := p.add
	gap := func(n int64) bool { return n%1000 == 7 }
	for n := int64(100); n < 10_000; n++ {
		if !gap(n) {
			plan(n)
		}
	}
	plan(12_000)
	if p.steps.Ranges() != 11 {
		t.Fatalf("%d ranges for 10 gaps and a step apart", p.steps.Ranges())
	}
	known := func(n int64) bool { return n >= 100 && n < 10_000 && !gap(n) || n == 12_000 }
	for n := int64(-2); n < 12_005; n++ {
		if p.has(n) != known(n) {
			t.Fatalf("step %d: planned %v, want %v", n, p.has(n), known(n))
		}
	}
	for n := int64(9_999); n >= 0; n-- { // the gaps and the steps before, newest first, and again
		plan(n)
	}
	if p.steps.Ranges() != 2 || p.steps.Len() != 10_001 {
		t.Fatalf("after the gaps were planned: %d ranges of %d steps; want 2 of 10001", p.steps.Ranges(), p.steps.Len())
	}
	if last, _ := p.newest(); last != 12_000 {
		t.Fatalf("newest %d", last)
	}
}

// TestWhatWasSentIsForgottenOncePlanned: the gateway keeps the ids it
// stored of the steps route has not planned, to refuse the same id with
// other content; a run of days plans a step at a time, and a planned
// step's ids are dropped at the next request.
func TestWhatWasSentIsForgottenOncePlanned(t *testing.T) {
	s, p := &sent{ids: map[int64]map[string]sentAs{}}, &planned{}
	send := func(step int64) {
		var trajs []schemas.Trajectory
		var msgs []*message.Message
		for i := range 4 {
			tr := schemas.Trajectory{Schema: schemas.Version, Run: "r", Step: step, GroupID: "g", TrajID: fmt.Sprint("t", i), Prompt: "p", Response: fmt.Sprint(i)}
			m, err := schemas.NewTrajMessage(tr)
			if err != nil {
				t.Fatal(err)
			}
			trajs, msgs = append(trajs, tr), append(msgs, m)
		}
		s.add(trajs, msgs, p)
	}
	for step := range int64(1000) {
		send(step)
		p.add(step)
	}
	send(1000)
	if len(s.ids) != 1 || len(s.ids[1000]) != 4 {
		t.Fatalf("kept the ids of %d steps (%d of step 1000); want step 1000's 4 alone", len(s.ids), len(s.ids[1000]))
	}
	if as, ok := s.of(1000, "t2"); !ok || as.group != "g" || !strings.HasPrefix(as.id, "r/traj/1000/g/t2/") {
		t.Fatalf("t2 of step 1000 sent as %+v, %v", as, ok)
	}
	if _, ok := s.of(999, "t2"); ok {
		t.Fatal("step 999, planned, is still known")
	}
}

// panicking is a world model that panics.
type panicking struct{}

func (panicking) Predict(context.Context, []schemas.Trajectory) ([]predict.Score, error) {
	panic("index out of range")
}
func (panicking) Name() string { return "broken" }

// TestAWorldModelThatPanicsFailsTheRequest: the world model's call runs
// apart from its request; a panic in it fails the request with 502 and
// leaves the gateway serving.
func TestAWorldModelThatPanicsFailsTheRequest(t *testing.T) {
	g, err := New(Config{Run: "r", WorldModel: panicking{}}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(g.Handler())
	defer srv.Close()
	for range 2 {
		code, b := post(t, srv.URL+"/v1/runs/r/rewards/slime", map[string]any{"prompt": "p", "response": "r"})
		if code != http.StatusBadGateway || !strings.Contains(string(b), "world model broken panicked: index out of range") {
			t.Fatalf("a panicking world model: %d %s; want 502 saying so", code, b)
		}
	}
}

// The map in force is the last one fuse would take: a calibration fuse
// refuses (a map that goes down, from a stage replacing calibrate; a score
// out of range; another run's) leaves the one before in force. Before, a
// map that goes down put the identity in force.
func TestACalibrationFuseRefusesLeavesTheMapInForce(t *testing.T) {
	g, err := New(Config{Run: "r", WorldModel: &openai.WorldModel{}}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	send := func(c schemas.Calibration) {
		b, err := json.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		g.calibrated(natsjs.Record{Data: b})
	}
	good := schemas.Calibration{Schema: schemas.Version, Run: "r", Seq: 1, Version: 1, Map: &schemas.Thresholds{X: []float64{0, 1}, Y: []float64{0.2, 0.6}}}
	send(good)
	for _, bad := range []schemas.Calibration{
		{Schema: schemas.Version, Run: "r", Seq: 2, Version: 2, Map: &schemas.Thresholds{X: []float64{0, 1}, Y: []float64{0.6, 0.2}}},
		{Schema: schemas.Version, Run: "r", Seq: 2, Version: 2, Map: &schemas.Thresholds{X: []float64{0, 1}, Y: []float64{0.2, 1e300}}},
		{Schema: schemas.Version, Run: "other", Seq: 2, Version: 2},
	} {
		send(bad)
		if st := g.cal.Load(); st.c.Version != 1 || st.m == nil || st.m.Predict(0.5) != 0.4 {
			t.Errorf("after %+v: version %d in force, want 1's map", bad, st.c.Version)
		}
	}
	send(schemas.Calibration{Schema: schemas.Version, Run: "r", Seq: 3, Version: 3})
	if st := g.cal.Load(); st.c.Version != 3 || st.m != nil {
		t.Errorf("a calibration without a map: version %d, map %v; want 3, the identity", st.c.Version, st.m)
	}
}

// A reward request whose world-model call the gateway's Close ends (the
// drain ran out) is answered 503, saying so, which a client asks again elsewhere; a 502
// would blame a world model that did not fail, and a client does not ask
// again after one.
func TestARewardTheStopCutsShortIsA503(t *testing.T) {
	gate := make(chan struct{})
	j := newGatedJudge(t, 1, gate)
	t.Cleanup(func() { close(gate) }) // before the judge closes: it waits for its handlers
	g, base := newGateway(t, j.URL, nil)
	type answer struct {
		code  int
		body  string
		retry string
	}
	answered := make(chan answer, 1)
	go func() {
		resp, err := http.Post(base+"/rewards/slime", "application/json", strings.NewReader(`{"prompt":"Task 3.","response":"score=0.4","label":"t3"}`))
		if err != nil {
			answered <- answer{body: err.Error()}
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		answered <- answer{resp.StatusCode, string(b), resp.Header.Get("Retry-After")}
	}()
	for calls, _ := j.seen(); calls == 0; calls, _ = j.seen() {
		time.Sleep(time.Millisecond)
	}
	g.Close() // what the end of the server's drain does
	a := <-answered
	if a.code != http.StatusServiceUnavailable || a.retry == "" || !strings.Contains(a.body, "the gateway is stopping: ask again") {
		t.Fatalf("a reward request under way as the gateway stopped: %d %s (Retry-After %q); want 503 saying so", a.code, a.body, a.retry)
	}
}

// Between the process's stop (the end of Run) and Close, a reward request
// under way gets its world model's answer, and so does one for the same
// solution, which waits for that call; one that needs a new call is
// answered 503 at once, without asking the world model, so that its
// client asks another gateway of the run rather than wait for a call the
// server's close may cut off.
func TestARewardUnderWayAtTheStopIsAnswered(t *testing.T) {
	gate := make(chan struct{})
	j := newGatedJudge(t, 1, gate)
	g, base := newGateway(t, j.URL, nil)
	type answer struct {
		code int
		body string
	}
	ask := func(body string) <-chan answer {
		out := make(chan answer, 1)
		go func() {
			resp, err := http.Post(base+"/rewards/slime", "application/json", strings.NewReader(body))
			if err != nil {
				out <- answer{body: err.Error()}
				return
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			out <- answer{resp.StatusCode, string(b)}
		}()
		return out
	}
	const under = `{"prompt":"Task 3.","response":"score=0.4","label":"t3"}`
	first := ask(under)
	for calls, _ := j.seen(); calls == 0; calls, _ = j.seen() {
		time.Sleep(time.Millisecond)
	}
	g.closed() // what the end of Run does
	again := ask(under)
	if a := <-ask(`{"prompt":"Task 4.","response":"score=0.9","label":"t4"}`); a.code != http.StatusServiceUnavailable || !strings.Contains(a.body, "the gateway is stopping: ask again") {
		t.Errorf("a reward request needing a new call after the stop began: %d %s; want 503 at once, saying so", a.code, a.body)
	}
	close(gate)
	for name, ch := range map[string]<-chan answer{"under way at the stop": first, "for the same solution after it": again} {
		if a := <-ch; a.code != http.StatusOK || !strings.Contains(a.body, "0.4") {
			t.Errorf("the reward request %s: %d %s; want 200 with the world model's 0.4", name, a.code, a.body)
		}
	}
	if calls, _ := j.seen(); calls != 1 {
		t.Errorf("the world model was asked %d times; want once, for the solution under way", calls)
	}
}
