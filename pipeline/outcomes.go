package pipeline

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
)

// OutcomeBucket is the key-value bucket of a prefix's execution outcomes.
// An execution is the expensive thing: one that finished is kept there
// while the stream keeps the group it answers, so that the group,
// redelivered after a crash or restart of the execute stage or taken over
// by another of its processes, runs only what has no outcome yet.
func OutcomeBucket(prefix string) string {
	return "WMRL_OUTCOMES_" + strings.ToUpper(natsjs.SafeName(prefix))
}

// outcomeWait bounds each read and write of the bucket: a bucket that does
// not answer costs an execution at worst, never a stalled group.
const outcomeWait = 5 * time.Second

// outcomeStore is the run's share of the outcome bucket.
type outcomeStore struct {
	st  *natsjs.StateStore
	run string
}

var _ execute.Outcomes = outcomeStore{}

// openOutcomes opens the bucket with the stream's retention and replicas
// (cfg's, as resolved at connect).
func openOutcomes(ctx context.Context, js jetstream.JetStream, cfg Config, remade func(bucket string)) (outcomeStore, error) {
	st, err := natsjs.OpenStore(ctx, js, natsjs.StoreConfig{
		Bucket: OutcomeBucket(cfg.Prefix), Description: "wmrl execution outcomes, kept as long as the groups they answer",
		Replicas: cfg.Replicas, TTL: cfg.MaxAge, Remade: remade,
	})
	return outcomeStore{st: st, run: cfg.Run}, err
}

// outcomes opens the run's outcome store once for the process: execute
// keeps outcomes in it and archive reads late anchors' back, and a bucket
// that does not answer is waited for (up to StartupWait) once, not by each;
// a full store that leaves no room to make it, for as long as it lasts.
func (p *Pipeline) outcomes(ctx context.Context) (outcomeStore, error) {
	p.outcomesOnce.Do(func() {
		remade := p.bucketRemade(OutcomeBucket(p.cfg.Prefix), "executions' outcomes are kept in it again. Those kept before are gone: an anchor group redelivered to another process "+
			"is executed again, and a late anchor group's rows are archived without its execution's status and seconds")
		p.outcomesErr = p.openWithRoom(ctx, "bucket "+OutcomeBucket(p.cfg.Prefix), roomToMake, func(ctx context.Context) (err error) {
			p.outcomeStore, err = openOutcomes(ctx, p.tr.js, p.cfg, remade)
			return err
		})
	})
	return p.outcomeStore, p.outcomesErr
}

// key is a bucket key for a run's trajectory key: group and trajectory IDs
// may hold any character, a bucket key only a few.
func (o outcomeStore) key(k string) string {
	sum := sha256.Sum256([]byte(o.run + "\x00" + k))
	return hex.EncodeToString(sum[:16])
}

func (o outcomeStore) Load(ctx context.Context, k string) (schemas.ExecItem, bool, error) {
	ctx, cancel := context.WithTimeout(ctx, outcomeWait)
	defer cancel()
	var it schemas.ExecItem
	ok, err := o.st.Load(ctx, o.key(k), &it)
	return it, ok, err
}

func (o outcomeStore) Save(ctx context.Context, k string, it schemas.ExecItem) error {
	ctx, cancel := context.WithTimeout(ctx, outcomeWait)
	defer cancel()
	return o.st.Save(ctx, o.key(k), it)
}
