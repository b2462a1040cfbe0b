package pipeline

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/openai"
	"github.com/wmrl/wmrl/connectors/sandbox"
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
	// (0: nats-server's own bound, 75% of the disk's free room at its
	// start). A store at its bound is full: every stage waits until room
	// is made (--retention ages messages out).
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
}

// DefaultConfig is `wmrl run` with no flags.
func DefaultConfig() Config {
	c := Config{Debias: true, Anchors: route.SchedulerConfig{Fraction: route.DefaultFraction, MinPerStep: 1, Rounding: route.RoundEven}}
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

// exposure says what an embedded server's --listen leaves open to the
// machines it reaches beyond this one, or "" when nothing is: a server
// that asks clients for nothing, or a secret it asks for sent in clear.
func (c *Config) exposure() string {
	if c.NATSURL != "" || natsjs.Loopback(c.Listen) {
		return ""
	}
	secret := "password"
	if c.NATSAuth.Token != "" {
		secret = "token"
	}
	switch {
	case c.NATSAuth.User == "" && c.NATSAuth.Token == "" && c.ListenTLS.ClientCA == "":
		return fmt.Sprintf("the embedded NATS server listens on %s, beyond this machine, and asks clients for nothing: whoever reaches it can publish "+
			"trajectories and read the run. Set WMRL_NATS_TOKEN (or WMRL_NATS_USER and WMRL_NATS_PASSWORD) to have it ask for one, "+
			"or give --listen-client-ca to have it ask for a certificate", c.Listen)
	case !c.ListenTLS.On():
		return fmt.Sprintf("the embedded NATS server listens on %s, beyond this machine, without TLS: the %s it asks for, and every message, "+
			"cross the network in clear. Give --listen-cert and --listen-key to have it speak TLS", c.Listen, secret)
	}
	return ""
}

// beyondThisMachine says whether an HTTP server listening on addr is
// reached from other machines. Unlike the embedded server's --listen, an
// address without a host (":8080") is every interface's.
func beyondThisMachine(addr string) bool {
	host, _, _ := net.SplitHostPort(addr)
	return addr != "" && (host == "" || !natsjs.Loopback(addr))
}

// metricsExposure says what --metrics leaves open to the machines it
// reaches beyond this one, or "" when nothing worse than the metrics
// themselves is.
func (c *Config) metricsExposure() string {
	if !c.PprofRemote || !beyondThisMachine(c.MetricsAddr) {
		return ""
	}
	return fmt.Sprintf("--pprof-remote serves Go's profiles on %s, beyond this machine, to whoever reaches it: "+
		"the command line (its URLs' user info hidden), the heap, and CPU profiles and traces that each cost the run a core while they are taken", c.MetricsAddr)
}

// gatewayExposure says what the gateway's address leaves open to the
// machines it reaches beyond this one, or "" when nothing is.
func (c *Config) gatewayExposure() string {
	if !beyondThisMachine(c.HTTPAddr) {
		return ""
	}
	switch {
	case c.HTTPToken == "":
		return fmt.Sprintf("the trainer gateway listens on %s, beyond this machine, and asks for no token: whoever reaches it can publish "+
			"trajectories and read the run's updates. Set WMRL_HTTP_TOKEN to have it ask for one", c.HTTPAddr)
	case c.HTTPCert == "":
		return fmt.Sprintf("the trainer gateway listens on %s, beyond this machine, without TLS: its bearer token, and every trajectory, "+
			"cross the network in clear. Give --http-cert and --http-key to have it speak HTTPS", c.HTTPAddr)
	}
	return ""
}

// tlsHint adds to a connection's error the flag that its TLS failure
// asks for, when the client did not give it: a server that requires a
// client certificate closes the connection just after the handshake (the
// client may see only that), and a server certificate of a private CA
// is unknown to the system's.
func tlsHint(err error, a natsjs.Auth) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	switch {
	case a.Cert == "" && (strings.Contains(msg, "certificate required") || strings.Contains(msg, "closed by remote after TLS handshake")):
		return fmt.Errorf("%w (the server asks every client for a certificate: give --nats-cert and --nats-key)", err)
	case a.CA == "" && strings.Contains(msg, "certificate signed by unknown authority"):
		return fmt.Errorf("%w (give --nats-ca with the CA that signed the server's certificate)", err)
	}
	return err
}

// clientOnlyFlags set what only a client of an external server presents
// (natsjs.Auth.ForClient): they mean nothing without --nats.
const clientOnlyFlags = "--nats-creds, --nats-nkey, --nats-ca, --nats-cert and --nats-key"

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

// openaiConfig is the OpenAI-compatible world model's client config.
func (c *Config) openaiConfig() openai.Config {
	retries := c.WMRetries
	if retries == 0 {
		retries = -1 // the client's 0 is its default
	}
	return openai.Config{BaseURL: c.WMURL, Model: c.WMModel, APIKey: c.WMAPIKey, Samples: c.WMSamples,
		Temperature: c.WMTemperature, MaxTokens: c.WMMaxTokens, Concurrency: c.WMConcurrency,
		Timeout: c.WMTimeout, Retries: retries}
}

// UpdateBytesPerTrajectory is about what a trajectory adds to its step's
// update (386 on the housing task's real run; IDs of other lengths move it).
const UpdateBytesPerTrajectory = 400

// execLimits are a real execution's limits on task as flags set them (the
// task's fill in the rest: sandbox.Limits.For). With GPUs shared out, the
// address space is unlimited unless the flag or the task says otherwise:
// CUDA's driver reserves far more of it than it uses, and a solution
// given a GPU under the default 1 GiB could not start CUDA at all.
func (c *Config) execLimits(task *sandbox.Task) sandbox.Limits {
	l := sandbox.Limits{Timeout: c.ExecTimeout, MemoryBytes: int64(c.ExecMemoryMB) << 20, CPUSeconds: c.ExecCPUSeconds,
		Processes: cmp.Or(c.ExecProcesses, sandbox.DefaultProcesses(c.ExecSlots)), DiskBytes: int64(c.ExecDiskMB) << 20,
		SubmissionBytes: int64(c.ExecSubmissionMB) << 20}
	if c.ExecGPUs != "" && l.MemoryBytes == 0 && (task == nil || task.MemoryMB == 0) {
		l.MemoryBytes = -1
	}
	return l
}

// gpuSets is ExecGPUs in sets of ExecGPUsEach, in the order given, and
// the GPUs left over, fewer than a set, which are not used.
func (c *Config) gpuSets() (sets [][]string, unused []string, err error) {
	each := cmp.Or(c.ExecGPUsEach, 1)
	if c.ExecGPUs == "" {
		if c.ExecGPUsEach != 0 {
			return nil, nil, fmt.Errorf("--exec-gpus-each %d: without --exec-gpus, there are no GPUs to share out", c.ExecGPUsEach)
		}
		return nil, nil, nil
	}
	var gpus []string
	for g := range strings.SplitSeq(c.ExecGPUs, ",") {
		g = strings.TrimSpace(g)
		switch {
		case g == "" || strings.ContainsAny(g, " \t\n="):
			return nil, nil, fmt.Errorf("--exec-gpus %q: want GPUs as nvidia-smi lists them, indexes or UUIDs, separated by commas (0,1,2,3)", c.ExecGPUs)
		case slices.Contains(gpus, g):
			return nil, nil, fmt.Errorf("--exec-gpus %q: GPU %s is given twice", c.ExecGPUs, g)
		}
		gpus = append(gpus, g)
	}
	if each < 1 || each > len(gpus) {
		return nil, nil, fmt.Errorf("--exec-gpus-each %d: want 1 to the %d GPUs of --exec-gpus", each, len(gpus))
	}
	for len(gpus) >= each {
		sets, gpus = append(sets, gpus[:each:each]), gpus[each:]
	}
	return sets, gpus, nil
}

// Validate reports the first invalid field.
func (c *Config) Validate() error {
	switch {
	case !schemas.ValidToken(c.Run):
		return fmt.Errorf("%w: run %q: letters, digits, '_' and '-' only", ErrConfig, c.Run)
	case !schemas.ValidToken(c.Prefix):
		return fmt.Errorf("%w: prefix %q: letters, digits, '_' and '-' only", ErrConfig, c.Prefix)
	case c.Source != SourceSim && c.Source != SourceExternal:
		return fmt.Errorf("%w: source %q: want sim or external", ErrConfig, c.Source)
	case c.Steps < 0:
		return fmt.Errorf("%w: steps %d < 0", ErrConfig, c.Steps)
	case c.MaxPayloadMB < 0 || c.MaxPayloadMB > 64:
		return fmt.Errorf("%w: nats-max-payload-mb %d: want 1 to 64 (MiB; NATS takes no larger messages)", ErrConfig, c.MaxPayloadMB)
	case !(c.MaxStoreGB >= 0) || math.IsInf(c.MaxStoreGB, 1):
		return fmt.Errorf("%w: --nats-max-store-gb %v: want GiB > 0, or 0 for 75%% of the disk's free room", ErrConfig, c.MaxStoreGB)
	case c.MaxStoreGB > 0 && c.NATSURL != "":
		return fmt.Errorf("%w: --nats-max-store-gb bounds the embedded server's store; with --nats, the server's max_file_store (or its account's max_file) does", ErrConfig)
	case c.Groups < 1 || c.GroupSize < 2 || c.Tasks < 1:
		return fmt.Errorf("%w: policy needs groups >= 1, group size >= 2, tasks >= 1", ErrConfig)
	case c.WorldModel != "sim" && c.WorldModel != "openai":
		return fmt.Errorf("%w: world model %q: want sim or openai", ErrConfig, c.WorldModel)
	case c.WorldModel == "openai" && (c.WMURL == "" || c.WMModel == ""):
		return fmt.Errorf("%w: --world-model openai needs --wm-url and --wm-model", ErrConfig)
	case c.PairWait < 0:
		return fmt.Errorf("%w: --pair-wait %v: want a duration > 0", ErrConfig, c.PairWait)
	case c.RewardMemory < 0:
		return fmt.Errorf("%w: --reward-memory %v: want a duration >= 0", ErrConfig, c.RewardMemory)
	case c.StepSummary < 0:
		return fmt.Errorf("%w: --step-summary %v: want a duration >= 0", ErrConfig, c.StepSummary)
	case c.HTTPDrain < 0:
		return fmt.Errorf("%w: --http-drain %v: want a duration >= 0", ErrConfig, c.HTTPDrain)
	case c.ArchiveCompactAfter < 0:
		return fmt.Errorf("%w: --archive-compact-after %v: want a duration >= 0 (0: never)", ErrConfig, c.ArchiveCompactAfter)
	case c.StuckAfter < 0:
		return fmt.Errorf("%w: --stuck-after %v: want a duration > 0", ErrConfig, c.StuckAfter)
	case c.WMConcurrency < 0:
		return fmt.Errorf("%w: --wm-concurrency %d: want >= 1 requests in flight", ErrConfig, c.WMConcurrency)
	case c.WMTimeout < 0 || c.WMRetries < 0:
		return fmt.Errorf("%w: --wm-timeout %v and --wm-retries %d: want >= 0", ErrConfig, c.WMTimeout, c.WMRetries)
	case c.WMDownAfter < 0 || c.WMProbeEvery < 0:
		return fmt.Errorf("%w: --wm-down-after %d and --wm-probe-every %v: want >= 0 (0 calls: never give up early)", ErrConfig, c.WMDownAfter, c.WMProbeEvery)
	case c.ExecDownAfter < 0 || c.ExecProbeEvery < 0:
		return fmt.Errorf("%w: --exec-down-after %d and --exec-probe-every %v: want >= 0 (0 executions: never give up early)", ErrConfig, c.ExecDownAfter, c.ExecProbeEvery)
	case c.Executor != "" && c.Executor != "sim" && c.Executor != "subprocess" && c.Executor != "sandbox-fusion":
		return fmt.Errorf("%w: executor %q: want sim, subprocess or sandbox-fusion", ErrConfig, c.Executor)
	case c.executor() != "sim" && c.TaskDir == "":
		return fmt.Errorf("%w: --executor %s needs --task DIR (its data and grader)", ErrConfig, c.executor())
	case c.executor() == "sandbox-fusion" && c.SandboxURL == "":
		return fmt.Errorf("%w: --executor sandbox-fusion needs --sandbox-url URL", ErrConfig)
	case c.executor() == "sandbox-fusion" && (c.ExecGPUs != "" || c.ExecUIDs != "" || c.ExecDiskMB != 0 || c.ExecPython != "" || len(c.ExecEnv) > 0):
		return fmt.Errorf("%w: --exec-gpus, --exec-uids, --exec-disk-mb, --exec-python and --exec-env are --executor subprocess's; "+
			"Sandbox Fusion's server decides those for its executions", ErrConfig)
	case c.ExecTimeout < 0 || c.ExecMemoryMB < -1 || c.ExecCPUSeconds < 0 || c.ExecProcesses < 0 || c.ExecDiskMB < -1:
		return fmt.Errorf("%w: --exec-timeout %v, --exec-memory-mb %d, --exec-cpu-seconds %d, --exec-processes %d and --exec-disk-mb %d: want >= 0 (0: the task's, else the defaults; --exec-memory-mb and --exec-disk-mb -1: no limit)",
			ErrConfig, c.ExecTimeout, c.ExecMemoryMB, c.ExecCPUSeconds, c.ExecProcesses, c.ExecDiskMB)
	case c.ExecSubmissionMB < 0:
		return fmt.Errorf("%w: --exec-submission-mb %d: want >= 0 (0: %d)", ErrConfig, c.ExecSubmissionMB, sandbox.DefaultSubmissionBytes>>20)
	case c.ExecSlots < 1:
		return fmt.Errorf("%w: exec slots %d < 1", ErrConfig, c.ExecSlots)
	case c.MaxAge < 0 || c.Duplicates < 0 || (c.MaxAge > 0 && c.Duplicates > c.MaxAge):
		return fmt.Errorf("%w: dedup window %v and retention %v: want 0 <= window <= retention", ErrConfig, c.Duplicates, c.MaxAge)
	case c.Replicas < 0 || c.Replicas > 5:
		return fmt.Errorf("%w: replicas %d: want 1 to 5 (JetStream's limit), or 0 to keep the stream's", ErrConfig, c.Replicas)
	case c.Replicas > 1 && c.NATSURL == "":
		return fmt.Errorf("%w: --replicas %d needs a JetStream cluster (--nats URL,URL,...): the embedded server is a single node", ErrConfig, c.Replicas)
	case c.NATSURL != "" && (c.ListenTLS != natsjs.ServerTLS{}):
		return fmt.Errorf("%w: --listen-cert, --listen-key and --listen-client-ca are the embedded server's; with --nats, the server's own configuration sets its TLS (and --nats-ca, --nats-cert and --nats-key what this process presents)", ErrConfig)
	case c.NATSURL == "" && c.NATSAuth.ForClient():
		return fmt.Errorf("%w: %s are for an external server (--nats URL); the embedded one asks only for WMRL_NATS_USER and WMRL_NATS_PASSWORD, or WMRL_NATS_TOKEN", ErrConfig, clientOnlyFlags)
	case c.CheckpointEvery < 0:
		return fmt.Errorf("%w: checkpoint every %d groups: want >= 1, or 0 for the default", ErrConfig, c.CheckpointEvery)
	case c.Source == SourceSim && !c.runs(StageFuse):
		return fmt.Errorf("%w: the simulated source paces itself on updates: run the fuse stage in the same process or use --source external", ErrConfig)
	}
	if err := c.NATSAuth.Check(); err != nil {
		return fmt.Errorf("%w: %v", ErrConfig, err)
	}
	if err := c.ListenTLS.Check(); err != nil {
		return fmt.Errorf("%w: %v", ErrConfig, err)
	}
	switch {
	case (c.HTTPCert == "") != (c.HTTPKey == ""):
		return fmt.Errorf("%w: --http-cert needs --http-key, and --http-key --http-cert", ErrConfig)
	case c.HTTPCert != "" && c.HTTPAddr == "":
		return fmt.Errorf("%w: --http-cert and --http-key are the gateway's: give --http ADDR", ErrConfig)
	}
	for _, s := range c.Stages {
		if !slices.Contains(AllStages, s) {
			return fmt.Errorf("%w: unknown stage %q (stages: %v)", ErrConfig, s, AllStages)
		}
	}
	if c.ExecUIDs != "" {
		if _, err := uidRange(c.ExecUIDs); err != nil {
			return fmt.Errorf("%w: --exec-uids %q: %v", ErrConfig, c.ExecUIDs, err)
		}
	}
	for _, kv := range c.ExecEnv {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			return fmt.Errorf("%w: --exec-env %q: want KEY=VALUE", ErrConfig, kv)
		} else if k == "CUDA_VISIBLE_DEVICES" && c.ExecGPUs != "" {
			return fmt.Errorf("%w: --exec-env %s and --exec-gpus %q: --exec-gpus gives each execution its own GPUs; name them there alone", ErrConfig, kv, c.ExecGPUs)
		}
	}
	if _, _, err := c.gpuSets(); err != nil {
		return fmt.Errorf("%w: %v", ErrConfig, err)
	}
	return c.validateCorrections() // route's scheduler checks its own settings again, by their fields' names, for the Go API
}

// validateCorrections checks the anchors', the calibration's and rho's
// settings by their flags' names, before anything starts: the stages'
// own checks name their fields (min_per_step, buffer_size) and came, for
// the calibration and rho, once the server and the other stages were up.
func (c *Config) validateCorrections() error {
	a := c.Anchors
	switch {
	case !(a.Fraction >= 0 && a.Fraction <= 1):
		return fmt.Errorf("%w: --anchor-fraction %v: want the share of a step's groups to execute, from 0 to 1", ErrConfig, a.Fraction)
	case a.MinPerStep < 0:
		return fmt.Errorf("%w: --anchor-min %d: want >= 0 anchor groups a step", ErrConfig, a.MinPerStep)
	case a.MaxInFlight < 0:
		return fmt.Errorf("%w: --anchor-max-in-flight %d: want >= 0 anchor groups in flight (0: no cap)", ErrConfig, a.MaxInFlight)
	case a.Rounding != "" && !slices.Contains(route.Roundings, a.Rounding):
		return fmt.Errorf("%w: --anchor-rounding %q: want %s", ErrConfig, a.Rounding, strings.Join(route.Roundings, " or "))
	}
	return CheckCalibration(c.Debiaser, c.Denoiser.Estimator)
}

// CheckCalibration checks the calibration's settings and rho's estimator
// ("": the default) by their flags' names (--min-pairs, --buffer, --rho,
// ...), as run, stage and replay take them.
func CheckCalibration(deb calibrate.DebiaserConfig, rho fuse.Estimator) error {
	d := deb.Effective()
	switch {
	case d.MinPairs < 0:
		return fmt.Errorf("%w: --min-pairs %d: want >= 0 (0: the reference's %d)", ErrConfig, d.MinPairs, calibrate.DefaultMinPairs)
	case d.RefitEvery < 0:
		return fmt.Errorf("%w: --refit-every %d: want >= 0 (0: the reference's %d)", ErrConfig, d.RefitEvery, calibrate.DefaultRefitEvery)
	case d.BufferSize < 2:
		return fmt.Errorf("%w: --buffer %d: want at least 2 anchor pairs", ErrConfig, d.BufferSize)
	case d.BufferSize < d.MinPairs:
		return fmt.Errorf("%w: --buffer %d is under --min-pairs %d: the isotonic map would never be fitted", ErrConfig, d.BufferSize, d.MinPairs)
	case d.Bins < 0 || d.Bins == 1:
		return fmt.Errorf("%w: --bins %d: want 0 (the raw pairs) or at least 2", ErrConfig, d.Bins)
	case d.BeforeFit != "" && d.BeforeFit != calibrate.BeforeFitMean && d.BeforeFit != calibrate.BeforeFitIdentity:
		return fmt.Errorf("%w: --before-fit %q: want %s or %s", ErrConfig, d.BeforeFit, calibrate.BeforeFitMean, calibrate.BeforeFitIdentity)
	}
	switch rho {
	case "", fuse.EstimatorReference, fuse.EstimatorRatio, fuse.EstimatorAdvantage, fuse.EstimatorOff:
	default:
		return fmt.Errorf("%w: --rho %q: want reference, ratio, advantage or off", ErrConfig, rho)
	}
	return nil
}

// uidRange parses "FIRST-LAST" into the uids from FIRST to LAST.
func uidRange(s string) ([]uint32, error) {
	a, b, ok := strings.Cut(s, "-")
	first, err1 := strconv.ParseUint(a, 10, 32)
	last, err2 := strconv.ParseUint(b, 10, 32)
	switch {
	case !ok || err1 != nil || err2 != nil:
		return nil, errors.New("want FIRST-LAST, two user ids")
	case first == 0 || last < first:
		return nil, errors.New("want 0 < FIRST <= LAST (root is not a sandbox user)")
	case last-first >= 1<<16:
		return nil, errors.New("want at most 65536 users")
	}
	uids := make([]uint32, 0, last-first+1)
	for u := first; u <= last; u++ {
		uids = append(uids, uint32(u))
	}
	return uids, nil
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

// maxStore is MaxStoreGB in bytes (0: nats-server's own bound).
func (c *Config) maxStore() int64 { return int64(c.MaxStoreGB * (1 << 30)) }

// ArchiveRoot is the archive stage's root directory: ArchiveDir, else
// DataDir/archive.
func (c *Config) ArchiveRoot() string {
	if c.ArchiveDir != "" {
		return c.ArchiveDir
	}
	return filepath.Join(c.DataDir, "archive")
}
