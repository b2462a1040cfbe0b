package natsjs

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// A checkpoint is read back as saved, from a server restarted on the same
// store, and a missing key is no error; a value the server refuses names
// its key and size.
func TestStateStoreSurvivesARestart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	open := func() (*Server, *StateStore) {
		t.Helper()
		srv, err := StartServer(ctx, ServerConfig{StoreDir: dir})
		if err != nil {
			t.Fatal(err)
		}
		nc, err := srv.Connect("state-test")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		st, err := OpenStateStore(ctx, js, "TEST_STATE", 1)
		if err != nil {
			t.Fatal(err)
		}
		return srv, st
	}
	type doc struct {
		Seq   uint64    `json:"seq"`
		Pairs []float64 `json:"pairs"`
	}
	srv, st := open()
	var got doc
	if ok, err := st.Load(ctx, "run.calibrate", &got); ok || err != nil {
		t.Fatalf("empty bucket: ok %v, err %v", ok, err)
	}
	for _, d := range []doc{{Seq: 7, Pairs: []float64{0.1, 0.25}}, {Seq: 9, Pairs: []float64{0.5}}} {
		if err := st.Save(ctx, "run.calibrate", d); err != nil {
			t.Fatal(err)
		}
	}
	srv.Shutdown()

	_, st = open()
	ok, err := st.Load(ctx, "run.calibrate", &got)
	if !ok || err != nil || got.Seq != 9 || len(got.Pairs) != 1 || got.Pairs[0] != 0.5 {
		t.Fatalf("after a restart: ok %v, err %v, %+v; want the newest value {9 [0.5]}", ok, err, got)
	}
	err = st.Save(ctx, "run.fuse", doc{Pairs: make([]float64, 4_500_000)}) // 9 MB of "0,": past the embedded server's 8 MB payload limit
	if err == nil || !strings.Contains(err.Error(), "run.fuse") || !strings.Contains(err.Error(), "bytes") {
		t.Errorf("an oversized value gives %v; want an error naming the key and its size", err)
	}
}
