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
	// MetaDeliveries, MetaStreamSeq and MetaSubject are set on received
	// messages: how often JetStream delivered it, its stream sequence, and
	// the subject it was published on.
	MetaDeliveries = "Wmrl-Deliveries"
	MetaStreamSeq  = "Wmrl-Stream-Seq"
	MetaSubject    = "Wmrl-Subject"
)

// ErrClosed is returned by a closed publisher or subscriber.
var ErrClosed = errors.New("natsjs: closed")

// PublisherConfig configures a Publisher. Conn is required.
type PublisherConfig struct {
	Conn *nats.Conn
	// CloseConn closes Conn when the publisher is closed.
	CloseConn bool
	// AckTimeout bounds the wait for the server's PubAcks of one Publish call
	// (default 30s).
	AckTimeout time.Duration
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
}

// Publisher publishes watermill messages to JetStream. Publish sends all its
// messages asynchronously and returns once the server has acknowledged
// every one (or the first failure): a nil error means they are stored. Safe
// for concurrent use.
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
	js, err := jetstream.New(cfg.Conn, jetstream.WithPublishAsyncMaxPending(cfg.MaxPending))
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

// Publish stores msgs on topic. Messages whose metadata holds HeaderMsgID
// are de-duplicated by the server.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return ErrClosed
	}
	err := p.publish(topic, msgs)
	if p.prov != nil && errors.Is(err, jetstream.ErrNoStreamResponse) {
		ctx, cancel := context.WithTimeout(context.Background(), p.cfg.AckTimeout)
		_, perr := p.prov.ensure(ctx, topic)
		cancel()
		if perr != nil {
			return perr
		}
		err = p.publish(topic, msgs)
	}
	return err
}

func (p *Publisher) publish(topic string, msgs []*message.Message) error {
	futures := make([]jetstream.PubAckFuture, 0, len(msgs))
	for _, m := range msgs {
		f, err := p.js.PublishMsgAsync(toNats(topic, m))
		if err != nil {
			return fmt.Errorf("natsjs: publish to %s: %w", topic, err)
		}
		futures = append(futures, f)
	}
	timeout := time.NewTimer(p.cfg.AckTimeout)
	defer timeout.Stop()
	for _, f := range futures {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			return fmt.Errorf("natsjs: publish to %s: %w", topic, err)
		case <-timeout.C:
			return fmt.Errorf("natsjs: publish to %s: no PubAck within %v", topic, p.cfg.AckTimeout)
		}
	}
	return nil
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
