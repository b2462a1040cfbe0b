package main

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
)

// TestAReaderWhereNoRunRanSaysWhatToGiveAndMakesNothing: status and dlq
// read a stopped run's store by starting a server on it, and a server
// makes a store where it is started. Run where no run ran (the default
// --data in another directory) or given a --data no run had, they made
// an empty store there and said only that it held no stream; now they
// say what to give, and leave the directory as it was.
func TestAReaderWhereNoRunRanSaysWhatToGiveAndMakesNothing(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	t.Chdir(dir)
	for _, args := range [][]string{{"status"}, {"status", "--json"}, {"dlq"}, {"dlq", "--resend"}, {"status", "--data", "typo"}, {"dlq", "--data", "typo"}} {
		data := "wmrl-data"
		if i := slices.Index(args, "--data"); i >= 0 {
			data = args[i+1]
		}
		want := "no pipeline's store in " + data + " (stat " + filepath.Join(data, "nats") + ": no such file or directory): give the --data of a stopped run, or --nats URL for a running one"
		if out, err := wmrl(ctx, args...); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("wmrl %s (%v):\n%s\nwant it to say %q", strings.Join(args, " "), err, out, want)
		}
	}
	if left, err := os.ReadDir(dir); err != nil || len(left) != 0 {
		t.Errorf("the readers left %v in their directory (%v); want nothing", left, err)
	}
}

// TestStatusShowsWhereTheRunIs: wmrl status shows the last step received
// and fused, the dead letters and every stage consumer of a live run, and
// on a stopped run's data the backlog that came in after it stopped, with
// no pull waiting for it.
func TestStatusShowsWhereTheRunIs(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, cfg, js := startExternal(t, ctx)
	pol := sim.Policy{Run: "default", Tasks: 4, Groups: 4, GroupSize: 4}
	publishStep := func(js jetstream.JetStream, n int64, watermark bool) {
		t.Helper()
		trajs, wm := pol.Step(n)
		for _, tr := range trajs {
			b, _ := json.Marshal(tr)
			if _, err := js.Publish(ctx, "wmrl.default.traj", b); err != nil {
				t.Fatal(err)
			}
		}
		if watermark {
			b, _ := json.Marshal(wm)
			if _, err := js.Publish(ctx, "wmrl.default.step", b); err != nil {
				t.Fatal(err)
			}
		}
	}
	publishStep(js, 0, true)
	if _, err := js.Publish(ctx, "wmrl.default.traj", []byte(`{"schema":1`)); err != nil {
		t.Fatal(err)
	}
	var out string
	var err error
	waitUntil(t, time.Minute, func() bool {
		out, err = wmrl(ctx, "status", "--nats", p.URL())
		return err == nil && strings.Contains(out, "steps fused:     up to 0") && strings.Contains(out, "dead letters:    1 ")
	})
	// Asked again: one look reads the stream's counts before the run's
	// newest messages, and may have read the execution's count before it
	// was stored and the update after (seen once, under a loaded CI).
	if out, err = wmrl(ctx, "status", "--nats", p.URL()); err != nil {
		t.Fatal(err)
	}
	t.Logf("wmrl status:\n%s", out)
	for _, want := range []string{"steps received:  up to 0", "next step:       1 (", "rho ", "groups 4, anchors 1", "(wmrl dlq lists them)",
		"newest of them:  rejected by route, ", "malformed JSON", "executions:      4 in the last 1h (1 anchor groups): scored 4\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("status does not show %q", want)
		}
	}
	if strings.Contains(out, "held back:") || strings.Contains(out, "being fused:") {
		t.Errorf("status names steps not fused, with every step fused:\n%s", out)
	}
	for _, consumer := range []string{"route_default_traj", "route_default_step", "predict_default_group", "execute_default_exec",
		"pair_default_pred", "pair_default_execution", "fuse_default_plan", "archive_default_update"} {
		row := regexp.MustCompile(`(?m)^\s*` + consumer + `\s+wmrl\.default\.\w+\s+0\s+\d+\s+\d+\s+\d+\s+\S+ ago\s*$`)
		if !row.MatchString(out) {
			t.Errorf("no row for %s with no backlog and a last delivery", consumer)
		}
	}

	// The same as JSON, for scripts.
	doc := statusJSON(t, ctx, "--nats", p.URL())
	if doc.Fused == nil || doc.Fused.Step != 0 || doc.Fused.Groups != 4 || doc.Fused.Anchors != 1 || doc.Fused.Rho < 1 || !slices.Equal(doc.Fused.WMModels, []string{"sim"}) ||
		doc.NextStep == nil || *doc.NextStep != 1 || doc.Received == nil || doc.Received.Step != 0 || doc.Calibration == nil {
		t.Errorf("status --json: received %+v, fused %+v, next %v, calibration %+v", doc.Received, doc.Fused, doc.NextStep, doc.Calibration)
	}
	if dl := doc.DeadLetters.Newest; doc.DeadLetters.Count != 1 || dl == nil || dl.Kind != "rejected" || dl.Stage != "route" || !strings.Contains(dl.Reason, "malformed JSON") {
		t.Errorf("status --json dead letters: %+v, newest %+v", doc.DeadLetters, dl)
	}
	if doc.Executions.Groups != 1 || doc.Executions.ByStatus["scored"] != 4 || len(doc.Unfused) != 0 {
		t.Errorf("status --json executions %+v, unfused %+v", doc.Executions, doc.Unfused)
	}
	// The simulated executor takes 1 ms an execution: the group's slowest
	// is its executions' maximum.
	if e, g := doc.Executions.Seconds, doc.Executions.GroupSlowest; e == nil || g == nil || e.Median < 0.001 || e.Median > e.P99 || e.P99 > e.Max || g.Max != e.Max || g.Median != e.Max {
		t.Errorf("status --json execution times %+v, a group's slowest %+v", e, g)
	}
	if c := consumerOf(doc, "route_default_traj"); c == nil || c.Backlog != 0 || c.LastDelivery == nil || c.Unread {
		t.Errorf("status --json route_default_traj: %+v", c)
	}

	if err := p.Stop(); err != nil {
		t.Fatal(err)
	}
	// Step 1 arrives while the pipeline is down.
	srv, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: filepath.Join(cfg.DataDir, "nats")})
	if err != nil {
		t.Fatal(err)
	}
	nc2, _ := srv.Connect("trainer")
	js2, _ := jetstream.New(nc2)
	publishStep(js2, 1, false)
	nc2.Close()
	srv.Shutdown()
	out, err = wmrl(ctx, "status", "--data", cfg.DataDir)
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^\s*route_default_traj\s+wmrl\.default\.traj\s+16\s+0\s+\d+\s+0\s+- \*\s*$`).MatchString(out) ||
		!strings.Contains(out, "* 1 consumer(s) with a backlog and no pull request waiting: nothing reads them") {
		t.Errorf("the stopped run's status does not show the 16 trajectories waiting for route, unread:\n%s", out)
	}
	if !regexp.MustCompile(`(?m)^steps fused:     up to 0 .*, anchors 1, world model sim$`).MatchString(out) {
		t.Errorf("the stopped run's status lost its last update, or does not name the world model that scored it:\n%s", out)
	}
	if !regexp.MustCompile(`(?m)^trajectories:    of step 1, the newest \S+, \S+ ago, whose watermark has not come`).MatchString(out) {
		t.Errorf("the stopped run's status does not show step 1 waiting for its watermark:\n%s", out)
	}
	doc = statusJSON(t, ctx, "--data", cfg.DataDir)
	if n := doc.NewestTrajectory; n == nil || n.Step != 1 || doc.Received == nil || doc.Received.Step != 0 {
		t.Errorf("status --json of the stopped run: newest trajectory %+v, received %+v; want step 1 past the watermark of 0", n, doc.Received)
	}
	if c := consumerOf(doc, "route_default_traj"); c == nil || c.Backlog != 16 || c.PullsWaiting != 0 || !c.Unread {
		t.Errorf("status --json of the stopped run, route_default_traj: %+v; want 16 unread", c)
	}
	if doc.Store.LimitBytes == nil || *doc.Store.LimitBytes <= 0 || doc.Store.StreamBytes == 0 {
		t.Errorf("status --json of the stopped run, store: %+v", doc.Store)
	}
	// The store's use against the embedded server's limit.
	if !regexp.MustCompile(`(?m)^store:           the stream \d+ kB; the JetStream account \d+ kB of its limit [\d.]+ [kMG]B \(0%\)$`).MatchString(out) {
		t.Errorf("the stopped run's status does not show the store's use against its limit:\n%s", out)
	}
	if strings.Contains(out, "the stream holds runs") || doc.OtherRuns != nil {
		t.Errorf("the status of a run with messages names other runs: %v\n%s", doc.OtherRuns, out)
	}
	// A --run mistyped: the runs the stream holds are named.
	out, err = wmrl(ctx, "status", "--data", cfg.DataDir, "--run", "defualt")
	if err != nil || !strings.Contains(out, "run defualt in stream WMRL_WMRL at "+cfg.DataDir+": 0 messages kept (retention 168h0m0s); the stream holds runs default: give --run one of them\n") {
		t.Errorf("the status of a run the stream does not hold (%v):\n%s", err, out)
	}
	out, err = wmrl(ctx, "status", "--json", "--data", cfg.DataDir, "--run", "defualt")
	var other statusDoc
	if err != nil || json.Unmarshal([]byte(out), &other) != nil || !slices.Equal(other.OtherRuns, []string{"default"}) {
		t.Errorf("status --json of a run the stream does not hold (%v): other_runs %v\n%s", err, other.OtherRuns, out)
	}
}

// statusJSON runs wmrl status --json with args and decodes it, refusing
// keys the document does not have.
func statusJSON(t *testing.T, ctx context.Context, args ...string) statusDoc {
	t.Helper()
	out, err := wmrl(ctx, append([]string{"status", "--json"}, args...)...)
	if err != nil {
		t.Fatal(err)
	}
	var doc statusDoc
	dec := json.NewDecoder(strings.NewReader(out))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&doc); err != nil {
		t.Fatalf("status --json: %v:\n%s", err, out)
	}
	// The keys a script reads, as the README names them.
	for _, key := range []string{`"next_step": `, `"fused": `, `"dead_letters": {`, `"anchor_groups": {`, `"consumers": [`, `"unread": `, `"limit_bytes": `} {
		if !strings.Contains(out, key) {
			t.Errorf("status --json has no %s:\n%s", key, out)
		}
	}
	return doc
}

func consumerOf(doc statusDoc, name string) *consumerDoc {
	for i := range doc.Consumers {
		if doc.Consumers[i].Name == name {
			return &doc.Consumers[i]
		}
	}
	return nil
}

// TestStatusTellsAnOutageFromBadInput: the newest dead letter's line says
// whether it was given up (a service down) or rejected, and a long reason
// is cut to one short line.
func TestStatusTellsAnOutageFromBadInput(t *testing.T) {
	now := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	reason := "gave up at once: the world model is down since 11:59:00 after 5 failures in a row: " + strings.Repeat("503 ", 100)
	st := &pipeline.Status{Stream: "S", DeadLetters: 7,
		LastDeadLetter:   &schemas.DeadLetter{Stage: "predict", Reason: reason},
		LastDeadLetterAt: now.Add(-3 * time.Second)}
	var b strings.Builder
	writeStatus(&b, st, "here", "wmrl", "default", now)
	line := regexp.MustCompile(`(?m)^newest of them:.*$`).FindString(b.String())
	if !strings.HasPrefix(line, "newest of them:  given up by predict, 2026-12-03T11:59:57Z, 3s ago: gave up at once: the world model is down") {
		t.Errorf("the newest dead letter's line is %q", line)
	}
	if n := len([]rune(line)); n > 320 || !strings.HasSuffix(line, "…") {
		t.Errorf("a %d-rune reason makes a %d-rune line, not cut: %q", len(reason), n, line)
	}

	if strings.Contains(b.String(), "every stage waits for room") {
		t.Errorf("a store of no known limit was said to be full:\n%s", b.String())
	}
	st.StoreUsed, st.StoreLimit = 99<<20, 100<<20
	b.Reset()
	writeStatus(&b, st, "here", "wmrl", "default", now)
	if !strings.Contains(b.String(), "of its limit 104.9 MB (99%)\n                 at its limit the server stores nothing, and every stage waits for room") {
		t.Errorf("a store at 99%% of its limit shows as:\n%s", b.String())
	}

	if !strings.Contains(b.String(), "executions:      none in the last 1h\n") {
		t.Errorf("no executions show as:\n%s", b.String())
	}

	st.Executions = pipeline.ExecutionsStatus{Groups: 5, ByStatus: map[string]int{schemas.ExecScored: 30, schemas.ExecCrashed: 9, schemas.ExecSandboxError: 1},
		Seconds: pipeline.TimeQuantiles{Median: 95.25, P99: 1199.9996, Max: 1200}, Slowest: pipeline.TimeQuantiles{Median: 301, P99: 1200, Max: 1200},
		NewestFailure:   schemas.ExecItem{Status: schemas.ExecCrashed, Detail: "exit code 1: ModuleNotFoundError: No module named 'lightgbm'"},
		NewestFailureAt: now.Add(-time.Minute),
		ByCause: map[string]int{"ModuleNotFoundError: No module named 'lightgbm'": 6, "KeyError: 'area'": 2, "killed by signal N (killed)": 1,
			"could not start the code: python3 is not found or not executable by user N": 1}}
	b.Reset()
	writeStatus(&b, st, "here", "wmrl", "default", now)
	if !strings.Contains(b.String(), "executions:      40 in the last 1h (5 anchor groups): scored 30, crashed 9, sandbox_error 1\n"+
		"                 each took median 1m35.25s, p99 20m0s, max 20m0s; a group's slowest median 5m1s, p99 20m0s, max 20m0s (a step waits for it up to --anchor-deadline)\n"+
		"newest failure:  crashed, 2026-12-03T11:59:00Z, 1m0s ago: exit code 1: ModuleNotFoundError: No module named 'lightgbm'\n"+
		"failure causes:  6 ModuleNotFoundError: No module named 'lightgbm'\n"+
		"                 2 KeyError: 'area'\n"+
		"                 1 could not start the code: python3 is not found or not executable by user N\n") {
		t.Errorf("the hour's executions show as:\n%s", b.String())
	}
	st.Executions.Capped, st.Executions.Since, st.Executions.Shared = true, now.Add(-90*time.Second), 24
	b.Reset()
	writeStatus(&b, st, "here", "wmrl", "default", now)
	if !strings.Contains(b.String(), "executions:      40 in the newest 5 anchor groups (since 2026-12-03T11:58:30Z, 1m30s ago): scored 30, crashed 9, sandbox_error 1; "+
		"24 more trajectories took a copy's (--exec-copies-once)\n") {
		t.Errorf("the newest groups of a busy hour show as:\n%s", b.String())
	}

	st.Anchors = pipeline.AnchorsStatus{Since: now.Add(-40 * time.Minute), Capped: true, Steps: 200, Groups: 400, Failed: 3}
	b.Reset()
	writeStatus(&b, st, "here", "wmrl", "default", now)
	if !strings.Contains(b.String(), "anchor groups:   none of 400 missed --anchor-deadline, 3 were executed with fewer than two scores, "+
		"in the 200 steps fused since 2026-12-03T11:20:00Z, 40m0s ago: the steps used the world model's rewards for them\n") {
		t.Errorf("the anchor groups of the newest steps, none late and 3 failed, show as:\n%s", b.String())
	}
	st.Anchors = pipeline.AnchorsStatus{Steps: 50, Groups: 100}
	b.Reset()
	writeStatus(&b, st, "here", "wmrl", "default", now)
	if !strings.Contains(b.String(), "anchor groups:   none of 100 missed --anchor-deadline in the 50 steps fused in the last 24h\n") {
		t.Errorf("the anchor groups of the last day's steps, all in time, show as:\n%s", b.String())
	}

	st.LastDeadLetter = &schemas.DeadLetter{Reason: "route: invalid message: malformed JSON"}
	b.Reset()
	writeStatus(&b, st, "here", "wmrl", "default", now)
	if !strings.Contains(b.String(), "newest of them:  rejected by -, 2026-12-03T11:59:57Z, 3s ago: route: invalid message: malformed JSON\n") {
		t.Errorf("a rejected dead letter without a stage shows as:\n%s", b.String())
	}
}

// TestStatusNamesStepsHeldBehindLaterOnes: a step planned and not fused
// while a later one is shows as held back, with what it waits for and
// where to look; those after the last fused step as being fused.
func TestStatusNamesStepsHeldBehindLaterOnes(t *testing.T) {
	now := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	st := &pipeline.Status{Stream: "WMRL_WMRL", LastUpdate: &schemas.Update{Step: 5}, LastUpdateAt: now,
		Unfused: []pipeline.UnfusedStep{{Step: 1, Planned: now.Add(-20 * time.Minute)}, {Step: 6, Planned: now.Add(-time.Second)}}}
	var b strings.Builder
	writeStatus(&b, st, "here", "wmrl", "default", now)
	out := b.String()
	for _, want := range []string{
		"held back:       step 1 (planned 20m0s ago), not fused while later steps are:",
		"wmrl dlq --resend sends it back",
		"being fused:     step 6 (planned 1s ago)\n",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("status does not show %q:\n%s", want, out)
		}
	}
}

// The next step is past every step a trajectory was sent to, planned or
// not: a trainer that crashed during step 7 resumes at 8, not into the
// step holding its old rollouts.
func TestTheNextStepIsPastTheNewestTrajectorysStep(t *testing.T) {
	seven, three := int64(7), int64(3)
	for _, tc := range []struct {
		st   pipeline.Status
		want int64
		ok   bool
	}{
		{pipeline.Status{}, 0, false},
		{pipeline.Status{LastTrajStep: &seven, LastStep: &schemas.StepClose{Step: 6}, LastUpdate: &schemas.Update{Step: 5}}, 8, true},
		{pipeline.Status{LastTrajStep: &three, LastStep: &schemas.StepClose{Step: 6}}, 7, true},
		{pipeline.Status{LastTrajStep: &three, LastUpdate: &schemas.Update{Step: 9}}, 10, true},
	} {
		if got, ok := nextStep(&tc.st); got != tc.want || ok != tc.ok {
			t.Errorf("%+v: next %d, %v; want %d, %v", tc.st, got, ok, tc.want, tc.ok)
		}
	}
}

// TestStatusSaysWhoRunsEachOnePerRunStage: a line per process that holds
// leases, in the stages' order, and one for the stages nobody runs; the
// JSON has every stage, with a null holder for those. A holder known to
// no longer run is said to be so, with when its lease lapses.
func TestStatusSaysWhoRunsEachOnePerRunStage(t *testing.T) {
	now := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	a := &natsjs.Holder{Host: "h1", PID: 4242, Since: now.Add(-time.Hour), ID: "a"}
	b := &natsjs.Holder{Host: "h2", PID: 7, Since: now.Add(-time.Minute), ID: "b"}
	st := &pipeline.Status{Stream: "S", Runners: []pipeline.StageRunner{
		{Stage: "route", Holder: a, Renewed: now.Add(-2 * time.Second)},
		{Stage: "pair", Holder: a, Renewed: now.Add(-3 * time.Second)},
		{Stage: "calibrate"},
		{Stage: "fuse", Holder: b, Renewed: now.Add(-4 * time.Second), Ended: true},
		{Stage: "archive"},
	}}
	var out strings.Builder
	writeStatus(&out, st, "here", "wmrl", "default", now)
	want := "one per run:     route, pair: host h1, pid 4242, since 2026-12-03T11:00:00Z (renewed 2s ago)\n" +
		"                 fuse: host h2, pid 7, since 2026-12-03T11:59:00Z (renewed 4s ago; it no longer runs: its lease lapses in 26s, and a process started for it on this machine takes over at once)\n" +
		"                 calibrate, archive: no process runs them (stopped, or a wmrl from before leases)\n"
	if !strings.Contains(out.String(), want) {
		t.Errorf("the stages' runners show as:\n%s\nwant:\n%s", out.String(), want)
	}
	var js strings.Builder
	if err := writeStatusJSON(&js, st, "default", now); err != nil {
		t.Fatal(err)
	}
	var doc statusDoc
	if err := json.Unmarshal([]byte(js.String()), &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.Runners) != 5 || doc.Runners[2].Stage != "calibrate" || doc.Runners[2].Holder != nil ||
		doc.Runners[3].Holder == nil || doc.Runners[3].Holder.Host != "h2" || doc.Runners[3].Holder.AgeSeconds != 4 ||
		!doc.Runners[3].Holder.NoLongerRuns || doc.Runners[0].Holder == nil || doc.Runners[0].Holder.NoLongerRuns {
		t.Errorf("runners in the JSON: %s", js.String())
	}
}

// TestStatusCountsTheAnchorGroupsThatMissedTheDeadline: wmrl status says
// how many of the recent steps' anchor groups missed --anchor-deadline, as
// the updates say: from the headers fuse sets, and from the update itself
// for one stored without them (by a stage in fuse's place, or before they
// were added).
func TestStatusCountsTheAnchorGroupsThatMissedTheDeadline(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var mu sync.Mutex
	var groups, late int
	cfg := finishedRun(ctx, t, 12, func(cfg *pipeline.Config) {
		cfg.ExecutorImpl, cfg.AnchorDeadline = slowGroups{}, 300*time.Millisecond
		cfg.ExecSlots = 256 // no execution waits for a slot behind the slow ones
		cfg.OnUpdate = func(u schemas.Update, _ time.Duration) {
			mu.Lock()
			defer mu.Unlock()
			groups += u.Anchors + len(u.LateAnchors) + len(u.FailedAnchors)
			late += len(u.LateAnchors)
		}
	})
	if late == 0 || late == groups {
		t.Fatalf("%d of %d anchor groups late: the test wants some of both", late, groups)
	}
	t.Logf("%d of %d anchor groups late", late, groups)
	line := func(late, groups, steps int) string {
		return fmt.Sprintf("anchor groups:   %d of %d (%.1f%%) missed --anchor-deadline in the %d steps fused in the last 24h: the steps used the world model's rewards for them\n",
			late, groups, 100*float64(late)/float64(groups), steps)
	}
	out, err := wmrl(ctx, "status", "--data", cfg.DataDir)
	if err != nil || !strings.Contains(out, line(late, groups, 12)) {
		t.Errorf("status (%v) lacks %q:\n%s", err, line(late, groups, 12), out)
	}
	doc := statusJSON(t, ctx, "--data", cfg.DataDir)
	if a := doc.AnchorGroups; a.Steps != 12 || a.Groups != groups || a.Late != late || a.Failed != 0 || a.Capped || a.WindowSeconds != 24*3600 {
		t.Errorf("status --json anchor_groups %+v; want %d of %d late over 12 steps", a, late, groups)
	}

	// Step 12's update, from a stage in fuse's place that sets no headers.
	srv, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: filepath.Join(cfg.DataDir, "nats")})
	if err != nil {
		t.Fatal(err)
	}
	nc, _ := srv.Connect("outside-fuse")
	js, _ := jetstream.New(nc)
	// fuse's updates carry the counts in their headers, which status reads.
	stream, err := js.Stream(ctx, "WMRL_WMRL")
	if err != nil {
		t.Fatal(err)
	}
	last, err := stream.GetLastMsgForSubject(ctx, "wmrl.default.update")
	if err != nil {
		t.Fatal(err)
	}
	var stored schemas.Update
	json.Unmarshal(last.Data, &stored)
	if h := last.Header; h.Get(schemas.HeaderAnchors) != fmt.Sprint(stored.Anchors) || h.Get(schemas.HeaderLateAnchors) != fmt.Sprint(len(stored.LateAnchors)) ||
		h.Get(schemas.HeaderFailedAnchors) != "0" {
		t.Errorf("step %d's update: headers %v; want its %d anchor groups used, %d late and none failed", stored.Step, h, stored.Anchors, len(stored.LateAnchors))
	}
	u := schemas.Update{Schema: schemas.Version, Run: "default", Step: 12, Groups: 16, Anchors: 1, LateAnchors: []string{"g3", "g9"}, Items: []schemas.UpdateItem{}}
	b, _ := json.Marshal(u)
	if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: "wmrl.default.update", Data: b, Header: nats.Header{jetstream.MsgIDHeader: {"default/update/12"}}}); err != nil {
		t.Fatal(err)
	}
	nc.Close()
	srv.Shutdown()
	if out, err := wmrl(ctx, "status", "--data", cfg.DataDir); err != nil || !strings.Contains(out, line(late+2, groups+3, 13)) {
		t.Errorf("status (%v) with an update without headers lacks %q:\n%s", err, line(late+2, groups+3, 13), out)
	}
}

// slowGroups executes as the simulated executor, but takes 600 ms for
// every trajectory of a group whose ID ends in an odd digit.
type slowGroups struct{}

func (slowGroups) Execute(ctx context.Context, t schemas.Trajectory) (execute.Result, error) {
	e := sim.Executor{Latency: time.Millisecond}
	if last := t.GroupID[len(t.GroupID)-1]; last%2 == 1 {
		e.Latency = 600 * time.Millisecond
	}
	return e.Execute(ctx, t)
}

// A step scored by two world models names both, one its predictions did
// not name too; a group never sent to be scored names none.
func TestStatusNamesTheWorldModelsOfTheNewestStep(t *testing.T) {
	now := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	u := &schemas.Update{Step: 9, Groups: 3, Items: []schemas.UpdateItem{
		{GroupID: "a", WMModel: "qwen", WMStatus: schemas.PredOK}, {GroupID: "b", WMModel: "", WMStatus: schemas.PredUngraded},
		{GroupID: "c", WMModel: "gpt", WMStatus: schemas.PredNotSent}, {GroupID: "d", WMModel: "llama", WMStatus: schemas.PredOK},
	}}
	st := &pipeline.Status{Stream: "S", LastUpdate: u, LastUpdateAt: now.Add(-time.Second)}
	var b strings.Builder
	writeStatus(&b, st, "here", "wmrl", "default", now)
	if line := regexp.MustCompile(`(?m)^steps fused:.*$`).FindString(b.String()); !strings.HasSuffix(line, ", world models qwen, (not named), llama") {
		t.Errorf("the newest step's line is %q", line)
	}
	u.WMModel = "qwen"
	b.Reset()
	writeStatus(&b, st, "here", "wmrl", "default", now)
	if line := regexp.MustCompile(`(?m)^steps fused:.*$`).FindString(b.String()); !strings.HasSuffix(line, ", world model qwen") {
		t.Errorf("the newest step's line, one world model: %q", line)
	}
	// Centred advantages are said, in the line and in --json; GRPO's are
	// said in --json alone.
	for _, norm := range []string{"", "center"} {
		u.AdvantageNorm = norm
		b.Reset()
		writeStatus(&b, st, "here", "wmrl", "default", now)
		line := regexp.MustCompile(`(?m)^steps fused:.*$`).FindString(b.String())
		if centred := strings.HasSuffix(line, ", advantages centred (Dr. GRPO), world model qwen"); centred != (norm == "center") {
			t.Errorf("advantage norm %q: the newest step's line is %q", norm, line)
		}
		b.Reset()
		if err := writeStatusJSON(&b, st, "default", now); err != nil {
			t.Fatal(err)
		}
		var doc struct {
			Fused struct {
				Norm string `json:"advantage_norm"`
			}
		}
		if err := json.Unmarshal([]byte(b.String()), &doc); err != nil || doc.Fused.Norm != cmp.Or(norm, "std") {
			t.Errorf("advantage norm %q: status --json says %q (%v)", norm, doc.Fused.Norm, err)
		}
	}
}
