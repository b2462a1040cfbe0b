package pipeline

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/calibrate"
)

// transport is the NATS connection a pipeline process uses: to an embedded
// server (the default) or to an external server or cluster.
type transport struct {
	nc     *nats.Conn
	js     jetstream.JetStream
	srv    *natsjs.Server // nil when external
	watch  *connWatch     // nil when embedded
	url    string
	stream string
	// created is when the stream was created: one deleted and made anew
	// has another time, which tells checkpoints of the old one.
	created time.Time
}

// certWarnAhead is how long before its expiry a server's certificate (the
// embedded NATS server's, the gateway's) is pointed out at the start.
const certWarnAhead = 7 * 24 * time.Hour

func connect(ctx context.Context, cfg *Config, m *Metrics) (*transport, error) {
	t := &transport{}
	var err error
	if cfg.NATSURL == "" {
		bound := cfg.maxStore()
		t.srv, err = natsjs.StartServer(ctx, natsjs.ServerConfig{
			StoreDir: cfg.storeDir(), Listen: cfg.Listen, MaxPayload: cfg.MaxPayloadMB << 20, MaxStore: bound,
			Auth: cfg.NATSAuth, TLS: cfg.ListenTLS,
			OnCertificate: certRenewed(cfg, m, certNATS, "nats: the embedded server"),
			OnClientCA:    clientCARead(cfg),
		})
		if err != nil {
			return nil, err
		}
		t.url = t.srv.URL()
		if err = writeStoreBound(cfg.DataDir, bound); err == nil {
			t.nc, err = t.srv.Connect("wmrl")
		}
	} else {
		t.url = natsjs.Redact(cfg.NATSURL)
		t.watch = &connWatch{url: t.url}
		if !cfg.Quiet {
			t.watch.out = cfg.Out
		}
		var opts []nats.Option
		if opts, err = cfg.NATSAuth.Options(); err == nil {
			opts = append(opts, t.watch.options()...)
			// A server that is not up yet is waited for (setUpStream says so).
			t.nc, err = nats.Connect(cfg.NATSURL, append(opts, nats.Name("wmrl"), nats.MaxReconnects(-1), nats.RetryOnFailedConnect(true))...)
		}
	}
	if err != nil {
		t.close()
		return nil, fmt.Errorf("pipeline: connect to NATS at %s: %w", t.url, err)
	}
	if t.js, err = jetstream.New(t.nc); err != nil {
		t.close()
		return nil, err
	}
	t.stream = StreamName(cfg.Prefix)
	if err := t.setUpStream(ctx, cfg); err != nil {
		t.close()
		return nil, err
	}
	return t, nil
}

// setUpStream makes or updates the stream and reads its creation time. A
// cluster that has no JetStream leader yet (just started, or electing one
// after the loss of a server) gets no answer or a timeout: that is waited
// out, with a line every attempt, for up to StartupWait.
func (t *transport) setUpStream(ctx context.Context, cfg *Config) error {
	ctx, cancel := context.WithTimeout(ctx, cfg.StartupWait)
	defer cancel()
	// Each attempt resolves the settings as given, not the last attempt's.
	maxAge, dups, replicas := cfg.MaxAge, cfg.Duplicates, cfg.Replicas
	attempt := 0
	err := natsjs.UntilAnswered(ctx, func(ctx context.Context) error {
		attempt++
		cfg.MaxAge, cfg.Duplicates, cfg.Replicas = maxAge, dups, replicas
		if err := resolveStreamSettings(ctx, t.js, t.stream, cfg); err != nil {
			return err
		}
		if err := natsjs.EnsureStream(ctx, t.js, StreamConfig(cfg)); err != nil {
			return err
		}
		info, err := t.info(ctx)
		if err != nil {
			return err
		}
		t.created = info.Created
		return nil
	}, func(err error) {
		if !cfg.Quiet {
			fmt.Fprintf(cfg.Out, "waiting for JetStream at %s (attempt %d): %v\n", t.url, attempt, tlsHint(t.withLastError(err), cfg.NATSAuth))
		}
	})
	if err != nil {
		return fmt.Errorf("pipeline: stream %s at %s: %w", t.stream, t.url, tlsHint(t.withLastError(err), cfg.NATSAuth))
	}
	return nil
}

// withLastError adds to err what the connection last heard from the
// server, when that says more: a server that refuses the credentials
// closes the connection, and the request only sees it closed.
func (t *transport) withLastError(err error) error {
	last := t.nc.LastError()
	switch {
	case last != nil && !errors.Is(err, last) && !strings.Contains(err.Error(), last.Error()):
		return fmt.Errorf("%w (the server's last error: %v)", err, last)
	case t.srv == nil && t.nc.Status() == nats.RECONNECTING:
		// A server not up yet: nats.go keeps dialling and records nothing.
		return fmt.Errorf("%w (no connection to the server yet: is it up, and reachable from here?)", err)
	}
	return err
}

func (t *transport) close() {
	if t.watch != nil {
		t.watch.stop()
	}
	if t.nc != nil {
		// Stages and publishers are closed by now; flush what is buffered
		// unless the server is gone (then there is nothing to wait for).
		if t.nc.IsConnected() {
			_ = t.nc.FlushTimeout(2 * time.Second)
		}
		t.nc.Close()
	}
	if t.srv != nil {
		t.srv.Shutdown()
	}
}

// StreamName is the stream holding every subject under prefix.
func StreamName(prefix string) string { return "WMRL_" + strings.ToUpper(natsjs.SafeName(prefix)) }

// Defaults of a stream a pipeline makes.
const (
	DefaultRetention   = 7 * 24 * time.Hour
	DefaultDedupWindow = 10 * time.Minute
)

// resolveStreamSettings fills the stream settings cfg leaves at 0 from the
// stream as it is, or with the defaults when there is none yet. A process
// started without --retention, --dedup-window or --replicas (a stage, a
// gateway) then keeps what the run's stream has instead of resetting it;
// one given them sets them.
func resolveStreamSettings(ctx context.Context, js jetstream.JetStream, name string, cfg *Config) error {
	var cur jetstream.StreamConfig
	s, err := js.Stream(ctx, name)
	switch {
	case err == nil:
		cur = s.CachedInfo().Config
	case errors.Is(err, jetstream.ErrStreamNotFound):
		cur = jetstream.StreamConfig{MaxAge: DefaultRetention, Duplicates: DefaultDedupWindow, Replicas: 1}
	default:
		return err
	}
	if cfg.MaxAge == 0 {
		cfg.MaxAge = cur.MaxAge
	}
	if cfg.Duplicates == 0 {
		cfg.Duplicates = cur.Duplicates
	}
	if cfg.Replicas == 0 {
		cfg.Replicas = cur.Replicas
	}
	if cfg.Duplicates > cfg.MaxAge && cfg.MaxAge > 0 {
		return fmt.Errorf("%w: dedup window %v longer than the retention %v", ErrConfig, cfg.Duplicates, cfg.MaxAge)
	}
	return nil
}

// StreamConfig is the one stream of a prefix: every subject under it,
// file-backed, kept for MaxAge, with a de-duplication window.
func StreamConfig(cfg *Config) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:        StreamName(cfg.Prefix),
		Description: "wmrl trajectories, internal stage messages, updates and dead letters",
		Subjects:    []string{cfg.Prefix + ".>"},
		Storage:     jetstream.FileStorage,
		Retention:   jetstream.LimitsPolicy,
		MaxAge:      cfg.MaxAge,
		Duplicates:  cfg.Duplicates,
		Discard:     jetstream.DiscardOld,
		Replicas:    cfg.Replicas,
	}
}

// groupsByMsgID lists the group IDs of the messages stored on subject by
// step, from message IDs of the form "<run>/<kind>/<step>/<group>".
func (t *transport) groupsByMsgID(ctx context.Context, subject string) (map[int64][]string, error) {
	out := map[int64][]string{}
	err := t.scanMsgIDs(ctx, subject, func(step int64, group string) {
		if group != "" {
			out[step] = append(out[step], group)
		}
	})
	return out, err
}

// scanMsgIDs reads subject's message IDs ("<run>/<kind>/<step>[/<rest>]",
// headers only) and hands fn the step and the rest; other IDs are skipped.
func (t *transport) scanMsgIDs(ctx context.Context, subject string, fn func(step int64, rest string)) error {
	return scanMsgIDs(ctx, t.js, t.stream, subject, fn)
}

func scanMsgIDs(ctx context.Context, js jetstream.JetStream, stream, subject string, fn func(step int64, rest string)) error {
	return natsjs.Scan(ctx, js, stream, subject, true, func(r natsjs.Record) error {
		if step, rest, ok := schemas.SplitMsgID(r.MsgID); ok {
			fn(step, rest)
		}
		return nil
	})
}

// info is the stream's information: its state (the first sequence moves
// past 1 once --retention ages messages out) and its creation time.
func (t *transport) info(ctx context.Context, opts ...jetstream.StreamInfoOpt) (*jetstream.StreamInfo, error) {
	s, err := t.js.Stream(ctx, t.stream)
	if err != nil {
		return nil, err
	}
	return s.Info(ctx, opts...)
}

// stored counts the messages on subject, as the stream's leader has them
// (a reader's consumer may sit on a replica that has fewer).
func (t *transport) stored(ctx context.Context, subject string) (uint64, error) {
	info, err := t.info(ctx, jetstream.WithSubjectFilter(subject))
	if err != nil {
		return 0, err
	}
	return info.State.Subjects[subject], nil
}

// last decodes the newest message on subject into v; ok is false when
// there is none.
func (t *transport) last(ctx context.Context, subject string, v any) (ok bool, err error) {
	s, err := t.js.Stream(ctx, t.stream)
	if err != nil {
		return false, err
	}
	m, err := s.GetLastMsgForSubject(ctx, subject)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if err := json.Unmarshal(m.Data, v); err != nil {
		return false, fmt.Errorf("pipeline: last message on %s: %w", subject, err)
	}
	return true, nil
}

// readerSource adapts a natsjs.Reader to calibrate's and fuse's Source:
// each message with its stream sequence. Those up to the reader's Last
// count in started.
type readerSource struct {
	r       *natsjs.Reader
	started prometheus.Counter
	last    uint64
}

// inputOf is r as stage's Source.
func (p *Pipeline) inputOf(stage string, r *natsjs.Reader) readerSource {
	return readerSource{r: r, started: p.metrics.StartReads.WithLabelValues(stage), last: r.Last}
}

func (s readerSource) Next(ctx context.Context) (calibrate.Input, error) {
	rec, err := s.r.Next(ctx)
	if err == nil && rec.Seq <= s.last {
		s.started.Inc()
	}
	return calibrate.Input{Data: rec.Data, Seq: rec.Seq}, err
}

// tlsHint adds to a connection's error the flag that its TLS failure
// asks for, when the client did not give it: a server that requires a
// client certificate closes the connection just after the handshake (the
// client may see only that), and a server certificate of a private CA
// is unknown to the system's.
func tlsHint(err error, a natsjs.Auth) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	switch {
	case a.Cert == "" && (strings.Contains(msg, "certificate required") || strings.Contains(msg, "closed by remote after TLS handshake")):
		return fmt.Errorf("%w (the server asks every client for a certificate: give --nats-cert and --nats-key)", err)
	case a.CA == "" && strings.Contains(msg, "certificate signed by unknown authority"):
		return fmt.Errorf("%w (give --nats-ca with the CA that signed the server's certificate)", err)
	}
	return err
}
