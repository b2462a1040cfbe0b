package pipeline

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
)

// TestPipelineWithAnOpenAIWorldModel runs every stage with the world model
// behind a real HTTP server speaking /v1/chat/completions, one reply in
// seven of which is garbage, and at most --wm-concurrency requests in
// flight: the first requests wait until one more than that are in flight
// (or a second passes), so a limit not passed on shows up as one too many.
func TestPipelineWithAnOpenAIWorldModel(t *testing.T) {
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
		json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"message": map[string]any{"content": content}}}})
	}))
	defer srv.Close()
	cfg := testConfig(t)
	cfg.Steps = 4
	var out syncBuffer
	cfg.Quiet, cfg.Out = false, &out
	cfg.WorldModel, cfg.WMURL, cfg.WMModel, cfg.WMConcurrency = "openai", srv.URL+"/v1", "judge", concurrency
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
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
	t.Logf("%d graded, %d ungraded predictions; %d null rewards in updates", graded, ungraded, nulls)
}
