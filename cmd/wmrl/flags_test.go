package main

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/stages/calibrate"
)

// The calibration flags of run and stage land in the debiaser's config, and
// left alone they keep the project's defaults.
func TestCalibrationFlagsReachTheDebiaser(t *testing.T) {
	parse := func(args ...string) pipeline.Config {
		cfg := pipeline.DefaultConfig()
		var estimator string
		fs := pflag.NewFlagSet("run", pflag.ContinueOnError)
		pipelineFlags(fs, &cfg, &estimator)
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	def := parse().Debiaser
	if def != calibrate.DefaultDebiaserConfig() {
		t.Errorf("no flags: debiaser %+v, want the defaults %+v", def, calibrate.DefaultDebiaserConfig())
	}
	got := parse("--before-fit", "identity", "--min-pairs", "32", "--refit-every", "16", "--bins", "0", "--buffer", "900").Debiaser
	want := calibrate.DebiaserConfig{BeforeFit: calibrate.BeforeFitIdentity, MinPairs: 32, RefitEvery: 16, Bins: 0, BufferSize: 900}
	if got != want {
		t.Errorf("debiaser %+v, want %+v", got, want)
	}
	if n := parse("--checkpoint-every", "8").CheckpointEvery; n != 8 {
		t.Errorf("--checkpoint-every 8 gives %d", n)
	}
	if c := parse(); c.WMRetries != 5 || c.WMTimeout != 120*time.Second {
		t.Errorf("no flags: world-model retries %d, timeout %v; want 5, 2m0s", c.WMRetries, c.WMTimeout)
	}
	if c := parse("--wm-retries", "0", "--wm-timeout", "20s"); c.WMRetries != 0 || c.WMTimeout != 20*time.Second {
		t.Errorf("--wm-retries 0 --wm-timeout 20s gives %d, %v", c.WMRetries, c.WMTimeout)
	}
}

// What a NATS server asks of a client reaches the pipeline from the
// environment (secrets) and the flags (files), on run and stage as on the
// commands that read a run from outside.
func TestNATSAuthComesFromTheEnvironmentAndTheFlags(t *testing.T) {
	t.Setenv("WMRL_NATS_USER", "trainer")
	t.Setenv("WMRL_NATS_PASSWORD", "s3cret")
	files := []string{"--nats-creds", "u.creds", "--nats-ca", "ca.pem", "--nats-cert", "c.pem", "--nats-key", "k.pem"}
	want := natsjs.Auth{User: "trainer", Password: "s3cret", Creds: "u.creds", CA: "ca.pem", Cert: "c.pem", Key: "k.pem"}

	cfg := pipeline.DefaultConfig()
	var estimator string
	fs := pflag.NewFlagSet("run", pflag.ContinueOnError)
	pipelineFlags(fs, &cfg, &estimator)
	if err := fs.Parse(files); err != nil {
		t.Fatal(err)
	}
	if cfg.NATSAuth != want {
		t.Errorf("run: %+v, want %+v", cfg.NATSAuth, want)
	}
	fs = pflag.NewFlagSet("run", pflag.ContinueOnError)
	pipelineFlags(fs, &cfg, &estimator)
	if err := fs.Parse([]string{"--listen-cert", "s.pem", "--listen-key", "sk.pem", "--listen-client-ca", "ca.pem", "--http-cert", "h.pem", "--http-key", "hk.pem"}); err != nil {
		t.Fatal(err)
	}
	if want := (natsjs.ServerTLS{Cert: "s.pem", Key: "sk.pem", ClientCA: "ca.pem"}); cfg.ListenTLS != want {
		t.Errorf("run's embedded server's TLS: %+v, want %+v", cfg.ListenTLS, want)
	}
	if cfg.HTTPCert != "h.pem" || cfg.HTTPKey != "hk.pem" {
		t.Errorf("run's gateway certificate %q and key %q, want h.pem and hk.pem", cfg.HTTPCert, cfg.HTTPKey)
	}
	var src pipeline.StreamSource
	var run string
	fs = pflag.NewFlagSet("status", pflag.ContinueOnError)
	streamSourceFlags(fs, &src, &run)
	if err := fs.Parse(files); err != nil {
		t.Fatal(err)
	}
	if src.Auth != want {
		t.Errorf("status: %+v, want %+v", src.Auth, want)
	}
}

// wmrl run --quiet prints no line a step and still says what a run must
// (here its closing line); before, it printed nothing at all, warnings
// included.
func TestQuietLeavesOutTheStepsAlone(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := wmrl(ctx, "run", "--steps", "4", "--quiet", "--data", t.TempDir(), "--listen", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("%v:\n%s", err, out)
	}
	if regexp.MustCompile(`(?m)^steps? `).MatchString(out) || !strings.Contains(out, "done: steps 0-3 fused and archived") {
		t.Errorf("wmrl run --quiet said:\n%s\nwant no step lines and its closing line", out)
	}
}

// A flag whose setting takes its default when 0 refuses 0 and less, on the
// command line and in --config, naming the flag and its default: before,
// `wmrl run --groups 0` ran 16 groups a step and said nothing. dlq's
// --since, whose 0 is "all", refuses less than 0, which listed all too, as
// compact's --min-age does (it merged every file); audit's
// --anchor-deadline -1s read the archive's own, unsaid; wm-eval's --groups
// -1 evaluated every group and its --wm-retries -1 tried each call once.
func TestAFlagThatCannotBeZeroSaysSo(t *testing.T) {
	ctx := context.Background()
	conf := filepath.Join(t.TempDir(), "run.yaml")
	if err := os.WriteFile(conf, []byte("exec-slots: 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"run", "--groups", "0"}, "--groups 0: want more than 0 (its default is 16)"},
		{[]string{"run", "--group-size", "-2"}, "--group-size -2: want more than 0 (its default is 8)"},
		{[]string{"stage", "route", "--nats", "nats://127.0.0.1:1", "--step-timeout", "0s"}, "--step-timeout 0s: want more than 0 (its default is 30s)"},
		{[]string{"run", "--config", conf}, "--exec-slots 0: want more than 0 (its default is 16)"},
		{[]string{"audit", "--tolerance", "0"}, "--tolerance 0: want more than 0 (its default is 0.05)"},
		{[]string{"dlq", "--since", "-5m"}, "--since -5m0s: want how far back from now, such as 15m (0: all)"},
		{[]string{"compact", "--min-age", "-1s"}, "--min-age -1s: want a duration >= 0 (0: every file)"},
		{[]string{"audit", "--anchor-deadline", "-1s"}, "--anchor-deadline -1s: want more than 0"},
		{[]string{"wm-eval", "--wm-url", "http://127.0.0.1:1/v1", "--wm-model", "m", "--groups", "-1"}, "wm-eval: --groups -1: want a number of anchor groups >= 0 (0: all)"},
		{[]string{"wm-eval", "--wm-url", "http://127.0.0.1:1/v1", "--wm-model", "m", "--wm-retries", "-1"},
			"wm-eval: pipeline: invalid config: --wm-timeout 2m0s and --wm-retries -1: want >= 0"},
	} {
		if out, err := wmrl(ctx, c.args...); err == nil || err.Error() != c.want {
			t.Errorf("wmrl %s: %v\n%s\nwant %q", strings.Join(c.args, " "), err, out, c.want)
		}
	}
	// Where 0 means something of its own, it is taken: run's --bins 0 fits
	// the raw pairs, wm-eval's --groups 0 evaluates every group.
	root := rootCommand()
	for _, args := range [][]string{{"run", "--bins", "0"}, {"wm-eval", "--groups", "0"}} {
		cmd, rest, err := root.Find(args)
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.ParseFlags(rest); err != nil {
			t.Fatal(err)
		}
		if err := refuseNotPositive(cmd); err != nil {
			t.Errorf("wmrl %s: %v", strings.Join(args, " "), err)
		}
	}
}

// Every numeric flag whose default is not 0 either refuses 0 (marked
// positive: its 0 would take the default and say nothing) or says in its
// usage what 0 does, or its command refuses 0 itself, naming it. Before
// it, --wm-timeout 0, --buffer 0, --archive-max-rows 0 and five more of
// run, stage and serve (serve's whole list), compact's --max-rows 0 and
// wm-eval's --concurrency 0 ran with their defaults and said nothing.
func TestEveryNumericFlagSaysWhatItsZeroDoes(t *testing.T) {
	zeroSays := regexp.MustCompile(`(^|[^0-9.])0( [a-z]+)?: `)
	// Refused by the command's own checks, with a reason of their own;
	// args keep the command from doing more than check, were it to take 0.
	refusedBy := map[string]struct{ flags, args []string }{
		"sim": {[]string{"seeds", "steps", "groups", "tasks", "group-size", "exec-noise"}, []string{"--no-sweep", "--out", t.TempDir()}},
	}
	numeric := map[string]bool{"int": true, "int64": true, "uint": true, "uint64": true, "float64": true, "duration": true}
	var visit func(cmd *cobra.Command)
	visit = func(cmd *cobra.Command) {
		for _, sub := range cmd.Commands() {
			visit(sub)
		}
		name := cmd.Name()
		cmd.Flags().VisitAll(func(f *pflag.Flag) {
			_, marked := f.Annotations[positiveMark]
			documented := zeroSays.MatchString(f.Usage)
			if marked && documented {
				t.Errorf("%s --%s refuses 0, and its usage says what 0 does: %q", name, f.Name, f.Usage)
			}
			if marked {
				fresh, rest, err := rootCommand().Find(append(strings.Fields(cmd.CommandPath())[1:], "--"+f.Name, "0"))
				if err == nil {
					err = fresh.ParseFlags(rest)
				}
				if err == nil {
					err = refuseNotPositive(fresh)
				}
				if err == nil || !strings.Contains(err.Error(), "--"+f.Name+" 0") {
					t.Errorf("%s --%s 0: %v; want it refused, naming it", name, f.Name, err)
				}
				return
			}
			if !numeric[f.Value.Type()] || isZero(f.DefValue) || strings.HasSuffix(f.Name, "seed") || documented {
				return
			}
			if by := refusedBy[name]; slices.Contains(by.flags, f.Name) {
				_, err := wmrl(context.Background(), append([]string{name, "--" + f.Name, "0"}, by.args...)...)
				words := strings.ReplaceAll(f.Name, "-", " ") + " 0"
				if err == nil || !strings.Contains(err.Error(), "--"+f.Name+" 0") && !strings.Contains(err.Error(), words) {
					t.Errorf("wmrl %s --%s 0: %v; want it refused, naming it", name, f.Name, err)
				}
				return
			}
			t.Errorf("%s --%s (default %s): neither refuses 0 nor says what it does: %q", name, f.Name, f.DefValue, f.Usage)
		})
	}
	visit(rootCommand())
}

// `wmrl stage` without a stage's name lists the stages, where cobra said
// "accepts 1 arg(s), received 0".
func TestStageWithoutANameListsThem(t *testing.T) {
	want := "stage NAME: name one stage (route, predict, execute, pair, calibrate, fuse, archive); got 0"
	if out, err := wmrl(context.Background(), "stage", "--nats", "nats://127.0.0.1:1"); err == nil || err.Error() != want {
		t.Errorf("wmrl stage: %v\n%s\nwant %q", err, out, want)
	}
}

// A process takes only the settings it reads. serve, which runs no stage,
// has no stage's flags, and stage and serve, on --nats, none of the
// embedded server's; run refuses those with --nats. Before, each of these
// was taken and did nothing, and serve's help listed 80 flags (31 now).
func TestAProcessTakesOnlyTheSettingsItReads(t *testing.T) {
	ctx := context.Background()
	conf := filepath.Join(t.TempDir(), "gateway.yaml")
	if err := os.WriteFile(conf, []byte("http: 127.0.0.1:1\nanchor-fraction: 0.2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	listen := filepath.Join(t.TempDir(), "run.yaml")
	if err := os.WriteFile(listen, []byte("listen: 127.0.0.1:4333\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	const nats = "nats://127.0.0.1:1"
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"serve", "--nats", nats, "--http", "127.0.0.1:1", "--exec-slots", "4"}, "unknown flag: --exec-slots"},
		{[]string{"serve", "--nats", nats, "--config", conf}, `--config ` + conf + `:2: wmrl serve has no setting "anchor-fraction"`},
		{[]string{"serve", "--nats", nats, "--http", "127.0.0.1:1", "--data", "d"}, "unknown flag: --data"},
		{[]string{"stage", "route", "--nats", nats, "--listen", "127.0.0.1:4333"}, "unknown flag: --listen"},
		{[]string{"stage", "route", "--nats", nats, "--nats-max-payload-mb", "16"}, "unknown flag: --nats-max-payload-mb"},
		{[]string{"run", "--nats", nats, "--nats-max-payload-mb", "16"},
			"--nats-max-payload-mb is the embedded server's, and with --nats this process starts none: the server's own configuration sets it (leave --nats-max-payload-mb out)"},
		{[]string{"run", "--nats", nats, "--config", listen},
			"--listen is the embedded server's, and with --nats this process starts none: the server's own configuration sets it (leave --listen out)"},
	} {
		if out, err := wmrl(ctx, c.args...); err == nil || err.Error() != c.want {
			t.Errorf("wmrl %s: %v\n%s\nwant %q", strings.Join(c.args, " "), err, out, c.want)
		}
	}
	// Without --nats, run starts the server those settings are for.
	cmd, rest, err := rootCommand().Find([]string{"run", "--listen", "127.0.0.1:4333", "--nats-max-payload-mb", "16"})
	if err == nil {
		err = cmd.ParseFlags(rest)
	}
	if err == nil {
		err = refuseEmbedded(cmd)
	}
	if err != nil {
		t.Errorf("wmrl run --listen 127.0.0.1:4333 --nats-max-payload-mb 16: %v", err)
	}
}

// wmrl --version says which build it is, as wmrl_build_info labels it.
func TestVersionSaysWhichBuild(t *testing.T) {
	out, err := wmrl(context.Background(), "--version")
	if want := "wmrl " + pipeline.ReadBuild().String() + "\n"; err != nil || out != want {
		t.Errorf("wmrl --version (%v): %q, want %q", err, out, want)
	}
}
