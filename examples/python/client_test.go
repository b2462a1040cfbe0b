// Package pythonclient holds the tests of wmrl_client.py, the trainers'
// Python client; the client itself needs no Go.
package pythonclient

import (
	"bufio"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	wmrlgateway "github.com/wmrl/wmrl/connectors/gateway"
	"github.com/wmrl/wmrl/connectors/openai"
)

// gateway answers the slime reward endpoint with the statuses in answers,
// one a request (the last one from then on): 503s with a Retry-After of
// retryAfter seconds, a 502, or a 200 with the reward 0.7.
type gateway struct {
	*httptest.Server
	mu      sync.Mutex
	answers []int
	at      []time.Time
}

func newGateway(t *testing.T, retryAfter string, answers ...int) *gateway {
	g := &gateway{answers: answers}
	g.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g.mu.Lock()
		code := g.answers[min(len(g.at), len(g.answers)-1)]
		g.at = append(g.at, time.Now())
		g.mu.Unlock()
		if r.URL.Path != "/v1/runs/default/rewards/slime" {
			code = http.StatusNotFound
		}
		w.Header().Set("Content-Type", "application/json")
		switch code {
		case http.StatusOK:
			w.Write([]byte("0.7\n"))
			return
		case http.StatusServiceUnavailable:
			w.Header().Set("Retry-After", retryAfter)
		}
		w.WriteHeader(code)
		w.Write([]byte(`{"error": "world model: the world model is down since then"}` + "\n"))
	}))
	t.Cleanup(g.Close)
	return g
}

func (g *gateway) requests() []time.Time {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]time.Time(nil), g.at...)
}

// ask runs the client's slime_reward against url with retry_for and
// prints the reward, or the error's status, retry_after and message, and
// what the client logged.
func ask(t *testing.T, url string, retryFor float64) string {
	t.Helper()
	return askTimes(t, url, retryFor, 1)
}

// askTimes is ask, calls times with one client.
func askTimes(t *testing.T, url string, retryFor float64, calls int) string {
	t.Helper()
	out, err := clientCommand(t, url, retryFor, calls).CombinedOutput()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, out)
	}
	return strings.TrimSpace(string(out))
}

// clientCommand is the Python process askTimes runs, not started; what it
// prints and logs goes to its standard output, unbuffered.
func clientCommand(t *testing.T, url string, retryFor float64, calls int) *exec.Cmd {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	script := `
import logging, sys
from wmrl_client import WMRLClient, WMRLError
logging.basicConfig(stream=sys.stdout, format="log %(message)s")
c = WMRLClient(sys.argv[1], retry_for=float(sys.argv[2]))
for _ in range(int(sys.argv[3])):
    try:
        print("reward", c.slime_reward("Task 1.", "print(1)"))
    except WMRLError as e:
        print("error", e.status, e.retry_after, e.message)
`
	return exec.Command(py, "-u", "-c", script, url, strconv.FormatFloat(retryFor, 'f', -1, 64), strconv.Itoa(calls))
}

// A 503 is asked again after its Retry-After until an answer comes.
func TestClientWaitsOutA503(t *testing.T) {
	g := newGateway(t, "1", 503, 503, 200)
	if got := ask(t, g.URL, 30); got != "reward 0.7" {
		t.Fatalf("client printed %q; want the reward after two 503s", got)
	}
	if n := len(g.requests()); n != 3 {
		t.Fatalf("%d requests; want 3", n)
	}
}

// A 503 whose Retry-After goes past retry_for, or any other error, is
// raised with the gateway's status, reason and Retry-After, after one
// request: the client reads the Retry-After rather than retrying blind.
func TestClientGivesUpAndSaysWhy(t *testing.T) {
	for _, c := range []struct {
		retryAfter string
		retryFor   float64
		want       string
	}{
		{"1", 0, "error 503 1.0 world model: the world model is down since then"},
		{"5", 3, "error 503 5.0 world model: the world model is down since then"},
	} {
		down := newGateway(t, c.retryAfter, 503, 200)
		if got := ask(t, down.URL, c.retryFor); got != c.want {
			t.Errorf("Retry-After %s, retry_for %v: the client printed %q; want %q", c.retryAfter, c.retryFor, got, c.want)
		}
		if n := len(down.requests()); n != 1 {
			t.Errorf("Retry-After %s, retry_for %v: %d requests; want 1", c.retryAfter, c.retryFor, n)
		}
	}
	bad := newGateway(t, "1", 502, 200)
	if got := ask(t, bad.URL, 30); !strings.HasPrefix(got, "error 502 None ") {
		t.Errorf("on a 502 the client printed %q; want the error, not asked again", got)
	}
	if n := len(bad.requests()); n != 1 {
		t.Errorf("%d requests on a 502; want 1", n)
	}
}

// freeAddr is a loopback address nothing listens on (for now).
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// A gateway that is not up yet (a wmrl run starting, or restarted under a
// trainer) is asked again until it answers, which is said once; one that
// never answers is raised as WMRLError after retry_for, with the cause.
func TestClientWaitsForAGatewayThatIsNotUpYet(t *testing.T) {
	addr := freeAddr(t)
	// The gateway comes up once the client has said it waits: a fixed
	// sleep raced Python's start on a loaded machine.
	cmd := clientCommand(t, "http://"+addr, 30, 1)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	type result struct {
		out string
		at  time.Time
	}
	waiting, done := make(chan struct{}), make(chan result, 1)
	go func() {
		var out []string
		var said sync.Once
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			out = append(out, sc.Text())
			if strings.Contains(sc.Text(), "asking again for up to") {
				said.Do(func() { close(waiting) })
			}
		}
		cmd.Wait()
		done <- result{strings.Join(out, "\n"), time.Now()}
	}()
	select {
	case <-waiting:
	case r := <-done:
		t.Fatalf("the client ended before it said it waits:\n%s", r.out)
	case <-time.After(time.Minute):
		cmd.Process.Kill()
		t.Fatal("the client did not say it waits within a minute")
	}
	g := newGateway(t, "1", 200)
	g.Close() // newGateway's listener is on another port: serve the same on addr
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	up := time.Now()
	srv := &http.Server{Handler: g.Config.Handler}
	go srv.Serve(l)
	defer srv.Close()
	var r result
	select {
	case r = <-done:
	case <-time.After(time.Minute):
		cmd.Process.Kill()
		t.Fatal("the client did not answer within a minute of the gateway coming up")
	}
	lines := strings.Split(r.out, "\n")
	if last := lines[len(lines)-1]; last != "reward 0.7" || r.at.Before(up) {
		t.Fatalf("client printed %q; want the reward once the gateway was up", r.out)
	}
	if n := strings.Count(r.out, "asking again for up to 30 s"); n != 1 || !strings.Contains(r.out, "answers again, after") {
		t.Errorf("the wait was said %d times, want once, and its end:\n%s", n, r.out)
	}

	start := time.Now()
	if got := ask(t, "http://"+freeAddr(t), 2); !strings.Contains(got, "error None None could not reach http://127.0.0.1:") ||
		!strings.Contains(got, "Connection refused") {
		t.Errorf("a gateway that never answers: the client printed %q; want WMRLError with the cause", got)
	}
	if took := time.Since(start); took < 2*time.Second {
		t.Errorf("the client gave up after %v, before retry_for", took)
	}
}

// An update is asked for in long polls of at most poll seconds, until it
// comes or wait has passed: the gateway holds a poll 10 minutes at most
// and a load balancer may cut one idle for a minute, where a step's
// anchors may execute for longer. A 404 other than "no update yet" (an
// unknown run) is raised at once.
func TestClientPollsForAnUpdateUntilItComes(t *testing.T) {
	var mu sync.Mutex
	var waits []string
	var polls int
	g := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		polls++
		n := polls
		waits = append(waits, r.URL.Query().Get("wait"))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		switch {
		case !strings.HasPrefix(r.URL.Path, "/v1/runs/default/"):
			w.WriteHeader(http.StatusNotFound)
			w.Write([]byte(`{"error": "unknown run \"other\" (this gateway serves run \"default\")"}`))
		case n < 3 || strings.HasSuffix(r.URL.Path, "/steps/9/update"):
			time.Sleep(200 * time.Millisecond) // the long poll, shortened
			w.WriteHeader(http.StatusNotFound)
			w.Write([]byte(`{"error": "step 3 has no update yet (waited 1s)"}`))
		default:
			w.Write([]byte(`{"step": 3, "items": []}`))
		}
	}))
	defer g.Close()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	script := `
import sys, time
from wmrl_client import WMRLClient, WMRLError
def show(run, step, wait):
    c = WMRLClient(sys.argv[1], run=run)
    start = time.monotonic()
    try:
        print("update of step", c.update(step, wait=wait, poll=1)["step"])
    except WMRLError as e:
        print("error", e.status, "after", "at least 2.5 s" if time.monotonic() - start >= 2.5 else "under 1 s" if time.monotonic() - start < 1 else "%.1f s" % (time.monotonic() - start))
show("default", 3, 30)
show("default", 9, 2.5)
show("other", 3, 30)
`
	out, err := exec.Command(py, "-c", script, g.URL).CombinedOutput()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, out)
	}
	want := "update of step 3\nerror 404 after at least 2.5 s\nerror 404 after under 1 s"
	if got := strings.TrimSpace(string(out)); got != want {
		t.Errorf("client printed %q; want %q", got, want)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, w := range waits {
		if secs, err := strconv.ParseFloat(w, 64); err != nil || secs > 1 {
			t.Errorf("a poll asked to wait %q; want at most poll, 1 s", w)
		}
	}
}

// A reward request waits for the gateway's answer as long as
// reward_timeout, past the client's timeout for other requests: the
// world model behind it may take a minute, and asking the batch again
// after `timeout` would only ask the world model twice.
func TestRewardsWaitForASlowWorldModel(t *testing.T) {
	var asked atomic.Int64
	g := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked.Add(1)
		time.Sleep(1500 * time.Millisecond) // the world model thinking
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte("0.7\n"))
	}))
	defer g.Close()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	script := `
import sys
from wmrl_client import WMRLClient
print("reward", WMRLClient(sys.argv[1], timeout=0.5).slime_reward("Task 1.", "print(1)"))
`
	out, err := exec.Command(py, "-c", script, g.URL).CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "reward 0.7" {
		t.Fatalf("python: %v\n%s", err, out)
	}
	if n := asked.Load(); n != 1 {
		t.Errorf("the reward was asked %d times; want once", n)
	}
}

// TestARetriedRewardIsScoredOnce: a reward request the client gave up on
// (its reward_timeout, shorter here than the world model takes) and asked
// again is answered by the real gateway from the world-model call already
// under way: the trainer gets its reward and the world model, an LLM paid
// by the token, is asked once.
func TestARetriedRewardIsScoredOnce(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	var asked atomic.Int64
	judge := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked.Add(1)
		select {
		case <-time.After(2 * time.Second): // the world model thinking
		case <-r.Context().Done():
			return
		}
		verdict(w, "0.7")
	}))
	defer judge.Close()
	srv := httptest.NewServer(gatewayOn(t, judge.URL).Handler())
	defer srv.Close()
	script := `
import sys, time
from wmrl_client import WMRLClient
start = time.monotonic()
print("reward", WMRLClient(sys.argv[1], timeout=0.3, reward_timeout=0.3).slime_reward("Task 1.", "print(1)"))
print("after", time.monotonic() - start, file=sys.stderr)
`
	cmd := exec.Command(py, "-c", script, srv.URL)
	cmd.Dir = "."
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "reward 0.7") || !strings.Contains(string(out), "asking again") {
		t.Fatalf("python: %v\n%s", err, out)
	}
	if n := asked.Load(); n != 1 {
		t.Errorf("the world model was asked %d times for one reward; want once\n%s", n, out)
	}
}

// TestABatchLargerThanARequestIsSplit: a reward batch of long solutions
// larger than a request may be goes to the real gateway in several
// requests, sent at once, and each reward comes back in its place.
func TestABatchLargerThanARequestIsSplit(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	// The world model scores a solution by the number it prints.
	judge := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Messages []struct{ Content string } `json:"messages"`
		}
		json.NewDecoder(r.Body).Decode(&req)
		score := "0"
		if m := printed.FindStringSubmatch(req.Messages[0].Content); m != nil {
			score = m[1]
		}
		verdict(w, score)
	}))
	defer judge.Close()
	g := gatewayOn(t, judge.URL)
	var requests atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		g.Handler().ServeHTTP(w, r)
	}))
	defer srv.Close()
	script := `
import sys
from wmrl_client import WMRLClient
c = WMRLClient(sys.argv[1])
n = 60
prompts = ["Task %d: %s" % (i, "x" * 150) for i in range(n)]
query = [p + "print(0.%02d)" % i for i, p in enumerate(prompts)]
r = c.openrlhf_rewards(query, prompts=prompts, labels=["t%d" % i for i in range(n)], max_bytes=2000)
assert r == [i / 100 for i in range(n)], r
print("ok", len(r))
`
	cmd := exec.Command(py, "-c", script, srv.URL)
	out, err := cmd.CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "ok 60" {
		t.Fatalf("python: %v\n%s", err, out)
	}
	if n := requests.Load(); n < 6 {
		t.Errorf("%d requests for a batch of about 23 kB in requests of 2 kB", n)
	}
}

var printed = regexp.MustCompile(`print\(([0-9.]+)\)`)

// verdict answers a chat completion whose reply scores the solution score.
func verdict(w http.ResponseWriter, score string) {
	json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"message": map[string]any{"role": "assistant",
		"content": `{"status":"scored","score":` + score + `,"rationale":"read"}`}}}})
}

// gatewayOn is the real gateway for run "default", its world model the
// OpenAI-compatible server at judgeURL; it touches no NATS.
func gatewayOn(t *testing.T, judgeURL string) *wmrlgateway.Gateway {
	t.Helper()
	wm, err := openai.New(openai.Config{BaseURL: judgeURL + "/v1", Model: "judge"})
	if err != nil {
		t.Fatal(err)
	}
	g, err := wmrlgateway.New(wmrlgateway.Config{Run: "default", WorldModel: wm}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

// Given several gateways of a run, the client leaves one it cannot reach,
// or one that answers 503 (stopping, or without its NATS server), for the
// next at once, and stays with the one that answered. Only when none
// answers does it wait, and then it names them all.
func TestClientTriesTheNextGateway(t *testing.T) {
	down := "http://" + freeAddr(t)
	stopping := newGateway(t, "30", 503) // a Retry-After past retry_for: waiting for it would fail the call
	up := newGateway(t, "1", 200)
	out := askTimes(t, strings.Join([]string{down, stopping.URL, up.URL}, ","), 5, 2)
	if strings.Count(out, "reward 0.7") != 2 {
		t.Fatalf("the client printed:\n%s\nwant two rewards, from the third gateway", out)
	}
	if !strings.Contains(out, "log wmrl gateway "+down+"/v1/runs/default: [Errno 111] Connection refused; asking "+stopping.URL+"/v1/runs/default") {
		t.Errorf("the client logged:\n%s\nwant the first gateway's refusal, and the next one asked", out)
	}
	if a, b := len(stopping.requests()), len(up.requests()); a != 1 || b != 2 {
		t.Errorf("the stopping gateway was asked %d times and the live one %d; want once and twice (the second call where the first was answered)", a, b)
	}

	other := "http://" + freeAddr(t)
	out = askTimes(t, down+","+other, 1, 2)
	if !strings.Contains(out, "error None None could not reach any of "+down+"/v1/runs/default, "+other+"/v1/runs/default for ") {
		t.Errorf("no gateway up: the client printed:\n%s\nwant WMRLError naming both", out)
	}
}
