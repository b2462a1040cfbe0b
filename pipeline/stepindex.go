package pipeline

import (
	"context"
	"sort"
	"time"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// A route started again must know every step planned, and a fuse every
// step whose update was published, or it would take a step twice. Both
// read those steps from the message IDs of their outputs (plans and
// updates), which the stream interleaves with everything else, so the
// server reads its whole store to find them: at 6,925 simulated steps (a
// 1.4 GB store) that was 4.5 s and 3.6 s of every start, growing with the
// run. So each keeps what it read, as ranges of steps with the stream
// sequence read through, in the checkpoint bucket. A start reads only what
// was stored after it; then the stage follows its output as it is stored
// and saves the index every indexEvery, so that a restart, even after
// days, reads a few seconds of messages. (Reading the stream again every
// so often instead would cost as much as the first read, spread out: the
// server loads every block to find a subject's messages, while following
// a subject reads each from the block being written.)

// indexEvery is how often a running stage saves its step index.
const indexEvery = 10 * time.Second

// stepIndex is the steps of the messages on a subject, read through stream
// sequence Through.
type stepIndex struct {
	Through uint64 `json:"through"`
	// Steps: inclusive ranges, in order, neither touching the next.
	Steps [][2]int64 `json:"steps"`
}

// add adds step.
func (x *stepIndex) add(step int64) {
	// The first range that ends at step-1 or later: step extends it, is
	// in it, or comes before it.
	i := sort.Search(len(x.Steps), func(i int) bool { return x.Steps[i][1] >= step-1 })
	switch {
	case i == len(x.Steps):
		x.Steps = append(x.Steps, [2]int64{step, step})
	case x.Steps[i][1] == step-1:
		x.Steps[i][1] = step
		if i+1 < len(x.Steps) && x.Steps[i+1][0] == step+1 {
			x.Steps[i][1] = x.Steps[i+1][1]
			x.Steps = append(x.Steps[:i+1], x.Steps[i+2:]...)
		}
	case x.Steps[i][0] <= step:
		// in it already
	case x.Steps[i][0] == step+1:
		x.Steps[i][0] = step
	default:
		x.Steps = append(x.Steps[:i], append([][2]int64{{step, step}}, x.Steps[i:]...)...)
	}
}

// all lists the steps in order.
func (x *stepIndex) all() []int64 {
	var out []int64
	for _, r := range x.Steps {
		for s := r[0]; s <= r[1]; s++ {
			out = append(out, s)
		}
	}
	return out
}

// stepIndexer keeps a subject's step index in the checkpoint bucket.
type stepIndexer struct {
	// scan reads the message IDs stored on the subject after a stream
	// sequence, in order, through the newest; follow reads them on as
	// they are stored, until ctx ends (nil then). load and save read and
	// write the kept index (ok false: none, or one of another stream).
	scan   func(ctx context.Context, after uint64, fn func(natsjs.Record) error) error
	follow func(ctx context.Context, after uint64, fn func(natsjs.Record)) error
	load   func(ctx context.Context) (x stepIndex, ok bool, err error)
	save   func(ctx context.Context, x stepIndex) error
	// onErr hears of a kept index that could not be read or written, or
	// of a subject no longer followed: the index is read anew from the
	// stream, or kept by the next save.
	onErr func(error)
	// now is the clock of the saves (nil: time.Now).
	now func() time.Time

	x stepIndex
}

// start reads the kept index and what was stored after it, saves the
// index so brought up to date, and returns it.
func (ix *stepIndexer) start(ctx context.Context) (*stepIndex, error) {
	x, ok, err := ix.load(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, err
		}
		ix.onErr(err)
	}
	if err != nil || !ok {
		x = stepIndex{}
	}
	ix.x = x
	from := x.Through
	if err := ix.scan(ctx, from, func(r natsjs.Record) error { ix.read(r); return nil }); err != nil {
		return nil, err
	}
	if ix.x.Through != from {
		ix.saveNow(ctx)
	}
	return &ix.x, nil
}

// read adds the step of a message read.
func (ix *stepIndexer) read(r natsjs.Record) {
	if step, ok := schemas.StepOfMsgID(r.MsgID); ok {
		ix.x.add(step)
	}
	ix.x.Through = max(ix.x.Through, r.Seq)
}

func (ix *stepIndexer) saveNow(ctx context.Context) {
	if err := ix.save(ctx, ix.x); err != nil && ctx.Err() == nil {
		ix.onErr(err)
	}
}

// keep follows the subject from where start read through, saving the
// index at most every, until ctx ends.
func (ix *stepIndexer) keep(ctx context.Context, every time.Duration) {
	now := ix.now
	if now == nil {
		now = time.Now
	}
	saved := now()
	err := ix.follow(ctx, ix.x.Through, func(r natsjs.Record) {
		ix.read(r)
		if now().Sub(saved) >= every {
			ix.saveNow(ctx)
			saved = now()
		}
	})
	if err != nil && ctx.Err() == nil {
		ix.onErr(err)
	}
}

// indexKey is the state bucket's key of a stage's step index.
func indexKey(stage string) string { return stage + "_steps" }

// stepsStored lists the steps of the messages on subject, stage's output
// (their IDs "<run>/<kind>/<step>"), from the index the stage keeps and
// what was stored after it, and keeps the index up to date while the
// pipeline runs. An index that cannot be read is read anew from the
// stream, as before there was one.
func (p *Pipeline) stepsStored(ctx context.Context, stage, subject string) ([]int64, error) {
	key := checkpointKey(p.cfg.Run, indexKey(stage))
	var store *natsjs.StateStore
	ix := &stepIndexer{
		scan: func(ctx context.Context, after uint64, fn func(natsjs.Record) error) error {
			return natsjs.ScanAfter(ctx, p.tr.js, p.tr.stream, subject, after, true, fn)
		},
		follow: func(ctx context.Context, after uint64, fn func(natsjs.Record)) error {
			r, err := natsjs.NewReaderAfter(ctx, p.tr.js, p.tr.stream, subject, after, true)
			if err != nil {
				return err
			}
			defer r.Close()
			return r.Follow(ctx, fn)
		},
		load: func(ctx context.Context) (stepIndex, bool, error) {
			var err error
			if store, err = p.stateStore(ctx); err != nil {
				return stepIndex{}, false, err
			}
			ctx, cancel := context.WithTimeout(ctx, p.cfg.StartupWait)
			defer cancel()
			var sc storedCheckpoint[stepIndex]
			ok, err := store.Load(ctx, key, &sc)
			return sc.Checkpoint, ok && sc.StreamCreated.Equal(p.tr.created), err
		},
		save: func(ctx context.Context, x stepIndex) error {
			if store == nil {
				return nil // the bucket could not be opened: said once, at the start
			}
			ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			return store.Save(ctx, key, storedCheckpoint[stepIndex]{StreamCreated: p.tr.created, Checkpoint: x})
		},
		onErr: func(err error) {
			p.metrics.CheckpointErrors.WithLabelValues(stage).Inc()
			p.notef("%s: the index of the steps on %s (what a restart reads instead of the whole stream) is not kept up to date: %v", stage, subject, err)
		},
	}
	x, err := ix.start(ctx)
	if err != nil {
		return nil, err
	}
	steps := x.all()
	p.go_(func() error { ix.keep(ctx, indexEvery); return nil })
	return steps, nil
}
