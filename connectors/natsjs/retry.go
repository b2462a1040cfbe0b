package natsjs

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// errMsgIDInProcess: the stream is still proposing an earlier send of the
// same Msg-Id to its replicas (a slow or changing leader); asking again
// later gets its PubAck.
const errMsgIDInProcess jetstream.ErrorCode = 10158

// errClusterNotAvailable: "JetStream system temporarily unavailable", as a
// cluster answers while it elects a meta leader.
const errClusterNotAvailable jetstream.ErrorCode = 10008

// retryable errors are those of a request that may not have reached the
// server that answers it (a stream or meta leader): sending it again can
// succeed. For a message, sending again can store it.
func retryable(err error) bool {
	if apiErr, ok := errors.AsType[*jetstream.APIError](err); ok && (apiErr.ErrorCode == errMsgIDInProcess || apiErr.ErrorCode == errClusterNotAvailable) {
		return true
	}
	for _, e := range []error{jetstream.ErrAsyncPublishTimeout, jetstream.ErrNoStreamResponse, nats.ErrNoResponders,
		nats.ErrDisconnected, nats.ErrTimeout, jetstream.ErrTooManyStalledMsgs, nats.ErrReconnectBufExceeded} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// requestAttempt bounds one request to the cluster, so that a reply lost
// with a server does not hold the caller until its own deadline.
const requestAttempt = 5 * time.Second

// untilAnswered runs op, each time with requestAttempt to answer, until it
// returns nil or an error that asking again cannot fix, or ctx ends (the
// last error then says what it waited for).
func untilAnswered(ctx context.Context, op func(context.Context) error) error {
	wait := 50 * time.Millisecond
	for {
		actx, cancel := context.WithTimeout(ctx, requestAttempt)
		err := op(actx)
		cancel()
		unanswered := errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil
		if err == nil || !unanswered && !retryable(err) {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (gave up: %v)", err, context.Cause(ctx))
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Second)
	}
}
