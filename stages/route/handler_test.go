package route

import (
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/schemas"
)

// recorder is a fake publisher that keeps the topics in publish order.
type recorder struct {
	mu     sync.Mutex
	topics []string
}

func (r *recorder) Publish(topic string, msgs ...*message.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for range msgs {
		r.topics = append(r.topics, topic)
	}
	return nil
}
func (r *recorder) Close() error { return nil }

func msgOf(t *testing.T, v any, redelivered bool) *message.Message {
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	m := message.NewMessage("id", b)
	if redelivered {
		m.Metadata.Set("redelivered", "yes")
	}
	return m
}

func TestHandlerStoresPlanLastAndTellsDuplicatesFromLateInput(t *testing.T) {
	pub := &recorder{}
	h, err := NewHandler(Config{
		Run: "r", Out: Topics{Group: "group", Exec: "exec", Plan: "plan"},
		Scheduler:   SchedulerConfig{Fraction: 0.5},
		Redelivered: func(m *message.Message) bool { return m.Metadata.Get("redelivered") != "" },
	}, pub)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var inputs []*message.Message
	for g := 0; g < 2; g++ {
		for i := 0; i < 2; i++ {
			tr := traj(0, string(rune('a'+g)), i, 2)
			tr.Run, tr.Prompt, tr.Response = "r", "p", "x"
			inputs = append(inputs, msgOf(t, tr, false))
		}
	}
	inputs = append(inputs, msgOf(t, schemas.StepClose{Schema: 1, Run: "r", Step: 0, Groups: 2}, false))
	errs := make([]error, len(inputs))
	for i, m := range inputs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i == len(inputs)-1 {
				errs[i] = h.HandleStep(m)
			} else {
				errs[i] = h.HandleTraj(m)
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("inputs still held after the step was complete")
	}
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if n := len(pub.topics); n != 4 || pub.topics[n-1] != "plan" {
		t.Fatalf("published %v; the plan must be stored last", pub.topics)
	}
	again := traj(0, "a", 0, 2)
	again.Run = "r"
	if err := h.HandleTraj(msgOf(t, again, true)); err != nil {
		t.Fatalf("a redelivered trajectory of a planned step: %v, want a silent ack", err)
	}
	if err := h.HandleTraj(msgOf(t, again, false)); !errors.Is(err, schemas.ErrInvalid) {
		t.Fatalf("a first delivery for a planned step: %v, want it dead-lettered as late", err)
	}
}
