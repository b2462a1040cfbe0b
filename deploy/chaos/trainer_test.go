package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/schemas"
)

// The rehearsal stops the run only once the archive's consumers have run
// dry: a message not yet delivered to it, or delivered and not
// acknowledged (an update waiting for its anchor groups' code), is not;
// another stage's backlog does not count.
func TestTheArchiveIsDryOnceItsConsumersHaveNothingLeft(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, tr := rehearsalServer(t, ctx)
	if tr.archiveDrained(ctx) {
		t.Fatal("dry before the stream exists")
	}
	durable := rehearsalStream(t, ctx, tr)
	consumer := func(stage string) jetstream.Consumer { return durable(stage+"_r_update", "rehearse.r.update") }
	if tr.archiveDrained(ctx) {
		t.Fatal("dry before the archive has a consumer")
	}
	archive := consumer(pipeline.StageArchive)
	consumer(pipeline.StageFuse) // keeps its message: not the archive's
	if !tr.archiveDrained(ctx) {
		t.Fatal("an empty archive consumer is not dry")
	}
	if _, err := tr.js.Publish(ctx, "rehearse.r.update", []byte("{}")); err != nil {
		t.Fatal(err)
	}
	if tr.archiveDrained(ctx) {
		t.Fatal("dry with an update not yet delivered")
	}
	msg := fetchOne(t, archive)
	if tr.archiveDrained(ctx) {
		t.Fatal("dry with an update delivered and not acknowledged")
	}
	if err := msg.DoubleAck(ctx); err != nil {
		t.Fatal(err)
	}
	if !tr.archiveDrained(ctx) {
		t.Fatal("not dry once the update is acknowledged (fuse's own backlog is not the archive's)")
	}
}

// The trainer posts through the gateways in turn, and tries the next on a
// refused connection or a 5xx; a request a gateway refuses (a 4xx) ends
// it, as a pipeline that refuses a good request must not pass.
func TestTheTrainerTriesTheNextGateway(t *testing.T) {
	var mu sync.Mutex
	var got []string
	unavailable := true
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		defer mu.Unlock()
		got = append(got, r.URL.Path+" "+string(b))
		switch {
		case strings.HasSuffix(r.URL.Path, "/bad"):
			http.Error(w, "trajectory 0: missing field(s): traj_id", http.StatusBadRequest)
		case unavailable:
			unavailable = false
			http.Error(w, "the NATS connection is reconnecting", http.StatusServiceUnavailable)
		default:
			w.WriteHeader(http.StatusAccepted)
		}
	}))
	defer up.Close()
	down := httptest.NewServer(http.NotFoundHandler())
	down.Close() // its port refuses connections now
	g := newGateways([]string{down.URL, up.URL}, "r")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := g.postStep(ctx, 3, []schemas.Trajectory{{TrajID: "a"}}, 1); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	if len(got) != 3 || got[0] != got[1] || !strings.HasPrefix(got[0], "/v1/runs/r/trajectories [") || got[2] != `/v1/runs/r/steps/3/close {"groups": 1}` {
		t.Errorf("the live gateway was asked %q; want the trajectories twice (a 503, then taken), then the close", got)
	}
	mu.Unlock()
	if err := g.post(ctx, "/bad", []byte("{}")); err == nil || !strings.Contains(err.Error(), "400 Bad Request: trajectory 0: missing field(s): traj_id") {
		t.Errorf("a request refused: %v; want the gateway's reason", err)
	}
}

// When every gateway fails, the trainer waits as long as the first of
// them asked in its Retry-After (a full store asks 10 s) before it goes
// round again, and 100 ms when none said: asking a full store ten times
// a second only loads the gateways.
func TestTheTrainerWaitsAsLongAsTheGatewaysAsk(t *testing.T) {
	var mu sync.Mutex
	refusals := []string{"10", "3", "", "1"} // a full store, an election, nothing said, ...
	asked := 0
	gateway := func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		if asked == len(refusals) {
			w.WriteHeader(http.StatusAccepted)
			return
		}
		if after := refusals[asked]; after != "" {
			w.Header().Set("Retry-After", after)
		}
		asked++
		http.Error(w, "no room", http.StatusServiceUnavailable)
	}
	a := httptest.NewServer(http.HandlerFunc(gateway))
	defer a.Close()
	b := httptest.NewServer(http.HandlerFunc(gateway))
	defer b.Close()
	g := newGateways([]string{a.URL, b.URL}, "r")
	var waited []time.Duration
	g.sleep = func(_ context.Context, d time.Duration) error { waited = append(waited, d); return nil }
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := g.post(ctx, "/trajectories", []byte("[]")); err != nil {
		t.Fatal(err)
	}
	// Rounds of two: (10, 3) waits 3 s, then ("", 1) waits 1 s.
	if want := []time.Duration{3 * time.Second, time.Second}; !slices.Equal(waited, want) {
		t.Errorf("the trainer waited %v between its rounds; want %v", waited, want)
	}
	waited = nil
	mu.Lock()
	refusals, asked = []string{"", ""}, 0
	mu.Unlock()
	if err := g.post(ctx, "/trajectories", []byte("[]")); err != nil {
		t.Fatal(err)
	}
	if want := []time.Duration{100 * time.Millisecond}; !slices.Equal(waited, want) {
		t.Errorf("with no Retry-After, the trainer waited %v; want %v", waited, want)
	}
}

// rehearsalStream makes the stream of prefix rehearse, and returns a
// maker of its durable consumers (by name, of a subject).
func rehearsalStream(t *testing.T, ctx context.Context, tr *runConn) func(name, subject string) jetstream.Consumer {
	t.Helper()
	stream, err := tr.js.CreateStream(ctx, jetstream.StreamConfig{Name: streamName("rehearse"), Subjects: []string{"rehearse.>"}})
	if err != nil {
		t.Fatal(err)
	}
	return func(name, subject string) jetstream.Consumer {
		t.Helper()
		c, err := stream.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: name, FilterSubject: subject, AckPolicy: jetstream.AckExplicitPolicy})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
}

// fetchOne is c's next message, delivered and not acknowledged.
func fetchOne(t *testing.T, c jetstream.Consumer) jetstream.Msg {
	t.Helper()
	batch, err := c.Fetch(1)
	if err != nil {
		t.Fatal(err)
	}
	msg := <-batch.Messages()
	if msg == nil {
		t.Fatal("no message fetched")
	}
	return msg
}

// rehearsalServer is an embedded server and a connection to run r of
// prefix rehearse on it, closed when the test ends.
func rehearsalServer(t *testing.T, ctx context.Context) (*natsjs.Server, *runConn) {
	t.Helper()
	srv, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	tr, err := dialRun(ctx, srv.URL(), "rehearse", "r")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(tr.close)
	return srv, tr
}

// The trainer waits out a full store, as the rehearsal's store-full fault
// makes one, rather than end at the first refusal (the rehearsal restarts
// a trainer that ends, and gives up on one that keeps ending at once); its
// messages, sent again, are stored once.
func TestTheTrainerWaitsOutAFullStore(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv, tr := rehearsalServer(t, ctx)
	stream, err := tr.js.CreateStream(ctx, jetstream.StreamConfig{Name: streamName("rehearse"), Subjects: []string{"rehearse.>"}, Duplicates: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	pub, err := natsjs.NewPublisher(natsjs.PublisherConfig{Conn: tr.nc})
	if err != nil {
		t.Fatal(err)
	}
	var msgs []*message.Message
	for i := range 3 {
		m, err := schemas.NewMessage(fmt.Sprintf("r/%d", i), map[string]int{"i": i})
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, m)
	}
	// One stored before the store fills: sent again, it stays one.
	if err := pub.Publish("rehearse.r.traj", msgs[0]); err != nil {
		t.Fatal(err)
	}
	if err := srv.LimitAccountStore(1); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- publish(ctx, pub, "rehearse.r.traj", msgs...) }()
	select {
	case err := <-done:
		t.Fatalf("the trainer's publish to a full store returned %v; want it to wait", err)
	case <-time.After(1500 * time.Millisecond):
	}
	if err := srv.LimitAccountStore(-1); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("once there was room: %v", err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 3 {
		t.Errorf("the stream holds %d messages; want the 3 sent, each once", info.State.Msgs)
	}
}
