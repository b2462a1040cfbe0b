package natsjs

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"
)

// Record is one message read in stream order.
type Record struct {
	Subject string
	Data    []byte
	Seq     uint64 // stream sequence
	Pending uint64 // messages after this one on the subject, when it was read
	MsgID   string
}

// Reader reads one subject of a stream in order from its first retained
// message, then follows new ones. It keeps no server-side state: each
// Reader starts from the beginning (an ordered, ephemeral consumer).
type Reader struct {
	it jetstream.MessagesContext
	// Backlog is how many messages were on the subject when the reader
	// started: a caller rebuilding state is caught up after that many.
	Backlog uint64
}

// NewReader opens a reader on subject in stream. headersOnly skips payloads
// (for scans that need only the message IDs).
func NewReader(ctx context.Context, js jetstream.JetStream, stream, subject string, headersOnly bool) (*Reader, error) {
	cons, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{subject},
		DeliverPolicy:  jetstream.DeliverAllPolicy,
		HeadersOnly:    headersOnly,
	})
	if err != nil {
		return nil, fmt.Errorf("natsjs: read %s: %w", subject, err)
	}
	info, err := cons.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("natsjs: read %s: %w", subject, err)
	}
	it, err := cons.Messages()
	if err != nil {
		return nil, fmt.Errorf("natsjs: read %s: %w", subject, err)
	}
	return &Reader{it: it, Backlog: info.NumPending}, nil
}

// Next blocks for the next message or until ctx is done.
func (r *Reader) Next(ctx context.Context) (Record, error) {
	m, err := r.it.Next(jetstream.NextContext(ctx))
	if err != nil {
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			return Record{}, ctx.Err()
		}
		return Record{}, err
	}
	rec := Record{Subject: m.Subject(), Data: m.Data(), MsgID: m.Headers().Get(HeaderMsgID)}
	if md, err := m.Metadata(); err == nil {
		rec.Seq, rec.Pending = md.Sequence.Stream, md.NumPending
	}
	return rec, nil
}

// Close stops the reader.
func (r *Reader) Close() { r.it.Stop() }

// Scan reads every message on subject that exists now, then returns.
func Scan(ctx context.Context, js jetstream.JetStream, stream, subject string, headersOnly bool, fn func(Record) error) error {
	r, err := NewReader(ctx, js, stream, subject, headersOnly)
	if err != nil {
		return err
	}
	defer r.Close()
	for i := uint64(0); i < r.Backlog; i++ {
		rec, err := r.Next(ctx)
		if err != nil {
			return fmt.Errorf("natsjs: scan %s: %w", subject, err)
		}
		if err := fn(rec); err != nil {
			return err
		}
		if rec.Pending == 0 {
			break
		}
	}
	return nil
}
