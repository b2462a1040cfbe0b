package natsjs

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/nats-io/nats.go/jetstream"
)

// StreamFunc says which stream holds a topic (a NATS subject) and how it is
// configured. It must return the same stream for every topic it covers.
type StreamFunc func(topic string) jetstream.StreamConfig

// StreamPerTopic gives every topic a file-backed stream of its own, named
// after it.
func StreamPerTopic(topic string) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:     SafeName(topic),
		Subjects: []string{topic},
		Storage:  jetstream.FileStorage,
	}
}

// SafeName turns a subject into a valid stream or consumer name.
func SafeName(s string) string {
	return strings.Map(func(r rune) rune {
		switch r {
		case '.', '*', '>', ' ', '\t', '/', '\\':
			return '_'
		}
		return r
	}, s)
}

// provisioner creates streams idempotently, once per stream name.
type provisioner struct {
	js     jetstream.JetStream
	stream StreamFunc
	mu     sync.Mutex
	done   map[string]bool
}

func newProvisioner(js jetstream.JetStream, f StreamFunc) *provisioner {
	if f == nil {
		f = StreamPerTopic
	}
	return &provisioner{js: js, stream: f, done: map[string]bool{}}
}

// ensure creates or updates the stream covering topic and returns its name.
func (p *provisioner) ensure(ctx context.Context, topic string) (string, error) {
	cfg := p.stream(topic)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done[cfg.Name] {
		return cfg.Name, nil
	}
	if err := EnsureStream(ctx, p.js, cfg); err != nil {
		return "", fmt.Errorf("natsjs: provision stream for %s: %w", topic, err)
	}
	p.done[cfg.Name] = true
	return cfg.Name, nil
}

// EnsureStream creates the stream when it is missing and updates it only
// when its subjects, retention age, de-duplication window or replica count
// differ; a Replicas of 0 keeps the stream's (and creates it with 1). Needless
// updates are not free: each one rewrites the stream's configuration on the
// server while other clients may be creating consumers on it.
func EnsureStream(ctx context.Context, js jetstream.JetStream, cfg jetstream.StreamConfig) error {
	s, err := js.Stream(ctx, cfg.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		_, err = js.CreateStream(ctx, cfg)
		if err == nil || errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			return nil // created, by us or meanwhile by another client
		}
	}
	if err != nil {
		return fmt.Errorf("stream %s: %w", cfg.Name, err)
	}
	cur := s.CachedInfo().Config
	if slices.Equal(cur.Subjects, cfg.Subjects) && cur.MaxAge == cfg.MaxAge &&
		(cfg.Duplicates == 0 || cur.Duplicates == cfg.Duplicates) &&
		(cfg.Replicas == 0 || cur.Replicas == cfg.Replicas) {
		return nil
	}
	if cfg.Replicas == 0 {
		cfg.Replicas = cur.Replicas
	}
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		return fmt.Errorf("update stream %s: %w", cfg.Name, err)
	}
	return nil
}
