package natsjs

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// ServerConfig configures an embedded NATS server with JetStream.
type ServerConfig struct {
	// StoreDir holds the JetStream file store; it survives restarts.
	StoreDir string
	// Listen is host:port for clients in other processes; port 0 (or an
	// empty Listen) picks a free port on 127.0.0.1.
	Listen string
	// Logs turns the server's own log on (stderr).
	Logs bool
}

// Server is an in-process NATS server.
type Server struct {
	ns *server.Server
}

// StartServer starts an embedded server and waits until it accepts clients.
func StartServer(ctx context.Context, cfg ServerConfig) (*Server, error) {
	if cfg.StoreDir == "" {
		return nil, fmt.Errorf("natsjs: embedded server needs a store directory")
	}
	host, port := "127.0.0.1", -1
	if cfg.Listen != "" {
		h, p, err := net.SplitHostPort(cfg.Listen)
		if err != nil {
			return nil, fmt.Errorf("natsjs: listen address %q: %w", cfg.Listen, err)
		}
		if h != "" {
			host = h
		}
		if port, err = strconv.Atoi(p); err != nil {
			return nil, fmt.Errorf("natsjs: listen port %q: %w", p, err)
		}
		if port == 0 {
			port = -1
		}
	}
	opts := &server.Options{
		ServerName: "wmrl-embedded",
		Host:       host,
		Port:       port,
		JetStream:  true,
		StoreDir:   cfg.StoreDir,
		NoSigs:     true,
		NoLog:      !cfg.Logs,
		// Large enough for a step's worth of trajectories in one message.
		MaxPayload: 8 << 20,
	}
	ns, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("natsjs: embedded server: %w", err)
	}
	if cfg.Logs {
		ns.ConfigureLogger()
	}
	go ns.Start()
	wait := 30 * time.Second
	if dl, ok := ctx.Deadline(); ok {
		wait = time.Until(dl)
	}
	if !ns.ReadyForConnections(wait) {
		ns.Shutdown()
		return nil, fmt.Errorf("natsjs: embedded server not ready after %v (is %s:%d in use? choose another with --listen)", wait, host, port)
	}
	return &Server{ns: ns}, nil
}

// URL is the address clients in other processes connect to.
func (s *Server) URL() string { return s.ns.ClientURL() }

// Connect opens an in-process connection (no TCP).
func (s *Server) Connect(name string) (*nats.Conn, error) {
	return nats.Connect("", nats.InProcessServer(s.ns), nats.Name(name), nats.MaxReconnects(-1))
}

// Shutdown stops the server and waits for it.
func (s *Server) Shutdown() {
	s.ns.Shutdown()
	s.ns.WaitForShutdown()
}
