// Package fusiontest runs a Sandbox Fusion server inside a test: its
// run_code endpoint, which really runs the code with python3.
package fusiontest

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// request is what run_code reads of a request.
type request struct {
	Code       string            `json:"code"`
	Language   string            `json:"language"`
	RunTimeout float64           `json:"run_timeout"`
	Files      map[string]string `json:"files"`
	FetchFiles []string          `json:"fetch_files"`
}

// Server speaks Sandbox Fusion's run_code and really runs the code with
// python3 in a scratch directory, its files written there and those
// asked for fetched back, as the real server does. The first failFirst
// requests get a 503. It counts the requests, and closes with the test.
func Server(t testing.TB, failFirst int64) (*httptest.Server, *atomic.Int64) {
	var calls atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/run_code" {
			http.NotFound(w, r)
			return
		}
		if calls.Add(1) <= failFirst {
			http.Error(w, "overloaded", http.StatusServiceUnavailable)
			return
		}
		var req request
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.Language != "python" {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		dir := t.TempDir()
		for name, enc := range req.Files {
			b, _ := base64.StdEncoding.DecodeString(enc)
			os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755)
			os.WriteFile(filepath.Join(dir, name), b, 0o644)
		}
		os.WriteFile(filepath.Join(dir, "code.py"), []byte(req.Code), 0o644)
		ctx, cancel := context.WithTimeout(r.Context(), time.Duration(req.RunTimeout*float64(time.Second)))
		defer cancel()
		cmd := exec.CommandContext(ctx, "python3", "code.py")
		cmd.Dir = dir
		var stderr []byte
		start := time.Now()
		_, err := cmd.Output()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			stderr = ee.Stderr
		}
		status, code := "Finished", cmd.ProcessState.ExitCode()
		if ctx.Err() != nil {
			status = "TimeLimitExceeded"
		}
		files := map[string]string{}
		for _, f := range req.FetchFiles {
			if b, err := os.ReadFile(filepath.Join(dir, f)); err == nil {
				files[f] = base64.StdEncoding.EncodeToString(b)
			}
		}
		overall := "Success"
		if status != "Finished" || code != 0 {
			overall = "Failed"
		}
		json.NewEncoder(w).Encode(map[string]any{"status": overall, "compile_result": nil, "files": files,
			"run_result": map[string]any{"status": status, "execution_time": time.Since(start).Seconds(), "return_code": code,
				"stdout": "", "stderr": string(stderr)}})
	}))
	t.Cleanup(srv.Close)
	return srv, &calls
}
