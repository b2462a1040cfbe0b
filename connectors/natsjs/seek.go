package natsjs

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"
)

// SeekAfter finds where a read of subject starts so as to skip the
// messages past does not hold of: a stream sequence before the first
// message on subject that it holds of, and after every message on subject
// before that one (for NewReaderAfter), or through when it holds of none
// up to stream sequence through (which callers take from the subject's
// newest message). past must hold of every message on subject stored after
// one it holds of, as "of step s or later" does of a run's messages, which
// stages store by step. It is a binary search by message gets, each the
// first message on subject at or after a sequence as the stream's leader
// has it: some log2(through) of them, where a scan reads every message.
func SeekAfter(ctx context.Context, js jetstream.JetStream, stream, subject string, through uint64, past func(Record) bool) (uint64, error) {
	var st jetstream.Stream
	if err := UntilAnswered(ctx, func(ctx context.Context) (err error) {
		st, err = js.Stream(ctx, stream)
		return err
	}, nil); err != nil {
		return 0, fmt.Errorf("natsjs: seek %s: %w", subject, err)
	}
	// first returns the first message on subject at or after seq, before
	// end (ok false: none), asking again while a cluster elects a leader.
	first := func(seq, end uint64) (Record, bool, error) {
		var m *jetstream.RawStreamMsg
		err := UntilAnswered(ctx, func(ctx context.Context) (err error) {
			m, err = st.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(subject))
			return err
		}, nil)
		switch {
		case errors.Is(err, jetstream.ErrMsgNotFound):
			return Record{}, false, nil
		case err != nil:
			return Record{}, false, fmt.Errorf("natsjs: seek %s: %w", subject, err)
		case m.Sequence >= end:
			return Record{}, false, nil
		}
		return Record{Subject: m.Subject, Data: m.Data, Seq: m.Sequence, MsgID: m.Header.Get(HeaderMsgID), Header: m.Header, Time: m.Time}, true, nil
	}
	newest, ok, err := first(through, through+1)
	if err != nil || !ok || !past(newest) {
		return through, err
	}
	// Every message on subject at or before lo fails past; the one at
	// found holds it, and those between lo and found stand before hi.
	lo, hi, found := uint64(0), through, through
	for lo+1 < hi {
		mid := lo + (hi-lo)/2
		r, ok, err := first(mid, hi)
		switch {
		case err != nil:
			return 0, err
		case !ok:
			hi = mid // none from mid up to hi
		case past(r):
			hi, found = r.Seq, r.Seq
		default:
			lo = r.Seq
		}
	}
	return found - 1, nil
}
