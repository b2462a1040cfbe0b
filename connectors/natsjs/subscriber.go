package natsjs

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// SubscriberConfig configures a Subscriber. Conn is required.
type SubscriberConfig struct {
	Conn *nats.Conn
	// CloseConn closes Conn when the subscriber is closed.
	CloseConn bool
	// Stream says which stream holds a topic (default: one per topic).
	Stream StreamFunc
	// ConsumerGroup names the durable consumer. Subscribers of one group share
	// a topic's messages (each message goes to one of them); different groups
	// each get every message. Empty: one shared group per topic.
	ConsumerGroup string
	// AckWait: an unacknowledged message is redelivered after it (default
	// 30s). Messages still being handled are kept alive with InProgress every
	// AckWait/2, so a long handler is never redelivered behind its back.
	AckWait time.Duration
	// MaxAckPending bounds messages handed out and not yet acknowledged, per
	// consumer (default 1024). A handler that holds messages (a join waiting
	// for its other side) needs room for all it holds.
	MaxAckPending int
	// Prefetch is how many messages the client buffers ahead (default 256).
	Prefetch int
	// PullExpiry: each pull request lasts this long (default 5s); the server
	// sends heartbeats every half of it, and two missed ones make the client
	// pull again. After the loss of a cluster node that led the consumer,
	// consumption resumes on the new leader within about this long (the
	// library's default, 30s, stalls a pipeline that long).
	PullExpiry time.Duration
	// NakDelay is the redelivery delay after a Nack, given how often the
	// message was delivered (default: 250ms doubling to 30s).
	NakDelay func(deliveries uint64) time.Duration
	// Logger for transient errors (default: none).
	Logger watermill.LoggerAdapter
	// SetUpWait bounds how long Subscribe keeps asking a cluster that
	// cannot answer for the moment (a lost server's requests, a meta leader
	// being elected) to set up the stream and the consumer (default 1m).
	SetUpWait time.Duration
}

func (c *SubscriberConfig) setDefaults() {
	if c.AckWait == 0 {
		c.AckWait = 30 * time.Second
	}
	if c.MaxAckPending == 0 {
		c.MaxAckPending = 1024
	}
	if c.Prefetch == 0 {
		c.Prefetch = 256
	}
	if c.PullExpiry == 0 {
		c.PullExpiry = 5 * time.Second
	}
	if c.Prefetch > c.MaxAckPending {
		c.Prefetch = c.MaxAckPending
	}
	if c.NakDelay == nil {
		c.NakDelay = ExponentialBackoff(250*time.Millisecond, 30*time.Second)
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.SetUpWait == 0 {
		c.SetUpWait = time.Minute
	}
}

// ExponentialBackoff doubles from first to at most max with each delivery.
func ExponentialBackoff(first, max time.Duration) func(uint64) time.Duration {
	return func(deliveries uint64) time.Duration {
		d := first
		for i := uint64(1); i < deliveries && d < max; i++ {
			d *= 2
		}
		return min(d, max)
	}
}

// Subscriber consumes JetStream topics as watermill messages through a
// durable pull consumer. It hands a message to its output channel without
// waiting for the previous one to be acknowledged (in flight bounded by
// MaxAckPending), acknowledges each when the handler acks it, and redelivers
// it with backoff when the handler nacks it. Safe for concurrent use.
type Subscriber struct {
	cfg     SubscriberConfig
	js      jetstream.JetStream
	prov    *provisioner
	closing chan struct{}
	once    sync.Once
	loops   sync.WaitGroup // consume loops
	msgs    sync.WaitGroup // messages handed out and not yet settled
	held    atomic.Int64   // ... counted

	mu    sync.Mutex
	acked []*atomic.Pointer[string] // per consumer: the reply subject of its last acknowledged message
}

var (
	_ message.Subscriber           = (*Subscriber)(nil)
	_ message.SubscribeInitializer = (*Subscriber)(nil)
)

// NewSubscriber builds a subscriber on an open connection.
func NewSubscriber(cfg SubscriberConfig) (*Subscriber, error) {
	if cfg.Conn == nil {
		return nil, errors.New("natsjs: subscriber needs a connection")
	}
	cfg.setDefaults()
	js, err := jetstream.New(cfg.Conn)
	if err != nil {
		return nil, fmt.Errorf("natsjs: jetstream: %w", err)
	}
	return &Subscriber{cfg: cfg, js: js, prov: newProvisioner(js, cfg.Stream), closing: make(chan struct{})}, nil
}

// SubscribeInitialize creates the topic's stream.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := s.prov.ensure(ctx, topic)
	return err
}

// Held counts the messages handed out and not yet settled (acknowledged,
// handed back or terminated): set against its consumers' count of
// messages delivered and not acknowledged, it tells those that are
// elsewhere (lost on their way, held by a process that ended), which the
// server delivers again after AckWait. Messages the client has prefetched
// and not handed out yet are not counted.
func (s *Subscriber) Held() int64 { return s.held.Load() }

// Durable is the consumer name used for topic.
func (s *Subscriber) Durable(topic string) string {
	if s.cfg.ConsumerGroup != "" {
		return SafeName(s.cfg.ConsumerGroup)
	}
	return SafeName("wm_" + topic)
}

// Subscribe starts consuming topic. The channel closes when ctx is done or
// the subscriber is closed; messages' contexts carry ctx's values and are
// cancelled when the message is settled or the subscriber closes.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	select {
	case <-s.closing:
		return nil, ErrClosed
	default:
	}
	setUp, cancel := context.WithTimeout(ctx, s.cfg.SetUpWait)
	defer cancel()
	var stream string
	if err := UntilAnswered(setUp, func(ctx context.Context) (err error) {
		stream, err = s.prov.ensure(ctx, topic)
		return err
	}, nil); err != nil {
		return nil, err
	}
	var cons jetstream.Consumer
	err := UntilAnswered(setUp, func(ctx context.Context) (err error) {
		cons, err = s.js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
			Durable:       s.Durable(topic),
			FilterSubject: topic,
			AckPolicy:     jetstream.AckExplicitPolicy,
			AckWait:       s.cfg.AckWait,
			MaxAckPending: s.cfg.MaxAckPending,
			MaxDeliver:    -1,
			DeliverPolicy: jetstream.DeliverAllPolicy,
		})
		return err
	}, nil)
	if err != nil {
		return nil, fmt.Errorf("natsjs: consumer %s on %s: %w", s.Durable(topic), topic, err)
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(s.cfg.Prefetch), jetstream.PullExpiry(s.cfg.PullExpiry))
	if err != nil {
		return nil, fmt.Errorf("natsjs: consume %s: %w", topic, err)
	}
	out := make(chan *message.Message)
	acked := new(atomic.Pointer[string])
	s.mu.Lock()
	s.acked = append(s.acked, acked)
	s.mu.Unlock()
	s.loops.Add(1)
	stop := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
		case <-s.closing:
		case <-stop:
		}
		// Drain: buffered messages still come out of Next, to be handed
		// back at once. Draining needs the server; without it (or if it
		// stalls) stop outright: the server redelivers after AckWait.
		if !s.cfg.Conn.IsConnected() {
			it.Stop()
			return
		}
		it.Drain()
		select {
		case <-stop:
		case <-time.After(2 * time.Second):
			it.Stop()
		}
	}()
	go func() {
		defer s.loops.Done()
		defer close(out)
		defer close(stop)
		s.consume(ctx, topic, it, out, acked)
	}()
	return out, nil
}

func (s *Subscriber) consume(ctx context.Context, topic string, it jetstream.MessagesContext, out chan<- *message.Message, acked *atomic.Pointer[string]) {
	for {
		jm, err := it.Next()
		if errors.Is(err, jetstream.ErrMsgIteratorClosed) {
			return
		}
		if err != nil {
			s.cfg.Logger.Error("natsjs: next message", err, watermill.LogFields{"topic": topic})
			continue // the iterator re-issues pulls after heartbeat or connection errors
		}
		if ctx.Err() != nil || s.isClosing() {
			handBack(jm, HandBackDelay)
			continue
		}
		wm := fromNats(jm)
		mctx, cancel := context.WithCancel(ctx)
		wm.SetContext(mctx)
		select {
		case out <- wm:
			s.msgs.Add(1)
			s.held.Add(1)
			go s.settle(jm, wm, cancel, acked)
		case <-ctx.Done():
			cancel()
			handBack(jm, HandBackDelay)
		case <-s.closing:
			cancel()
			handBack(jm, HandBackDelay)
		}
	}
}

func (s *Subscriber) isClosing() bool {
	select {
	case <-s.closing:
		return true
	default:
		return false
	}
}

// settle waits for the handler's verdict and passes it to JetStream,
// keeping the message alive meanwhile; an acknowledged message's reply
// subject goes to acked.
func (s *Subscriber) settle(jm jetstream.Msg, wm *message.Message, cancel context.CancelFunc, acked *atomic.Pointer[string]) {
	defer s.msgs.Done()
	defer s.held.Add(-1)
	defer cancel()
	keepAlive := time.NewTicker(s.cfg.AckWait / 2)
	defer keepAlive.Stop()
	for {
		select {
		case <-wm.Acked():
			ack(jm, acked)
			return
		case <-wm.Nacked():
			n, _ := strconv.ParseUint(wm.Metadata.Get(MetaDeliveries), 10, 64)
			handBack(jm, s.cfg.NakDelay(n))
			return
		case <-keepAlive.C:
			_ = jm.InProgress()
		case <-s.closing:
			// A verdict that came with the close counts: select picks at
			// random among ready cases, and an acknowledged message handed
			// back would be handled twice.
			select {
			case <-wm.Acked():
				ack(jm, acked)
			case <-wm.Nacked():
				n, _ := strconv.ParseUint(wm.Metadata.Get(MetaDeliveries), 10, 64)
				handBack(jm, s.cfg.NakDelay(n))
			default:
				handBack(jm, HandBackDelay)
			}
			return
		}
	}
}

func ack(jm jetstream.Msg, acked *atomic.Pointer[string]) {
	if jm.Ack() == nil {
		reply := jm.Reply()
		acked.Store(&reply)
	}
}

// HandBackDelay is how soon a message handed back by a subscriber that
// stops is redelivered.
const HandBackDelay = 100 * time.Millisecond

// handBack gives jm back for redelivery after delay, always as a Nak with
// a delay. A plain Nak only queues the message for redelivery in the
// server's memory, while the consumer's stored state still has it
// delivered at its last delivery (or InProgress): when the server stops
// right after, as the embedded one does with its process, the restarted
// server waits out AckWait (30 s) before redelivering it. A Nak with a
// delay is stored, as delivered AckWait - delay ago, so a restarted server
// redelivers it at once. The delay also gives a stopping subscriber time
// to withdraw its pull requests, so that the message does not bounce back
// to it.
func handBack(jm jetstream.Msg, delay time.Duration) {
	_ = jm.NakWithDelay(max(delay, time.Nanosecond)) // nats.go sends a plain Nak for 0
}

func fromNats(jm jetstream.Msg) *message.Message {
	h := jm.Headers()
	uuid := h.Get(HeaderUUID)
	if uuid == "" {
		uuid = watermill.NewUUID()
	}
	wm := message.NewMessage(uuid, jm.Data())
	for k, v := range h {
		if k != HeaderUUID && len(v) > 0 {
			wm.Metadata.Set(k, v[0])
		}
	}
	wm.Metadata.Set(MetaSubject, jm.Subject())
	if md, err := jm.Metadata(); err == nil {
		wm.Metadata.Set(MetaDeliveries, strconv.FormatUint(md.NumDelivered, 10))
		wm.Metadata.Set(MetaStreamSeq, strconv.FormatUint(md.Sequence.Stream, 10))
		wm.Metadata.Set(MetaStored, strconv.FormatInt(md.Timestamp.UnixNano(), 10))
	}
	return wm
}

// Stored is when the stream stored a received message (MetaStored), zero
// when not known.
func Stored(m *message.Message) time.Time {
	ns, err := strconv.ParseInt(m.Metadata.Get(MetaStored), 10, 64)
	if err != nil {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

// StreamSeq is a received message's stream sequence (MetaStreamSeq), 0
// when it has none.
func StreamSeq(m *message.Message) uint64 {
	seq, _ := strconv.ParseUint(m.Metadata.Get(MetaStreamSeq), 10, 64)
	return seq
}

// awaitAcks waits until the server has handled every acknowledgement and
// hand-back sent so far. A consumer's are queued on the server and handled
// on its own goroutine, in order, and a server that stops drops what is
// still queued: acknowledgements sent just before a stop were sometimes
// lost, their messages coming again after the restart (in 4 runs of
// TestAcksOutliveTheServer in 120, three at once on two cores). A request
// on the reply subject of each consumer's last acknowledged message, as
// an "in progress" (+WPI, which changes nothing for a message no longer
// pending), is answered once the queue up to it is handled.
func (s *Subscriber) awaitAcks() {
	s.mu.Lock()
	acked := slices.Clone(s.acked)
	s.mu.Unlock()
	for _, a := range acked {
		if reply := a.Load(); reply != nil {
			_, _ = s.cfg.Conn.Request(*reply, []byte("+WPI"), 2*time.Second)
		}
	}
}

// Close stops every subscription, hands unsettled messages back to the
// server for redelivery, and returns once all output channels are closed.
func (s *Subscriber) Close() error {
	s.once.Do(func() {
		close(s.closing)
		s.loops.Wait()
		s.msgs.Wait()
		if s.cfg.Conn.IsConnected() {
			_ = s.cfg.Conn.FlushTimeout(2 * time.Second) // push out the last acks and naks
			s.awaitAcks()
		}
		if s.cfg.CloseConn {
			s.cfg.Conn.Close()
		}
	})
	return nil
}
