// Package natstest runs JetStream clusters inside a test's process, so
// that fail-over is tested against real servers: every node a
// nats-server, routed to the others over loopback.
package natstest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Node is one server of a cluster.
type Node struct {
	Opts *server.Options
	srv  *server.Server
}

// Name is the node's server name, as stream infos report leaders.
func (n *Node) Name() string { return n.Opts.ServerName }

// Start runs the node (again, after Stop: on the same store).
func (n *Node) Start(t testing.TB) {
	t.Helper()
	srv, err := server.NewServer(n.Opts)
	if err != nil {
		t.Fatalf("%s: %v", n.Name(), err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(30 * time.Second) {
		srv.Shutdown()
		t.Fatalf("%s: not ready for connections after 30s", n.Name())
	}
	n.srv = srv
}

// Stop shuts the node down, as a crash of its machine would, and waits.
func (n *Node) Stop() {
	if n.srv != nil {
		n.srv.Shutdown()
		n.srv.WaitForShutdown()
		n.srv = nil
	}
}

// MetaLeader waits until one running node leads the cluster's JetStream
// meta layer (where streams and consumers are made) and returns it.
func MetaLeader(t testing.TB, nodes []*Node) *Node {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		for _, n := range nodes {
			if n.srv != nil && n.srv.JetStreamIsLeader() {
				return n
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("no node leads the JetStream meta layer after a minute")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

var (
	handedMu sync.Mutex
	handed   = map[int]bool{} // ports FreePort gave out
)

// FreePort is a TCP port on 127.0.0.1 nothing listens on now, drawn below
// Linux's ephemeral range (32768 and up). A port the kernel hands out for
// ":0" is free only until the kernel hands it out again, as the source port
// of some outgoing connection (the cluster's own routes, say) before the
// node that was given it binds it: that failed a cluster test with
// "address already in use". Ports below the range are only ever taken by a
// listener asking for them by number. A port is handed out once per test
// process: two calls before either port is bound drew the same one, and a
// node's configuration had "Duplicate route entry detected". Nor is one
// handed out that another test process of the run holds (reserve).
func FreePort(t testing.TB) int {
	t.Helper()
	handedMu.Lock()
	defer handedMu.Unlock()
	for range 1000 {
		port := 20000 + rand.IntN(12000)
		if handed[port] || !reserve(port) {
			continue
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err == nil {
			l.Close()
			handed[port] = true
			return port
		}
	}
	t.Fatal("natstest: no free port in 20000-31999 after 1000 tries")
	return 0
}

// Options are n nodes of cluster name on free loopback ports, routed to
// each other, each with its own fresh store.
func Options(t testing.TB, name string, n int) []*server.Options {
	t.Helper()
	var opts []*server.Options
	var routes []*url.URL
	for i := range n {
		o := &server.Options{
			ServerName: fmt.Sprintf("%s-%d", name, i+1),
			Host:       "127.0.0.1",
			Port:       FreePort(t),
			JetStream:  true,
			StoreDir:   t.TempDir(),
			NoLog:      true,
			NoSigs:     true,
			Cluster:    server.ClusterOpts{Name: name, Host: "127.0.0.1", Port: FreePort(t)},
		}
		routes = append(routes, &url.URL{Scheme: "nats-route", Host: fmt.Sprintf("127.0.0.1:%d", o.Cluster.Port)})
		opts = append(opts, o)
	}
	for _, o := range opts {
		o.Routes = routes
	}
	return opts
}

// Start runs a node per Options (ports, routes and stores set), stopped
// when the test ends, and waits until the cluster's JetStream answers (it
// has a meta leader). It returns the nodes and the client URLs, comma
// separated, as nats.Connect and wmrl's --nats take them.
func Start(t testing.TB, opts []*server.Options) ([]*Node, string) {
	t.Helper()
	var nodes []*Node
	var urls []string
	for _, o := range opts {
		n := &Node{Opts: o}
		n.Start(t)
		t.Cleanup(n.Stop)
		nodes = append(nodes, n)
		urls = append(urls, fmt.Sprintf("nats://127.0.0.1:%d", o.Port))
	}
	all := strings.Join(urls, ",")
	WaitForJetStream(t, all)
	return nodes, all
}

// WaitForJetStream waits until the cluster at urls answers JetStream
// requests (it has elected its meta leader).
func WaitForJetStream(t testing.TB, urls string) {
	t.Helper()
	nc, err := nats.Connect(urls)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := js.AccountInfo(ctx)
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the cluster's JetStream does not answer after a minute: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// StreamLeader waits until stream name exists and has a leader, and
// returns the leader's server name.
func StreamLeader(t testing.TB, js jetstream.JetStream, name string) string {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		s, err := js.Stream(ctx, name)
		cancel()
		if err == nil {
			if info := s.CachedInfo(); info.Cluster != nil && info.Cluster.Leader != "" {
				return info.Cluster.Leader
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("stream %s has no leader after a minute (%v)", name, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Named returns the node called name.
func Named(t testing.TB, nodes []*Node, name string) *Node {
	t.Helper()
	for _, n := range nodes {
		if n.Name() == name {
			return n
		}
	}
	t.Fatalf("no node is called %q", name)
	return nil
}
