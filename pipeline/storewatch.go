package pipeline

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
)

// storeEvery is how often the store's use is read for the metrics (a
// variable for tests).
var storeEvery = 30 * time.Second

// followEvery is how often the embedded server's store, given no bound,
// follows its disk's room, and the server is asked whether it can still
// store: often, since another writer may fill the disk within seconds,
// and both cost microseconds (a variable for tests).
var followEvery = time.Second

// diskRoom reads the free room and the size of a disk (a variable for
// tests, which cannot fill the machine's).
var diskRoom = natsjs.DiskRoom

// watchStore keeps the metrics of what the stream and the JetStream store
// hold, and how much room is left, until ctx is done: a run of days with
// long prompts can fill the store (the stream keeps every message for its
// retention), and a full store stops every stage until room is made. One
// process per run reads them: the one with the embedded server, else the
// one that runs route.
func (p *Pipeline) watchStore(ctx context.Context) {
	t := time.NewTicker(storeEvery)
	defer t.Stop()
	for {
		p.readStore(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (p *Pipeline) readStore(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	m := p.metrics
	limit, replicas := int64(0), 1
	if info, err := p.tr.info(ctx); err == nil {
		m.StreamBytes.Set(float64(info.State.Bytes))
		replicas = info.Config.Replicas
	}
	if ai, err := p.tr.js.AccountInfo(ctx); err == nil {
		var used uint64
		used, limit = accountStore(ai, replicas)
		m.StoreBytes.Set(float64(used))
	}
	if p.tr.srv != nil {
		if limit <= 0 {
			limit = p.tr.srv.StoreLimit()
		}
		if free, _, err := diskRoom(p.cfg.storeDir()); err == nil {
			m.StoreDiskFree.Set(float64(free))
		}
	}
	m.StoreLimit.Set(float64(max(limit, 0)))
}

// watchServer watches the embedded server until ctx is done. Its store,
// given no bound, follows the room its disk gives it
// (natsjs.Server.FollowDisk), and the run says when that leaves the store
// full, and when it has room again: so the store stops taking messages
// before a disk that others fill (a trainer's checkpoints) is full. A
// server that met a full disk anyway (a bound beyond it, a writer faster
// than a second) stores nothing more until it is started again: the run
// then ends, saying so (ErrStoreBroken), where every write timed out,
// room made or not, until it was stopped (tried on a small disk).
func (p *Pipeline) watchServer(ctx context.Context) error {
	t := time.NewTicker(followEvery)
	defer t.Stop()
	short, failed, broken := false, false, 0
	for {
		free, _, err := diskRoom(p.cfg.storeDir())
		if why := p.tr.srv.Broken(); why == "" || ctx.Err() != nil {
			broken = 0
		} else if broken++; broken == brokenFor {
			room := "its disk's room could not be read"
			if err == nil {
				room = FormatBytes(free) + " free on " + p.cfg.storeDir()
			}
			return fmt.Errorf("%w: %s (%s). Nothing is lost: make room there, and start wmrl again on the same --data "+
				"(a supervisor's restart waits for room)", ErrStoreBroken, why, room)
		}
		if err == nil && p.cfg.MaxStoreGB == 0 {
			limit, _, err := p.tr.srv.FollowDisk(free)
			if err != nil && !failed {
				p.notef("nats: the embedded server's store could not follow its disk's room: %v", err)
			}
			failed = err != nil
			p.sayRoom(&short, p.tr.srv.StoreUsed(), limit, free)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// ErrStoreBroken ends a run whose embedded server can store nothing more
// until it is started again.
var ErrStoreBroken = errors.New("nats: the embedded server can store nothing more until it is started again, as nats-server does after a write found its disk full")

// brokenFor is how many checks in a row a server must be found broken
// before the run ends: a write error does not pass, and a moment of a
// stream's deletion (a bucket deleted by hand) must not end a run.
const brokenFor = 3

// roomShort is how close to its limit a store counts as full: the
// largest message it may be sent (a step's update) no longer fits.
const roomShort = 8 << 20

// sayRoom says when the embedded server's store, following its disk, has
// no room left, and when it has again; short is what was said last.
func (p *Pipeline) sayRoom(short *bool, used, limit, free int64) {
	now := used+roomShort > limit
	switch {
	case now && !*short:
		p.notef("nats: the embedded server's store holds %s, and may hold %s: three quarters of what its disk gives it (%s free on %s). "+
			"Every stage waits for room until some is made on that disk (or give --nats-max-store-gb, or a shorter --retention)",
			FormatBytes(used), FormatBytes(limit), FormatBytes(free), p.cfg.storeDir())
	case !now && *short:
		p.notef("nats: room on the disk of the embedded server's store (%s free on %s): it may hold %s, and holds %s",
			FormatBytes(free), p.cfg.storeDir(), FormatBytes(limit), FormatBytes(used))
	}
	*short = now
}

// FormatBytes writes a byte count in the unit that suits it.
func FormatBytes(n int64) string {
	switch {
	case n >= 1e9:
		return fmt.Sprintf("%.1f GB", float64(n)/1e9)
	case n >= 1e6:
		return fmt.Sprintf("%.1f MB", float64(n)/1e6)
	}
	return fmt.Sprintf("%.0f kB", float64(n)/1e3)
}

// boundBeyondDisk says, when --nats-max-store-gb is more than the disk
// can give the store (what it holds and what is free), that the disk
// fills first: the server then fails writes of its own files, rather
// than refuse messages for want of room, and may turn JetStream off.
func (p *Pipeline) boundBeyondDisk(ctx context.Context) {
	bound := p.cfg.maxStore()
	if bound <= 0 {
		return
	}
	free, _, err := diskRoom(p.cfg.storeDir())
	if err != nil {
		return
	}
	ai, err := p.tr.js.AccountInfo(ctx)
	if err != nil {
		return
	}
	if room := int64(ai.Store) + free; bound > room {
		p.notef("nats: --nats-max-store-gb %s is more than the disk gives the store (it holds %.1f GiB, and %.1f GiB is free on %s): the disk would fill first, "+
			"and a server that cannot write its files may turn JetStream off; give at most %.1f, less what the trainer and the archive need there",
			strconv.FormatFloat(p.cfg.MaxStoreGB, 'f', -1, 64), gib(int64(ai.Store)), gib(free), p.cfg.storeDir(), gib(room))
	}
}

func gib(n int64) float64 { return float64(n) / (1 << 30) }

// accountStore is what the account stores on file, and its limit (0:
// none known), as they bear on a stream of replicas: the account's, or,
// where its limits are tiered by replicas (an operator's R1 and R3), those
// of the stream's tier, against which its writes are refused. A tiered
// account reports no limit of its own.
func accountStore(ai *jetstream.AccountInfo, replicas int) (used uint64, limit int64) {
	if ai.Limits.MaxStore != 0 || len(ai.Tiers) == 0 {
		return ai.Store, max(ai.Limits.MaxStore, 0)
	}
	tier, ok := ai.Tiers[fmt.Sprintf("R%d", max(replicas, 1))]
	if !ok {
		return ai.Store, 0
	}
	return tier.Store, max(tier.Limits.MaxStore, 0)
}

// roomWait is how often a roomWaiter asks a full store again.
var roomWait = 2 * time.Second

// roomWaiter waits out a full NATS store (natsjs.StoreFull) before a
// write that cannot be done without: a lease the one-per-run stages take
// (a key-value write), the simulated trainer's trajectories. A process
// started on a full store used to end at once, and a supervisor's
// restarts of it loop; a run's simulated trainer ended the run.
type roomWaiter struct {
	p          *Pipeline
	who, waits string // who waits, and what for ("this process waits for room before it runs them")
	saidAt     time.Time
}

// retry runs op until it returns nil, or an error other than a full
// store's, waiting for room in between.
func (r *roomWaiter) retry(ctx context.Context, op func() error) error {
	for {
		err := op()
		if err == nil {
			return nil
		}
		if err := r.wait(ctx, err); err != nil {
			return err
		}
	}
}

// openWithRoom runs open, each attempt with StartupWait to answer, until
// it succeeds or fails for another reason than a full store, which it
// waits out, saying so as who, once a minute: a bucket deleted while the
// store is full cannot be made anew, and a process starting then ended at
// once, in a loop of restarts (a rehearsal, seed 41, its lease bucket).
func (p *Pipeline) openWithRoom(ctx context.Context, who, waits string, open func(ctx context.Context) error) error {
	full := roomWaiter{p: p, who: who, waits: waits}
	return full.retry(ctx, func() error {
		ctx, cancel := context.WithTimeout(ctx, p.cfg.StartupWait)
		defer cancel()
		return open(ctx)
	})
}

// roomToMake is what a process waits for in openWithRoom.
const roomToMake = "this process waits for room to make it (deleted while the store filled, or never made) before it starts its stages"

// wait returns err unless it is a full store's; then it says so, at most
// once a minute, and returns after roomWait, or with ctx's error.
func (r *roomWaiter) wait(ctx context.Context, err error) error {
	if !natsjs.StoreFull(err) {
		return err
	}
	if time.Since(r.saidAt) >= time.Minute {
		r.saidAt = time.Now()
		r.p.notef("%s: %s; %s, asking every %v: %v", r.who, natsjs.StoreFullHint, r.waits, roomWait, err)
	}
	select {
	case <-ctx.Done():
		return fmt.Errorf("%w: %s waited for room in the NATS store (%v)", errStoppedWaiting, r.who, err)
	case <-time.After(roomWait):
		return nil
	}
}
