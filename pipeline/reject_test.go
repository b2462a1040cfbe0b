package pipeline

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/schemas"
)

// A calibration whose map is not monotone, from a stage that replaces
// calibrate (as the wire contract allows), is refused by fuse and
// dead-lettered with the reason; the run goes on. Before, fuse's reader
// returned the map's error, which stopped the run, and a restart read the
// same calibration again and stopped again: no step after it was ever
// fused.
func TestACalibrationWithANonMonotoneMapIsDeadLettered(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	cfg := testConfig(t)
	cfg.Steps = 6
	cfg.AnchorDeadline = 2 * time.Second // the refused calibration's anchor group is late
	top := filepath.Join(t.TempDir(), "topology.yaml")
	if err := os.WriteFile(top, []byte("stages:\n  calibrate:\n    out:\n      calibration: \"{prefix}.{run}.calibration_raw\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg.TopologyFile = top
	var out syncBuffer
	cfg.Out, cfg.Quiet = &out, false
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, _, js := startClient(t, ctx, cfg)

	stream, err := js.Stream(ctx, StreamName("wmrl"))
	if err != nil {
		t.Fatal(err)
	}
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "my_calibrate",
		FilterSubject: "wmrl.default.calibration_raw", AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var broken string // the group whose calibration was sent with its map turned around
	cc, err := cons.Consume(func(m jetstream.Msg) {
		mu.Lock()
		defer mu.Unlock()
		data := m.Data()
		var c schemas.Calibration
		if err := json.Unmarshal(data, &c); err != nil {
			t.Error(err)
			return
		}
		if broken == "" && c.Map != nil && len(c.Map.Y) >= 2 && c.Map.Y[0] < c.Map.Y[len(c.Map.Y)-1] {
			broken = c.GroupID
			slices.Reverse(c.Map.Y) // a bug in this stage: the map goes down
			b, err := json.Marshal(c)
			if err != nil {
				t.Error(err)
			}
			data = b
		}
		if _, err := js.Publish(ctx, "wmrl.default.calibration", data, jetstream.WithMsgID("mine/"+m.Headers().Get(jetstream.MsgIDHeader))); err != nil {
			t.Error(err)
			return
		}
		_ = m.Ack()
	})
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Stop()

	stopped := make(chan error, 1)
	go func() { stopped <- p.Wait() }()
	select {
	case err := <-stopped:
		if err != nil {
			t.Fatalf("the run stopped: %v\n%s", err, out.String())
		}
	case <-ctx.Done():
		t.Fatalf("the run did not finish its steps:\n%s", out.String())
	}
	mu.Lock()
	defer mu.Unlock()
	if broken == "" {
		t.Fatal("no calibration had a map to break: the test proves nothing")
	}
	if n := len(readStored(t, cfg.DataDir, "wmrl.default.update")); int64(n) != cfg.Steps {
		t.Errorf("%d updates, want %d", n, cfg.Steps)
	}
	var found []schemas.DeadLetter
	for _, b := range readStored(t, cfg.DataDir, "wmrl.default.dlq") {
		var dl schemas.DeadLetter
		if err := json.Unmarshal(b, &dl); err != nil {
			t.Fatal(err)
		}
		found = append(found, dl)
	}
	if len(found) != 1 || found[0].Stage != StageFuse || found[0].Subject != "wmrl.default.calibration" || found[0].Seq == 0 ||
		!strings.Contains(found[0].Reason, "fuse: invalid message: calibration ") || !strings.Contains(found[0].Reason, "its map: ") || !strings.Contains(found[0].Payload, `"group_id":"`+broken+`"`) || GivenUp(found[0]) {
		t.Errorf("dead letters %+v, want fuse's one of group %s's calibration, rejected for its map\n%s", found, broken, out.String())
	}
	if !strings.Contains(out.String(), "fuse: dead-lettered to wmrl.default.dlq: fuse: invalid message: calibration ") {
		t.Errorf("the run did not say it dead-lettered the calibration:\n%s", out.String())
	}
}

// A message dead-lettered a second time (an in-order reader's restart
// re-reads what followed its checkpoint; a lost acknowledgement hands a
// message back) is stored once: the letter's ID is the stage and the
// message's stream sequence.
func TestAMessageDeadLetteredTwiceIsStoredOnce(t *testing.T) {
	cfg := testConfig(t)
	cfg.Source = SourceExternal
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, nc, _ := startClient(t, ctx, cfg)
	for range 2 {
		p.dl.reject(StageFuse, "wmrl.default.calibration", 7, errors.New("fuse: invalid message: bad"), []byte(`{}`))
	}
	p.dl.reject(StageCalibrate, "wmrl.default.pairs", 7, errors.New("calibrate: invalid message: bad"), []byte(`{}`))
	p.dl.reject(StageFuse, "wmrl.default.calibration", 8, errors.New("fuse: invalid message: bad"), []byte(`{}`))
	var stored []string
	for _, b := range scanAll(t, nc, "wmrl.default.dlq") {
		var dl schemas.DeadLetter
		if err := json.Unmarshal(b, &dl); err != nil {
			t.Fatal(err)
		}
		stored = append(stored, fmt.Sprintf("%s %d", dl.Stage, dl.Seq))
	}
	if want := []string{"fuse 7", "calibrate 7", "fuse 8"}; !slices.Equal(stored, want) {
		t.Errorf("dead letters %q, want %q", stored, want)
	}
}
