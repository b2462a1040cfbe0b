package pipeline

import (
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
)

// A stage's handler that panics has a bug that the message in hand set off.
// Left to watermill's router, the panic was recovered with nothing said
// (the router logs to nothing here) and the message handed back, to panic
// again on every redelivery, for ever, while whatever the handler had
// locked stayed locked. Instead, recoverPanics turns the panic into a
// *panicError, the dead-letter middleware stores the message on the dlq
// subject with where it panicked (as given up, so that `wmrl dlq --resend`
// sends it back once the bug is fixed), and the run stops, saying so with
// the stack: the panic may have left the stage's state half-changed, and a
// restart rebuilds it from the stream and the checkpoints (those calibrate
// and fuse save on the way out hold only what their in-order readers
// built, which no handler changes). The restart does not meet the message
// again.

// panicError is a handler's panic.
type panicError struct {
	value any
	where string // the function and line that panicked
	stack []byte
}

func (e *panicError) Error() string { return fmt.Sprintf("panic at %s: %v", e.where, e.value) }

// recoverPanics is the innermost middleware: a panic in h becomes its
// error.
func recoverPanics(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) (out []*message.Message, err error) {
		defer func() {
			if v := recover(); v != nil {
				err = &panicError{value: v, where: panicSite(), stack: debug.Stack()}
			}
		}()
		return h(msg)
	}
}

// panicSite names the frame that panicked, as "pkg.Func (file.go:12)":
// the first one below the runtime's panic call that is not the runtime's.
// It is called while a panic is being recovered (from a deferred function
// or what that calls), whose frames sit on top of the panicking ones.
func panicSite() string {
	pcs := make([]uintptr, 64)
	frames := runtime.CallersFrames(pcs[:runtime.Callers(2, pcs)])
	inPanic := false
	for {
		f, more := frames.Next()
		switch {
		case f.Function == "runtime.gopanic":
			inPanic = true
		case inPanic && !strings.HasPrefix(f.Function, "runtime.") && !strings.HasPrefix(f.Function, "internal/runtime/"):
			file := f.File[strings.LastIndexByte(f.File, '/')+1:]
			return fmt.Sprintf("%s (%s:%d)", f.Function[strings.LastIndexByte(f.Function, '/')+1:], file, f.Line)
		}
		if !more {
			return "an unknown place"
		}
	}
}

// panicReason is the dead letter's reason for a message stage panicked
// on: given up, so that wmrl dlq --resend sends it back once the bug is
// fixed.
func panicReason(stage string, pe *panicError) string {
	return givenUpPrefix + "at once: " + stage + ": " + pe.Error()
}

// asPanic returns err's panic, if it is one.
func asPanic(err error) (*panicError, bool) {
	var pe *panicError
	return pe, errors.As(err, &pe)
}

// panicked stops the run after stage's handler panicked on a message from
// subject; stored says where the message went, or why it could not be.
func (p *Pipeline) panicked(stage, subject string, pe *panicError, stored string) {
	p.notef("%s: a bug: the handler panicked on a message from %s: %v\n%s", stage, subject, pe.value, pe.stack)
	p.fail(fmt.Errorf("%s: a bug: the handler panicked on a message from %s (%s); the run stops, since the stage's state "+
		"may be half-changed, and a restart rebuilds it (wmrl dlq --resend sends the message back once the bug is fixed); %s: %w",
		stage, subject, stored, p.reportHint(), pe))
}

// fusePanicked is the error that stops the run after fuse panicked fusing
// or publishing step (called while the panic is recovered). Nothing is
// dead-lettered: a step is many messages, its inputs are handed back
// unsettled, and its update is what the trainer waits for.
func (p *Pipeline) fusePanicked(step int64, v any, stack []byte) error {
	pe := &panicError{value: v, where: panicSite(), stack: stack}
	p.notef("fuse: a bug: fusing step %d panicked: %v\n%s", step, v, stack)
	return fmt.Errorf("fuse: a bug: fusing step %d panicked; the run stops, since the stage's state may be half-changed, and a restart "+
		"rebuilds it and fuses the step again from its inputs, which are handed back (it stops here again until the bug is fixed); %s: %w",
		step, p.reportHint(), pe)
}

// reportHint asks for a bug's report, with the stack when it was printed.
func (p *Pipeline) reportHint() string {
	if p.cfg.Quiet {
		return "please report it"
	}
	return "please report it with the stack printed above"
}
