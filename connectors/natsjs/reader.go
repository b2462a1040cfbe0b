package natsjs

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Record is one message read in stream order.
type Record struct {
	Subject string
	Data    []byte
	Seq     uint64 // stream sequence
	Pending uint64 // messages after this one on the subject, when it was read
	MsgID   string
	Header  nats.Header // all of the message's headers, the message ID's too
	Time    time.Time   // when the stream stored it
}

// Reader reads one subject of a stream in order from its first retained
// message, then follows new ones. It keeps no server-side state: each
// Reader starts from the beginning (an ordered, ephemeral consumer). When
// the consumer is lost and cannot be made again at once (the cluster node
// that held it is gone), the Reader makes a new one that starts after the
// last message it returned, trying again with a growing pause until it
// succeeds or Next's context ends.
type Reader struct {
	js          jetstream.JetStream
	stream      string
	subject     string
	headersOnly bool
	since       time.Time // the first message stored at or after it; zero: the first retained
	after       uint64    // ... or the first after this stream sequence
	next        uint64    // stream sequence to resume at; 0: the beginning (since)
	mu          sync.Mutex
	it          jetstream.MessagesContext // nil between a loss and the next open
	cons        jetstream.Consumer        // the newest consumer made, deleted on Close
	closed      bool
	// Last is the stream sequence of the subject's newest message when the
	// reader started, as the stream's leader has it (0: there was none,
	// none at or after since, or none after the sequence it starts
	// after): a caller rebuilding state is caught up
	// once it has read it. The consumer's own count of what is pending
	// cannot say: in a cluster the server holding the consumer may be a
	// replica still catching up with the leader (scans placed on one just
	// restarted read none of 10,000 messages).
	Last uint64
	// OnRetry, if set, hears why the reader is about to try again (from a
	// goroutine calling Next).
	OnRetry func(err error)
}

// NewReader opens a reader on subject in stream. headersOnly skips payloads
// (for scans that need only the message IDs). A cluster that cannot answer
// for the moment (a lost server, a meta leader being elected) is asked
// again for up to ReaderSetUpWait.
func NewReader(ctx context.Context, js jetstream.JetStream, stream, subject string, headersOnly bool) (*Reader, error) {
	return newReader(ctx, &Reader{js: js, stream: stream, subject: subject, headersOnly: headersOnly})
}

// NewReaderSince opens a reader on subject that starts at the first
// message stored at or after since; headersOnly as for NewReader.
func NewReaderSince(ctx context.Context, js jetstream.JetStream, stream, subject string, since time.Time, headersOnly bool) (*Reader, error) {
	return newReader(ctx, &Reader{js: js, stream: stream, subject: subject, since: since, headersOnly: headersOnly})
}

// NewReaderAfter opens a reader on subject that starts after stream
// sequence seq (0: at the first retained); headersOnly as for NewReader.
func NewReaderAfter(ctx context.Context, js jetstream.JetStream, stream, subject string, seq uint64, headersOnly bool) (*Reader, error) {
	return newReader(ctx, &Reader{js: js, stream: stream, subject: subject, after: seq, next: seq + 1, headersOnly: headersOnly})
}

func newReader(ctx context.Context, r *Reader) (*Reader, error) {
	subject := r.subject
	setUp, cancel := context.WithTimeout(ctx, ReaderSetUpWait)
	defer cancel()
	if err := UntilAnswered(setUp, func(ctx context.Context) (err error) {
		_, err = r.open(ctx)
		return err
	}, nil); err != nil {
		return nil, err
	}
	if err := UntilAnswered(setUp, func(ctx context.Context) (err error) {
		r.Last, err = r.last(ctx)
		return err
	}, nil); err != nil {
		r.Close()
		return nil, fmt.Errorf("natsjs: read %s: %w", subject, err)
	}
	return r, nil
}

// last asks the stream's leader for the stream sequence of the subject's
// newest message (0: none, none at or after r.since, or none after
// r.after). The stream's
// own message API answers from its leader; a direct get (AllowDirect,
// which wmrl's streams do not set) may be answered by any replica.
func (r *Reader) last(ctx context.Context) (uint64, error) {
	stream, err := r.js.Stream(ctx, r.stream)
	if err != nil {
		return 0, err
	}
	m, err := stream.GetLastMsgForSubject(ctx, r.subject)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return 0, nil
	case err != nil:
		return 0, err
	case !r.since.IsZero() && m.Time.Before(r.since), m.Sequence <= r.after:
		return 0, nil
	}
	return m.Sequence, nil
}

// ReadThrough reports whether rec, just read, is at or past Last: what
// the subject held when the reader started has all been read. A message
// with nothing pending after it short of Last means that the consumer's
// server lags the leader (the rest comes as it catches up) or that the
// message at Last was deleted since; the leader is asked again, and Last
// follows its answer.
func (r *Reader) ReadThrough(ctx context.Context, rec Record) (bool, error) {
	if rec.Seq >= r.Last {
		return true, nil
	}
	if rec.Pending > 0 {
		return false, nil
	}
	last, err := r.last(ctx)
	if err != nil {
		return false, fmt.Errorf("natsjs: read %s: %w", r.subject, err)
	}
	r.Last = last
	return rec.Seq >= last, nil
}

// ReaderSetUpWait bounds how long NewReader asks again.
const ReaderSetUpWait = time.Minute

// open makes the ordered consumer, starting at r.next.
func (r *Reader) open(ctx context.Context) (jetstream.Consumer, error) {
	cfg := jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{r.subject},
		DeliverPolicy:  jetstream.DeliverAllPolicy,
		HeadersOnly:    r.headersOnly,
		// The library's own recovery makes one attempt; after that Next
		// retries here, where the context is honoured and OnRetry hears.
		MaxResetAttempts: 1,
	}
	switch {
	case r.next > 0:
		cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, r.next
	case !r.since.IsZero():
		cfg.DeliverPolicy, cfg.OptStartTime = jetstream.DeliverByStartTimePolicy, &r.since
	}
	cons, err := r.js.OrderedConsumer(ctx, r.stream, cfg)
	if err != nil {
		return nil, fmt.Errorf("natsjs: read %s: %w", r.subject, err)
	}
	it, err := cons.Messages()
	if err != nil {
		return nil, fmt.Errorf("natsjs: read %s: %w", r.subject, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cons = cons
	if r.closed {
		it.Stop()
		return nil, jetstream.ErrMsgIteratorClosed
	}
	r.it = it
	return cons, nil
}

// Next blocks for the next message or until ctx is done. A context that
// ends stops the reader: call Next with the context of the reader's use.
func (r *Reader) Next(ctx context.Context) (Record, error) {
	wait := 250 * time.Millisecond
	for {
		r.mu.Lock()
		it, closed := r.it, r.closed
		r.mu.Unlock()
		if closed {
			return Record{}, jetstream.ErrMsgIteratorClosed
		}
		var err error
		if it == nil {
			if _, err = r.open(ctx); err == nil {
				continue
			}
		} else {
			stop := context.AfterFunc(ctx, it.Stop) // ends the library's own retries too
			var m jetstream.Msg
			m, err = it.Next(jetstream.NextContext(ctx))
			stop()
			if err == nil {
				rec := Record{Subject: m.Subject(), Data: m.Data(), MsgID: m.Headers().Get(HeaderMsgID), Header: m.Headers()}
				if md, err := m.Metadata(); err == nil {
					rec.Seq, rec.Pending, rec.Time = md.Sequence.Stream, md.NumPending, md.Timestamp
					r.next = rec.Seq + 1
				}
				return rec, nil
			}
			it.Stop()
			r.mu.Lock()
			r.it, closed = nil, r.closed
			r.mu.Unlock()
			if closed {
				return Record{}, jetstream.ErrMsgIteratorClosed
			}
		}
		if ctx.Err() != nil {
			return Record{}, ctx.Err()
		}
		if r.js.Conn().IsClosed() {
			// Closed for good (by its owner, or by nats.go after its
			// reconnections ran out): no retry can read on.
			return Record{}, fmt.Errorf("natsjs: read %s: %w (last error: %v)", r.subject, nats.ErrConnectionClosed, r.js.Conn().LastError())
		}
		if r.OnRetry != nil {
			r.OnRetry(err)
		}
		select {
		case <-ctx.Done():
			return Record{}, ctx.Err()
		case <-time.After(wait):
		}
		wait = min(2*wait, 10*time.Second)
	}
}

// Follow hands fn each message in turn until ctx ends (nil then) or the
// reader fails.
func (r *Reader) Follow(ctx context.Context, fn func(Record)) error {
	for {
		rec, err := r.Next(ctx)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, context.Canceled) {
				return nil
			}
			return err
		}
		fn(rec)
	}
}

// Close stops the reader and deletes its consumer, so that readers opened
// often (scans) do not leave consumers behind until the server's inactivity
// threshold (5 minutes) removes them.
func (r *Reader) Close() {
	r.mu.Lock()
	r.closed = true
	if r.it != nil {
		r.it.Stop()
	}
	cons := r.cons
	r.cons = nil
	r.mu.Unlock()
	if cons == nil {
		return
	}
	if info := cons.CachedInfo(); info != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = r.js.DeleteConsumer(ctx, r.stream, info.Name) // best effort: the threshold removes it otherwise
	}
}

// Scan reads every message on subject that exists now, then returns.
func Scan(ctx context.Context, js jetstream.JetStream, stream, subject string, headersOnly bool, fn func(Record) error) error {
	return ScanSince(ctx, js, stream, subject, time.Time{}, headersOnly, fn)
}

// ScanSince is Scan from the first message stored at or after since (the
// zero time: from the first).
func ScanSince(ctx context.Context, js jetstream.JetStream, stream, subject string, since time.Time, headersOnly bool, fn func(Record) error) error {
	r, err := NewReaderSince(ctx, js, stream, subject, since, headersOnly)
	if err != nil {
		return err
	}
	return r.scan(ctx, fn)
}

// ScanAfter is Scan of the messages after stream sequence seq: where an
// earlier scan ended, with no message of it read again. When the subject
// has none, it asks the stream only for the subject's newest message.
func ScanAfter(ctx context.Context, js jetstream.JetStream, stream, subject string, seq uint64, headersOnly bool, fn func(Record) error) error {
	r := &Reader{js: js, stream: stream, subject: subject, headersOnly: headersOnly}
	last, err := r.last(ctx)
	if err != nil || last <= seq {
		return err
	}
	r.next = seq + 1
	if r, err = newReader(ctx, r); err != nil {
		return err
	}
	return r.scan(ctx, fn)
}

// scan reads through Last, then closes the reader.
func (r *Reader) scan(ctx context.Context, fn func(Record) error) error {
	defer r.Close()
	for done := r.Last == 0; !done; {
		rec, err := r.Next(ctx)
		if err != nil {
			return fmt.Errorf("natsjs: scan %s: %w", r.subject, err)
		}
		if err := fn(rec); err != nil {
			return err
		}
		if done, err = r.ReadThrough(ctx, rec); err != nil {
			return err
		}
	}
	return nil
}
