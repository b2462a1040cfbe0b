package pipeline

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// Steps added in any order, twice or more, are kept as the fewest ranges
// that hold exactly them.
func TestAStepIndexKeepsItsStepsAsRanges(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := range 200 {
		var want []int64
		for s := range int64(60) {
			if rng.Float64() < 0.7 {
				want = append(want, s)
			}
		}
		added := append(slices.Clone(want), want[:len(want)/3]...) // some twice
		rng.Shuffle(len(added), func(i, j int) { added[i], added[j] = added[j], added[i] })
		var x stepIndex
		for _, s := range added {
			x.add(s)
		}
		if got := x.all(); !slices.Equal(got, want) {
			t.Fatalf("trial %d: added %v, holds %v", trial, added, got)
		}
		for i, r := range x.Steps {
			if r[0] > r[1] || (i > 0 && x.Steps[i-1][1]+1 >= r[0]) {
				t.Fatalf("trial %d: ranges %v: %v is empty, or touches the one before", trial, x.Steps, r)
			}
		}
	}
}

// planRecords are n stored messages of a subject with step IDs, from
// stream sequence first on, every other sequence.
func planRecords(first uint64, steps ...int64) []natsjs.Record {
	var out []natsjs.Record
	for i, s := range steps {
		out = append(out, natsjs.Record{Seq: first + 2*uint64(i), MsgID: fmt.Sprintf("r/plan/%d", s)})
	}
	return out
}

// A start reads only the messages stored after the index kept, and keeps
// the index so brought up to date; without one it reads them all.
func TestAStartReadsOnlyWhatWasStoredAfterTheIndex(t *testing.T) {
	ctx := context.Background()
	stored := planRecords(1, 0, 1, 2, 3, 5, 4)
	var kept *stepIndex
	var read int
	var errs []error
	indexer := func(loadErr error) *stepIndexer {
		return &stepIndexer{
			scan: func(_ context.Context, after uint64, fn func(natsjs.Record) error) error {
				for _, r := range stored {
					if r.Seq > after {
						read++
						if err := fn(r); err != nil {
							return err
						}
					}
				}
				return nil
			},
			load: func(context.Context) (stepIndex, bool, error) {
				if kept == nil || loadErr != nil {
					return stepIndex{}, false, loadErr
				}
				return *kept, true, nil
			},
			save: func(_ context.Context, x stepIndex) error {
				c := x
				c.Steps = slices.Clone(x.Steps)
				kept = &c
				return nil
			},
			onErr: func(err error) { errs = append(errs, err) },
		}
	}
	start := func(ix *stepIndexer) []int64 {
		t.Helper()
		read = 0
		x, err := ix.start(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return x.all()
	}
	if got := start(indexer(nil)); !slices.Equal(got, []int64{0, 1, 2, 3, 4, 5}) || read != 6 {
		t.Fatalf("the first start: steps %v, %d messages read; want 0-5, all 6", got, read)
	}
	if kept == nil || kept.Through != 11 {
		t.Fatalf("kept %+v; want the index through sequence 11", kept)
	}
	stored = append(stored, planRecords(13, 6, 8)...)
	if got := start(indexer(nil)); !slices.Equal(got, []int64{0, 1, 2, 3, 4, 5, 6, 8}) || read != 2 {
		t.Errorf("a start after two more: steps %v, %d messages read; want 0-6 and 8, reading the 2", got, read)
	}
	if kept.Through != 15 {
		t.Errorf("kept through %d, want 15", kept.Through)
	}
	// Nothing new: nothing read, and the index kept as it was.
	saved := kept
	if got := start(indexer(nil)); len(got) != 8 || read != 0 || kept != saved {
		t.Errorf("a start with nothing new: %d steps, %d read, saved again: %v", len(got), read, kept != saved)
	}
	// An index that cannot be read: all of the subject, said.
	if got := start(indexer(errors.New("bucket gone"))); len(got) != 8 || read != 8 || len(errs) != 1 {
		t.Errorf("a start without its index: %d steps, %d read, %v said; want 8, all 8, the error", len(got), read, errs)
	}
}

// While the stage runs, the index follows what is stored, from where its
// start read through, and is saved at most every so often: a start after a
// kill reads what was stored since.
func TestTheIndexFollowsWhatIsStoredWhileTheStageRuns(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stored := make(chan natsjs.Record, 10)
	saved := make(chan stepIndex, 10)
	var followedFrom uint64
	// The clock of the saves is the time of the record being read.
	t0 := time.Unix(1e9, 0)
	clock := t0
	ix := &stepIndexer{
		now: func() time.Time { return clock },
		scan: func(_ context.Context, after uint64, fn func(natsjs.Record) error) error {
			for _, r := range planRecords(1, 0, 1) {
				if r.Seq > after {
					if err := fn(r); err != nil {
						return err
					}
				}
			}
			return nil
		},
		follow: func(ctx context.Context, after uint64, fn func(natsjs.Record)) error {
			followedFrom = after
			for {
				select {
				case <-ctx.Done():
					return nil
				case r := <-stored:
					clock = r.Time
					fn(r)
				}
			}
		},
		load:  func(context.Context) (stepIndex, bool, error) { return stepIndex{}, false, nil },
		save:  func(_ context.Context, x stepIndex) error { x.Steps = slices.Clone(x.Steps); saved <- x; return nil },
		onErr: func(err error) { t.Error(err) },
	}
	if _, err := ix.start(ctx); err != nil {
		t.Fatal(err)
	}
	if x := <-saved; x.Through != 3 || !slices.Equal(x.all(), []int64{0, 1}) {
		t.Fatalf("saved at the start: %+v; want steps 0 and 1 through sequence 3", x)
	}
	done := make(chan struct{})
	go func() { defer close(done); ix.keep(ctx, 10*time.Second) }()
	for i, r := range planRecords(5, 2, 3, 4) {
		r.Time = t0.Add(time.Duration(i) * 6 * time.Second) // 0, 6, 12 s
		stored <- r
	}
	select {
	case x := <-saved:
		if x.Through != 9 || !slices.Equal(x.all(), []int64{0, 1, 2, 3, 4}) {
			t.Errorf("saved while following: %+v; want steps 0-4 through sequence 9", x)
		}
	case <-time.After(30 * time.Second):
		t.Error("nothing saved while following")
	}
	cancel()
	<-done
	if followedFrom != 3 {
		t.Errorf("followed from sequence %d, want 3, where the start read through", followedFrom)
	}
	if len(saved) != 0 {
		t.Errorf("saved more than once in 12 s, at most every 10: %+v", <-saved)
	}
}

// A run started again keeps the index of route's plans and of fuse's
// updates in the checkpoint bucket: the steps of the run before, through
// the last of each it stored.
func TestARunKeepsTheIndexOfItsPlansAndUpdates(t *testing.T) {
	cfg, ctx := runToEnd(t, 12)
	lastOf := map[schemas.Kind]uint64{}
	func() {
		js, closeIt := openStopped(t, ctx, cfg.DataDir)
		defer closeIt()
		s, err := js.Stream(ctx, StreamName(cfg.Prefix))
		if err != nil {
			t.Fatal(err)
		}
		for _, kind := range []schemas.Kind{schemas.KindPlan, schemas.KindUpdate} {
			m, err := s.GetLastMsgForSubject(ctx, schemas.Subject(cfg.Prefix, cfg.Run, kind))
			if err != nil {
				t.Fatal(err)
			}
			lastOf[kind] = m.Sequence
		}
	}()
	cfg.Steps = 20
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	js, closeIt := openStopped(t, ctx, cfg.DataDir)
	defer closeIt()
	kv, err := js.KeyValue(ctx, StateBucket(cfg.Prefix))
	if err != nil {
		t.Fatal(err)
	}
	for stage, kind := range map[string]schemas.Kind{StageRoute: schemas.KindPlan, StageFuse: schemas.KindUpdate} {
		e, err := kv.Get(ctx, checkpointKey(cfg.Run, indexKey(stage)))
		if err != nil {
			t.Errorf("%s: the index: %v", stage, err)
			continue
		}
		var sc storedCheckpoint[stepIndex]
		if err := json.Unmarshal(e.Value(), &sc); err != nil {
			t.Fatal(err)
		}
		// Saved at the second start (and each minute, which a short run
		// does not last): what the first run stored.
		if x := sc.Checkpoint; x.Through != lastOf[kind] || !slices.Equal(x.Steps, [][2]int64{{0, 11}}) {
			t.Errorf("%s: index %+v; want steps 0-11 through sequence %d, the first run's last %s", stage, x, lastOf[kind], kind)
		}
	}
}

// BenchmarkAStartReadsItsStepIndex: a start finds the steps planned on a
// stream of 40,000 trajectories (1 KiB) and 1,000 plans, with no index
// (every plan read, as every start did before) and with one kept through
// the 990th plan (the last 10 read), each on a server just started on the
// store, as a restart's is (its blocks not yet read). x_full is how many
// times longer the start without the index takes.
func BenchmarkAStartReadsItsStepIndex(b *testing.B) {
	ctx := context.Background()
	dir := b.TempDir()
	var srv *natsjs.Server
	var nc *nats.Conn
	var js jetstream.JetStream
	serve := func() {
		var err error
		if srv, err = natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: dir}); err != nil {
			b.Fatal(err)
		}
		if nc, err = srv.Connect("bench"); err != nil {
			b.Fatal(err)
		}
		js, _ = jetstream.New(nc)
	}
	stop := func() { nc.Close(); srv.Shutdown() }
	serve()
	defer func() { stop() }()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "B", Subjects: []string{"b.>"}}); err != nil {
		b.Fatal(err)
	}
	payload := make([]byte, 1024)
	var kept stepIndex // through the 990th plan
	for i := range 40_000 {
		if _, err := js.PublishAsync("b.r.traj", payload); err != nil {
			b.Fatal(err)
		}
		if i%40 == 39 {
			step := int64(i / 40)
			m := &nats.Msg{Subject: "b.r.plan", Data: []byte("{}"), Header: nats.Header{jetstream.MsgIDHeader: {fmt.Sprintf("r/plan/%d", step)}}}
			ack, err := js.PublishMsg(ctx, m)
			if err != nil {
				b.Fatal(err)
			}
			if step < 990 {
				kept.add(step)
				kept.Through = ack.Sequence
			}
		}
	}
	<-js.PublishAsyncComplete()
	start := func(index *stepIndex) time.Duration {
		stop()
		serve()
		ix := &stepIndexer{
			scan: func(ctx context.Context, after uint64, fn func(natsjs.Record) error) error {
				return natsjs.ScanAfter(ctx, js, "B", "b.r.plan", after, true, fn)
			},
			load: func(context.Context) (stepIndex, bool, error) {
				if index == nil {
					return stepIndex{}, false, nil
				}
				return stepIndex{Through: index.Through, Steps: slices.Clone(index.Steps)}, true, nil
			},
			save:  func(context.Context, stepIndex) error { return nil },
			onErr: func(err error) { b.Fatal(err) },
		}
		t := time.Now()
		x, err := ix.start(ctx)
		if err != nil {
			b.Fatal(err)
		}
		took := time.Since(t)
		if got := x.all(); len(got) != 1000 || got[999] != 999 {
			b.Fatalf("found %d steps", len(got))
		}
		return took
	}
	var full, indexed time.Duration
	for b.Loop() {
		full += start(nil)
		indexed += start(&kept)
	}
	b.ReportMetric(float64(full.Microseconds())/1e3/float64(b.N), "ms_full")
	b.ReportMetric(float64(indexed.Microseconds())/1e3/float64(b.N), "ms_indexed")
	b.ReportMetric(float64(full)/float64(indexed), "x_full")
}
