package pipeline

import (
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/breaker"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/execute"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/predict"
	"github.com/wmrl/wmrl/stages/route"
)

// ErrConfig reports an invalid Config.
var ErrConfig = errors.New("pipeline: invalid config")

// Sources of trajectories.
const (
	SourceSim      = "sim"      // the simulated policy publishes steps
	SourceExternal = "external" // trajectories come from outside
)

// Config is everything a pipeline process needs. Zero values take the
// defaults of setDefaults.
type Config struct {
	Run    string // run name (default "default")
	Prefix string // subject prefix (default "wmrl")
	// DataDir holds the embedded server's store (default ./wmrl-data).
	DataDir string
	// ArchiveDir is the archive stage's root (default DataDir/archive);
	// files close every ArchiveMaxAge (default 10s) or ArchiveMaxRows rows
	// (default 1,000,000), and only then are their inputs acknowledged.
	ArchiveDir     string
	ArchiveMaxAge  time.Duration
	ArchiveMaxRows int
	// ArchiveCompactAfter: closed archive files older than this are merged
	// into files of up to ArchiveMaxRows rows, in the background (0: never;
	// DefaultConfig: an hour). A file every ArchiveMaxAge is 8,640 a day.
	ArchiveCompactAfter time.Duration
	// ArchiveCode puts the anchor groups' prompts and responses into
	// their rows (DefaultConfig: true): the archive stage reads the
	// anchor groups route sends execute, and holds each until its step is
	// archived.
	ArchiveCode bool
	// NATSURL selects an external server or cluster; empty embeds one.
	NATSURL string
	// NATSAuth is what the external server asks of a client (the flags of
	// clientOnlyFlags, and secrets from the environment). Its user and
	// password, or token, are also required by the embedded server of
	// every client, for when --listen lets other machines in.
	NATSAuth natsjs.Auth
	// Listen is the embedded server's client address (default
	// 127.0.0.1:4222; port 0 picks a free one).
	Listen string
	// ListenTLS makes the embedded server speak TLS to the clients that
	// reach it over the network, and verify theirs with a client CA.
	ListenTLS natsjs.ServerTLS
	// MaxPayloadMB is the embedded server's max_payload in MiB (0: 8).
	MaxPayloadMB int
	// MaxStoreGB bounds the embedded server's JetStream store, in GiB
	// (0: three quarters of what its disk gives it, what it holds and the
	// free room, followed every 30 s as other writers fill the disk or
	// make room). A store at its bound is full: every stage waits until
	// room is made (--retention ages messages out).
	MaxStoreGB float64
	// Stages run in this process: nil means all, an empty slice none (a
	// gateway alone).
	Stages []string
	// Topology file (YAML); empty: the standard subjects.
	TopologyFile string

	Source string // SourceSim (default) or SourceExternal
	Steps  int64  // stop after this many steps (0: run until stopped)
	// Policy shape for the simulated source.
	Groups, GroupSize, Tasks int
	Seed                     uint64
	// InFlightSteps: the simulated source runs at most this many steps
	// ahead of the last update, as an asynchronous trainer would (default 2).
	InFlightSteps int

	// WorldModel: "sim" (default) or "openai", an OpenAI-compatible server
	// at WMURL serving WMModel (key from WMRL_WM_API_KEY), with an optional
	// prompt template file, WMSamples samples per trajectory and at most
	// WMConcurrency requests in flight (0: 16).
	WorldModel     string
	WMURL, WMModel string
	WMTemplateFile string
	WMSamples      int
	WMTemperature  float64
	WMMaxTokens    int
	WMConcurrency  int
	WMAPIKey       string
	// WMTimeout bounds each world-model request (0: 120s); WMRetries is how
	// often a failed one is tried again (0: never; DefaultConfig: 5). A
	// call fails, for the breaker, once its last retry has.
	WMTimeout time.Duration
	WMRetries int
	// WMDownAfter: after this many world-model calls in a row have failed
	// (each retried by the connector), or twice WMConcurrency requests in
	// a row (the OpenAI-compatible client reports each), groups are given
	// up at once, and
	// the gateway's reward requests answered 503, until a call succeeds
	// again, tried once every WMProbeEvery (default 30s): see
	// breaker.Breaker. 0 never gives up early (DefaultConfig: 5).
	WMDownAfter  int
	WMProbeEvery time.Duration

	// Executor: "sim" or "subprocess", which runs anchors for real on the
	// task in TaskDir, or, where TaskDir holds task directories, on the
	// one each trajectory's task_id names (sandbox.LoadTasks). Empty:
	// subprocess when TaskDir is set, else sim.
	Executor string
	TaskDir  string
	// SandboxURL is the Sandbox Fusion server of Executor "sandbox-fusion".
	SandboxURL string
	// ExecTimeout, ExecMemoryMB and ExecCPUSeconds bound each real
	// execution (sandbox-fusion is sent the first two). 0 takes the task's
	// time_limit_seconds and memory_mb, else 60 s and 1024 MiB; memory -1
	// sets no address-space limit. CPU time defaults to the wall clock
	// times the cores, plus 1 (sandbox.Limits).
	ExecTimeout    time.Duration
	ExecMemoryMB   int
	ExecCPUSeconds int
	// ExecDiskMB bounds what each execution keeps on disk in its directory
	// (0: sandbox.DefaultDiskBytes; -1: no limit). The subprocess executor's
	// only; Sandbox Fusion's server has its own.
	ExecDiskMB int
	// ExecSubmissionMB bounds the submission file the grader reads into
	// memory (0: sandbox.DefaultSubmissionBytes); a larger one is invalid.
	ExecSubmissionMB int
	// ExecProcesses bounds the processes and threads of all the process's
	// executions together, as they run as one user (default:
	// sandbox.DefaultProcesses(ExecSlots)).
	ExecProcesses int
	// ExecPython runs the subprocess executor's solutions (default: python3
	// on /usr/local/bin:/usr/bin:/bin); a path puts its directory first on
	// the code's PATH, as a virtualenv would. ExecEnv (KEY=VALUE) is added
	// to the code's environment.
	ExecPython string
	ExecEnv    []string
	// ExecUIDs, "FIRST-LAST", gives each execution at once a user of its
	// own from that range, as root (sandbox.Subprocess.UIDs): executions
	// cannot then read or overwrite each other's directories (their
	// processes are apart anyway, in PID namespaces of their own). Empty:
	// all run as nobody.
	ExecUIDs string
	// ExecGPUs lists the GPUs the executions at once share out ("0,1,2,3",
	// indexes or UUIDs as nvidia-smi lists them), ExecGPUsEach to each
	// execution (default 1): sandbox.Subprocess.GPUs, in sets of
	// ExecGPUsEach in the order given. Empty: every execution sees every
	// GPU.
	ExecGPUs     string
	ExecGPUsEach int

	// Anchors is the anchor choice. Its MaxInFlight caps anchor groups
	// sent for execution and not yet executed, counted on ExecConsumer
	// (default: the execute stage's durable consumer; name another when an
	// outside executor reads the exec subject through its own).
	Anchors      route.SchedulerConfig
	ExecConsumer string
	Debias       bool
	Debiaser     calibrate.DebiaserConfig
	Denoiser     fuse.DenoiserConfig
	// AdvantageNorm is how the fused advantages are formed within a
	// group, as the trainer they replace forms its own: fuse.Standardize
	// (GRPO, the default) or fuse.CenterOnly (Dr. GRPO).
	AdvantageNorm fuse.Normalization
	// AnchorDeadline: anchors later than this fall back to world-model
	// rewards for their step (default 30s).
	AnchorDeadline time.Duration
	// PairWait: an anchor group's prediction or execution waits at most
	// this long for the other in the pair stage, then is dead-lettered
	// (default 1h; late executions still calibrate within it).
	PairWait time.Duration
	// StuckAfter: a step still missing a group's prediction this long
	// after its plan reached fuse is reported, once (default 5m). Nothing
	// times a prediction out: a stage between predict and fuse that
	// dead-letters one holds its step until it is sent again.
	StuckAfter time.Duration
	// StepTimeout: a step closes this long after its watermark even with
	// incomplete groups (default 30s).
	StepTimeout time.Duration
	// ExecLatency of the simulated executor (default 20ms); ExecSlots caps
	// executions at once per execute process (default 16).
	ExecLatency time.Duration
	ExecSlots   int
	// ExecCopiesOnce runs a solution (the same task, prompt and response)
	// once in the run and gives its copies, in its anchor group and in
	// others, its outcome (execute.Handler.CopiesOnce): for executions
	// that are deterministic.
	ExecCopiesOnce bool
	// ExecDownAfter: after this many executions in a row have failed (the
	// executor's own errors, not a solution's), anchor groups are published
	// at once with their executions ungraded until one succeeds again,
	// tried once every ExecProbeEvery (default 30s). 0 never gives up early
	// (DefaultConfig: 5).
	ExecDownAfter  int
	ExecProbeEvery time.Duration

	// Retention of the stream and its de-duplication window. 0 keeps the
	// stream's, or makes a new one with DefaultRetention (7 days) and
	// DefaultDedupWindow (10 minutes). After Start they hold the stream's.
	MaxAge     time.Duration
	Duplicates time.Duration
	// StartupWait: how long a start waits for a cluster's JetStream to
	// answer (one just started, or electing a leader; default 1 minute).
	StartupWait time.Duration
	// Replicas of the stream and of the checkpoint bucket on a JetStream
	// cluster (3 survives the loss of a node). 0 takes the stream's (1 for
	// a new one), so that a stage process started without the flag cannot
	// scale a replicated stream down; the bucket follows the stream. The
	// embedded server is one node: more than 1 needs NATSURL.
	Replicas int
	// CheckpointEvery: calibrate and fuse save a checkpoint of their state
	// every this many anchor groups (default 256) and when they stop, so
	// that a restart does not need messages --retention has aged out.
	CheckpointEvery int
	// MaxAttempts: a message whose handler fails on its MaxAttempts-th
	// delivery is dead-lettered with the error (default 10).
	MaxAttempts int
	// MaxAckPending per consumer (default 65536: joins hold whole steps).
	MaxAckPending int

	// WorldModelImpl and ExecutorImpl, when set, replace the world model
	// and executor chosen above (for embedding: a simulator, a test double).
	WorldModelImpl predict.WorldModel
	ExecutorImpl   execute.Executor

	// OnUpdate, if set, sees every update this process stores, with the
	// time from the step's last input to it (for embedding and benchmarks).
	OnUpdate func(u schemas.Update, latency time.Duration)
	// wrapPublisher, if set, stands between each stage and what it
	// publishes (tests: a fault in a stage's output).
	wrapPublisher func(stage string, pub message.Publisher) message.Publisher

	// HTTPAddr serves the trainer gateway (connectors/gateway) when set;
	// HTTPToken, if set, is the bearer token it requires.
	HTTPAddr  string
	HTTPToken string
	// HTTPCert and HTTPKey, when set, make the gateway speak HTTPS with
	// that certificate, read again when the files change.
	HTTPCert, HTTPKey string
	// RewardMemory is how long the gateway's reward endpoints keep the
	// world model's score of a solution (DefaultConfig: 15 minutes; 0:
	// only while its call is under way).
	RewardMemory time.Duration
	// HTTPDrain is how long a stopping process lets its gateway's requests
	// in flight run, the reward endpoints' world-model calls among them
	// (DefaultConfig: 10 s). Then those calls end, their requests answer
	// 503, and what still runs a second later is cut off.
	HTTPDrain time.Duration

	MetricsAddr string // serve Prometheus /metrics here when set
	// PprofRemote serves MetricsAddr's Go profiles to other machines too;
	// without it they go to requests from this one only.
	PprofRemote bool
	Out         io.Writer // progress lines (default os.Stdout)
	Quiet       bool      // no progress lines, and no notes either
	// NoStepLines prints no line for the steps this process fuses; the
	// notes (a world model down, a lease taken over, ...) and the closing
	// line still print.
	NoStepLines bool
	// StepSummary, when set, prints one line every StepSummary summing up
	// the steps fused in it, instead of a line a step: at full speed, or
	// over days, a line a step is more than anyone reads.
	StepSummary time.Duration

	// ackWait, when set, replaces the consumers' AckWait (30 s): tests
	// set an hour, so that what waits for it shows as never coming.
	ackWait time.Duration
	// trajsAlone has the simulated trainer and the gateway store each
	// trajectory in a message of its own, not a group a message (the
	// benchmarks' baseline).
	trajsAlone bool
	// gatewayConnState, if set, hears the gateway's connections change
	// state (tests: a request the server is handling as it stops).
	gatewayConnState func(net.Conn, http.ConnState)
	// leaseTTL, when set, replaces LeaseTTL: tests of a lapsed lease.
	leaseTTL time.Duration
	// streamCheck and streamRecheck, when set, replace how often the
	// process checks that its stream and consumers are on the server, and
	// how long after one is found gone it looks again: tests of a stream
	// deleted, which run beside others.
	streamCheck, streamRecheck time.Duration
}

// DefaultConfig is `wmrl run` with no flags.
func DefaultConfig() Config {
	c := Config{Debias: true, AdvantageNorm: fuse.Standardize, Anchors: route.SchedulerConfig{Fraction: route.DefaultFraction, MinPerStep: 1, Rounding: route.RoundEven}}
	c.Debiaser = calibrate.DefaultDebiaserConfig()
	c.ArchiveCompactAfter = time.Hour
	c.ArchiveCode = true
	c.WMDownAfter, c.ExecDownAfter = 5, 5
	c.WMRetries = 5
	c.RewardMemory = 15 * time.Minute
	c.HTTPDrain = 10 * time.Second
	c.setDefaults()
	return c
}

func (c *Config) setDefaults() {
	def := func(p *string, v string) {
		if *p == "" {
			*p = v
		}
	}
	def(&c.Run, "default")
	def(&c.Prefix, schemas.DefaultPrefix)
	def(&c.DataDir, "wmrl-data")
	def(&c.Listen, "127.0.0.1:4222")
	def(&c.Source, SourceSim)
	def(&c.WorldModel, "sim")
	if c.Stages == nil {
		c.Stages = slices.Clone(AllStages)
	}
	defInt := func(p *int, v int) {
		if *p == 0 {
			*p = v
		}
	}
	defInt(&c.Groups, 16)
	defInt(&c.GroupSize, 8)
	defInt(&c.Tasks, 32)
	defInt(&c.InFlightSteps, 2)
	defInt(&c.ExecSlots, 16)
	defInt(&c.MaxAttempts, 10)
	defInt(&c.MaxAckPending, 65536)
	defDur := func(p *time.Duration, v time.Duration) {
		if *p == 0 {
			*p = v
		}
	}
	defDur(&c.AnchorDeadline, 30*time.Second)
	defDur(&c.PairWait, time.Hour)
	defDur(&c.StuckAfter, 5*time.Minute)
	defDur(&c.StepTimeout, 30*time.Second)
	defDur(&c.ExecLatency, 20*time.Millisecond)
	defDur(&c.StartupWait, time.Minute)
	defDur(&c.WMProbeEvery, breaker.DefaultProbe)
	defDur(&c.ExecProbeEvery, breaker.DefaultProbe)
	if c.Out == nil {
		c.Out = os.Stdout
	}
	if _, ok := c.Out.(*lockedWriter); !ok {
		c.Out = &lockedWriter{w: c.Out} // stages write their lines from goroutines of their own
	}
}

// lockedWriter lets one Write at a time through to w, so that lines
// printed at once do not interleave.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// executor is the executor in force: an explicit choice, else subprocess
// when a task is given, else sim. Derived here, not defaulted, so that a
// TaskDir set after DefaultConfig still implies real execution.
func (c *Config) executor() string {
	switch {
	case c.Executor != "":
		return c.Executor
	case c.TaskDir != "":
		return "subprocess"
	}
	return "sim"
}

func (c *Config) runs(stage string) bool { return slices.Contains(c.Stages, stage) }

func (c *Config) storeDir() string { return filepath.Join(c.DataDir, "nats") }

// maxStore is MaxStoreGB in bytes (0: the store follows its disk).
func (c *Config) maxStore() int64 { return int64(c.MaxStoreGB * (1 << 30)) }

// ArchiveRoot is the archive stage's root directory: ArchiveDir, else
// DataDir/archive.
func (c *Config) ArchiveRoot() string {
	if c.ArchiveDir != "" {
		return c.ArchiveDir
	}
	return filepath.Join(c.DataDir, "archive")
}
