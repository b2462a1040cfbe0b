package pipeline

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/sandbox"
	"github.com/wmrl/wmrl/stages/fuse"
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
		{"in-flight cap", func(c *Config) { c.Anchors.MaxInFlight = -2 }, "--anchor-max-in-flight -2: want >= 0"},
		{"anchor minimum", func(c *Config) { c.Anchors.MinPerStep = -1 }, "--anchor-min -1: want >= 0"},
		{"fraction of NaN", func(c *Config) { c.Anchors.Fraction = math.NaN() }, "--anchor-fraction NaN"},
		{"pairs before the first fit", func(c *Config) { c.Debiaser.MinPairs = -1 }, "--min-pairs -1: want >= 0 (0: the reference's 200)"},
		{"the reference's pairs before the first fit", func(c *Config) { c.Debiaser.MinPairs = 0 }, ""},
		{"refit cadence", func(c *Config) { c.Debiaser.RefitEvery = -64 }, "--refit-every -64"},
		{"buffer", func(c *Config) { c.Debiaser.BufferSize = 1 }, "--buffer 1: want at least 2"},
		{"buffer under the first fit", func(c *Config) { c.Debiaser.MinPairs, c.Debiaser.BufferSize = 300, 250 }, "--buffer 250 is under --min-pairs 300"},
		{"one bin", func(c *Config) { c.Debiaser.Bins = 1 }, "--bins 1: want 0 (the raw pairs) or at least 2"},
		{"raw pairs", func(c *Config) { c.Debiaser.Bins = 0 }, ""},
		{"map before the fit", func(c *Config) { c.Debiaser.BeforeFit = "flat" }, `--before-fit "flat": want mean or identity`},
		{"rho estimator", func(c *Config) { c.Denoiser.Estimator = "median" }, `--rho "median": want reference, ratio, advantage or off`},
		{"rho off", func(c *Config) { c.Denoiser.Estimator = fuse.EstimatorOff }, ""},
		{"advantage norm", func(c *Config) { c.AdvantageNorm = "zscore" }, `--advantage-norm "zscore": want "std" (GRPO`},
		{"Dr. GRPO's advantages", func(c *Config) { c.AdvantageNorm = fuse.CenterOnly }, ""},
		{"the default advantages", func(c *Config) { c.AdvantageNorm = "" }, ""},
		{"replicas on the embedded server", func(c *Config) { c.Replicas = 3 }, "--replicas 3 needs a JetStream cluster"},
		{"replicas on a cluster", func(c *Config) { c.Replicas, c.NATSURL = 3, "nats://a:4222,nats://b:4222" }, ""},
		{"too many replicas", func(c *Config) { c.Replicas, c.NATSURL = 7, "nats://a:4222" }, "replicas 7: want 1 to 5"},
		{"fraction", func(c *Config) { c.Anchors.Fraction = 1.5 }, "1.5"},
		{"anchor rounding", func(c *Config) { c.Anchors.Rounding = "up" }, `rounding "up"`},
		{"pair wait", func(c *Config) { c.PairWait = -time.Second }, "--pair-wait -1s"},
		{"world-model concurrency", func(c *Config) { c.WMConcurrency = -4 }, "--wm-concurrency -4"},
		{"world-model timeout", func(c *Config) { c.WMTimeout = -time.Second }, "--wm-timeout -1s"},
		{"execution memory", func(c *Config) { c.ExecMemoryMB = -2 }, "--exec-memory-mb -2"},
		{"no address-space limit", func(c *Config) { c.ExecMemoryMB = -1 }, ""},
		{"execution users", func(c *Config) { c.ExecUIDs = "100000-100015" }, ""},
		{"execution users backwards", func(c *Config) { c.ExecUIDs = "100015-100000" }, `--exec-uids "100015-100000": want 0 < FIRST <= LAST`},
		{"execution users, one", func(c *Config) { c.ExecUIDs = "100000" }, `--exec-uids "100000": want FIRST-LAST`},
		{"execution timeout", func(c *Config) { c.ExecTimeout = -time.Second }, "--exec-timeout -1s"},
		{"execution environment", func(c *Config) { c.ExecEnv = []string{"A=1", "OMP_NUM_THREADS"} }, `--exec-env "OMP_NUM_THREADS": want KEY=VALUE`},
		{"execution disk", func(c *Config) { c.ExecDiskMB = -2 }, "--exec-disk-mb -2"},
		{"submission size", func(c *Config) { c.ExecSubmissionMB = -1 }, "--exec-submission-mb -1: want >= 0"},
		{"GPUs", func(c *Config) { c.ExecGPUs, c.ExecGPUsEach = "0, 1,GPU-5f0c3e9a", 2 }, ""},
		{"GPUs given twice", func(c *Config) { c.ExecGPUs = "0,1,0" }, `--exec-gpus "0,1,0": GPU 0 is given twice`},
		{"GPUs with a gap", func(c *Config) { c.ExecGPUs = "0,,1" }, `--exec-gpus "0,,1": want GPUs as nvidia-smi lists them`},
		{"more GPUs each than given", func(c *Config) { c.ExecGPUs, c.ExecGPUsEach = "0,1", 3 }, "--exec-gpus-each 3: want 1 to the 2 GPUs of --exec-gpus"},
		{"GPUs each without GPUs", func(c *Config) { c.ExecGPUsEach = 2 }, "--exec-gpus-each 2: without --exec-gpus"},
		{"GPUs named twice", func(c *Config) { c.ExecGPUs, c.ExecEnv = "0,1", []string{"CUDA_VISIBLE_DEVICES=0"} }, "--exec-env CUDA_VISIBLE_DEVICES=0 and --exec-gpus \"0,1\""},
		{"GPUs on Sandbox Fusion", func(c *Config) {
			c.Executor, c.SandboxURL, c.TaskDir, c.ExecGPUs = "sandbox-fusion", "http://s", "t", "0"
		}, "are --executor subprocess's"},
		{"a disk limit on Sandbox Fusion", func(c *Config) {
			c.Executor, c.SandboxURL, c.TaskDir, c.ExecDiskMB = "sandbox-fusion", "http://s", "t", 100
		}, "are --executor subprocess's"},
		{"Sandbox Fusion", func(c *Config) {
			c.Executor, c.SandboxURL, c.TaskDir, c.ExecMemoryMB = "sandbox-fusion", "http://s", "t", 100
		}, ""},
		{"world-model retries", func(c *Config) { c.WMRetries = -1 }, "--wm-retries -1"},
		{"gateway drain", func(c *Config) { c.HTTPDrain = -time.Second }, "--http-drain -1s: want a duration >= 0"},
		{"archive merges", func(c *Config) { c.ArchiveCompactAfter = -time.Second }, "--archive-compact-after -1s: want a duration >= 0 (0: never)"},
		{"no gateway drain", func(c *Config) { c.HTTPDrain = 0 }, ""},
		{"a client certificate on the embedded server", func(c *Config) { c.NATSAuth.Cert, c.NATSAuth.Key = "c.pem", "k.pem" }, "are for an external server (--nats URL)"},
		{"a token on the embedded server", func(c *Config) { c.NATSAuth.Token = "t" }, ""},
		{"a certificate without its key", func(c *Config) { c.NATSURL, c.NATSAuth.Cert = "tls://a:4222", "c.pem" }, "a client certificate needs its key"},
		{"the embedded server's TLS with --nats", func(c *Config) { c.NATSURL, c.ListenTLS.Cert, c.ListenTLS.Key = "tls://a:4222", "s.pem", "k.pem" }, "--listen-cert, --listen-key and --listen-client-ca are the embedded server's"},
		{"a client CA without the server's certificate", func(c *Config) { c.ListenTLS.ClientCA = "ca.pem" }, "a CA for client certificates needs the server's own certificate"},
		{"the gateway's certificate without its key", func(c *Config) { c.HTTPAddr, c.HTTPCert = "127.0.0.1:8080", "c.pem" }, "--http-cert needs --http-key"},
		{"a store bound", func(c *Config) { c.MaxStoreGB = 0.5 }, ""},
		{"a negative store bound", func(c *Config) { c.MaxStoreGB = -1 }, "--nats-max-store-gb -1: want GiB > 0"},
		{"a store bound of NaN", func(c *Config) { c.MaxStoreGB = math.NaN() }, "--nats-max-store-gb NaN"},
		{"a store bound with --nats", func(c *Config) { c.MaxStoreGB, c.NATSURL = 10, "nats://a:4222" }, "--nats-max-store-gb bounds the embedded server's store"},
		{"the gateway's certificate without a gateway", func(c *Config) { c.HTTPCert, c.HTTPKey = "c.pem", "k.pem" }, "--http-cert and --http-key are the gateway's: give --http ADDR"},
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

func TestGPUsAreSharedOutInSetsInTheOrderGiven(t *testing.T) {
	for _, tc := range []struct {
		gpus   string
		each   int
		sets   string
		unused []string
	}{
		{"", 0, "[]", nil},
		{"0,1,2,3", 0, "[[0] [1] [2] [3]]", nil},
		{"3,2, 1,0", 2, "[[3 2] [1 0]]", nil},
		{"0,1,2,3,4", 2, "[[0 1] [2 3]]", []string{"4"}},
		{"GPU-a,GPU-b", 2, "[[GPU-a GPU-b]]", nil},
	} {
		c := Config{ExecGPUs: tc.gpus, ExecGPUsEach: tc.each}
		sets, unused, err := c.gpuSets()
		if err != nil || fmt.Sprint(sets) != tc.sets || !slices.Equal(unused, tc.unused) {
			t.Errorf("--exec-gpus %q --exec-gpus-each %d: %v, unused %v, %v; want %s, unused %v", tc.gpus, tc.each, sets, unused, err, tc.sets, tc.unused)
		}
	}
}

// TestGPUsLiftTheDefaultAddressSpaceLimit: a solution given a GPU cannot
// start CUDA under the default 1 GiB of address space, so sharing GPUs
// out lifts the default; the flag and the task's memory_mb still win.
func TestGPUsLiftTheDefaultAddressSpaceLimit(t *testing.T) {
	for _, tc := range []struct {
		gpus      string
		flagMB    int
		taskMB    int
		wantBytes int64
	}{
		{"", 0, 0, 1 << 30},
		{"0,1", 0, 0, -1},
		{"0,1", 0, 4096, 4096 << 20},
		{"0,1", 2048, 0, 2048 << 20},
		{"0,1", -1, 4096, -1},
	} {
		c := Config{ExecGPUs: tc.gpus, ExecMemoryMB: tc.flagMB}
		task := &sandbox.Task{MemoryMB: tc.taskMB}
		if got := c.execLimits(task).For(task).MemoryBytes; got != tc.wantBytes && (got >= 0 || tc.wantBytes >= 0) { // < 0: none
			t.Errorf("--exec-gpus %q, --exec-memory-mb %d, memory_mb %d: address space %d, want %d", tc.gpus, tc.flagMB, tc.taskMB, got, tc.wantBytes)
		}
	}
}

// TestTheSubmissionLimitComesFromItsFlag: --exec-submission-mb reaches
// the executor's limits, and 0 leaves the sandbox's default.
func TestTheSubmissionLimitComesFromItsFlag(t *testing.T) {
	for flag, want := range map[int]int64{0: sandbox.DefaultSubmissionBytes, 5: 5 << 20} {
		c := Config{ExecSubmissionMB: flag}
		if got := c.execLimits(nil).For(nil).SubmissionBytes; got != want {
			t.Errorf("--exec-submission-mb %d: %d bytes, want %d", flag, got, want)
		}
	}
}

// The world-model flags reach its client: the timeout as it is (0: the
// client's 120 s), and no retries as no retries, not as the client's
// default of 5.
func TestWorldModelClientConfig(t *testing.T) {
	c := DefaultConfig()
	c.WorldModel, c.WMURL, c.WMModel = "openai", "http://wm/v1", "judge"
	if got := c.openaiConfig(); got.Retries != 5 || got.Timeout != 0 || got.BaseURL != "http://wm/v1" || got.Model != "judge" {
		t.Errorf("defaults: %+v; want 5 retries, the client's timeout", got)
	}
	c.WMTimeout, c.WMRetries = 7*time.Second, 0
	if got := c.openaiConfig(); got.Retries >= 0 || got.Timeout != 7*time.Second {
		t.Errorf("--wm-timeout 7s --wm-retries 0: %+v; want a negative Retries (none) and 7s", got)
	}
}
