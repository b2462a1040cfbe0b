package main

import (
	"context"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/pipeline/offline"
	"github.com/wmrl/wmrl/stages/archive"
)

// judge is an OpenAI-compatible server whose score for a solution is
// score(its code), read out of the default prompt as the predict stage
// sends it; a code it gives no score for gets a reply that is not JSON.
func judge(t *testing.T, score func(code string) (float64, bool)) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Messages []struct{ Content string } `json:"messages"`
		}
		if r.URL.Path != "/v1/chat/completions" || json.NewDecoder(r.Body).Decode(&req) != nil || len(req.Messages) == 0 {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		msg := req.Messages[len(req.Messages)-1].Content
		_, code, _ := strings.Cut(msg, "Candidate solution:\n```\n")
		code, _, _ = strings.Cut(code, "\n```")
		content := "I cannot tell."
		if s, ok := score(code); ok {
			content = fmt.Sprintf(`{"status":"scored","score":%g,"rationale":"as judged"}`, s)
		}
		json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"message": map[string]any{"content": content}}}})
	}))
	t.Cleanup(srv.Close)
	return srv
}

// TestWMEvalSetsAWorldModelAgainstTheRecordedOne runs the pipeline to an
// archive, then wm-eval with two judges over HTTP: one that knows every
// execution's true score ranks every group perfectly and is called better
// than the run's world model; one that scores by a hash of the code is
// called worse. The CSV holds every executed trajectory with both scores.
// An archive without code, and a call without the model, are refused
// with the reason.
func TestWMEvalSetsAWorldModelAgainstTheRecordedOne(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	archiveOf := func(code bool) string {
		cfg := pipeline.DefaultConfig()
		cfg.DataDir, cfg.Listen, cfg.Quiet, cfg.Steps, cfg.ExecLatency = t.TempDir(), "127.0.0.1:0", true, 12, time.Millisecond
		cfg.ArchiveCode = code
		if err := pipeline.Run(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		return cfg.ArchiveRoot()
	}
	root := archiveOf(true)
	files, _ := archive.Files(root, "default")
	executed, err := offline.Executed(files)
	if err != nil {
		t.Fatal(err)
	}
	truth := map[string]float64{}
	for _, r := range executed {
		truth[*r.Response] = *r.TrueScore
	}
	if len(executed) < 100 || len(truth) != len(executed) {
		t.Fatalf("%d executed trajectories, %d distinct codes: the oracle needs each code once", len(executed), len(truth))
	}
	oracle := judge(t, func(code string) (float64, bool) { s, ok := truth[code]; return s, ok })
	hashed := judge(t, func(code string) (float64, bool) {
		h := fnv.New32a()
		h.Write([]byte(code))
		return float64(h.Sum32()%1000) / 1000, true
	})

	csvPath := filepath.Join(t.TempDir(), "eval.csv")
	out, err := wmrl(ctx, "wm-eval", "--archive", root, "--wm-url", oracle.URL+"/v1", "--wm-model", "oracle", "--out", csvPath)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	t.Logf("wm-eval, the oracle:\n%s", out)
	n := len(executed)
	for _, want := range []string{
		fmt.Sprintf(`\(%d executed trajectories\)`, n),
		fmt.Sprintf(`(?m)^\s+graded\s+%d \(100%%\)\s+%d \(100%%\)$`, n, n),
		`(?m)^\s+within-group Spearman\s+0\.\d+\s+1\.000$`,
		`paired over \d+ groups: \+0\.\d+ ± 0\.\d+ \(2 SE\): oracle ranks better`,
	} {
		if !regexp.MustCompile(want).MatchString(out) {
			t.Errorf("wm-eval with the oracle does not say %s", want)
		}
	}
	f, err := os.Open(csvPath)
	if err != nil {
		t.Fatal(err)
	}
	recs, err := csv.NewReader(f).ReadAll()
	f.Close()
	if err != nil || len(recs) != len(executed)+1 {
		t.Fatalf("CSV: %d records (%v), want a header and %d", len(recs), err, len(executed))
	}
	for _, rec := range recs[1:] {
		if rec[5] != rec[7] || rec[6] == "" || rec[8] != "scored" {
			t.Fatalf("CSV row %v: the oracle's score is not the true one, or the recorded one is missing", rec)
		}
	}

	out, err = wmrl(ctx, "wm-eval", "--archive", root, "--wm-url", hashed.URL+"/v1", "--wm-model", "hashed", "--groups", "20")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	t.Logf("wm-eval, scores by hash on 20 groups:\n%s", out)
	if !strings.Contains(out, "on 20 anchor groups") || !strings.Contains(out, "hashed ranks worse") ||
		!regexp.MustCompile(`(?m)^by task, the least favourable change first \(5 of \d+ tasks`).MatchString(out) {
		t.Errorf("wm-eval with scores by hash on a sample of 20 groups:\n%s", out)
	}

	if _, err := wmrl(ctx, "wm-eval", "--archive", root); err == nil || !strings.Contains(err.Error(), "--wm-url and --wm-model") {
		t.Errorf("without a world model: %v", err)
	}
	if _, err := wmrl(ctx, "wm-eval", "--archive", archiveOf(false), "--wm-url", oracle.URL+"/v1", "--wm-model", "oracle"); err == nil ||
		!strings.Contains(err.Error(), "--archive-code=false") {
		t.Errorf("an archive without code: %v", err)
	}
}
