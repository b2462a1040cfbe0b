package natsjs

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/wmrl/wmrl/connectors/tlsfiles"
	"github.com/wmrl/wmrl/stages/flock"
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
	// MaxPayload is the largest message it takes (0: DefaultMaxPayload;
	// NATS allows up to 64 MiB).
	MaxPayload int
	// MaxStore bounds the JetStream file store in bytes. 0 leaves it to
	// the disk: three quarters of what the disk gives the store (what it
	// holds and the free room), as nats-server sets once at its start,
	// here set at the start and again at each FollowDisk.
	MaxStore int64
	// Auth's user and password, or token, when set, are required of every
	// client, the embedded one's own connections included. Its other
	// fields are a client's and are not used here.
	Auth Auth
	// TLS, when given a certificate, is spoken by every client that comes
	// over the network; the in-process connections need none.
	TLS ServerTLS
	// OnCertificate, if set, hears of each renewal of TLS's certificate
	// and key files: the new certificate's expiry, or why it could not be
	// loaded (the one before stays in use).
	OnCertificate func(notAfter time.Time, err error)
	// OnClientCA, if set, hears of each change of TLS's client CA file:
	// how many certificates it now holds, or why it could not be loaded
	// (the CAs before stay trusted).
	OnClientCA func(certificates int, err error)
}

// ServerTLS is the embedded server's side of TLS: PEM files of its
// certificate and key, and, to require of every client over the network a
// certificate of its own, the CA that signs those.
type ServerTLS struct {
	Cert, Key, ClientCA string
}

// On says whether the server speaks TLS.
func (t ServerTLS) On() bool { return t.Cert != "" }

// Check names what does not go together, and files that cannot be read.
func (t ServerTLS) Check() error {
	var errs []error
	if (t.Cert == "") != (t.Key == "") {
		errs = append(errs, errors.New("the server's certificate needs its key, and a key its certificate"))
	}
	if t.ClientCA != "" && t.Cert == "" {
		errs = append(errs, errors.New("a CA for client certificates needs the server's own certificate and key: clients are verified over TLS"))
	}
	errs = append(errs, unreadable("", []namedFile{
		{"server certificate", t.Cert}, {"server key", t.Key}, {"client CA", t.ClientCA},
	})...)
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("natsjs: embedded server's TLS: %w", err)
	}
	return nil
}

// DefaultMaxPayload is the embedded server's max_payload: a step's update,
// and calibrate's checkpoint, are single messages (an update is about 400
// bytes a trajectory).
const DefaultMaxPayload = 8 << 20

// Server is an in-process NATS server.
type Server struct {
	ns    *server.Server
	lock  *os.File // holds the store's lock until Shutdown
	auth  Auth     // what its own connections present
	certs *tlsfiles.Reloader
	// follows: started without MaxStore, its store's limit follows the
	// disk (followed: the limit FollowDisk set last).
	follows  bool
	followed atomic.Int64
}

// StartServer starts an embedded server and waits until it accepts clients.
// The store directory is locked for as long as the server runs: a second
// server on the same store (another `wmrl run` on the same --data, or a
// reader of a run still going) would write over the first one's files, so
// it is refused, naming the process that holds the store.
func StartServer(ctx context.Context, cfg ServerConfig) (*Server, error) {
	if cfg.StoreDir == "" {
		return nil, fmt.Errorf("natsjs: embedded server needs a store directory")
	}
	lock, err := lockStore(cfg.StoreDir)
	if err != nil {
		return nil, err
	}
	srv, err := runServer(ctx, cfg)
	if err != nil {
		flock.Release(lock)
		return nil, err
	}
	srv.lock = lock
	return srv, nil
}

// ErrStoreInUse is the error of a store another server holds.
var ErrStoreInUse = errors.New("in use by another process")

// lockStore takes an exclusive lock on the store directory (flock on
// StoreDir/wmrl.lock, released by the kernel when the process dies, so a
// killed run leaves no stale lock) and writes this process's id into it.
func lockStore(dir string) (*os.File, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("natsjs: store %s: %w", dir, err)
	}
	path := filepath.Join(dir, "wmrl.lock")
	f, err := flock.Open(path, os.O_RDWR|os.O_CREATE, 0o644, syscall.LOCK_EX|syscall.LOCK_NB)
	if err != nil {
		holder, _ := os.ReadFile(path)
		if errors.Is(err, syscall.EWOULDBLOCK) {
			who := "another process"
			if pid := strings.TrimSpace(string(holder)); pid != "" {
				who = "process " + pid
			}
			return nil, fmt.Errorf("natsjs: store %s is %w (%s holds it): stop that process, or give --nats with its server's URL to use it from here", dir, ErrStoreInUse, who)
		}
		return nil, fmt.Errorf("natsjs: lock store %s: %w", dir, err)
	}
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return f, nil
}

func runServer(ctx context.Context, cfg ServerConfig) (*Server, error) {
	if err := cfg.Auth.Check(); err != nil {
		return nil, err
	}
	if err := cfg.TLS.Check(); err != nil {
		return nil, err
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
	if port > 0 {
		// The server only logs a failed listen (and logs nothing here), so
		// it would be waited for until the deadline: try the address first.
		addr := net.JoinHostPort(host, strconv.Itoa(port))
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("natsjs: embedded server cannot listen on %s: %w (another wmrl run or NATS server there? choose another address with --listen, or give --nats with that server's URL)", addr, err)
		}
		l.Close()
	}
	opts := &server.Options{
		ServerName:        "wmrl-embedded",
		Host:              host,
		Port:              port,
		JetStream:         true,
		StoreDir:          cfg.StoreDir,
		NoSigs:            true,
		NoLog:             !cfg.Logs,
		MaxPayload:        int32(cmp.Or(cfg.MaxPayload, DefaultMaxPayload)),
		JetStreamMaxStore: cfg.MaxStore,
		Username:          cfg.Auth.User,
		Password:          cfg.Auth.Password,
	}
	if cfg.Auth.Token != "" {
		opts.Authorization = cfg.Auth.Token
	}
	var certs *tlsfiles.Reloader
	if cfg.TLS.On() {
		tc, err := server.GenTLSConfig(&server.TLSConfigOpts{
			CertFile: cfg.TLS.Cert, KeyFile: cfg.TLS.Key, CaFile: cfg.TLS.ClientCA, Verify: cfg.TLS.ClientCA != "",
		})
		if err != nil {
			return nil, fmt.Errorf("natsjs: embedded server's TLS: %w", err)
		}
		// The files are read again when they change, so that a renewed
		// certificate serves new connections without a restart.
		if certs, err = tlsfiles.Load(cfg.TLS.Cert, cfg.TLS.Key, cfg.OnCertificate); err != nil {
			return nil, fmt.Errorf("natsjs: embedded server's TLS: %w", err)
		}
		tc.Certificates, tc.GetCertificate = nil, certs.GetCertificate
		// So is the client CA: a CA added to the bundle in place is
		// trusted by the next handshake.
		if cfg.TLS.ClientCA != "" {
			cas, err := tlsfiles.LoadCAs(cfg.TLS.ClientCA, cfg.OnClientCA)
			if err != nil {
				return nil, fmt.Errorf("natsjs: embedded server's TLS: %w", err)
			}
			base := tc.Clone()
			tc.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
				c := base.Clone()
				c.ClientCAs = cas.Pool()
				return c, nil
			}
		}
		opts.TLS, opts.TLSConfig, opts.TLSVerify = true, tc, cfg.TLS.ClientCA != ""
	}
	// Without a bound, the server's own limit is the disk's size, a
	// ceiling, and the account's the one enforced (FollowDisk): the
	// server's cannot be raised once derived from the disk.
	_, size, serr := DiskRoom(cfg.StoreDir)
	follows := cfg.MaxStore == 0 && serr == nil && size > 0
	if follows {
		opts.JetStreamMaxStore = size
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
	if wait <= 0 {
		ns.Shutdown()
		return nil, fmt.Errorf("natsjs: embedded server: no time left to start it: %w", context.DeadlineExceeded)
	}
	if !ns.ReadyForConnections(wait) {
		ns.Shutdown()
		return nil, fmt.Errorf("natsjs: embedded server not ready after %v (is %s:%d in use? choose another with --listen)", wait, host, port)
	}
	srv := &Server{ns: ns, auth: Auth{User: cfg.Auth.User, Password: cfg.Auth.Password, Token: cfg.Auth.Token}, certs: certs, follows: follows}
	// A client reads the store's limit in its account's info, never the
	// server's: the account takes the store's limit as its own, so that
	// wmrl status --nats, an outside stage or the nats CLI knows it.
	// Refused (streams of fixed size hold part of the store), the account
	// stays unlimited: a bound given is the server's all the same.
	if follows {
		if free, _, err := DiskRoom(cfg.StoreDir); err == nil {
			_, _, _ = srv.FollowDisk(free)
		}
	} else {
		_ = srv.LimitAccountStore(srv.StoreLimit())
	}
	return srv, nil
}

// CertificateNotAfter is when the certificate the server presents to
// clients over the network expires (zero without TLS).
func (s *Server) CertificateNotAfter() time.Time {
	if s.certs == nil {
		return time.Time{}
	}
	return s.certs.NotAfter()
}

// Loopback says whether a listen address (as ServerConfig's Listen) is
// reachable from this machine alone: an empty host is 127.0.0.1 here; a
// name other than localhost is taken to reach further.
func Loopback(listen string) bool {
	if listen == "" {
		return true
	}
	host, _, err := net.SplitHostPort(listen)
	switch {
	case err != nil:
		return false
	case host == "" || host == "localhost":
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// URL is the address clients in other processes connect to.
func (s *Server) URL() string { return s.ns.ClientURL() }

// Connect opens an in-process connection (no TCP).
func (s *Server) Connect(name string) (*nats.Conn, error) {
	opts, err := s.auth.Options()
	if err != nil {
		return nil, err
	}
	return nats.Connect("", append(opts, nats.InProcessServer(s.ns), nats.Name(name), nats.MaxReconnects(-1))...)
}

// Shutdown stops the server, waits for it, and releases its store.
func (s *Server) Shutdown() {
	s.ns.Shutdown()
	s.ns.WaitForShutdown()
	if s.lock != nil {
		flock.Release(s.lock)
		s.lock = nil
	}
}
