// Package openaitest runs a world model inside a test: an
// OpenAI-compatible chat completions server that scores the solutions of
// wmrl's default prompt.
package openaitest

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// Judge is an OpenAI-compatible server (its base URL + "/v1") whose
// score for a solution is score(its code), read out of the default
// prompt as the predict stage sends it; a code it gives no score for gets
// a reply that is not JSON. It closes with the test.
func Judge(t testing.TB, score func(code string) (float64, bool)) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Messages []struct{ Content string } `json:"messages"`
		}
		if r.URL.Path != "/v1/chat/completions" || json.NewDecoder(r.Body).Decode(&req) != nil || len(req.Messages) == 0 {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		code := PromptedCode(req.Messages[len(req.Messages)-1].Content)
		content := "I cannot tell."
		if s, ok := score(code); ok {
			content = fmt.Sprintf(`{"status":"scored","score":%g,"rationale":"as judged"}`, s)
		}
		json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"message": map[string]any{"content": content}}}})
	}))
	t.Cleanup(srv.Close)
	return srv
}

// PromptedCode is the candidate solution of a default prompt: the lines
// between its code fence and the fence's close.
func PromptedCode(msg string) string {
	_, rest, _ := strings.Cut(msg, "\nCandidate solution")
	_, rest, _ = strings.Cut(rest, "\n")
	fence, rest, _ := strings.Cut(rest, "\n")
	code, _, _ := strings.Cut(rest, "\n"+fence+"\n")
	return code
}
