package pipeline

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/fuse"
)

// ageOut removes every message of a stopped pipeline's stream stored before
// the first one on subject whose record keep says to keep, as --retention
// does to a run older than it; it returns how many messages it removed.
func ageOut(t *testing.T, dataDir, subject string, keep func(natsjs.Record) bool) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, closeIt := openStopped(t, ctx, dataDir)
	defer closeIt()
	var from uint64
	if err := natsjs.Scan(ctx, js, StreamName("wmrl"), subject, false, func(r natsjs.Record) error {
		if from == 0 && keep(r) {
			from = r.Seq
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if from == 0 {
		t.Fatalf("nothing on %s to keep", subject)
	}
	s, err := js.Stream(ctx, StreamName("wmrl"))
	if err != nil {
		t.Fatal(err)
	}
	before, _ := s.Info(ctx)
	if err := s.Purge(ctx, jetstream.WithPurgeSequence(from)); err != nil {
		t.Fatal(err)
	}
	after, _ := s.Info(ctx)
	return before.State.Msgs - after.State.Msgs
}

// runToEnd runs a test pipeline of the given steps to its end; ctx bounds
// the rest of the test.
func runToEnd(t *testing.T, steps int64) (Config, context.Context) {
	t.Helper()
	cfg := testConfig(t)
	cfg.Steps = steps
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	return cfg, ctx
}

// openStopped serves a stopped pipeline's store until closed (before the
// pipeline starts on it again).
func openStopped(t *testing.T, ctx context.Context, dataDir string) (js jetstream.JetStream, closeIt func()) {
	t.Helper()
	srv, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: filepath.Join(dataDir, "nats")})
	if err != nil {
		t.Fatal(err)
	}
	nc, err := srv.Connect("stopped")
	if err != nil {
		srv.Shutdown()
		t.Fatal(err)
	}
	closeIt = func() { nc.Close(); srv.Shutdown() }
	if js, err = jetstream.New(nc); err != nil {
		closeIt()
		t.Fatal(err)
	}
	return js, closeIt
}

// absorbAll absorbs the pair groups in order through a fresh calibration
// and denoiser with cfg's settings, as a pipeline that lost nothing and
// counted nothing twice would have: it returns each calibration by its
// number and rho after it. A group absorbed twice fails the test.
func absorbAll(t *testing.T, cfg Config, groups [][]byte) (want map[int64]*schemas.Calibration, rhoAfter map[int64]float64) {
	t.Helper()
	deb, err := calibrate.NewDebiaser(cfg.Debiaser)
	if err != nil {
		t.Fatal(err)
	}
	ref := &calibrate.Stage{RunID: "default", Deb: deb}
	den, err := fuse.NewDenoiser(cfg.Denoiser)
	if err != nil {
		t.Fatal(err)
	}
	want, rhoAfter = map[int64]*schemas.Calibration{}, map[int64]float64{}
	for _, b := range groups {
		c, err := ref.Absorb(b)
		if err != nil || c == nil {
			t.Fatalf("reference absorb (nil: the group came twice): %v, %v: %s", c, err, b[:min(len(b), 120)])
		}
		want[c.Seq] = c
		cal, truth := make([]float64, len(c.Pairs)), make([]float64, len(c.Pairs))
		for i, p := range c.Pairs {
			cal[i], truth[i] = p.Before, p.True
		}
		rhoAfter[c.Seq], _ = den.Observe(cal, truth)
	}
	return want, rhoAfter
}

// A run outlives the stream's retention: its oldest messages, among them
// the first anchor groups' pairs and calibrations, are gone when it
// restarts. The restarted calibrate stage must still publish a calibration
// for every new anchor group, numbered after the last one stored, with the
// version and map that absorbing every group of the run gives; the
// restarted fuse stage's rho must still count every group. Without the
// checkpoints, calibrate rebuilds from the retained pairs alone and
// numbers the new groups as already stored (it publishes nothing), and
// fuse's rho forgets the aged-out groups.
func TestRestartAfterRetentionAgedOutTheFirstGroups(t *testing.T) {
	cfg := testConfig(t)
	cfg.CheckpointEvery = 4
	cfg.Steps = 12
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	firstPairs := readStored(t, cfg.DataDir, "wmrl.default.pairs")
	if len(firstPairs) != 24 {
		t.Fatalf("%d pair groups in 12 steps, want 24", len(firstPairs))
	}
	// Age out everything before the calibration of the 14th anchor group,
	// so that the checkpoints (every 4 groups, and at the stop) stand for
	// groups that are no longer in the stream.
	removed := ageOut(t, cfg.DataDir, "wmrl.default.calibration", func(r natsjs.Record) bool {
		var c schemas.Calibration
		return json.Unmarshal(r.Data, &c) == nil && c.Seq == 14
	})
	if left := readStored(t, cfg.DataDir, "wmrl.default.pairs"); len(left) >= len(firstPairs) || removed == 0 {
		t.Fatalf("aging out removed %d messages and left %d of %d pair groups: nothing aged out", removed, len(left), len(firstPairs))
	}

	// The restarted run stops by itself at step 24, although the updates
	// of its first steps are gone.
	cfg.Steps = 24
	rctx, rcancel := context.WithTimeout(ctx, time.Minute)
	defer rcancel()
	if err := Run(rctx, cfg); err != nil {
		t.Fatal(err)
	}
	if rctx.Err() != nil {
		t.Fatal("the restarted 24-step run did not stop by itself within a minute")
	}
	ups := decodeUpdates(t, readStored(t, cfg.DataDir, "wmrl.default.update"))

	// What absorbing every pair group of the run, in order, gives.
	all := slices.Clone(firstPairs)
	seen := map[string]bool{}
	key := func(b []byte) string {
		var pg schemas.PairGroup
		if err := json.Unmarshal(b, &pg); err != nil {
			t.Fatal(err)
		}
		return fmt.Sprintf("%d/%s", pg.Step, pg.GroupID)
	}
	for _, b := range firstPairs {
		seen[key(b)] = true
	}
	for _, b := range readStored(t, cfg.DataDir, "wmrl.default.pairs") {
		if !seen[key(b)] {
			all = append(all, b)
		}
	}
	if len(all) != 48 {
		t.Fatalf("%d pair groups in 24 steps, want 48", len(all))
	}
	want, rhoAfter := absorbAll(t, cfg, all)

	got := map[int64]schemas.Calibration{}
	for _, b := range readStored(t, cfg.DataDir, "wmrl.default.calibration") {
		var c schemas.Calibration
		if err := json.Unmarshal(b, &c); err != nil {
			t.Fatal(err)
		}
		if _, dup := got[c.Seq]; dup {
			t.Fatalf("calibration %d stored twice", c.Seq)
		}
		got[c.Seq] = c
	}
	for seq := int64(14); seq <= 48; seq++ {
		g, ok := got[seq]
		if !ok {
			t.Fatalf("no calibration %d after the restart (have %d of 14..48)", seq, len(got))
		}
		w := want[seq]
		if g.Step != w.Step || g.GroupID != w.GroupID || g.Version != w.Version || g.PairsTotal != w.PairsTotal {
			t.Fatalf("calibration %d: step %d group %s version %d pairs %d; absorbing every group gives step %d group %s version %d pairs %d",
				seq, g.Step, g.GroupID, g.Version, g.PairsTotal, w.Step, w.GroupID, w.Version, w.PairsTotal)
		}
		gb, _ := json.Marshal(g.Map)
		wb, _ := json.Marshal(w.Map)
		if string(gb) != string(wb) {
			t.Fatalf("calibration %d: map %s; absorbing every group gives %s", seq, gb, wb)
		}
	}
	for step := int64(12); step < 24; step++ {
		u, ok := ups[step]
		if !ok {
			t.Fatalf("no update for step %d", step)
		}
		if len(u.LateAnchors) != 0 || u.Anchors != 2 {
			t.Fatalf("step %d: %d anchors, late %v: the restart lost anchor groups", step, u.Anchors, u.LateAnchors)
		}
		w := want[u.CalibrationSeq]
		if w == nil || u.PairsTotal != w.PairsTotal || u.CalibrationVersion != w.Version || math.Abs(u.Rho-rhoAfter[u.CalibrationSeq]) > 1e-12 {
			t.Fatalf("step %d, fused after calibration %d: pairs %d version %d rho %.15f; counting every anchor group of the run gives %v",
				step, u.CalibrationSeq, u.PairsTotal, u.CalibrationVersion, u.Rho, describe(w, rhoAfter[u.CalibrationSeq]))
		}
	}
	// Steps in flight fuse in the order their anchors are calibrated, so
	// the last step need not be the one that saw every pair; some step is.
	most := int64(0)
	for _, u := range ups {
		most = max(most, u.PairsTotal)
	}
	if most != int64(24*2*cfg.GroupSize) {
		t.Errorf("the updates saw %d pairs at most, want all %d", most, 24*2*cfg.GroupSize)
	}
}

func describe(c *schemas.Calibration, rho float64) string {
	if c == nil {
		return "no such calibration"
	}
	return fmt.Sprintf("pairs %d version %d rho %.15f", c.PairsTotal, c.Version, rho)
}

// A run whose first anchor groups aged out and that has no checkpoint (it
// was started before checkpoints existed, or they failed) cannot number
// its new calibrations: it is refused at start, with the reason, instead
// of stalling.
func TestAgedOutRunWithoutACheckpointIsRefused(t *testing.T) {
	cfg, ctx := runToEnd(t, 6)
	ageOut(t, cfg.DataDir, "wmrl.default.calibration", func(r natsjs.Record) bool {
		var c schemas.Calibration
		return json.Unmarshal(r.Data, &c) == nil && c.Seq == 5
	})
	func() {
		js, closeIt := openStopped(t, ctx, cfg.DataDir)
		defer closeIt()
		kv, err := js.KeyValue(ctx, StateBucket("wmrl"))
		if err != nil {
			t.Fatal(err)
		}
		if err := kv.Purge(ctx, checkpointKey("default", StageCalibrate)); err != nil {
			t.Fatal(err)
		}
	}()
	cfg.Steps = 8
	_, err := Start(ctx, cfg)
	if err == nil || !strings.Contains(err.Error(), "aged out") || !strings.Contains(err.Error(), "no checkpoint") {
		t.Fatalf("restart without a checkpoint after the age-out: %v; want an error saying the pairs aged out and there is no checkpoint", err)
	}
}

// A checkpoint outlives a stream deleted and made anew (the bucket is kept
// apart); restoring it would give the new run the old one's map and rho.
// Each stage refuses it, also running alone, naming the key to delete.
func TestCheckpointOfADeletedStreamIsRefused(t *testing.T) {
	cfg, ctx := runToEnd(t, 4)
	func() {
		js, closeIt := openStopped(t, ctx, cfg.DataDir)
		defer closeIt()
		if err := js.DeleteStream(ctx, StreamName("wmrl")); err != nil {
			t.Fatal(err)
		}
	}()
	for _, stage := range []string{StageCalibrate, StageFuse} {
		alone := cfg
		alone.Stages, alone.Source = []string{stage}, SourceExternal
		_, err := Start(ctx, alone)
		if err == nil || !strings.Contains(err.Error(), "made anew") || !strings.Contains(err.Error(), "default."+stage) {
			t.Errorf("%s alone on a new stream with the old checkpoint: %v; want an error saying the stream is new and naming the key", stage, err)
		}
	}
}

// A run restarted with other correction settings says so, as a notice
// rather than an error, and goes on under the new ones.
func TestARestartWithOtherSettingsIsSaid(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := testConfig(t)
	cfg.Steps = 3
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	cfg.Steps, cfg.Quiet = 5, false
	cfg.Denoiser.Estimator = fuse.EstimatorReference
	cfg.Debiaser.Bins = 0
	out := &syncBuffer{}
	cfg.Out = out
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`fuse: the checkpoint was made with other settings (debias true, denoiser {"estimator":"advantage",`,
		`rebuilding rho from the retained calibrations under the new settings`,
		`calibrate: the checkpoint was made with other calibration settings (`,
		`done: steps 0-4`,
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("no %q in:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "invalid config") {
		t.Errorf("changed settings read as an invalid config:\n%s", out.String())
	}
}

// TestARestartAfterACrashDoesNotWaitOutAckWait: a process that dies with
// its embedded server (SIGKILL, the OOM killer) hands nothing back, and
// its route held a step's trajectories. The process started again on its
// data gets them at once, though the consumers' AckWait is an hour here:
// the step is fused whole, not closed short without them.
func TestARestartAfterACrashDoesNotWaitOutAckWait(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := testConfig(t)
	cfg.Source, cfg.ackWait, cfg.StepTimeout = SourceExternal, time.Hour, 20*time.Second
	pol := sim.Policy{Run: "default", Tasks: 4, Groups: 4, GroupSize: 4}
	trajs, wm := pol.Step(0)

	p, nc, js := startClient(t, ctx, cfg)
	for _, tr := range trajs { // no watermark: route holds them all
		b, _ := json.Marshal(tr)
		if _, err := js.Publish(ctx, "wmrl.default.traj", b); err != nil {
			t.Fatal(err)
		}
	}
	route, err := js.Consumer(ctx, StreamName("wmrl"), consumerName(StageRoute, "default", schemas.KindTraj))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, func() bool {
		info, err := route.Info(ctx)
		return err == nil && info.NumAckPending == len(trajs)
	})
	nc.Close()
	p.tr.srv.Shutdown() // the process dies with its server: nothing handed back
	p.Stop()

	var fused atomic.Pointer[schemas.Update]
	cfg.OnUpdate = func(u schemas.Update, _ time.Duration) { fused.Store(&u) }
	_, _, js = startClient(t, ctx, cfg)
	b, _ := json.Marshal(wm)
	if _, err := js.Publish(ctx, "wmrl.default.step", b); err != nil {
		t.Fatal(err)
	}
	waitFor(t, time.Minute, func() bool { return fused.Load() != nil })
	if u := fused.Load(); u.Step != 0 || len(u.Items) != len(trajs) || len(u.Skipped) != 0 {
		t.Fatalf("step %d fused with %d of the %d trajectories (skipped %v): those the crashed process held did not come back", u.Step, len(u.Items), len(trajs), u.Skipped)
	}
}

// A running calibrate stage forgets the anchor groups whose pair groups
// the stream aged out (--retention), as its restart would: a copy of one
// is absorbed again, a copy of one the stream holds is not. Before, it
// remembered every anchor group of the run for as long as it ran.
func TestCalibrateForgetsWhatTheStreamAgedOut(t *testing.T) {
	cfg := testConfig(t)
	cfg.Source = SourceExternal
	cfg.CheckpointEvery = 4 // calibrate asks the stream what it holds every 4 groups read
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_, _, js := startClient(t, ctx, cfg)
	pol := sim.Policy{Run: "default", Tasks: 4, Groups: 4, GroupSize: 4} // one anchor group a step
	stored := func(subject string) []natsjs.Record {
		var out []natsjs.Record
		if err := natsjs.Scan(ctx, js, StreamName("wmrl"), subject, false, func(r natsjs.Record) error {
			out = append(out, r)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return out
	}
	calibrations := func() map[string][]int64 { // by step/group, their seqs
		out := map[string][]int64{}
		for _, r := range stored("wmrl.default.calibration") {
			var c schemas.Calibration
			if err := json.Unmarshal(r.Data, &c); err != nil {
				t.Fatal(err)
			}
			key := fmt.Sprintf("%d/%s", c.Step, c.GroupID)
			out[key] = append(out[key], c.Seq)
		}
		return out
	}
	absorbed := func(seq int64) func() bool {
		return func() bool {
			for _, seqs := range calibrations() {
				if slices.Contains(seqs, seq) {
					return true
				}
			}
			return false
		}
	}
	for n := range int64(6) {
		publishStep(t, ctx, js, pol, n)
	}
	waitFor(t, time.Minute, absorbed(6))
	pairs := stored("wmrl.default.pairs")
	if len(pairs) != 6 {
		t.Fatalf("%d pair groups in 6 steps of one anchor group", len(pairs))
	}
	s, err := js.Stream(ctx, StreamName("wmrl"))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Purge(ctx, jetstream.WithPurgeSequence(pairs[2].Seq)); err != nil { // the first two anchor groups age out
		t.Fatal(err)
	}
	for n := int64(6); n < 14; n++ {
		publishStep(t, ctx, js, pol, n)
	}
	waitFor(t, time.Minute, absorbed(14))

	keyOf := func(r natsjs.Record) string {
		var pg schemas.PairGroup
		if err := json.Unmarshal(r.Data, &pg); err != nil {
			t.Fatal(err)
		}
		return fmt.Sprintf("%d/%s", pg.Step, pg.GroupID)
	}
	for _, r := range []natsjs.Record{pairs[4], pairs[0]} { // calibrate reads them in this order
		if _, err := js.Publish(ctx, "wmrl.default.pairs", r.Data, jetstream.WithMsgID(fmt.Sprintf("copy/%d", r.Seq))); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, time.Minute, absorbed(15))
	cals := calibrations()
	if seqs := cals[keyOf(pairs[0])]; fmt.Sprint(seqs) != "[15]" {
		t.Errorf("the copy of anchor group %s, aged out of the stream: calibrations %v, want [15] (absorbed again, as after a restart)", keyOf(pairs[0]), seqs)
	}
	if seqs := cals[keyOf(pairs[4])]; fmt.Sprint(seqs) != "[5]" {
		t.Errorf("anchor group %s, still in the stream, and its copy: calibrations %v, want [5] (the copy refused)", keyOf(pairs[4]), seqs)
	}
}

// A restart reads what was stored after its stages' checkpoints, not the
// run's history: calibrate knows the anchor groups it absorbed from the
// record its checkpoint lists (a copy of an old group, stored while the
// run was down, is still refused), fuse the calibrated groups of its
// unfused steps from its checkpoint. Before, each read every retained
// pair group and calibration at every start. With a part of that record
// gone, calibrate reads them all again, and loses nothing either way.
func TestARestartReadsOnlyWhatCameAfterItsCheckpoints(t *testing.T) {
	cfg := testConfig(t)
	cfg.CheckpointEvery = 4
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	run := func(steps int64) *Metrics {
		t.Helper()
		cfg.Steps = steps
		p, err := Start(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Wait(); err != nil {
			t.Fatal(err)
		}
		return p.Metrics()
	}
	startReads := func(m *Metrics, stage string) float64 { return testutil.ToFloat64(m.StartReads.WithLabelValues(stage)) }
	run(6)
	first := readStored(t, cfg.DataDir, "wmrl.default.pairs")
	if len(first) != 12 {
		t.Fatalf("%d pair groups in 6 steps, want 12", len(first))
	}
	// A copy of the first anchor group's pair group (under another
	// message ID), stored while the run is down.
	js, closeIt := openStopped(t, ctx, cfg.DataDir)
	if _, err := js.Publish(ctx, "wmrl.default.pairs", first[0], jetstream.WithMsgID("copy")); err != nil {
		t.Fatal(err)
	}
	closeIt()

	m := run(10)
	if c, f := startReads(m, StageCalibrate), startReads(m, StageFuse); c != 1 || f != 0 {
		t.Errorf("the restart read %v pair groups and %v calibrations at its start; want 1 (the copy) and 0: the checkpoints stand for the rest", c, f)
	}
	checkCalibrations := func(steps int) {
		t.Helper()
		seen := map[string]bool{}
		for i, b := range readStored(t, cfg.DataDir, "wmrl.default.calibration") {
			var c schemas.Calibration
			if err := json.Unmarshal(b, &c); err != nil {
				t.Fatal(err)
			}
			key := fmt.Sprintf("%d/%s", c.Step, c.GroupID)
			if seen[key] || c.Seq != int64(i+1) {
				t.Fatalf("calibration %d (%s, the %d-th stored): a group calibrated twice, or one numbered out of turn", c.Seq, key, i+1)
			}
			seen[key] = true
		}
		if len(seen) != 2*steps {
			t.Fatalf("%d anchor groups calibrated in %d steps, want %d", len(seen), steps, 2*steps)
		}
		ups := decodeUpdates(t, readStored(t, cfg.DataDir, "wmrl.default.update"))
		for step := range int64(steps) {
			if u := ups[step]; u.Anchors != 2 || len(u.LateAnchors) != 0 {
				t.Fatalf("step %d: %d anchors, late %v: the restart lost calibrated anchor groups", step, u.Anchors, u.LateAnchors)
			}
		}
	}
	checkCalibrations(10)

	// A part of calibrate's record lost: the next start reads every
	// retained pair group, and refuses the copy as before.
	js, closeIt = openStopped(t, ctx, cfg.DataDir)
	kv, err := js.KeyValue(ctx, StateBucket(cfg.Prefix))
	if err != nil {
		t.Fatal(err)
	}
	keys, err := kv.ListKeysFiltered(ctx, seenPrefix("default")+".>")
	if err != nil {
		t.Fatal(err)
	}
	var parts []string
	for k := range keys.Keys() {
		parts = append(parts, k)
	}
	if len(parts) == 0 {
		t.Fatal("no part of calibrate's record in the bucket")
	}
	if err := kv.Purge(ctx, parts[0]); err != nil {
		t.Fatal(err)
	}
	closeIt()
	m = run(12)
	if c := startReads(m, StageCalibrate); c != 21 {
		t.Errorf("the start without a part of the record read %v pair groups; want all 21 (20 anchor groups and the copy)", c)
	}
	checkCalibrations(12)
}

// The checkpoint bucket deleted under a running process takes the parts
// of calibrate's record with it: once the bucket is made anew, calibrate
// saves its whole record again, so that its checkpoint lists parts a
// restart finds (rather than have the restart read every retained pair
// group).
func TestADeletedCheckpointBucketGetsCalibratesRecordAgain(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := testConfig(t)
	cfg.Source, cfg.CheckpointEvery = SourceExternal, 4
	p, _, js := startClient(t, ctx, cfg)
	pol := sim.Policy{Run: "default", Tasks: 4, Groups: 4, GroupSize: 4} // one anchor group a step
	calibrated := func(n int) func() bool {
		return func() bool {
			var c schemas.Calibration
			ok, err := p.tr.last(ctx, "wmrl.default.calibration", &c)
			return err == nil && ok && c.Seq >= int64(n)
		}
	}
	for n := range int64(6) {
		publishStep(t, ctx, js, pol, n)
	}
	waitFor(t, time.Minute, calibrated(6))
	bucket := StateBucket(cfg.Prefix)
	if err := js.DeleteKeyValue(ctx, bucket); err != nil {
		t.Fatal(err)
	}
	for n := int64(6); n < 14; n++ {
		publishStep(t, ctx, js, pol, n)
	}
	waitFor(t, time.Minute, calibrated(14))
	waitFor(t, 30*time.Second, func() bool { return testutil.ToFloat64(p.Metrics().BucketsRemade.WithLabelValues(bucket)) == 1 })
	if err := p.Stop(); err != nil {
		t.Fatal(err)
	}
	js, closeIt := openStopped(t, ctx, cfg.DataDir)
	defer closeIt()
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		t.Fatal(err)
	}
	e, err := kv.Get(ctx, checkpointKey(cfg.Run, StageCalibrate))
	if err != nil {
		t.Fatal(err)
	}
	var sc storedCheckpoint[calibrate.Checkpoint]
	if err := json.Unmarshal(e.Value(), &sc); err != nil {
		t.Fatal(err)
	}
	cp := sc.Checkpoint
	if cp.Seq != 14 || !cp.SeenKept {
		t.Fatalf("the checkpoint at the stop: after group %d, record kept %v; want 14, kept", cp.Seq, cp.SeenKept)
	}
	held := map[string]bool{}
	for _, part := range cp.SeenParts {
		v, err := kv.Get(ctx, seenKey(cfg.Run, part))
		if err != nil {
			t.Fatalf("part %d of the record, which the checkpoint lists: %v", part, err)
		}
		var keys map[string]uint64
		if err := json.Unmarshal(v.Value(), &keys); err != nil {
			t.Fatal(err)
		}
		for k := range keys {
			held[k] = true
		}
	}
	if len(held) != 14 {
		t.Errorf("the parts the checkpoint lists hold %d anchor groups; want all 14", len(held))
	}
}
