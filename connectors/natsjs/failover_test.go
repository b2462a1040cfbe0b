package natsjs

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
)

// replicatedStream starts a three-node cluster in this process and makes
// a stream name on subjects on all three servers; everything stops when the
// test ends.
func replicatedStream(t *testing.T, name, subjects string) ([]*natstest.Node, string, jetstream.JetStream, context.Context) {
	t.Helper()
	nodes, urls := natstest.Start(t, natstest.Options(t, strings.ToLower(name), 3))
	nc, err := nats.Connect(urls, nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subjects},
		Storage: jetstream.FileStorage, Replicas: 3, Duplicates: 10 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	return nodes, urls, js, ctx
}

// A stream replicated on three servers loses its leader while a publisher
// sends batch after batch. Every Publish must still return nil, and the
// stream must hold every message exactly once: the messages the old leader
// never acknowledged are sent again to the new one, and their Msg-Ids keep
// the ones it did store from being stored twice. Without the retries, the
// batch in flight fails ("server is disconnected").
func TestPublishSurvivesTheLossOfTheStreamLeader(t *testing.T) {
	nodes, urls, js, ctx := replicatedStream(t, "FAILOVER", "fo.>")
	// The publisher is connected to the leader, so that its loss also
	// cuts the publisher's connection: the PubAcks it awaits are lost.
	leader := natstest.Named(t, nodes, natstest.StreamLeader(t, js, "FAILOVER"))
	pubConn, err := nats.Connect(fmt.Sprintf("nats://127.0.0.1:%d,%s", leader.Opts.Port, urls), nats.DontRandomize(), nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	pub, err := NewPublisher(PublisherConfig{Conn: pubConn, CloseConn: true, AckTimeout: 2 * time.Minute, AttemptTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()

	const batches, size = 60, 200
	stopAt := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		for b := range batches {
			if b == batches/3 {
				close(stopAt)
			}
			msgs := make([]*message.Message, size)
			for i := range msgs {
				m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf("%d/%d", b, i)))
				m.Metadata.Set(HeaderMsgID, fmt.Sprintf("m-%d-%d", b, i))
				msgs[i] = m
			}
			if err := pub.Publish("fo.data", msgs...); err != nil {
				done <- fmt.Errorf("batch %d: %w", b, err)
				return
			}
		}
		done <- nil
	}()
	<-stopAt
	leader.Stop()
	if err := <-done; err != nil {
		t.Fatalf("publishing across the loss of %s: %v", leader.Name(), err)
	}

	seen := map[string]int{}
	if err := Scan(ctx, js, "FAILOVER", "fo.data", false, func(r Record) error {
		seen[string(r.Data)]++
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var missing, twice []string
	for b := range batches {
		for i := range size {
			switch k := fmt.Sprintf("%d/%d", b, i); seen[k] {
			case 0:
				missing = append(missing, k)
			case 1:
			default:
				twice = append(twice, k)
			}
		}
	}
	if len(missing) > 0 || len(twice) > 0 || len(seen) != batches*size {
		t.Fatalf("after the loss of %s: %d messages missing (%v), %d stored twice (%v), %d distinct stored of %d",
			leader.Name(), len(missing), head(missing), len(twice), head(twice), len(seen), batches*size)
	}
}

func head(s []string) []string { return s[:min(len(s), 5)] }

// Without a stream for the subject there is nothing to wait for: the
// error says so at once instead of after AckTimeout's retries.
func TestPublishWithoutAStreamSaysSo(t *testing.T) {
	srv := startServer(t)
	pub, err := NewPublisher(PublisherConfig{Conn: connect(t, srv), CloseConn: true, AckTimeout: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	err = pub.Publish("nowhere.data", message.NewMessage(watermill.NewUUID(), []byte("x")))
	if err == nil || !strings.Contains(err.Error(), "no stream takes the subject") {
		t.Fatalf("publish to a subject without a stream: %v", err)
	}
}

// A Reader's ordered consumer lives on one server. When that server goes,
// the Reader goes on after the last message it returned: every message of
// the subject comes out once, in stream order.
func TestReaderFollowsAcrossTheLossOfItsServer(t *testing.T) {
	nodes, urls, js, ctx := replicatedStream(t, "FOLLOW", "fl.>")
	nc, err := nats.Connect(urls, nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	const total = 3000
	pub, err := NewPublisher(PublisherConfig{Conn: nc, AckTimeout: 2 * time.Minute, AttemptTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	publish := func(from, to int) {
		t.Helper()
		for i := from; i < to; i++ {
			m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))
			m.Metadata.Set(HeaderMsgID, fmt.Sprint(i))
			if err := pub.Publish("fl.data", m); err != nil {
				t.Fatal(err)
			}
		}
	}
	publish(0, total/2)
	r, err := NewReader(ctx, js, "FOLLOW", "fl.data", false)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var retries []string
	r.OnRetry = func(err error) { retries = append(retries, err.Error()) }
	next := func(want int) {
		t.Helper()
		rec, err := r.Next(ctx)
		if err != nil {
			t.Fatalf("message %d: %v (retries: %v)", want, err, retries)
		}
		if string(rec.Data) != fmt.Sprint(want) {
			t.Fatalf("message %d: read %q (stream seq %d)", want, rec.Data, rec.Seq)
		}
	}
	for i := range total / 4 {
		next(i)
	}
	// The server that holds the reader's consumer.
	var host string
	s, _ := js.Stream(ctx, "FOLLOW")
	for name := range s.ListConsumers(ctx).Info() {
		host = name.Cluster.Leader
	}
	for _, n := range nodes {
		if n.Name() == host {
			n.Stop()
		}
	}
	if host == "" {
		t.Fatal("the reader's consumer has no server")
	}
	publish(total/2, total)
	for i := total / 4; i < total; i++ {
		next(i)
	}
	t.Logf("lost %s; retries: %d %v", host, len(retries), retries)
	// Next ends with its context, even while the reader waits.
	short, cancelShort := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancelShort()
	if _, err := r.Next(short); err == nil {
		t.Fatal("Next returned a message past the end")
	}
}

// What a publisher sends again: errors of a message that may not have
// reached a stream leader; never the stream's verdict on the message.
func TestPublishRetriesOnlyWhatSendingAgainCanFix(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{jetstream.ErrAsyncPublishTimeout, true},
		{fmt.Errorf("wrapped: %w", jetstream.ErrNoStreamResponse), true},
		{nats.ErrDisconnected, true},
		{&jetstream.APIError{Code: 409, ErrorCode: 10158, Description: "duplicate message id is in process"}, true},
		{&jetstream.APIError{Code: 404, ErrorCode: 10059, Description: "stream not found"}, false},
		{&jetstream.APIError{Code: 400, ErrorCode: 10054, Description: "maximum payload exceeded"}, false},
		{nats.ErrMaxPayload, false},
		{nats.ErrConnectionClosed, false},
	} {
		if got := retryable(tc.err); got != tc.want {
			t.Errorf("retryable(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

// A reader whose consumer is lost and cannot be made again at once (here:
// its stream is gone for a while) tells OnRetry why, tries again, and goes
// on after the last message it returned once it can: the messages that
// stream sequence numbers up to it are not read twice.
func TestReaderRetriesUntilItsConsumerCanBeMadeAgain(t *testing.T) {
	srv := startServer(t)
	nc := connect(t, srv)
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := jetstream.StreamConfig{Name: "GONE", Subjects: []string{"gone.>"}}
	publish := func(from, to int) {
		t.Helper()
		for i := from; i < to; i++ {
			if _, err := js.Publish(ctx, "gone.data", []byte(fmt.Sprint(i))); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := js.CreateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	publish(0, 5)
	r, err := NewReader(ctx, js, "GONE", "gone.data", false)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	retried := make(chan error, 100)
	r.OnRetry = func(err error) { retried <- err }
	for i := range 5 {
		if rec, err := r.Next(ctx); err != nil || string(rec.Data) != fmt.Sprint(i) {
			t.Fatalf("message %d: %q, %v", i, rec.Data, err)
		}
	}
	if err := js.DeleteStream(ctx, "GONE"); err != nil {
		t.Fatal(err)
	}
	go func() {
		// Back once the reader has failed twice; the new stream numbers
		// its messages from 1 again, so the first 5 are behind the reader.
		for range 2 {
			<-retried
		}
		if _, err := js.CreateStream(ctx, cfg); err == nil {
			publish(0, 8)
		}
	}()
	rec, err := r.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Seq != 6 || string(rec.Data) != "5" {
		t.Fatalf("after the stream came back: seq %d %q, want seq 6, the first after the last read", rec.Seq, rec.Data)
	}
}

// A subscriber and a reader started while the cluster has just lost the
// server that makes their consumers (the JetStream meta leader) wait for
// the next one instead of failing or hanging: a stage process starting as
// a server goes down starts all the same. Without the retries the
// subscriber's request went unanswered until the test's deadline.
func TestSubscribeWaitsForTheClustersNextMetaLeader(t *testing.T) {
	nodes, _, js, ctx := replicatedStream(t, "METALOSS", "ml.>")
	if _, err := js.Publish(ctx, "ml.a", []byte("x")); err != nil {
		t.Fatal(err)
	}
	leader := natstest.MetaLeader(t, nodes)
	var urls []string
	for _, n := range nodes {
		if n != leader {
			urls = append(urls, fmt.Sprintf("nats://127.0.0.1:%d", n.Opts.Port))
		}
	}
	nc, err := nats.Connect(strings.Join(urls, ","), nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	sub, err := NewSubscriber(SubscriberConfig{Conn: nc, Stream: func(string) jetstream.StreamConfig {
		return jetstream.StreamConfig{Name: "METALOSS", Subjects: []string{"ml.>"}, Storage: jetstream.FileStorage, Replicas: 3, Duplicates: 10 * time.Minute}
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	js2, _ := jetstream.New(nc)
	leader.Stop()
	read := make(chan error, 1)
	go func() {
		r, err := NewReader(ctx, js2, "METALOSS", "ml.a", false)
		if err == nil {
			var rec Record
			if rec, err = r.Next(ctx); err == nil && string(rec.Data) != "x" {
				err = fmt.Errorf("read %q, want the stored x", rec.Data)
			}
			r.Close()
		}
		read <- err
	}()
	msgs, err := sub.Subscribe(ctx, "ml.a")
	if err != nil {
		t.Fatalf("subscribe just after the meta leader's loss: %v", err)
	}
	if err := <-read; err != nil {
		t.Fatalf("a reader opened just after the meta leader's loss: %v", err)
	}
	select {
	case m := <-msgs:
		m.Ack()
		if string(m.Payload) != "x" {
			t.Fatalf("got %q, want the stored x", m.Payload)
		}
	case <-ctx.Done():
		t.Fatal("no message after the meta leader's loss")
	}
}

// A scan's consumer may be placed on any replica of the stream, and one
// just restarted holds only what it has caught up with: the consumer
// reports nothing pending there, and scans placed on it read nothing (4 of
// 40, of 20,000 messages, before). Every scan reads every message: it
// reads until the newest message the stream's leader holds.
func TestAScanOnAReplicaCatchingUpReadsEverything(t *testing.T) {
	nodes, _, js, ctx := replicatedStream(t, "CATCHUP", "cu.>")
	leader := natstest.StreamLeader(t, js, "CATCHUP")
	var behind *natstest.Node
	for _, n := range nodes {
		if n.Name() != leader {
			behind = n
		}
	}
	behind.Stop()
	const n = 10000
	for i := range n {
		if _, err := js.PublishAsync("cu.x", fmt.Appendf(nil, "%d", i)); err != nil {
			t.Fatal(err)
		}
		if i%1000 == 999 { // no more in flight than the library takes (4,000), on a loaded machine too
			<-js.PublishAsyncComplete()
		}
	}
	behind.Start(t)
	const scans = 30
	var short []int
	for range scans {
		got := 0
		if err := Scan(ctx, js, "CATCHUP", "cu.x", true, func(Record) error { got++; return nil }); err != nil {
			t.Fatal(err)
		}
		if got != n {
			short = append(short, got)
		}
	}
	if len(short) > 0 {
		t.Fatalf("%d of %d scans read short of the %d messages: %v", len(short), scans, n, short)
	}
}
