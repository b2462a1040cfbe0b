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

// The server's answers when it has no room to store: its JetStream store
// is full (10023, as a publish or a key-value write is answered), the
// account's share of it is (10002: an operator's limit of the account,
// `max_file` or `max_mem`, as a shared NATS sets for each of its users),
// or a new stream or consumer would not fit (10047 on file, 10028 in
// memory).
const (
	errInsufficientResources jetstream.ErrorCode = 10023
	errAccountExceeded       jetstream.ErrorCode = 10002
	errStorageExceeded       jetstream.ErrorCode = 10047
	errMemoryExceeded        jetstream.ErrorCode = 10028
)

// StoreFull reports whether err is the server refusing to store for lack
// of room. Nothing was stored, and the same request succeeds once room is
// made (disk freed, the store's or the account's limit raised, messages
// aged out), so it is an outage to wait out, not a fault of what was sent.
func StoreFull(err error) bool {
	apiErr, ok := errors.AsType[*jetstream.APIError](err)
	if !ok {
		return false
	}
	switch apiErr.ErrorCode {
	case errInsufficientResources, errAccountExceeded, errStorageExceeded, errMemoryExceeded:
		return true
	}
	return false
}

// StoreFullHint says what a StoreFull error means and how to make room.
const StoreFullHint = "the NATS server has no room to store (its JetStream store, or the account's share of it, is full: free its disk, raise its max_file_store (wmrl run's --nats-max-store-gb) or the account's limit, or shorten --retention; wmrl status shows the store's use)"

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

// UntilAnswered runs op, each time with requestAttempt to answer, until it
// returns nil or an error that asking again cannot fix, or ctx ends (the
// last error then says what it waited for). Asking again fixes what
// retryable says, an attempt that got no answer in time, and a server whose
// JetStream is not up yet. onRetry, if set, hears each error asked past.
// It is how every request that sets things up or keeps state meets a
// cluster that is starting or electing a leader.
func UntilAnswered(ctx context.Context, op func(context.Context) error, onRetry func(error)) error {
	wait := 50 * time.Millisecond
	for {
		actx, cancel := context.WithTimeout(ctx, requestAttempt)
		err := op(actx)
		cancel()
		unanswered := errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil
		if err == nil || !unanswered && !retryable(err) && !errors.Is(err, jetstream.ErrJetStreamNotEnabled) {
			return err
		}
		if onRetry != nil {
			onRetry(err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (gave up: %v)", err, context.Cause(ctx))
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Second)
	}
}
