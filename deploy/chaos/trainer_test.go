package main

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/pipeline"
)

// The rehearsal stops the run only once the archive's consumers have run
// dry: a message not yet delivered to it, or delivered and not
// acknowledged (an update waiting for its anchor groups' code), is not;
// another stage's backlog does not count.
func TestTheArchiveIsDryOnceItsConsumersHaveNothingLeft(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	tr, err := dialRun(ctx, srv.URL(), "rehearse", "r")
	if err != nil {
		t.Fatal(err)
	}
	defer tr.close()
	if tr.archiveDrained(ctx) {
		t.Fatal("dry before the stream exists")
	}
	stream, err := tr.js.CreateStream(ctx, jetstream.StreamConfig{Name: streamName("rehearse"), Subjects: []string{"rehearse.>"}})
	if err != nil {
		t.Fatal(err)
	}
	consumer := func(stage string) jetstream.Consumer {
		c, err := stream.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: stage + "_r_update", FilterSubject: "rehearse.r.update", AckPolicy: jetstream.AckExplicitPolicy})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
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
	batch, err := archive.Fetch(1)
	if err != nil {
		t.Fatal(err)
	}
	msg := <-batch.Messages()
	if msg == nil {
		t.Fatal("no message fetched")
	}
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
