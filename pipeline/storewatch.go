package pipeline

import (
	"context"
	"syscall"
	"time"
)

// storeEvery is how often the store's use is read for the metrics (a
// variable for tests).
var storeEvery = 30 * time.Second

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
	if info, err := p.tr.info(ctx); err == nil {
		m.StreamBytes.Set(float64(info.State.Bytes))
	}
	limit := int64(0)
	if ai, err := p.tr.js.AccountInfo(ctx); err == nil {
		m.StoreBytes.Set(float64(ai.Store))
		limit = ai.Limits.MaxStore
	}
	if p.tr.srv != nil {
		if limit <= 0 {
			limit = p.tr.srv.StoreLimit()
		}
		var fs syscall.Statfs_t
		if syscall.Statfs(p.cfg.storeDir(), &fs) == nil {
			m.StoreDiskFree.Set(float64(fs.Bavail) * float64(fs.Bsize))
		}
	}
	m.StoreLimit.Set(float64(max(limit, 0)))
}
