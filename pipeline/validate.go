package pipeline

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/sandbox"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/route"
)

// This file checks a Config: each refusal names the flag and what it wants.

// clientOnlyFlags set what only a client of an external server presents
// (natsjs.Auth.ForClient): they mean nothing without --nats.
const clientOnlyFlags = "--nats-creds, --nats-nkey, --nats-ca, --nats-cert and --nats-key"

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
		return fmt.Errorf("%w: --nats-max-store-gb %v: want GiB > 0, or 0 for three quarters of what the disk gives the store", ErrConfig, c.MaxStoreGB)
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
	if err := CheckAdvantageNorm(c.AdvantageNorm); err != nil {
		return err
	}
	return CheckCalibration(c.Debiaser, c.Denoiser.Estimator)
}

// CheckAdvantageNorm checks the advantages' normalisation ("": the
// default) by its flag's name, as run, stage and replay take it.
func CheckAdvantageNorm(n fuse.Normalization) error {
	if _, err := fuse.ParseNormalization(string(n)); err != nil {
		return fmt.Errorf("%w: --advantage-norm %q: want %q (GRPO: (r - mean) / std within the group) or %q (Dr. GRPO: r - mean), as the trainer the fused advantages replace forms its own", ErrConfig, n, fuse.Standardize, fuse.CenterOnly)
	}
	return nil
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
