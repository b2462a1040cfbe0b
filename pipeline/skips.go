package pipeline

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
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
	pe := &panicError{value: v, where: stackSite(stack), stack: stack}
	stored := "dead-lettered to " + s.p.dl.subject
	if _, err := s.p.dl.send(s.stage, s.subject, in.Seq, givenUpPrefix+"at once: "+s.stage+": "+pe.Error(), in.Data); err != nil {
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
	report := "please report it with the stack printed above"
	if s.p.cfg.Quiet {
		report = "please report it"
	}
	return fmt.Errorf("%s: a bug: absorbing the message at %d on %s panicked (%s); the run stops, since the stage's state may be half-changed, "+
		"and a restart rebuilds it from its checkpoint, %s (wmrl dlq --resend sends the message back once the bug is fixed); %s: %w",
		s.stage, in.Seq, s.subject, stored, skipped, report, pe)
}

// stackSite names the frame that panicked in a stack of debug.Stack, as
// "pkg.Func (file.go:12)": the first one below the runtime's panic call
// that is not the runtime's.
func stackSite(stack []byte) string {
	lines := strings.Split(string(stack), "\n")
	for i, l := range lines {
		if !strings.HasPrefix(l, "panic(") {
			continue
		}
		for j := i + 2; j+1 < len(lines); j += 2 { // a function's line, then its file's
			fn, at := lines[j], strings.TrimSpace(lines[j+1])
			if strings.HasPrefix(fn, "runtime.") {
				continue
			}
			fn = fn[strings.LastIndexByte(fn, '/')+1:]
			if k := strings.LastIndexByte(fn, '('); k > 0 {
				fn = fn[:k] // its arguments
			}
			at = at[strings.LastIndexByte(at, '/')+1:]
			at, _, _ = strings.Cut(at, " ") // " +0x1f"
			return fmt.Sprintf("%s (%s)", fn, at)
		}
	}
	return "an unknown place"
}
