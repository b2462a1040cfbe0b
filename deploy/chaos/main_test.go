package main

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// Options that do not go together are refused, naming what to give,
// before anything is built or started.
func TestOptionsThatDoNotGoTogetherAreRefused(t *testing.T) {
	for _, tc := range []struct {
		o    options
		want string // "" for none
	}{
		{options{cluster: 1}, ""},
		{options{cluster: 1, oneProcess: true}, ""},
		{options{cluster: 3, natsServer: "nats-server"}, ""},
		{options{cluster: 1, nats: "nats://a", natsServer: "nats-server"}, "--nats and --nats-server: give one"},
		{options{cluster: 0}, "--cluster 0: want 1 to 5 nodes"},
		{options{cluster: 3}, "--cluster 3 needs --nats-server"},
		{options{cluster: 1, oneProcess: true, nats: "nats://a"}, "--one-process runs the server in the wmrl process it kills"},
		{options{cluster: 1, oneProcess: true, natsServer: "nats-server"}, "--one-process runs the server in the wmrl process it kills"},
		{options{cluster: 1, oneProcess: true, archiveApart: true}, "--archive-apart needs two"},
	} {
		err := tc.o.validate()
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%+v refused: %v", tc.o, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%+v: %v, want %q", tc.o, err, tc.want)
		}
	}
}

// With --one-process the run's server stops with it; what it stored is
// read back from its store in --dir by a server of the rehearsal's own.
func TestTheStoreOfAStoppedRunIsReadForTheCheck(t *testing.T) {
	ctx := context.Background()
	o := options{dir: t.TempDir(), prefix: "wmrlchaos", run: "r"}
	run, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: filepath.Join(o.dir, "nats")})
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(run.URL())
	if err != nil {
		t.Fatal(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: streamName(o.prefix), Subjects: []string{o.prefix + ".>"}}); err != nil {
		t.Fatal(err)
	}
	subject := o.prefix + "." + o.run + "." + string(schemas.KindUpdate)
	for step := range 3 {
		if _, err := js.Publish(ctx, subject, fmt.Appendf(nil, `{"step":%d}`, step)); err != nil {
			t.Fatal(err)
		}
	}
	nc.Close()
	run.Shutdown()

	srv, conn, err := openStore(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	defer conn.close()
	if n, err := conn.count(ctx, schemas.KindUpdate); err != nil || n != 3 {
		t.Errorf("the stopped run's store read back: %d updates (%v), want the 3 it stored", n, err)
	}
	if step, ok, err := conn.lastStep(ctx, schemas.KindUpdate); err != nil || !ok || step != 2 {
		t.Errorf("the newest update read back: step %d (%v, %v), want 2", step, ok, err)
	}
}
