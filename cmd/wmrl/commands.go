package main

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/stages/fuse"
)

func rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:           "wmrl",
		Short:         "World-model rewards for RL: predict every trajectory, execute a few, correct, fuse",
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			if path, _ := cmd.Flags().GetString(configFlag); path != "" {
				if err := applyConfigFile(cmd.Flags(), cmd.CommandPath(), path); err != nil {
					return err
				}
			}
			if err := refuseEmbedded(cmd); err != nil {
				return err
			}
			return refuseNotPositive(cmd)
		},
	}
	root.Version = pipeline.ReadBuild().String()
	root.SetVersionTemplate("wmrl {{.Version}}\n")
	root.PersistentFlags().String(configFlag, "", "YAML file of this command's settings (name: value, a flag's name without its dashes; a list for a flag given once per value); a flag on the command line wins")
	root.AddCommand(runCommand(), stageCommand(), serveCommand(), simCommand(), replayCommand(), auditCommand(), compactCommand(), dlqCommand(), statusCommand(), wmEvalCommand())
	return root
}

// positiveMark marks, among a flag's annotations, a flag whose setting
// takes its default when 0 (pipeline.Config's, the connectors', the
// audit's): given 0, or less, the command would go on with the default
// and say nothing, so it refuses them. Every other numeric flag whose
// default is not 0 says in its usage what 0 does (a test holds both).
const positiveMark = "wmrl:positive"

// positive marks the named flags of fs, defined already, as positiveMark.
func positive(fs *pflag.FlagSet, names ...string) { mark(fs, positiveMark, names...) }

// mark sets the annotation how on the named flags of fs, defined already.
func mark(fs *pflag.FlagSet, how string, names ...string) {
	for _, name := range names {
		if err := fs.SetAnnotation(name, how, []string{"true"}); err != nil {
			panic(fmt.Sprintf("wmrl: %v", err)) // a flag renamed and not here
		}
	}
}

// firstMarked is refuse's error for the first flag of cmd marked how and
// given (on the command line or in --config), nil if refuse takes them all.
func firstMarked(cmd *cobra.Command, how string, refuse func(*pflag.Flag) error) error {
	var refused error
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if _, marked := f.Annotations[how]; marked && f.Changed && refused == nil {
			refused = refuse(f)
		}
	})
	return refused
}

// refuseNotPositive names a flag of cmd marked positive given 0 or less,
// on the command line or in --config.
func refuseNotPositive(cmd *cobra.Command) error {
	return firstMarked(cmd, positiveMark, func(f *pflag.Flag) error {
		v := f.Value.String()
		x, err := strconv.ParseFloat(v, 64)
		if d, derr := time.ParseDuration(v); err != nil && derr == nil {
			x, err = d.Seconds(), nil
		}
		switch {
		case err != nil || x > 0: // taken
			return nil
		case isZero(f.DefValue): // left out, it takes what the command reads elsewhere (replay: as recorded)
			return fmt.Errorf("--%s %s: want more than 0", f.Name, v)
		}
		return fmt.Errorf("--%s %s: want more than 0 (its default is %s)", f.Name, v, f.DefValue)
	})
}

// refuseEmbedded names a setting of the embedded server (embeddedMark)
// given with --nats, which starts none: taken, it would be ignored.
func refuseEmbedded(cmd *cobra.Command) error {
	if nats := cmd.Flags().Lookup("nats"); nats == nil || nats.Value.String() == "" {
		return nil
	}
	return firstMarked(cmd, embeddedMark, func(f *pflag.Flag) error {
		return fmt.Errorf("--%s is the embedded server's, and with --nats this process starts none: "+
			"the server's own configuration sets it (leave --%s out)", f.Name, f.Name)
	})
}

// isZero reports whether a flag's default reads as 0 (0, 0s).
func isZero(def string) bool {
	if x, err := strconv.ParseFloat(def, 64); err == nil {
		return x == 0
	}
	d, err := time.ParseDuration(def)
	return err == nil && d == 0
}

// worldModelFlags binds the flags of an OpenAI-compatible world model
// (run, stage, wm-eval); its key comes from WMRL_WM_API_KEY.
func worldModelFlags(fs *pflag.FlagSet, cfg *pipeline.Config) {
	cfg.WMAPIKey = os.Getenv("WMRL_WM_API_KEY")
	fs.StringVar(&cfg.WMURL, "wm-url", "", "base URL of the world model's server, e.g. http://127.0.0.1:8000/v1")
	fs.StringVar(&cfg.WMModel, "wm-model", "", "model name the world model's server serves")
	fs.StringVar(&cfg.WMTemplateFile, "wm-template", "", "prompt template file (Go text/template over .TaskID .Prompt .Code .DataSummary .Limits)")
	fs.IntVar(&cfg.WMSamples, "wm-samples", 1, "samples per trajectory, averaged (their spread is recorded)")
	fs.Float64Var(&cfg.WMTemperature, "wm-temperature", 0, "sampling temperature of the world model (use > 0 with --wm-samples > 1)")
	fs.IntVar(&cfg.WMMaxTokens, "wm-max-tokens", 512, "max tokens of a world-model reply")
	fs.IntVar(&cfg.WMConcurrency, "wm-concurrency", 16, "world-model requests in flight at most, per process (a vLLM or SGLang server batches many)")
	fs.DurationVar(&cfg.WMTimeout, "wm-timeout", 120*time.Second, "time a world-model request may take before it is given up (and retried)")
	fs.IntVar(&cfg.WMRetries, "wm-retries", cfg.WMRetries, "how often a world-model request that failed (429, 5xx, timeout, connection) is tried again, with jittered backoff; a call fails once its last retry has (0: never)")
	positive(fs, "wm-samples", "wm-max-tokens", "wm-concurrency", "wm-timeout")
}

// natsAuthFlags binds what an external NATS server may ask of a client.
// The secrets come from WMRL_NATS_USER and WMRL_NATS_PASSWORD, or
// WMRL_NATS_TOKEN (or the URL's user info).
func natsAuthFlags(fs *pflag.FlagSet, a *natsjs.Auth) {
	*a = natsjs.AuthFromEnv()
	fs.StringVar(&a.Creds, "nats-creds", "", "user credentials file (JWT and NKey seed, as nsc writes it) for --nats")
	fs.StringVar(&a.NKey, "nats-nkey", "", "file with a user's NKey seed for --nats")
	fs.StringVar(&a.CA, "nats-ca", "", "PEM file of the CA that signed --nats's server certificate (default: the system's)")
	fs.StringVar(&a.Cert, "nats-cert", "", "client certificate (PEM) for a --nats server that verifies its clients; with --nats-key")
	fs.StringVar(&a.Key, "nats-key", "", "key (PEM) of --nats-cert")
}

// stepLineFlags binds, for run and stage (those that may fuse steps), how
// the steps fused are printed.
func stepLineFlags(fs *pflag.FlagSet, cfg *pipeline.Config) {
	fs.BoolVar(&cfg.NoStepLines, "quiet", false, "no line for each step fused (notes, warnings and the closing line still print)")
	fs.DurationVar(&cfg.StepSummary, "step-summary", 0, "instead of a line for each step fused, one line this often summing up the steps fused in it (how many, how fast, the newest's rho, D and calibration, latencies, what was lost): for a run of days, or at full speed")
}

// pipelineFlags binds the flags of a process of the pipeline to a Config:
// run has them all; stage (on --nats) all but the embedded server's; serve,
// which runs no stage, only the stream's and the gateway's, so that its
// help and its --config name what it reads.
func pipelineFlags(fs *pflag.FlagSet, cfg *pipeline.Config, estimator *string) {
	streamFlags(fs, cfg)
	embeddedServerFlags(fs, cfg)
	gatewayFlags(fs, cfg)
	stageFlags(fs, cfg, estimator)
}

// streamFlags binds where a process finds its run's stream, and how a
// process that creates the stream keeps it (run, stage, serve).
func streamFlags(fs *pflag.FlagSet, cfg *pipeline.Config) {
	fs.StringVar(&cfg.Run, "run", cfg.Run, "run name (a subject token)")
	fs.StringVar(&cfg.Prefix, "prefix", cfg.Prefix, "subject prefix")
	fs.StringVar(&cfg.NATSURL, "nats", "", "external NATS URL or cluster (default: embedded server)")
	natsAuthFlags(fs, &cfg.NATSAuth)
	fs.StringVar(&cfg.TopologyFile, "topology", "", "YAML file re-pointing stage subjects")
	fs.DurationVar(&cfg.MaxAge, "retention", 0, "how long the stream keeps every message (trajectories, stage messages, updates); 0: the stream's own, or 7 days for a new one")
	fs.DurationVar(&cfg.Duplicates, "dedup-window", 0, "the stream's de-duplication window, whose message IDs the server holds in memory; 0: the stream's own, or 10 minutes for a new one")
	fs.IntVar(&cfg.Replicas, "replicas", 0, "replicas of the stream and the checkpoint bucket on a JetStream cluster: 3 survives a node's loss (needs --nats); 0 creates them with 1 and leaves existing ones as they are")
}

// embeddedMark marks, among a flag's annotations, a setting of the
// embedded server, which a process on --nats does not start.
const embeddedMark = "wmrl:embedded"

// embeddedServerFlags binds the embedded server's settings (run; stage and
// serve need --nats). Given with --nats, they are refused (refuseEmbedded).
func embeddedServerFlags(fs *pflag.FlagSet, cfg *pipeline.Config) {
	fs.StringVar(&cfg.Listen, "listen", cfg.Listen, "client address of the embedded server (port 0: any free one)")
	fs.StringVar(&cfg.ListenTLS.Cert, "listen-cert", "", "certificate (PEM) of the embedded server: clients over the network then speak TLS (tls:// URLs); with --listen-key")
	fs.StringVar(&cfg.ListenTLS.Key, "listen-key", "", "key (PEM) of --listen-cert")
	fs.StringVar(&cfg.ListenTLS.ClientCA, "listen-client-ca", "", "PEM file of the CA whose certificates the embedded server requires of every client over the network (with --listen-cert)")
	fs.IntVar(&cfg.MaxPayloadMB, "nats-max-payload-mb", 8, "largest message the embedded server takes, in MiB (1-64): a step's update is one message, about 400 bytes a trajectory")
	fs.Float64Var(&cfg.MaxStoreGB, "nats-max-store-gb", 0, "most the embedded server's store holds, in GiB (0: three quarters of what the disk gives it, what it holds and the free room, followed as other writers fill the disk or make room); a full store stops every stage until room is made, so leave the disk what the trainer needs")
	positive(fs, "nats-max-payload-mb")
	mark(fs, embeddedMark, "listen", "listen-cert", "listen-key", "listen-client-ca", "nats-max-payload-mb", "nats-max-store-gb")
}

// gatewayFlags binds what a process serves (metrics, the trainer gateway)
// and the world model that its reward endpoints, and a predict stage, ask
// (run, stage, serve). Secrets come from the environment, never from
// flags (they would show in ps).
func gatewayFlags(fs *pflag.FlagSet, cfg *pipeline.Config) {
	cfg.HTTPToken = os.Getenv("WMRL_HTTP_TOKEN")
	fs.StringVar(&cfg.MetricsAddr, "metrics", "", "serve Prometheus /metrics on this address, and Go's profiles at /debug/pprof/ to this machine")
	fs.BoolVar(&cfg.PprofRemote, "pprof-remote", false, "serve --metrics's Go profiles to other machines too (they show the command line, its URLs' user info hidden, and a CPU profile costs the run a core)")
	fs.StringVar(&cfg.HTTPAddr, "http", cfg.HTTPAddr, "serve the trainer HTTP gateway on this address")
	fs.StringVar(&cfg.HTTPCert, "http-cert", "", "certificate (PEM) for the gateway to speak HTTPS with, read again when it changes; with --http-key")
	fs.StringVar(&cfg.HTTPKey, "http-key", "", "key (PEM) of --http-cert")
	fs.DurationVar(&cfg.HTTPDrain, "http-drain", cfg.HTTPDrain, "how long a stopping process lets its gateway's requests in flight run, reward requests waiting for the world model among them (give a Kubernetes pod's terminationGracePeriodSeconds room for it); then those answer 503, asked again elsewhere, and what still runs a second later is cut off (0: they answer 503 at once)")
	fs.DurationVar(&cfg.RewardMemory, "reward-memory", cfg.RewardMemory, "how long the gateway's reward endpoints keep the world model's score of a solution, so that the same solution asked again (a trainer retrying a request) is not scored again (0: only while its call is under way, for a world model sampled anew each time)")
	fs.StringVar(&cfg.WorldModel, "world-model", "sim", "world model: sim, or openai (an OpenAI-compatible /v1/chat/completions server; key from WMRL_WM_API_KEY)")
	worldModelFlags(fs, cfg)
	fs.IntVar(&cfg.WMDownAfter, "wm-down-after", cfg.WMDownAfter, "after this many world-model calls in a row failed (each after the connector's own retries), or twice --wm-concurrency requests in a row, give its groups up at once, recorded ungraded, and answer the gateway's reward requests 503, until a call succeeds again (0: never; each group then waits out its retries)")
	fs.DurationVar(&cfg.WMProbeEvery, "wm-probe-every", cfg.WMProbeEvery, "while the world model is down (--wm-down-after), let one group's call through this often to see whether it is back")
	positive(fs, "wm-probe-every")
}

// stageFlags binds the stages' settings (run, stage).
func stageFlags(fs *pflag.FlagSet, cfg *pipeline.Config, estimator *string) {
	fs.StringVar(&cfg.DataDir, "data", cfg.DataDir, "data directory: the embedded server's store (DATA/nats) and, unless --archive says otherwise, the archive (DATA/archive)")
	fs.IntVar(&cfg.CheckpointEvery, "checkpoint-every", 0, "calibrate and fuse checkpoint their state every this many anchor groups (0: 256) and when they stop, so that a restart reads only what was stored after them, and does not need what --retention aged out")
	fs.StringVar(&cfg.Executor, "executor", "", "anchor executor: sim, subprocess (real execution of the --task here) or sandbox-fusion (on --sandbox-url)")
	fs.StringVar(&cfg.SandboxURL, "sandbox-url", "", "Sandbox Fusion server for --executor sandbox-fusion, e.g. http://127.0.0.1:8080")
	fs.StringVar(&cfg.TaskDir, "task", "", "task directory (task.json, public/, private/, leaderboard.csv), or a directory of task directories, where each trajectory is executed on the task its task_id names (a single task takes every trajectory); implies --executor subprocess")
	fs.DurationVar(&cfg.ExecTimeout, "exec-timeout", 0, "wall-clock limit of one real execution (0: the task's time_limit_seconds, else 60s); past it the solution scores 0 as timed_out")
	fs.IntVar(&cfg.ExecMemoryMB, "exec-memory-mb", 0, "address space of one real execution, in MiB (0: the task's memory_mb, else 1024, or no limit with --exec-gpus; -1: no limit, which CUDA needs)")
	fs.IntVar(&cfg.ExecDiskMB, "exec-disk-mb", 0, "what one execution of --executor subprocess may keep on disk in its directory, its /tmp, the task's data apart, in MiB; code that writes more is killed, a crash (0: 16384; -1: no limit)")
	fs.IntVar(&cfg.ExecSubmissionMB, "exec-submission-mb", 0, "largest submission file that a real execution's grader reads, in MiB: a larger one is invalid, as is (with --executor subprocess) one that is not a file in the code's directory (0: 1024)")
	fs.StringVar(&cfg.ExecPython, "exec-python", "", "Python that runs the solutions of --executor subprocess, e.g. a virtualenv's /opt/ml/bin/python with the task's packages (its directory leads the code's PATH; default: python3 on /usr/local/bin:/usr/bin:/bin)")
	fs.StringVar(&cfg.ExecGPUs, "exec-gpus", "", "GPUs that --executor subprocess shares out among the executions at once, as nvidia-smi lists them (0,1,2,3 or UUIDs): each sees only its own, as CUDA_VISIBLE_DEVICES, and waits for free ones, here and in other wmrl processes on the machine (default: every execution sees every GPU)")
	fs.IntVar(&cfg.ExecGPUsEach, "exec-gpus-each", 0, "GPUs of --exec-gpus that each execution gets, taken in the order given (0: 1)")
	fs.StringVar(&cfg.ExecUIDs, "exec-uids", "", "FIRST-LAST: as root, run each execution at once as a user of its own from this range (unused ids, no account needed), so that executions cannot read or overwrite each other's files; other wmrl processes on the machine given the same ones wait for them (default: all as nobody)")
	fs.StringArrayVar(&cfg.ExecEnv, "exec-env", nil, "KEY=VALUE added to the environment of --executor subprocess's solutions (repeat it), e.g. OMP_NUM_THREADS=4")
	fs.IntVar(&cfg.ExecProcesses, "exec-processes", 0, "processes and threads of the user executions run as: all of this process's executions at once share it, unless --exec-uids gives each its own (0: (64 + 8 per core) per --exec-slots)")
	fs.IntVar(&cfg.ExecCPUSeconds, "exec-cpu-seconds", 0, "CPU time of one real execution, all its threads (0: the wall-clock limit times this machine's cores, plus 1); subprocess only")
	fs.Float64Var(&cfg.Anchors.Fraction, "anchor-fraction", cfg.Anchors.Fraction, "share of groups executed for real (0: --anchor-min groups a step)")
	fs.IntVar(&cfg.Anchors.MinPerStep, "anchor-min", cfg.Anchors.MinPerStep, "minimum anchor groups per step (0: none where the fraction rounds to none)")
	fs.StringVar(&cfg.Anchors.Rounding, "anchor-rounding", cfg.Anchors.Rounding, "how a step's fraction of its groups becomes a whole count: even (round half to even every step, the reference: 0.10 of 16 groups executes 2) or spread (1 or 2 a step, so that any run of steps executes the fraction to within one group)")
	fs.Uint64Var(&cfg.Anchors.Seed, "anchor-seed", 0, "seed of the anchor draw")
	fs.IntVar(&cfg.Anchors.MaxInFlight, "anchor-max-in-flight", 0, "cap on anchor groups sent for execution and not executed yet; a step planned at the cap gets fewer anchors (0: no cap)")
	fs.StringVar(&cfg.ExecConsumer, "exec-consumer", "", "JetStream consumer whose backlog counts executions in flight (default: the execute stage's)")
	fs.BoolVar(&cfg.Debias, "debias", cfg.Debias, "apply the isotonic calibration to world-model scores")
	fs.StringVar(&cfg.Debiaser.BeforeFit, "before-fit", cfg.Debiaser.BeforeFit, "the calibration map before its first fit: mean (flat at the anchors' mean score: no within-group signal from a world model not yet checked) or identity (raw world-model scores, the reference)")
	fs.IntVar(&cfg.Debiaser.MinPairs, "min-pairs", cfg.Debiaser.MinPairs, "anchor pairs buffered before the first isotonic fit (0: the reference's 200)")
	fs.IntVar(&cfg.Debiaser.RefitEvery, "refit-every", cfg.Debiaser.RefitEvery, "refit the isotonic map after this many new pairs (0: the reference's 64)")
	fs.IntVar(&cfg.Debiaser.Bins, "bins", cfg.Debiaser.Bins, "equal-width bins before the isotonic fit (0: raw pairs)")
	fs.IntVar(&cfg.Debiaser.BufferSize, "buffer", cfg.Debiaser.BufferSize, "anchor pairs kept for the fit")
	fs.StringVar(estimator, "rho", string(fuse.DefaultEstimator), "rho estimator: reference, ratio, advantage or off")
	fs.StringVar((*string)(&cfg.AdvantageNorm), "advantage-norm", string(cfg.AdvantageNorm), "how a group's advantages are formed, as the trainer the fused advantages replace forms its own: std ((r - mean) / std, GRPO; verl's norm_adv_by_std_in_grpo true) or center (r - mean, Dr. GRPO; norm_adv_by_std_in_grpo false)")
	fs.DurationVar(&cfg.StepTimeout, "step-timeout", 30*time.Second, "a step is planned this long after its watermark with what came, when groups are missing or short of their group_size (said, and counted in wmrl_steps_closed_short_total)")
	fs.DurationVar(&cfg.AnchorDeadline, "anchor-deadline", cfg.AnchorDeadline, "anchors later than this fall back to world-model rewards for their step")
	fs.DurationVar(&cfg.PairWait, "pair-wait", cfg.PairWait, "an anchor group's prediction or execution waits at most this long for the other (their pairs calibrate even when late), then goes to the dead letters")
	fs.DurationVar(&cfg.StuckAfter, "stuck-after", cfg.StuckAfter, "say so when a step still misses a group's prediction this long after fuse got its plan (a prediction has no deadline: a step waits for every group's), or has had trajectories this long and no watermark")
	fs.DurationVar(&cfg.ExecLatency, "exec-latency", cfg.ExecLatency, "latency of the simulated executor")
	fs.IntVar(&cfg.ExecSlots, "exec-slots", 16, "executions at once in this process's execute stage")
	fs.BoolVar(&cfg.ExecCopiesOnce, "exec-copies-once", false, "execute a solution (the same task, prompt and response) once in the run and give its copies, in its anchor group or another, that outcome: right for deterministic executions (a test suite), not where the score varies from run to run (a seed)")
	fs.IntVar(&cfg.ExecDownAfter, "exec-down-after", cfg.ExecDownAfter, "after this many executions in a row failed (the executor's errors, not a solution's), publish anchor groups at once with their executions ungraded, so that their steps use the world model for them, until one succeeds again (0: never; each group then waits out its retries)")
	fs.DurationVar(&cfg.ExecProbeEvery, "exec-probe-every", cfg.ExecProbeEvery, "while the executor is down (--exec-down-after), let one execution through this often to see whether it is back")
	fs.StringVar(&cfg.ArchiveDir, "archive", "", "Parquet archive root of the archive stage (default: DATA/archive; off: no archive)")
	fs.DurationVar(&cfg.ArchiveMaxAge, "archive-max-age", 10*time.Second, "close an archive file (and acknowledge its inputs) after this long")
	fs.IntVar(&cfg.ArchiveMaxRows, "archive-max-rows", 1_000_000, "close an archive file after this many rows")
	fs.BoolVar(&cfg.ArchiveCode, "archive-code", cfg.ArchiveCode, "archive the anchor groups' prompts and responses in their rows (what evaluating or training another world model on the executions needs)")
	fs.DurationVar(&cfg.ArchiveCompactAfter, "archive-compact-after", cfg.ArchiveCompactAfter, "merge closed archive files older than this into files of up to --archive-max-rows rows, in the background (0: never)")
	positive(fs, "exec-slots", "exec-latency", "exec-probe-every", "buffer", "step-timeout",
		"anchor-deadline", "pair-wait", "stuck-after", "archive-max-age", "archive-max-rows")
}

// noArchive drops the archive stage from a run given --archive off.
func noArchive(cfg *pipeline.Config) {
	if cfg.ArchiveDir == "off" {
		cfg.ArchiveDir = ""
		cfg.Stages = slices.DeleteFunc(slices.Clone(cfg.Stages), func(s string) bool { return s == pipeline.StageArchive })
	}
}

func runCommand() *cobra.Command {
	cfg := pipeline.DefaultConfig()
	var estimator string
	cmd := &cobra.Command{
		Use:   "run",
		Short: "Run the whole pipeline in one process (embedded NATS, simulated rollouts by default)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg.Denoiser.Estimator = fuse.Estimator(estimator)
			cfg.Out = cmd.OutOrStdout()
			noArchive(&cfg)
			followMemoryLimit(cmd.Context(), cfg.Out, cfg.Quiet)
			return pipeline.Run(cmd.Context(), cfg)
		},
	}
	fs := cmd.Flags()
	pipelineFlags(fs, &cfg, &estimator)
	fs.Int64Var(&cfg.Steps, "steps", 0, "stop after this many steps (0: until Ctrl-C)")
	fs.StringVar(&cfg.Source, "source", cfg.Source, "sim: simulated rollouts; external: wait for trajectories from outside")
	fs.IntVar(&cfg.Groups, "groups", cfg.Groups, "groups per step (simulated source)")
	fs.IntVar(&cfg.GroupSize, "group-size", cfg.GroupSize, "trajectories per group (simulated source)")
	fs.Uint64Var(&cfg.Seed, "seed", 0, "seed of the simulated source")
	positive(fs, "groups", "group-size")
	stepLineFlags(fs, &cfg)
	return cmd
}

func stageCommand() *cobra.Command {
	cfg := pipeline.DefaultConfig()
	var estimator string
	cmd := &cobra.Command{
		Use:   "stage NAME",
		Short: "Run one stage alone (" + strings.Join(pipeline.AllStages, ", ") + "); processes of predict or execute share the work, a second of another waits to take over from the first",
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) != 1 {
				return fmt.Errorf("stage NAME: name one stage (%s); got %d", strings.Join(pipeline.AllStages, ", "), len(args))
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if cfg.NATSURL == "" {
				return fmt.Errorf("stage %s: --nats URL is required (the server other stages use)", args[0])
			}
			cfg.Stages = []string{args[0]}
			cfg.Source = pipeline.SourceExternal
			cfg.Denoiser.Estimator = fuse.Estimator(estimator)
			cfg.Out = cmd.OutOrStdout()
			followMemoryLimit(cmd.Context(), cfg.Out, cfg.Quiet)
			return pipeline.Run(cmd.Context(), cfg)
		},
	}
	fs := cmd.Flags()
	streamFlags(fs, &cfg)
	fs.Lookup("nats").Usage = "NATS URL or cluster of the run's server, which the other stages use (required)"
	gatewayFlags(fs, &cfg)
	stageFlags(fs, &cfg, &estimator)
	stepLineFlags(fs, &cfg)
	return cmd
}

func serveCommand() *cobra.Command {
	cfg := pipeline.DefaultConfig()
	cmd := &cobra.Command{
		Use:   "serve --nats URL --http ADDR",
		Short: "Serve the trainer HTTP gateway for a pipeline running elsewhere (bearer token from WMRL_HTTP_TOKEN)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cfg.NATSURL == "" || cfg.HTTPAddr == "" {
				return fmt.Errorf("serve: --nats URL and --http ADDR are required")
			}
			cfg.Stages = []string{}
			cfg.Source = pipeline.SourceExternal
			cfg.Out = cmd.OutOrStdout()
			followMemoryLimit(cmd.Context(), cfg.Out, cfg.Quiet)
			return pipeline.Run(cmd.Context(), cfg)
		},
	}
	streamFlags(cmd.Flags(), &cfg)
	cmd.Flags().Lookup("nats").Usage = "NATS URL or cluster of the run's server, which its stages use (required)"
	gatewayFlags(cmd.Flags(), &cfg)
	return cmd
}
