package pipeline

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/stages/route"
)

func TestConfigValidateNamesWhatIsWrong(t *testing.T) {
	for _, tc := range []struct {
		name string
		set  func(*Config)
		want string // "" = valid
	}{
		{"defaults", func(*Config) {}, ""},
		{"run name", func(c *Config) { c.Run = "a.b" }, `run "a.b"`},
		{"negative exec slots", func(c *Config) { c.ExecSlots = -1 }, "exec slots -1"},
		{"window above retention", func(c *Config) { c.MaxAge, c.Duplicates = time.Minute, time.Hour }, "dedup window 1h0m0s and retention 1m0s"},
		{"negative retention", func(c *Config) { c.MaxAge = -time.Hour }, "retention -1h0m0s"},
		{"negative checkpoint cadence", func(c *Config) { c.CheckpointEvery = -1 }, "checkpoint every -1 groups"},
		{"in-flight cap", func(c *Config) { c.Anchors.MaxInFlight = -2 }, "max_in_flight -2"},
		{"replicas on the embedded server", func(c *Config) { c.Replicas = 3 }, "--replicas 3 needs a JetStream cluster"},
		{"replicas on a cluster", func(c *Config) { c.Replicas, c.NATSURL = 3, "nats://a:4222,nats://b:4222" }, ""},
		{"too many replicas", func(c *Config) { c.Replicas, c.NATSURL = 7, "nats://a:4222" }, "replicas 7: want 1 to 5"},
		{"fraction", func(c *Config) { c.Anchors.Fraction = 1.5 }, "1.5"},
		{"anchor rounding", func(c *Config) { c.Anchors.Rounding = "up" }, `rounding "up"`},
		{"pair wait", func(c *Config) { c.PairWait = -time.Second }, "--pair-wait -1s"},
		{"world-model concurrency", func(c *Config) { c.WMConcurrency = -4 }, "--wm-concurrency -4"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := DefaultConfig()
			tc.set(&c)
			c.setDefaults()
			err := c.Validate()
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("valid config refused: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("got %v, want an error naming %q", err, tc.want)
			case tc.want != "" && !errors.Is(err, ErrConfig) && !errors.Is(err, route.ErrConfig):
				t.Fatalf("%v is neither pipeline's nor route's ErrConfig", err)
			}
		})
	}
}
