package pipeline

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// Route, pair, calibrate, fuse and archive run once per run: each joins a
// step's messages, which a second process would split with it through the
// shared durable consumers (neither would ever hold a whole step, and the
// run would stall while both run). A process takes a lease on each of
// them before it starts, and
// one that finds a lease held waits, saying by whom, until its holder
// stops (and releases it) or is not heard from for the lease's TTL: a
// second `wmrl stage fuse`, or the new one of a rolling update, is a
// standby rather than a stall.

// LeaseTTL is how long a stage's lease outlives its holder's last renewal:
// after a crash on an external server, its successor waits this long at
// most, as it waits out the consumers' AckWait for what the crashed one
// held.
const LeaseTTL = 30 * time.Second

// LeaseBucket is the key-value bucket of a prefix's stage leases.
func LeaseBucket(prefix string) string {
	return "WMRL_LEASES_" + strings.ToUpper(natsjs.SafeName(prefix))
}

// onePerRun are the stages a run has one process of, in the order their
// leases are taken and listed.
var onePerRun = []string{StageRoute, StagePair, StageCalibrate, StageFuse, StageArchive}

// leaseKey is a stage's lease key for the run.
func leaseKey(run, stage string) string { return run + "." + stage }

// takeLeases takes the leases of the one-per-run stages this process runs,
// waiting for those another process holds. On the embedded server, just
// started on its store, a lease of one of them is the process before
// this one's, which is gone: it is freed first.
func (p *Pipeline) takeLeases(ctx context.Context) error {
	var mine []string
	for _, st := range onePerRun {
		if p.cfg.runs(st) {
			mine = append(mine, st)
		}
	}
	if len(mine) == 0 {
		return nil
	}
	for _, st := range mine { // present at 0, so that a run's sum by stage is defined
		p.metrics.Standby.WithLabelValues(st).Set(0)
	}
	ttl := p.cfg.leaseTTL
	if ttl == 0 {
		ttl = LeaseTTL
	}
	var (
		running []string
		ls      *natsjs.Leases
	)
	err := p.openWithRoom(ctx, "bucket "+LeaseBucket(p.cfg.Prefix), roomToMake, func(ctx context.Context) (err error) {
		if p.tr.srv == nil { // the embedded server's store is this process's alone
			running = p.runningWithoutLeases(ctx, LeaseBucket(p.cfg.Prefix))
		}
		ls, err = natsjs.OpenLeases(ctx, p.tr.js, LeaseBucket(p.cfg.Prefix), p.cfg.Replicas, ttl,
			p.bucketRemade(LeaseBucket(p.cfg.Prefix), "the leases of the stages it runs are written to it again, so that the run keeps one process of each"))
		return err
	})
	if err != nil {
		return fmt.Errorf("pipeline: %w", err)
	}
	// The stages taken from a process that no longer runs on this
	// machine, or went silent: what it held of their messages is given
	// again at once.
	var ended []string
	ls.OnEnded(func(key string, h natsjs.Holder, how string) {
		st := strings.TrimPrefix(key, p.cfg.Run+".")
		ended = append(ended, st)
		p.notef("%s: the process that ran this stage for run %s (%s) %s: this one takes it over now, not %v after that one was last heard from",
			st, p.cfg.Run, h, how, ttl)
	})
	if len(running) > 0 {
		ls.MarkRemade(ctx)
		p.notef("the key-value bucket %s was not on the NATS server, while another process reads the run's %s: it was deleted under the running run, and this process made it anew; "+
			"it leaves a lease missing from it to its holder for %v, the time that holder has to write it again",
			LeaseBucket(p.cfg.Prefix), strings.Join(running, ", "), ttl)
	}
	me := natsjs.NewHolder()
	full := roomWaiter{p: p, who: strings.Join(mine, ", "), waits: "this process waits for room before it runs them"}
	if p.tr.srv != nil {
		for _, st := range mine {
			if err := full.retry(ctx, func() error { return ls.Free(ctx, leaseKey(p.cfg.Run, st)) }); err != nil {
				return fmt.Errorf("pipeline: %w", err)
			}
		}
	}
	if err := p.waitForLeases(ctx, ls, me, mine, &full); err != nil {
		return err
	}
	if len(ended) > 0 {
		p.expireHeld(ctx, ended, "the process that ran them before")
	}
	for i, le := range p.leases {
		p.go_(func() error {
			select {
			case <-le.Lost():
				p.leaseLost.Store(mine[i], true)
				return fmt.Errorf("pipeline: stage %s: %w; this process stops, handing back what it holds (start it again: it waits for the holder)", mine[i], le.Err())
			case <-ctx.Done():
				return nil
			}
		})
	}
	return nil
}

// waitForLeases takes the leases of the stages mine, waiting while another
// process holds one of them (and while the store is full), and says so.
// All or none: a process waiting for one lease holds no other, so that
// status does not name it for stages it does not run yet.
func (p *Pipeline) waitForLeases(ctx context.Context, ls *natsjs.Leases, me natsjs.Holder, mine []string, full *roomWaiter) error {
	var told string
	for {
		stage, holder, err := p.tryLeases(ctx, ls, me, mine)
		if err != nil {
			if err := full.wait(ctx, err); err != nil {
				return err
			}
			continue
		}
		if holder == nil {
			break
		}
		if told != stage+holder.ID {
			told = stage + holder.ID
			w := fmt.Sprintf("waiting to run %s, which another process runs (%s)", stage, holder)
			p.standby.Store(&w)
			for _, st := range mine {
				p.metrics.Standby.WithLabelValues(st).Set(1)
			}
			serves := ""
			if u := p.HTTPURL(); u != "" {
				serves = "; its trainer gateway at " + u + " serves meanwhile"
			}
			p.notef("%s: another process runs this stage for run %s (%s); this one waits, and takes over once that one stops, "+
				"or %v after it was last heard from (a run has one %s: two would split its messages between them and stall the run)%s",
				stage, p.cfg.Run, holder, ls.TTL(), stage, serves)
		}
		if err := ls.Wait(ctx, leaseKey(p.cfg.Run, stage)); err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("%w: it waited to run %s, which another process runs (%s)", errStoppedWaiting, stage, holder)
			}
			return fmt.Errorf("pipeline: stage %s: %w", stage, err)
		}
	}
	if told != "" {
		for _, st := range mine {
			p.metrics.Standby.WithLabelValues(st).Set(0)
		}
		what := "stages " + strings.Join(mine, ", ")
		if len(mine) == 1 {
			what = mine[0] + " stage"
		}
		p.notef("took over run %s's %s", p.cfg.Run, what)
	}
	return nil
}

// runningWithoutLeases is, when bucket is not on the server, the
// one-per-run stages of the run whose durable consumers another process
// reads (pull requests waiting: a subscriber keeps one open, and each
// lasts 5 s), or nil. A process that starts while the lease bucket is
// deleted makes it anew as on a run's first start; without this, it took
// the stages whose holders had not written their leases again yet, and so
// did standbys that had not read the bucket gone (a rehearsal, seed 36).
// On an error it says nil: the start goes on as before; so it does after
// leaseCheckWait, as a request a cluster does not answer (a consumer list
// asked while its nodes elect their leaders) held the caller until its
// own deadline, and four processes ended on it (a rehearsal, seed 41).
func (p *Pipeline) runningWithoutLeases(ctx context.Context, bucket string) []string {
	ctx, cancel := context.WithTimeout(ctx, leaseCheckWait)
	defer cancel()
	if _, err := p.tr.js.KeyValue(ctx, bucket); !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil
	}
	stream, err := p.tr.js.Stream(ctx, p.tr.stream)
	if err != nil {
		return nil
	}
	reading := map[string]bool{}
	consumers := stream.ListConsumers(ctx)
	for ci := range consumers.Info() {
		if ci.NumWaiting > 0 {
			reading[ci.Name] = true
		}
	}
	var running []string
	for _, st := range onePerRun {
		for _, kind := range schemas.Kinds {
			if reading[consumerName(st, p.cfg.Run, kind)] {
				running = append(running, st)
				break
			}
		}
	}
	// On a run's first start, a process started with this one may have
	// made the bucket and begun reading since: it made the bucket first.
	if _, err := p.tr.js.KeyValue(ctx, bucket); len(running) == 0 || !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil
	}
	return running
}

// leaseCheckWait bounds runningWithoutLeases.
const leaseCheckWait = 5 * time.Second

// tryLeases takes the leases of stages, in order, and keeps them all; at
// the first another process holds, it frees those it took and names the
// stage and the holder.
func (p *Pipeline) tryLeases(ctx context.Context, ls *natsjs.Leases, me natsjs.Holder, stages []string) (string, *natsjs.Holder, error) {
	var got []*natsjs.Lease
	for _, st := range stages {
		le, other, err := ls.TryAcquire(ctx, leaseKey(p.cfg.Run, st), me)
		if err == nil && other == nil {
			got = append(got, le)
			continue
		}
		free, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		for _, le := range got {
			_ = le.Release(free) // else it lapses
		}
		cancel()
		if err != nil {
			return "", nil, fmt.Errorf("pipeline: stage %s: %w", st, err)
		}
		return st, other, nil
	}
	p.leases = got
	return "", nil, nil
}

// errStoppedWaiting: stopped (Ctrl-C, SIGTERM) while waiting for another
// process's lease, or for room in the store, before anything started.
var errStoppedWaiting = errors.New("stopped before it started")

// releaseLeases frees the process's leases once its stages have handed
// back what they held, so that a process waiting for them starts at once.
// Without a connection to the server they lapse instead, TTL after their
// last renewal.
func (p *Pipeline) releaseLeases() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for _, le := range p.leases {
		if !p.tr.nc.IsConnected() {
			le.Abandon()
			continue
		}
		wg.Go(func() {
			if err := le.Release(ctx); err != nil {
				p.notef("%v; it lapses after its TTL", err)
			}
		})
	}
	wg.Wait()
}
