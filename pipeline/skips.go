package pipeline

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/stages/calibrate"
)

// A bug that one message sets off in calibrate's or fuse's in-order
// reader (absorbing a pair group or a calibration) would, as a panic, end
// the process, and every restart would read the message again and end
// again: the run could not go on, whatever was restarted. Instead the
// stage recovers it, and skips: the message is stored on the dlq subject
// as given up (wmrl dlq --resend sends it back once the bug is fixed),
// its stream sequence goes on the stage's skip list in the state bucket,
// and the run stops with the stack, with no checkpoint of the state the
// panic may have half-changed. A restart rebuilds the state from the last
// checkpoint and passes over the messages the list names.

// skipKey is the state bucket's key of a stage's skip list.
func skipKey(stage string) string { return stage + "_skipped" }

// skips is a stage's skip list: the stream sequences of the messages its
// in-order reader passes over.
type skips struct {
	p              *Pipeline
	stage, subject string
	store          *natsjs.StateStore

	mu   sync.Mutex
	seqs map[uint64]bool
}

// skipsOf loads stage's skip list for its reader of subject.
func (p *Pipeline) skipsOf(ctx context.Context, stage, subject string) (*skips, error) {
	store, list, _, err := loadCheckpoint[[]uint64](ctx, p, skipKey(stage))
	if err != nil {
		return nil, err
	}
	s := &skips{p: p, stage: stage, subject: subject, store: store, seqs: map[uint64]bool{}}
	for _, seq := range list {
		s.seqs[seq] = true
	}
	if len(list) > 0 {
		p.notef("%s: passing over the messages at %v on %s: absorbing each set off a bug before (wmrl dlq lists them; --resend sends them back once it is fixed)",
			stage, list, subject)
	}
	return s, nil
}

// has reports whether the reader passes over the message at seq.
func (s *skips) has(seq uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.seqs[seq]
}

// panicked dead-letters in, whose absorption panicked with v, adds it to
// the list, and returns the error that stops the run.
func (s *skips) panicked(in calibrate.Input, v any, stack []byte) error {
	pe := &panicError{value: v, where: panicSite(), stack: stack} // called while the panic is recovered
	stored := "dead-lettered to " + s.p.dl.subject
	if _, err := s.p.dl.send(s.stage, s.subject, in.Seq, "", panicReason(s.stage, pe), in.Data); err != nil {
		stored = "it could not be dead-lettered: " + err.Error()
	}
	s.mu.Lock()
	s.seqs[in.Seq] = true
	list := slices.Sorted(maps.Keys(s.seqs))
	s.mu.Unlock()
	skipped := "passing over it"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := s.store.Save(ctx, checkpointKey(s.p.cfg.Run, skipKey(s.stage)), storedCheckpoint[[]uint64]{StreamCreated: s.p.tr.created, Checkpoint: list})
	if err != nil {
		skipped = fmt.Sprintf("but it could not be marked to be passed over (%v), so a restart meets it again", err)
	}
	s.p.notef("%s: a bug: absorbing the message at %d on %s panicked: %v\n%s", s.stage, in.Seq, s.subject, v, stack)
	return fmt.Errorf("%s: a bug: absorbing the message at %d on %s panicked (%s); the run stops, since the stage's state may be half-changed, "+
		"and a restart rebuilds it from its checkpoint, %s (wmrl dlq --resend sends the message back once the bug is fixed); %s: %w",
		s.stage, in.Seq, s.subject, stored, skipped, s.p.reportHint(), pe)
}
