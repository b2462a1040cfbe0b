package natsjs

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// StateStore keeps small JSON documents in a JetStream key-value bucket,
// the newest value of each key: the checkpoints of stages whose state
// outlives the stream's retention (no age limit, so a checkpoint survives
// the messages it summarises), and the outcomes of executions (aged out
// with the messages they answer).
type StateStore struct {
	b *kvBucket
}

// StoreConfig is a key-value bucket's shape: file-backed, the newest value
// of each key, on Replicas servers of a cluster (1 on a single server).
type StoreConfig struct {
	Bucket, Description string
	Replicas            int
	// TTL ages a value out this long after it was stored (0: never).
	TTL time.Duration
	// Remade, if set, hears that the bucket was found gone from the
	// server (deleted while the process ran) and was made anew.
	Remade func(bucket string)
}

// OpenStore opens a bucket, creating it if it does not exist and setting
// an existing one's replica count and TTL. A bucket that cannot answer for
// the moment is waited for, up to ctx.
func OpenStore(ctx context.Context, js jetstream.JetStream, cfg StoreConfig) (*StateStore, error) {
	b, err := openBucket(ctx, js, cfg)
	if err != nil {
		return nil, err
	}
	return &StateStore{b: b}, nil
}

func openKV(ctx context.Context, js jetstream.JetStream, cfg StoreConfig) (jetstream.KeyValue, error) {
	var kv jetstream.KeyValue
	err := UntilAnswered(ctx, func(ctx context.Context) (err error) {
		kv, err = js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
			Bucket:      cfg.Bucket,
			Description: cfg.Description,
			History:     1,
			TTL:         cfg.TTL,
			Storage:     jetstream.FileStorage,
			Replicas:    max(cfg.Replicas, 1),
		})
		return err
	}, nil)
	if err != nil {
		return nil, fmt.Errorf("natsjs: bucket %s: %w", cfg.Bucket, err)
	}
	return kv, nil
}

// Load decodes key's value into v; ok is false when the key has none. A
// bucket that cannot answer for the moment (no server of it responding, as
// in a fresh cluster or while its only server restarts; a lost connection)
// is waited for, up to ctx.
func (s *StateStore) Load(ctx context.Context, key string, v any) (ok bool, err error) {
	var e jetstream.KeyValueEntry
	err = s.b.do(ctx, bucketGoneAgain, func(ctx context.Context) (err error) {
		e, err = s.b.kv.Get(ctx, key)
		return err
	})
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("natsjs: load %s: %w", key, err)
	}
	if err := json.Unmarshal(e.Value(), v); err != nil {
		return false, fmt.Errorf("natsjs: load %s: %w", key, err)
	}
	return true, nil
}

// Save stores v as key's value; it returns once the server has stored it,
// waiting up to ctx for a bucket that cannot answer for the moment.
func (s *StateStore) Save(ctx context.Context, key string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("natsjs: save %s: %w", key, err)
	}
	if err := s.b.do(ctx, bucketGoneAgain, func(ctx context.Context) error {
		_, err := s.b.kv.Put(ctx, key, b) // the same value again: harmless
		return err
	}); err != nil {
		return fmt.Errorf("natsjs: save %s (%d bytes): %w", key, len(b), err)
	}
	return nil
}

// LoadAll hands fn the value of each key under prefix (keys prefix.*,
// and deeper), read through one watch of the bucket rather than a request
// a key. A bucket that cannot answer for the moment is waited for, up to
// ctx; an error of fn ends it.
func (s *StateStore) LoadAll(ctx context.Context, prefix string, fn func(key string, value []byte) error) error {
	var got []jetstream.KeyValueEntry
	if err := s.b.do(ctx, bucketGoneAgain, func(actx context.Context) error {
		got = got[:0]
		wctx, cancel := context.WithCancel(ctx) // the watch outlives its request
		defer cancel()
		w, err := s.b.kv.WatchFiltered(wctx, []string{prefix + ".>"}, jetstream.IgnoreDeletes())
		if err != nil {
			return err
		}
		defer w.Stop()
		for {
			select {
			case <-actx.Done():
				return actx.Err()
			case e, ok := <-w.Updates():
				switch {
				case !ok:
					return fmt.Errorf("the watch ended")
				case e == nil:
					return nil // every key's value as of the start is read
				}
				got = append(got, e)
			}
		}
	}); err != nil {
		return fmt.Errorf("natsjs: load %s.*: %w", prefix, err)
	}
	for _, e := range got {
		if err := fn(e.Key(), e.Value()); err != nil {
			return err
		}
	}
	return nil
}

// Delete removes key and its value; a key with none is no error.
func (s *StateStore) Delete(ctx context.Context, key string) error {
	if err := s.b.do(ctx, bucketGoneAgain, func(ctx context.Context) error {
		return s.b.kv.Purge(ctx, key)
	}); err != nil {
		return fmt.Errorf("natsjs: delete %s: %w", key, err)
	}
	return nil
}
