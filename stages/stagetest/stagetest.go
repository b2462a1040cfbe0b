// Package stagetest holds the fakes the stages' unit tests share. The
// stages' tests against the real thing (embedded NATS, every stage) are in
// pipeline/.
package stagetest

import (
	"bytes"
	"context"
	"encoding/json"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Recorder is a publisher that keeps what it is given, in order.
type Recorder struct {
	// Err, if set, is returned by Publish, which then keeps nothing (a
	// stream that is down).
	Err error

	mu     sync.Mutex
	topics []string
	msgs   []*message.Message
}

// Publish records msgs under topic.
func (r *Recorder) Publish(topic string, msgs ...*message.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.Err != nil {
		return r.Err
	}
	for _, m := range msgs {
		r.topics = append(r.topics, topic)
		r.msgs = append(r.msgs, m)
	}
	return nil
}

// Close does nothing.
func (r *Recorder) Close() error { return nil }

// Count is how many messages were published.
func (r *Recorder) Count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.msgs)
}

// Payload is the i-th published message's payload.
func (r *Recorder) Payload(i int) []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.msgs[i].Payload
}

// Decode unmarshals the i-th published message into v.
func (r *Recorder) Decode(t testing.TB, i int, v any) {
	t.Helper()
	r.mu.Lock()
	m := r.msgs[i]
	r.mu.Unlock()
	if err := json.Unmarshal(m.Payload, v); err != nil {
		t.Fatalf("published message %d: %v", i, err)
	}
}

// Message is v as JSON in a message carrying ctx, as a subscriber hands it
// to a handler.
func Message(t testing.TB, ctx context.Context, v any) *message.Message {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	m := message.NewMessage("id", b)
	m.SetContext(ctx)
	return m
}

// Output is a bytes.Buffer that a pipeline's or a process's goroutines may
// write to while the test reads it.
type Output struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (o *Output) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.Write(p)
}

func (o *Output) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.String()
}

// Reset empties it.
func (o *Output) Reset() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.b.Reset()
}
