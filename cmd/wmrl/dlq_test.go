package main

import (
	"bytes"
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/schemas"
)

// wmrl runs the command line in this process and returns what it printed.
func wmrl(ctx context.Context, args ...string) (string, error) {
	var out bytes.Buffer
	root := rootCommand()
	root.SetArgs(args)
	root.SetOut(&out)
	root.SetErr(&out)
	err := root.ExecuteContext(ctx)
	return out.String(), err
}

// TestDeadLettersAreShownWithTheirReasons: what the pipeline dead-letters
// is listed with stage, subject, what it was about and why, summed up by
// stage and by kind; --json gives back each original payload; --follow
// shows one that comes later; a stopped pipeline's data directory reads the
// same, and a running one's is refused rather than opened twice.
func TestDeadLettersAreShownWithTheirReasons(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, cfg, js := startExternal(t, ctx)
	publish := func(subject, payload string) {
		t.Helper()
		if _, err := js.Publish(ctx, subject, []byte(payload)); err != nil {
			t.Fatal(err)
		}
	}

	bad := []string{
		`{"schema":1,"run":"default","step":3,"group_id":"g7","traj_id":"g7-1","task_id":"t9","prompt":"p","response":"r","policy_version":0}`, // no group_size
		`{"schema": 1, "run": "default", `,
	}
	for _, b := range bad {
		publish("wmrl.default.traj", b)
	}
	// An outside stage that gave up on a message after its retries.
	outside, _ := json.Marshal(schemas.DeadLetter{Schema: 1, Subject: "wmrl.default.pred_raw", Stage: "abstain",
		Reason: "gave up after 10 deliveries: judge unreachable", Payload: `{"step":5,"group_id":"g2"}`, Time: time.Now().UTC()})
	publish("wmrl.default.dlq", string(outside))
	waitUntil(t, 30*time.Second, func() bool {
		out, err := wmrl(ctx, "dlq", "--nats", p.URL())
		return err == nil && strings.HasPrefix(lastLine(out), "3 dead letters")
	})

	out, err := wmrl(ctx, "dlq", "--nats", p.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("wmrl dlq:\n%s", out)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 4 {
		t.Fatalf("want 3 dead letters and a summary; got\n%s", out)
	}
	// In the order they were dead-lettered, which the outside stage's
	// need not share with route's.
	for _, want := range [][]string{
		{"[step 3, group g7, traj g7-1, task t9]", "route", "wmrl.default.traj", "missing field(s): group_size"},
		{"[32 bytes, not a JSON object]", "route", "wmrl.default.traj", "malformed JSON"},
		{"[step 5, group g2]", "abstain", "wmrl.default.pred_raw", "gave up after 10 deliveries: judge unreachable"},
	} {
		i := slices.IndexFunc(lines[:3], func(l string) bool { return strings.Contains(l, want[0]) })
		if i < 0 {
			t.Errorf("no line shows %s", want[0])
			continue
		}
		for _, w := range want[1:] {
			if !strings.Contains(lines[i], w) {
				t.Errorf("line %q does not show %q", lines[i], w)
			}
		}
	}
	if sum := lines[3]; !strings.Contains(sum, "on wmrl.default.dlq") ||
		!strings.Contains(sum, "route 2 (rejected 2, given up 0)") ||
		!strings.Contains(sum, "abstain 1 (rejected 0, given up 1)") {
		t.Errorf("summary %q", sum)
	}

	// --json --stage route: the stored dead letters, with the payloads as published.
	out, err = wmrl(ctx, "dlq", "--nats", p.URL(), "--json", "--stage", "route")
	if err != nil {
		t.Fatal(err)
	}
	var payloads []string
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		var dl schemas.DeadLetter
		if err := json.Unmarshal([]byte(l), &dl); err != nil {
			t.Fatalf("--json line %q: %v", l, err)
		}
		if dl.Stage != pipeline.StageRoute || dl.Subject != "wmrl.default.traj" || dl.Reason == "" {
			t.Errorf("--json --stage route gave %+v", dl)
		}
		payloads = append(payloads, dl.Payload)
	}
	slices.Sort(payloads)
	if want := slices.Sorted(slices.Values(bad)); !slices.Equal(payloads, want) {
		t.Errorf("payloads %q, want the published %q", payloads, want)
	}

	// --follow: one that comes after the stored ones is shown as it comes.
	fctx, stopFollow := context.WithCancel(ctx)
	var followed lockedBuffer
	done := make(chan error, 1)
	go func() {
		root := rootCommand()
		root.SetArgs([]string{"dlq", "--nats", p.URL(), "--follow"})
		root.SetOut(&followed)
		done <- root.ExecuteContext(fctx)
	}()
	waitUntil(t, 30*time.Second, func() bool { return strings.Count(followed.String(), "\n") == 3 })
	publish("wmrl.default.traj", `{"schema":1,"run":"elsewhere","step":4,"group_id":"g1","traj_id":"g1-0","group_size":2,"task_id":"t","prompt":"p","response":"r","policy_version":0}`)
	waitUntil(t, 30*time.Second, func() bool { return strings.Contains(followed.String(), `"elsewhere"`) })
	stopFollow()
	if err := <-done; err != nil {
		t.Fatalf("--follow ended with %v", err)
	}
	if !strings.HasPrefix(lastLine(followed.String()), "4 dead letters") {
		t.Errorf("--follow's summary when stopped: %q", lastLine(followed.String()))
	}

	// A running pipeline's store is not opened a second time.
	if _, err := wmrl(ctx, "dlq", "--data", cfg.DataDir); err == nil || !strings.Contains(err.Error(), "in use") || !strings.Contains(err.Error(), "--nats") {
		t.Fatalf("--data of a running pipeline: %v", err)
	}
	publish("wmrl.quiet.step", `{}`) // a run of its own, without dead letters
	if err := p.Stop(); err != nil {
		t.Fatal(err)
	}
	stopped, err := wmrl(ctx, "dlq", "--data", cfg.DataDir)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(lastLine(stopped), "4 dead letters") || !strings.Contains(stopped, "[step 3, group g7, traj g7-1, task t9]") {
		t.Errorf("from the stopped pipeline's data:\n%s", stopped)
	}
	if _, err := wmrl(ctx, "dlq", "--data", cfg.DataDir, "--prefix", "other"); err == nil || !strings.Contains(err.Error(), "no stream WMRL_OTHER") {
		t.Errorf("a prefix nothing ran with: %v", err)
	}
	if out, err := wmrl(ctx, "dlq", "--data", cfg.DataDir, "--run", "quiet"); err != nil || strings.TrimSpace(out) != "no dead letters on wmrl.quiet.dlq" {
		t.Errorf("a run without dead letters: %q, %v", out, err)
	}
	// A run the stream does not hold (mistyped) is not one without dead
	// letters: before, both read "no dead letters".
	for _, args := range [][]string{{}, {"--resend", "--dry-run"}} {
		out, err := wmrl(ctx, append([]string{"dlq", "--data", cfg.DataDir, "--run", "defualt"}, args...)...)
		if err == nil || !strings.Contains(err.Error(), "holds nothing of run defualt (it holds default, quiet): give --run one of them") || strings.TrimSpace(out) != "" {
			t.Errorf("dlq %v of a run the stream does not hold: %q, %v", args, out, err)
		}
	}
}

// startExternal starts a pipeline waiting for trajectories from outside,
// on its own embedded server, and a client of it; both stop with the test.
func startExternal(t *testing.T, ctx context.Context) (*pipeline.Pipeline, pipeline.Config, jetstream.JetStream) {
	t.Helper()
	cfg := pipeline.DefaultConfig()
	cfg.DataDir, cfg.Listen, cfg.Quiet, cfg.Source = t.TempDir(), "127.0.0.1:0", true, pipeline.SourceExternal
	cfg.ExecLatency = time.Millisecond
	p, err := pipeline.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Stop() })
	nc, err := nats.Connect(p.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, _ := jetstream.New(nc)
	return p, cfg, js
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

func waitUntil(t *testing.T, d time.Duration, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %v", d)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestResendSendsBackWhatAnOutageGaveUp: --dry-run says what --resend
// would do and changes nothing; --resend stores the dead letter given up
// on its subject again, as it was, removes it from the dead letters, and
// keeps the rejected input; --follow is refused with it.
func TestResendSendsBackWhatAnOutageGaveUp(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, _, js := startExternal(t, ctx)
	const payload = `{"schema":1,"run":"default","step":5,"group_id":"g2","items":[]}`
	for _, dl := range []schemas.DeadLetter{
		{Schema: 1, Subject: "wmrl.default.pred_raw", Stage: "abstain", Reason: "gave up after 10 deliveries: judge unreachable", Payload: payload},
		{Schema: 1, Subject: "wmrl.default.traj", Stage: "route", Reason: "route: invalid message: malformed JSON", Payload: `{"schema`},
	} {
		b, _ := json.Marshal(dl)
		if _, err := js.Publish(ctx, "wmrl.default.dlq", b); err != nil {
			t.Fatal(err)
		}
	}
	stored := func(subject string) []string {
		t.Helper()
		var out []string
		if err := natsjs.Scan(ctx, js, pipeline.StreamName("wmrl"), subject, false, func(r natsjs.Record) error {
			out = append(out, string(r.Data))
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return out
	}
	const kept = "kept 1: rejected input, which would be rejected again"
	for _, c := range []struct {
		args    []string
		summary string
		lines   int // a line for each dead letter sent, and the summary
		left    int // dead letters
		sent    int // copies on pred_raw
	}{
		{[]string{"--dry-run"}, "would send again 1 dead letter (1 to wmrl.default.pred_raw); " + kept, 2, 2, 0},
		{[]string{"--resend"}, "sent again 1 dead letter (1 to wmrl.default.pred_raw); " + kept, 2, 1, 1},
		{[]string{"--resend"}, "sent again 0 dead letters; " + kept, 1, 1, 1},
	} {
		out, err := wmrl(ctx, append([]string{"dlq", "--nats", p.URL()}, c.args...)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("wmrl dlq %s:\n%s", strings.Join(c.args, " "), out)
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if len(lines) != c.lines || lines[len(lines)-1] != c.summary {
			t.Errorf("%d lines ending %q, want %d ending %q", len(lines), lines[len(lines)-1], c.lines, c.summary)
		}
		if len(lines) > 1 && !strings.Contains(lines[0], "[step 5, group g2]") {
			t.Errorf("line %q does not show the dead letter sent", lines[0])
		}
		if n := len(stored("wmrl.default.dlq")); n != c.left {
			t.Errorf("after %v: %d dead letters left, want %d", c.args, n, c.left)
		}
		if got := stored("wmrl.default.pred_raw"); len(got) != c.sent || (c.sent == 1 && got[0] != payload) {
			t.Errorf("after %v: pred_raw holds %q, want the payload %d time(s)", c.args, got, c.sent)
		}
	}
	if _, err := wmrl(ctx, "dlq", "--nats", p.URL(), "--resend", "--follow"); err == nil || !strings.Contains(err.Error(), "--follow") {
		t.Errorf("--resend --follow: %v, want it refused", err)
	}
}

// TestFollowOutlivesARestartOfTheRun: `dlq --follow` on a run's server
// says when the server goes away, waits for it (nats.go alone gives up
// after 2 minutes), says when it is back, and shows what is
// dead-lettered after the restart.
func TestFollowOutlivesARestartOfTheRun(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := pipeline.DefaultConfig()
	cfg.DataDir, cfg.Quiet, cfg.Source = t.TempDir(), true, pipeline.SourceExternal
	cfg.Listen = freePort(t)
	start := func() *pipeline.Pipeline {
		t.Helper()
		p, err := pipeline.Start(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Stop() })
		return p
	}
	p := start()
	url := p.URL()

	fctx, stopFollow := context.WithCancel(ctx)
	var followed, said lockedBuffer
	done := make(chan error, 1)
	go func() {
		root := rootCommand()
		root.SetArgs([]string{"dlq", "--nats", url, "--follow"})
		root.SetOut(&followed)
		root.SetErr(&said)
		done <- root.ExecuteContext(fctx)
	}()
	// Following: nothing stored, nothing shown, until the stop.
	time.Sleep(500 * time.Millisecond)
	if err := p.Stop(); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 30*time.Second, func() bool { return strings.Contains(said.String(), "dlq: lost the connection to "+url) })
	time.Sleep(3 * time.Second) // reconnects failing meanwhile
	// The same server again, at the same URL (stopped when the test ends).
	start()
	waitUntil(t, 30*time.Second, func() bool { return strings.Contains(said.String(), "dlq: connected to "+url+" again") })

	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	if _, err := js.Publish(ctx, "wmrl.default.traj", []byte(`{"schema": 1, "run": "default", `)); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 30*time.Second, func() bool { return strings.Contains(followed.String(), "malformed JSON") })
	stopFollow()
	if err := <-done; err != nil {
		t.Fatalf("--follow ended with %v; it said:\n%s", err, said.String())
	}
	if n := strings.Count(said.String(), "lost the connection"); n != 1 {
		t.Errorf("said the connection lost %d times, for one restart and a stop:\n%s", n, said.String())
	}
}

// A dead letter whose payload was cut to fit says so on its line, with
// where the whole is, instead of reading as a payload that is not JSON.
func TestACutDeadLetterSaysWhereTheWholeIs(t *testing.T) {
	line := dlqLine(schemas.DeadLetter{Stage: "route", Subject: "wmrl.default.traj", Reason: "route: invalid message: schema 2",
		Payload: `{"schema":2,"run":"default","step":0,"response":"`, PayloadBytes: 1024153, Seq: 41})
	if want := "[payload cut to 49 of 1024153 bytes; the whole at stream sequence 41]  route: invalid message: schema 2"; !strings.Contains(line, want) {
		t.Errorf("%q, want it to hold %q", line, want)
	}
}
