package natsjs

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Headers the adapter reads and writes.
const (
	// HeaderUUID carries the watermill message UUID.
	HeaderUUID = "Wm-Uuid"
	// HeaderMsgID, set in a message's metadata, becomes the JetStream
	// de-duplication ID: a second publish with the same ID inside the
	// stream's duplicate window is dropped by the server.
	HeaderMsgID = jetstream.MsgIDHeader
	// MetaDeliveries, MetaStreamSeq, MetaSubject and MetaStored are set on
	// received messages: how often JetStream delivered it, its stream
	// sequence, the subject it was published on, and when the stream
	// stored it (Unix nanoseconds).
	MetaDeliveries = "Wmrl-Deliveries"
	MetaStreamSeq  = "Wmrl-Stream-Seq"
	MetaSubject    = "Wmrl-Subject"
	MetaStored     = "Wmrl-Stored"
)

// ErrClosed is returned by a closed publisher or subscriber.
var ErrClosed = errors.New("natsjs: closed")

// PublisherConfig configures a Publisher. Conn is required.
type PublisherConfig struct {
	Conn *nats.Conn
	// CloseConn closes Conn when the publisher is closed.
	CloseConn bool
	// AckTimeout bounds the wait for the server's PubAcks of one Publish call
	// (default 30s), retries included.
	AckTimeout time.Duration
	// AttemptTimeout: a message without a PubAck this long after it was sent
	// is sent again (default 5s, at most AckTimeout). A cluster that lost
	// the stream's leader elects another within a few seconds; the messages
	// the old leader never acknowledged go to the new one. The stream
	// stores a message sent twice once if it carries HeaderMsgID (every
	// wmrl message does); one without may be stored twice.
	AttemptTimeout time.Duration
	// MaxPending bounds async publishes in flight (default 4096).
	MaxPending int
	// Stream, when set, lets Publish create a missing stream and retry.
	Stream StreamFunc
}

func (c *PublisherConfig) setDefaults() {
	if c.AckTimeout == 0 {
		c.AckTimeout = 30 * time.Second
	}
	if c.MaxPending == 0 {
		c.MaxPending = 4096
	}
	if c.AttemptTimeout == 0 {
		c.AttemptTimeout = 5 * time.Second
	}
	c.AttemptTimeout = min(c.AttemptTimeout, c.AckTimeout)
}

// Publisher publishes watermill messages to JetStream. Publish sends all its
// messages asynchronously and returns once the server has acknowledged
// every one: a nil error means they are stored. Messages that time out,
// meet no stream (no leader yet) or are cut off by a reconnect are sent
// again until AckTimeout; an error the stream gives (too large, a limit)
// fails the call at once. Safe for concurrent use.
type Publisher struct {
	cfg    PublisherConfig
	js     jetstream.JetStream
	prov   *provisioner
	mu     sync.RWMutex
	closed bool
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher builds a publisher on an open connection.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	if cfg.Conn == nil {
		return nil, errors.New("natsjs: publisher needs a connection")
	}
	cfg.setDefaults()
	// The library's own per-message timeout resolves every future, so none
	// stays pending (and holds a MaxPending slot) after its attempt.
	js, err := jetstream.New(cfg.Conn, jetstream.WithPublishAsyncMaxPending(cfg.MaxPending),
		jetstream.WithPublishAsyncTimeout(cfg.AttemptTimeout))
	if err != nil {
		return nil, fmt.Errorf("natsjs: jetstream: %w", err)
	}
	p := &Publisher{cfg: cfg, js: js}
	if cfg.Stream != nil {
		p.prov = newProvisioner(js, cfg.Stream)
	}
	return p, nil
}

func toNats(topic string, m *message.Message) *nats.Msg {
	nm := nats.NewMsg(topic)
	nm.Data = m.Payload
	for k, v := range m.Metadata {
		nm.Header.Set(k, v)
	}
	nm.Header.Set(HeaderUUID, m.UUID)
	return nm
}

// WireSize is what the server counts of m against its max_payload: the
// payload and the headers Publish sends with it.
func WireSize(m *message.Message) int { return toNats("", m).Size() }

// Publish stores msgs on topic. Messages whose metadata holds HeaderMsgID
// are de-duplicated by the server.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return ErrClosed
	}
	deadline := time.Now().Add(p.cfg.AckTimeout)
	wait := 50 * time.Millisecond
	for attempt := 1; ; attempt++ {
		var err error
		if msgs, err = p.attempt(topic, msgs, deadline); len(msgs) == 0 {
			return nil
		}
		if errors.Is(err, jetstream.ErrNoStreamResponse) {
			// No stream answered: none takes the subject (create it, or
			// fail), or its leader is being elected (wait for it).
			if perr := p.noStream(topic, deadline); perr != nil {
				return perr
			}
		}
		if !retryable(err) || time.Until(deadline) < wait {
			return fmt.Errorf("natsjs: publish to %s: %d message(s) not stored after %d attempt(s) in %v: %w",
				topic, len(msgs), attempt, p.cfg.AckTimeout-time.Until(deadline).Truncate(time.Millisecond), err)
		}
		time.Sleep(wait)
		wait = min(2*wait, time.Second)
	}
}

// noStream handles a publish no stream answered: with a StreamFunc it
// creates the stream if it is missing; without, a subject no stream takes
// is an error at once.
func (p *Publisher) noStream(topic string, deadline time.Time) error {
	// At most an attempt's time: without a meta leader the lookup may get
	// no answer at all, and the next attempt may already find the stream.
	ctx, cancel := context.WithTimeout(context.Background(), min(p.cfg.AttemptTimeout, time.Until(deadline)))
	defer cancel()
	if p.prov != nil {
		_, err := p.prov.ensure(ctx, topic)
		return err
	}
	if _, err := p.js.StreamNameBySubject(ctx, topic); errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("natsjs: publish to %s: no stream takes the subject", topic)
	}
	return nil
}

// attempt sends msgs once and waits for every PubAck (each resolves within
// AttemptTimeout). It returns the messages not stored, in their order, and
// the error of the first of them.
func (p *Publisher) attempt(topic string, msgs []*message.Message, deadline time.Time) (failed []*message.Message, first error) {
	futures := make([]jetstream.PubAckFuture, 0, len(msgs))
	for _, m := range msgs {
		f, err := p.js.PublishMsgAsync(toNats(topic, m))
		if err != nil {
			first = err
			break
		}
		futures = append(futures, f)
	}
	// A backstop: the library resolves every future within AttemptTimeout.
	backstop := time.NewTimer(time.Until(deadline) + p.cfg.AttemptTimeout)
	defer backstop.Stop()
	for i, f := range futures {
		select {
		case <-f.Ok():
			continue
		case err := <-f.Err():
			if failed == nil {
				first = err
			}
		case <-backstop.C:
			return msgs[i:], jetstream.ErrAsyncPublishTimeout
		}
		failed = append(failed, msgs[i])
	}
	// Those never sent (PublishMsgAsync failed) come after the sent ones.
	return append(failed, msgs[len(futures):]...), first
}

// Close waits for pending publishes (up to AckTimeout) and refuses new ones.
func (p *Publisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	select {
	case <-p.js.PublishAsyncComplete():
	case <-time.After(p.cfg.AckTimeout):
	}
	if p.cfg.CloseConn {
		p.cfg.Conn.Close()
	}
	return nil
}
