package sandbox

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
)

// Fusion executes trajectories on a Sandbox Fusion server (the run_code API
// verl users already run): the code with the task's public data as files
// under data/, the submission fetched back and graded here.
type Fusion struct {
	URL  string // e.g. http://127.0.0.1:8080 (run_code is appended)
	Task *Task
	// Limits: the server is asked for Timeout as run_timeout and
	// MemoryBytes as memory_limit_MB (zero: the task's, else 60 s and
	// 1024 MiB; negative: -1, no limit); it enforces them itself, so the
	// rest do not apply.
	Limits Limits
	// Retries on 5xx and connection errors (default 3); a request the
	// server has not answered within the run timeout and Slack (default
	// 30s) is not retried.
	Retries int
	Slack   time.Duration
	Client  *http.Client

	mu        sync.Mutex
	filesJSON []byte // publicFiles
}

var _ execute.Executor = (*Fusion)(nil)

type fusionRequest struct {
	Code           string            `json:"code"`
	Language       string            `json:"language"`
	CompileTimeout float64           `json:"compile_timeout"`
	RunTimeout     float64           `json:"run_timeout"`
	MemoryLimitMB  int               `json:"memory_limit_MB"`
	Stdin          string            `json:"stdin"`
	Files          map[string]string `json:"files,omitempty"` // spliced in: see publicFiles
	FetchFiles     []string          `json:"fetch_files"`
}

type fusionResponse struct {
	Status    string `json:"status"` // Success | Failed | SandboxError
	Message   string `json:"message"`
	RunResult *struct {
		Status        string  `json:"status"` // Finished | TimeLimitExceeded | Error
		ExecutionTime float64 `json:"execution_time"`
		ReturnCode    *int    `json:"return_code"`
		Stderr        string  `json:"stderr"`
	} `json:"run_result"`
	Files map[string]string `json:"files"`
}

// publicFiles is the task's public data as the JSON object run_code takes
// for files (name to base64), read and encoded once per executor: it is
// the bulk of every request, and encoding it for each execution made about
// ten times its size in garbage (BenchmarkLargePublicData). Data changed
// on disk during a run is therefore not seen until the process restarts.
func (f *Fusion) publicFiles() ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.filesJSON != nil {
		return f.filesJSON, nil
	}
	var files [][2]string // path, relative path
	var size int64
	err := f.Task.walkPublic(func(path, rel string, dir bool) error {
		if !dir {
			files = append(files, [2]string{path, rel})
			if info, err := os.Stat(path); err == nil {
				size += info.Size()
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("sandbox fusion: public data: %w", err)
	}
	buf := bytes.NewBuffer(make([]byte, 0, base64.StdEncoding.EncodedLen(int(size))+64*len(files)+2))
	buf.WriteByte('{')
	for i, file := range files {
		if i > 0 {
			buf.WriteByte(',')
		}
		name, _ := json.Marshal("data/" + file[1])
		buf.Write(name)
		buf.WriteString(`:"`) // base64 needs no JSON escaping
		if err := encodeFile(buf, file[0]); err != nil {
			return nil, fmt.Errorf("sandbox fusion: public data: %w", err)
		}
		buf.WriteByte('"')
	}
	buf.WriteByte('}')
	f.filesJSON = buf.Bytes()
	return f.filesJSON, nil
}

func encodeFile(w io.Writer, path string) error {
	file, err := os.Open(path)
	if err != nil {
		return err
	}
	defer file.Close()
	enc := base64.NewEncoder(base64.StdEncoding, w)
	if _, err := io.Copy(enc, file); err != nil {
		return err
	}
	return enc.Close()
}

// Execute runs one trajectory. A sandbox that fails (SandboxError, or
// unreachable after the retries) is not a score: SandboxError comes back as
// schemas.ExecSandboxError, an unreachable server as an error so the group
// is retried later.
func (f *Fusion) Execute(ctx context.Context, t schemas.Trajectory) (execute.Result, error) {
	l, retries := f.Limits.For(f.Task), f.Retries
	timeout, mem := l.Timeout, int(l.MemoryBytes>>20)
	if l.MemoryBytes < 0 {
		mem = -1 // Sandbox Fusion's "no limit"
	}
	if retries == 0 {
		retries = 3
	}
	files, err := f.publicFiles()
	if err != nil {
		return execute.Result{Status: schemas.ExecSandboxError, Detail: err.Error()}, nil
	}
	// The request is this execution's fields with the shared files spliced
	// in, never copied into a body of its own.
	head, _ := json.Marshal(fusionRequest{Code: t.Response, Language: "python", CompileTimeout: 10,
		RunTimeout: timeout.Seconds(), MemoryLimitMB: mem, FetchFiles: []string{f.Task.Submission}})
	body := [][]byte{head[:len(head)-1], []byte(`,"files":`), files, []byte("}")}
	var resp fusionResponse
	var last error
	for attempt := 0; attempt <= retries; attempt++ {
		if attempt > 0 {
			if err := sleepCtx(ctx, time.Duration(rand.Int64N(int64(200*time.Millisecond<<attempt)))); err != nil {
				return execute.Result{}, err
			}
		}
		if resp, last = f.post(ctx, body, timeout, fusionAnswerBytes(l)); last == nil {
			break
		}
		if errors.Is(last, errAnswerTooLarge) {
			// The code's doing (a submission over its limit): it would be
			// as large again.
			return execute.Result{Status: schemas.ExecInvalid, Detail: fmt.Sprintf("Sandbox Fusion's answer is over %d MiB: %s is over the %d MiB a submission may be",
				fusionAnswerBytes(l)>>20, f.Task.Submission, l.SubmissionBytes>>20)}, nil
		}
		if errors.Is(last, context.DeadlineExceeded) && ctx.Err() == nil {
			// No answer within the run timeout and the slack: a server
			// that hangs would hang again, each time for as long. The
			// stage retries the group later, and its breaker counts this.
			last = fmt.Errorf("no answer within %v (the run timeout and %v of slack): %w", timeout+f.slack(), f.slack(), last)
			break
		}
	}
	if last != nil {
		return execute.Result{}, fmt.Errorf("sandbox fusion at %s: %w", redacted(f.URL), last)
	}
	return f.judge(resp, l)
}

// errAnswerTooLarge: the server's answer is larger than a submission
// within its limit makes one.
var errAnswerTooLarge = errors.New("the answer is too large")

// fusionAnswerBytes is the largest answer read from the server: the
// submission's limit in base64, and room for the rest.
func fusionAnswerBytes(l Limits) int64 { return (l.SubmissionBytes+2)/3*4 + 16<<20 }

func (f *Fusion) judge(resp fusionResponse, l Limits) (execute.Result, error) {
	timeout := l.Timeout
	rr := resp.RunResult
	switch {
	case resp.Status == "SandboxError" || rr == nil:
		return execute.Result{Status: schemas.ExecSandboxError, Detail: strings.TrimSpace("sandbox error: " + resp.Message)}, nil
	case rr.Status == "TimeLimitExceeded":
		return execute.Result{Status: schemas.ExecTimedOut, Seconds: rr.ExecutionTime, Detail: fmt.Sprintf("killed after %v, its wall-clock limit", timeout)}, nil
	case rr.ReturnCode == nil || *rr.ReturnCode != 0 || rr.Status == "Error":
		code := -1
		if rr.ReturnCode != nil {
			code = *rr.ReturnCode
		}
		return execute.Result{Status: schemas.ExecCrashed, Seconds: rr.ExecutionTime,
			Detail: fmt.Sprintf("exit code %d: %s", code, lastLines(rr.Stderr, 5))}, nil
	}
	enc, ok := resp.Files[f.Task.Submission]
	if !ok {
		return execute.Result{Status: schemas.ExecInvalid, Seconds: rr.ExecutionTime, Detail: "no " + f.Task.Submission + " written"}, nil
	}
	sub, err := base64.StdEncoding.DecodeString(enc)
	if err != nil {
		return execute.Result{Status: schemas.ExecSandboxError, Detail: "fetched submission is not base64: " + err.Error()}, nil
	}
	if size := int64(len(sub)); size > l.SubmissionBytes {
		return execute.Result{Status: schemas.ExecInvalid, Seconds: rr.ExecutionTime, Detail: overLimit(f.Task.Submission, size, l.SubmissionBytes).Error()}, nil
	}
	score, err := f.Task.Grade(sub)
	if err != nil {
		return execute.Result{Status: schemas.ExecInvalid, Seconds: rr.ExecutionTime, Detail: err.Error()}, nil
	}
	return execute.Result{Status: schemas.ExecScored, Score: score, Seconds: rr.ExecutionTime}, nil
}

func (f *Fusion) post(ctx context.Context, body [][]byte, timeout time.Duration, limit int64) (fusionResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout+f.slack())
	defer cancel()
	parts, n := make([]io.Reader, len(body)), 0
	for i, b := range body {
		parts[i], n = bytes.NewReader(b), n+len(b)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(f.URL, "/")+"/run_code", io.MultiReader(parts...))
	if err != nil {
		return fusionResponse{}, err
	}
	req.ContentLength = int64(n)
	req.Header.Set("Content-Type", "application/json")
	client := f.Client
	if client == nil {
		client = http.DefaultClient
	}
	hr, err := client.Do(req)
	if err != nil {
		return fusionResponse{}, err
	}
	defer hr.Body.Close()
	raw, _ := io.ReadAll(io.LimitReader(hr.Body, limit+1))
	if hr.StatusCode != http.StatusOK {
		return fusionResponse{}, fmt.Errorf("HTTP %d: %s", hr.StatusCode, strings.TrimSpace(string(raw[:min(len(raw), 200)])))
	}
	if int64(len(raw)) > limit {
		return fusionResponse{}, errAnswerTooLarge
	}
	var resp fusionResponse
	if err := json.Unmarshal(raw, &resp); err != nil {
		return fusionResponse{}, errors.New("response is not run_code JSON: " + err.Error())
	}
	return resp, nil
}

func (f *Fusion) slack() time.Duration {
	if f.Slack == 0 {
		return 30 * time.Second
	}
	return f.Slack
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// redacted is u with its password hidden, as net/http's own errors give
// it: the error goes to the dead letters and the run's output.
func redacted(u string) string {
	if p, err := url.Parse(u); err == nil {
		return p.Redacted()
	}
	return u
}
