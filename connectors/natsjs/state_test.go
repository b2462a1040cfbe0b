package natsjs

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
)

// A checkpoint is read back as saved, from a server restarted on the same
// store, and a missing key is no error; a value the server refuses names
// its key and size.
func TestStateStoreSurvivesARestart(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	open := func() (*Server, *StateStore) {
		t.Helper()
		srv, err := StartServer(ctx, ServerConfig{StoreDir: dir})
		if err != nil {
			t.Fatal(err)
		}
		st, err := OpenStore(ctx, jsOn(t, srv, "state-test"), StoreConfig{Bucket: "TEST_STATE", Replicas: 1})
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

// A checkpoint bucket whose server is down for a moment (here the one
// server of a one-replica bucket; in a fresh cluster, a bucket whose
// replicas have not started answering yet) answers "no responders": Load
// and Save wait for it, up to their context, instead of failing the
// stage that asked.
func TestStateStoreWaitsForItsBucketsServer(t *testing.T) {
	t.Parallel()
	nodes, urls := natstest.Start(t, natstest.Options(t, "state", 3))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	setup, err := nats.Connect(urls)
	if err != nil {
		t.Fatal(err)
	}
	defer setup.Close()
	sjs, _ := jetstream.New(setup)
	if _, err := OpenStore(ctx, sjs, StoreConfig{Bucket: "WAIT_STATE", Replicas: 1}); err != nil {
		t.Fatal(err)
	}
	holder := natstest.Named(t, nodes, natstest.StreamLeader(t, sjs, "KV_WAIT_STATE"))
	var other *natstest.Node
	for _, n := range nodes {
		if n != holder {
			other = n
		}
	}
	nc, err := nats.Connect(fmt.Sprintf("nats://127.0.0.1:%d", other.Opts.Port), nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	st, err := OpenStore(ctx, js, StoreConfig{Bucket: "WAIT_STATE", Replicas: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Save(ctx, "run.fuse", map[string]int{"seq": 3}); err != nil {
		t.Fatal(err)
	}

	// outage stops the holder and starts it again 2 s later; the channel
	// closes once it is back.
	outage := func() <-chan struct{} {
		holder.Stop()
		back := make(chan struct{})
		go func() {
			defer close(back)
			time.Sleep(2 * time.Second)
			holder.Start(t)
		}()
		return back
	}
	back := outage()
	var got map[string]int
	ok, err := st.Load(ctx, "run.fuse", &got)
	if !ok || err != nil || got["seq"] != 3 {
		t.Fatalf("load while the bucket's server was down: ok %v, err %v, %v; want {seq: 3} once it is back", ok, err, got)
	}
	select {
	case <-back:
	default:
		t.Fatal("the load returned before the bucket's server was back")
	}
	back = outage()
	if err := st.Save(ctx, "run.fuse", map[string]int{"seq": 4}); err != nil {
		t.Fatalf("save while the bucket's server was down: %v", err)
	}
	<-back
	if ok, err := st.Load(ctx, "run.fuse", &got); !ok || err != nil || got["seq"] != 4 {
		t.Fatalf("after the save: ok %v, err %v, %v; want {seq: 4}", ok, err, got)
	}
	// Waiting ends with the context, and says why.
	holder.Stop()
	short, cancelShort := context.WithTimeout(ctx, time.Second)
	defer cancelShort()
	if _, err := st.Load(short, "run.fuse", &got); err == nil || !strings.Contains(err.Error(), "run.fuse") {
		t.Fatalf("load with the server gone for good: %v; want an error naming the key", err)
	}
}

// LoadAll reads the newest value of every key under a prefix and no
// other, none of a deleted key, and returns at once from a bucket holding
// none.
func TestStateStoreLoadsEveryKeyUnderAPrefix(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv, err := StartServer(ctx, ServerConfig{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	st, err := OpenStore(ctx, jsOn(t, srv, "state-test"), StoreConfig{Bucket: "TEST_STATE", Replicas: 1})
	if err != nil {
		t.Fatal(err)
	}
	load := func() map[string]string {
		t.Helper()
		got := map[string]string{}
		if err := st.LoadAll(ctx, "run.seen", func(key string, value []byte) error {
			got[key] = string(value)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return got
	}
	if got := load(); len(got) != 0 {
		t.Fatalf("an empty bucket gives %v", got)
	}
	for key, v := range map[string]int{"run.seen.1": 1, "run.seen.2": 2, "run.seen.3": 3, "run.seenx.4": 4, "run.seen": 5, "other.seen.6": 6} {
		if err := st.Save(ctx, key, v); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.Save(ctx, "run.seen.2", 22); err != nil {
		t.Fatal(err)
	}
	if err := st.Delete(ctx, "run.seen.1"); err != nil {
		t.Fatal(err)
	}
	if err := st.Delete(ctx, "run.seen.never"); err != nil {
		t.Errorf("deleting a key that has no value: %v", err)
	}
	if got := fmt.Sprint(load()); got != "map[run.seen.2:22 run.seen.3:3]" {
		t.Errorf("under run.seen: %s; want map[run.seen.2:22 run.seen.3:3]", got)
	}
	if ok, err := st.Load(ctx, "run.seen.1", new(int)); ok || err != nil {
		t.Errorf("a deleted key loads: ok %v, err %v", ok, err)
	}
}
