package pipeline

import (
	"context"
	"path/filepath"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
)

// ReadStored returns every message retained on subject in the store of a
// stopped pipeline's data directory (the embedded server's), by opening the
// store with a server of its own: for offline inspection and tests.
func ReadStored(ctx context.Context, dataDir, prefix, subject string) ([][]byte, error) {
	srv, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: filepath.Join(dataDir, "nats")})
	if err != nil {
		return nil, err
	}
	defer srv.Shutdown()
	nc, err := srv.Connect("read-stored")
	if err != nil {
		return nil, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	var out [][]byte
	err = natsjs.Scan(ctx, js, StreamName(prefix), subject, false, func(r natsjs.Record) error {
		out = append(out, r.Data)
		return nil
	})
	return out, err
}
