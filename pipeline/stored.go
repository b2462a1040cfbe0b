package pipeline

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// StreamSource says where a pipeline's stream is for reading it from
// outside the pipeline: a server's URL (NATSURL), or else the data
// directory of a stopped pipeline's embedded server, opened with a server
// of its own (refused while the pipeline runs: its store is locked).
type StreamSource struct {
	NATSURL string
	// Auth is what the server at NATSURL asks of a client.
	Auth    natsjs.Auth
	DataDir string
	Prefix  string
	// Note hears what a reader that follows a server (dlq --follow) has
	// to say about its connection: lost, and back. Nil: nothing is said.
	Note func(string)
}

// streamConn is an open StreamSource.
type streamConn struct {
	js     jetstream.JetStream
	url    string
	stream string
	close  func()
	srv    *natsjs.Server // the store's own server, reading --data; nil for a URL
}

// open connects to the source and checks that its stream exists; it never
// creates one (a reader that made an empty stream would hide a wrong
// --prefix or --data). A connection to a URL gives up reconnecting after
// nats.go's 2 minutes, but one that follows: that one waits for the
// server for as long as it is followed (a pipeline restarted in the
// meantime), and says so.
func (s StreamSource) open(ctx context.Context, follow bool) (*streamConn, error) {
	if s.NATSURL == "" && s.Auth.ForClient() {
		return nil, fmt.Errorf("pipeline: %s are for a server's URL (--nats); a stopped pipeline's --data is read directly", clientOnlyFlags)
	}
	c := &streamConn{stream: StreamName(s.Prefix)}
	var nc *nats.Conn
	var srv *natsjs.Server
	var err error
	if s.NATSURL == "" {
		// A server started on a directory makes its store there: a reader
		// given a --data no run had (a typo, or the default in another
		// directory) would leave an empty store behind.
		store := filepath.Join(s.DataDir, "nats")
		if fi, err := os.Stat(store); err != nil || !fi.IsDir() {
			if err == nil {
				err = fmt.Errorf("%s is not a directory", store)
			}
			return nil, fmt.Errorf("pipeline: no pipeline's store in %s (%w): give the --data of a stopped run, or --nats URL for a running one", s.DataDir, err)
		}
		srv, err = natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: store, MaxStore: readStoreBound(s.DataDir)})
		if err != nil {
			return nil, err
		}
		c.url, c.srv = "the store in "+s.DataDir, srv
		nc, err = srv.Connect("wmrl-reader")
	} else {
		c.url = natsjs.Redact(s.NATSURL)
		var opts []nats.Option
		if opts, err = s.Auth.Options(); err == nil {
			if follow {
				opts = append(opts, s.following(c.url)...)
			}
			nc, err = nats.Connect(s.NATSURL, append(opts, nats.Name("wmrl-reader"), nats.Timeout(10*time.Second))...)
		}
	}
	c.close = func() {
		if nc != nil {
			nc.Close()
		}
		if srv != nil {
			srv.Shutdown()
		}
	}
	if err == nil {
		c.js, err = jetstream.New(nc)
	}
	if err == nil {
		_, err = c.js.Stream(ctx, c.stream)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			err = fmt.Errorf("no stream %s: no pipeline with --prefix %s has run there", c.stream, s.Prefix)
		}
	}
	if err != nil {
		c.close()
		return nil, fmt.Errorf("pipeline: read %s: %w", c.url, tlsHint(err, s.Auth))
	}
	return c, nil
}

// following are the options of a connection that waits for its server
// for good, saying when it is lost and when it is back.
func (s StreamSource) following(url string) []nats.Option {
	note := s.Note
	if note == nil {
		note = func(string) {}
	}
	return []nats.Option{
		nats.MaxReconnects(-1),
		nats.DisconnectErrHandler(func(nc *nats.Conn, err error) {
			if nc.IsClosed() {
				return // closed here, when the reader is done
			}
			why := ""
			if err != nil {
				why = ": " + err.Error()
			}
			note(fmt.Sprintf("lost the connection to %s%s; waiting for it to come back (Ctrl-C to stop)", url, why))
		}),
		nats.ReconnectHandler(func(*nats.Conn) { note(fmt.Sprintf("connected to %s again", url)) }),
	}
}

// ReadStored returns every message retained on subject in the store of a
// stopped pipeline's data directory (the embedded server's), by opening the
// store with a server of its own: for offline inspection and tests.
func ReadStored(ctx context.Context, dataDir, prefix, subject string) ([][]byte, error) {
	c, err := StreamSource{DataDir: dataDir, Prefix: prefix}.open(ctx, false)
	if err != nil {
		return nil, err
	}
	defer c.close()
	var out [][]byte
	err = natsjs.Scan(ctx, c.js, c.stream, subject, false, func(r natsjs.Record) error {
		out = append(out, r.Data)
		return nil
	})
	return out, err
}

// ReadDeadLetters hands fn every dead letter of run retained in the
// source's stream, oldest first. With follow it then waits for new ones
// until ctx ends (and returns nil then); without, it returns once it has
// read those stored when it started. A message on the subject that is not
// a dead letter is handed over with only its Payload and a Reason saying
// so, rather than skipped: whatever landed there is what the reader came
// to see.
func ReadDeadLetters(ctx context.Context, src StreamSource, run string, follow bool, fn func(schemas.DeadLetter) error) error {
	c, err := src.open(ctx, follow)
	if err != nil {
		return err
	}
	defer c.close()
	subject := schemas.Subject(src.Prefix, run, schemas.KindDLQ)
	r, err := natsjs.NewReader(ctx, c.js, c.stream, subject, false)
	if err != nil {
		return fmt.Errorf("pipeline: read %s at %s: %w", subject, c.url, err)
	}
	defer r.Close()
	if !follow && r.Last == 0 {
		return runHeld(ctx, c, src.Prefix, run)
	}
	for done := false; !done; {
		rec, err := r.Next(ctx)
		if err != nil {
			if follow && ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("pipeline: read %s at %s: %w", subject, c.url, err)
		}
		var dl schemas.DeadLetter
		if err := json.Unmarshal(rec.Data, &dl); err != nil {
			dl = schemas.DeadLetter{Reason: "not a dead letter: " + err.Error(), Payload: string(rec.Data)}
		} else if dl.Stage == "" {
			dl = schemas.DeadLetter{Reason: "not a dead letter: no stage", Payload: string(rec.Data)}
		}
		if err := fn(dl); err != nil {
			return err
		}
		if !follow {
			if done, err = r.ReadThrough(ctx, rec); err != nil {
				return fmt.Errorf("pipeline: read %s at %s: %w", subject, c.url, err)
			}
		}
	}
	return nil
}

// storeBoundFile keeps, beside a data directory's store, the bound its
// last process gave the embedded server (--nats-max-store-gb), so that a
// reader of the stopped store sets its own server the same: `wmrl status`
// then measures the store against the run's bound, not the default.
func storeBoundFile(dataDir string) string { return filepath.Join(dataDir, "nats-max-store") }

// writeStoreBound records bound (bytes; 0: the default, and the file goes).
func writeStoreBound(dataDir string, bound int64) error {
	f := storeBoundFile(dataDir)
	if bound <= 0 {
		if err := os.Remove(f); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("pipeline: %w", err)
		}
		return nil
	}
	if err := os.WriteFile(f, fmt.Appendf(nil, "%d\n", bound), 0o644); err != nil {
		return fmt.Errorf("pipeline: the store's bound: %w", err)
	}
	return nil
}

// readStoreBound is the bound recorded in dataDir, 0 for none (or one
// that cannot be read: the default is then the reader's).
func readStoreBound(dataDir string) int64 {
	b, err := os.ReadFile(storeBoundFile(dataDir))
	if err != nil {
		return 0
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || n < 0 {
		return 0
	}
	return n
}
