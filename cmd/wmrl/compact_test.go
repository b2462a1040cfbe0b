package main

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/pipeline/offline/offlinetest"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/fuse"
)

// TestCompactedArchiveReplaysTheSame: an archive of many small files,
// merged by wmrl compact, holds the same rows in the same order, and a
// replay over it still reproduces the run exactly.
func TestCompactedArchiveReplaysTheSame(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := finishedRun(ctx, t, 40, func(cfg *pipeline.Config) {
		cfg.Debiaser.MinPairs, cfg.Debiaser.RefitEvery = 32, 16
		cfg.ArchiveMaxAge = 5 * time.Millisecond // a file every few steps
		cfg.ArchiveCompactAfter = 0
	})
	root := cfg.ArchiveRoot()
	files, _ := archive.Files(root, cfg.Run)
	before, err := archive.ReadAll(root, cfg.Run)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) < 5 {
		t.Fatalf("the run left %d archive files; the test needs several", len(files))
	}

	t.Logf("%d files, %d rows", len(files), len(before))
	out, err := wmrl(ctx, "compact", "--archive", root)
	if err != nil {
		t.Fatal(err)
	}
	if want := "run default: " + strconv.Itoa(len(files)) + " files -> 1 (1 merged files, " + strconv.Itoa(len(before)) + " rows)"; !strings.Contains(out, want) {
		t.Errorf("wmrl compact said %q; want %q", out, want)
	}
	after, err := archive.ReadAll(root, cfg.Run)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(after, before) {
		t.Fatalf("the merged archive's %d rows differ from the %d before", len(after), len(before))
	}
	out, err = wmrl(ctx, "replay", "--archive", root)
	if err != nil || !strings.Contains(out, "REPRODUCED: identical") {
		t.Errorf("replay of the merged archive (%v):\n%s", err, out)
	}
}

// finishedRun runs the whole pipeline for steps steps on the simulator, in
// a fresh data directory, with set applied to its configuration, and
// returns that configuration once the run has ended.
func finishedRun(ctx context.Context, t *testing.T, steps int64, set func(*pipeline.Config)) pipeline.Config {
	t.Helper()
	cfg := pipeline.DefaultConfig()
	cfg.DataDir, cfg.Listen, cfg.Quiet = t.TempDir(), "127.0.0.1:0", true
	cfg.Steps, cfg.ExecLatency = steps, time.Millisecond
	set(&cfg)
	if err := pipeline.Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// TestReplayUnderOtherSettingsDrawsWhatChanged: wmrl replay with a setting
// changed writes the replayed rows and, beside them, a PNG of what the
// setting changed; the per-step table is printed only with --steps.
func TestReplayUnderOtherSettingsDrawsWhatChanged(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := finishedRun(ctx, t, 20, func(cfg *pipeline.Config) {
		cfg.Debiaser.MinPairs, cfg.Debiaser.RefitEvery = 32, 16
	})
	dir := t.TempDir()
	out, err := wmrl(ctx, "replay", "--archive", cfg.ArchiveRoot(), "--rho", "reference", "--out", filepath.Join(dir, "ref.parquet"))
	if err != nil {
		t.Fatalf("%v:\n%s", err, out)
	}
	pic := filepath.Join(dir, "ref.png")
	if !strings.Contains(out, "what changed, step by step: "+pic) || strings.Contains(out, "max|dfused|") {
		t.Errorf("wmrl replay --rho reference said:\n%s\nwant the plot named, %s, and no table of steps", out, pic)
	}
	offlinetest.DecodePNG(t, pic)
	if out, err := wmrl(ctx, "replay", "--archive", cfg.ArchiveRoot(), "--plot", filepath.Join(dir, "same.png")); err == nil || !strings.Contains(err.Error(), "--plot draws what other settings changed") {
		t.Errorf("wmrl replay --plot with the recorded settings (%v):\n%s\nwant it refused, saying why", err, out)
	}
	// Other settings that cannot be are refused by their flags' names,
	// before the archive is read (they were by the stages' field names).
	for _, bad := range [][]string{{"--rho", "median", `--rho "median": want reference, ratio, advantage or off`},
		{"--buffer", "1", "--buffer 1: want at least 2 anchor pairs"}, {"--min-pairs", "9000", "--buffer 5000 is under --min-pairs 9000"}} {
		if out, err := wmrl(ctx, "replay", "--archive", cfg.ArchiveRoot(), bad[0], bad[1]); err == nil || !strings.Contains(err.Error(), bad[2]) {
			t.Errorf("wmrl replay %s %s (%v):\n%s\nwant it refused, saying %q", bad[0], bad[1], err, out, bad[2])
		}
	}
	out, err = wmrl(ctx, "replay", "--archive", cfg.ArchiveRoot(), "--rho", "reference", "--out", filepath.Join(dir, "ref.parquet"), "--steps")
	if err != nil || strings.Count(out, "\n      19  ") != 1 {
		t.Errorf("wmrl replay --steps (%v) said:\n%s\nwant a line for step 19", err, out)
	}
}

// A run that forms its advantages as Dr. GRPO does records so in its
// archive: a replay on the recorded settings reproduces it, and one with
// GRPO's standardised advantages moves every fused advantage but none of
// their signs (a group's standard deviation only rescales it).
func TestARunsAdvantageNormIsReplayedAsRecorded(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := finishedRun(ctx, t, 20, func(cfg *pipeline.Config) {
		cfg.Debiaser.MinPairs, cfg.Debiaser.RefitEvery = 32, 16
		cfg.AdvantageNorm = fuse.CenterOnly
	})
	files, _ := archive.Files(cfg.ArchiveRoot(), cfg.Run)
	d, err := archive.Describe(files)
	if err != nil || d.Settings.AdvantageNorm != fuse.CenterOnly {
		t.Fatalf("the archive records advantage norm %q (%v), want center", d.Settings.AdvantageNorm, err)
	}
	out, err := wmrl(ctx, "replay", "--archive", cfg.ArchiveRoot())
	if err != nil || !strings.Contains(out, "REPRODUCED: identical") {
		t.Errorf("replay on the recorded settings (%v):\n%s", err, out)
	}
	out, err = wmrl(ctx, "replay", "--archive", cfg.ArchiveRoot(), "--advantage-norm", "std", "--out", filepath.Join(t.TempDir(), "std.parquet"))
	if err != nil || !strings.Contains(out, "with [advantage-norm std]: max |d fused| ") || !strings.Contains(out, "fused sign kept on 100.0% of rows") ||
		strings.Contains(out, "max |d fused| 0,") {
		t.Errorf("replay with standardised advantages (%v):\n%s\nwant every fused advantage moved, none of their signs", err, out)
	}
	if out, err := wmrl(ctx, "replay", "--archive", cfg.ArchiveRoot(), "--advantage-norm", "zscore"); err == nil ||
		!strings.Contains(err.Error(), `--advantage-norm "zscore": want "std" (GRPO`) {
		t.Errorf("replay --advantage-norm zscore (%v):\n%s\nwant it refused, naming the flag", err, out)
	}
}

// TestTheOfflineCommandsReadRunsArchiveByDefault: in the directory where
// wmrl run ran on its defaults, replay, audit and compact read its archive
// without --archive, and audit writes its report to audit-<run>; where
// there is none, or no such run, they say what to give.
func TestTheOfflineCommandsReadRunsArchiveByDefault(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	t.Chdir(t.TempDir())
	for _, args := range [][]string{{"replay"}, {"audit"}, {"compact"}} {
		if out, err := wmrl(ctx, args...); err == nil || !strings.Contains(err.Error(), "no archive at wmrl-data/archive, where wmrl run keeps it by default: give --archive") {
			t.Errorf("wmrl %s where no run ran (%v):\n%s\nwant it to say what to give", args[0], err, out)
		}
	}
	finishedRun(ctx, t, 10, func(cfg *pipeline.Config) { cfg.DataDir = pipeline.DefaultConfig().DataDir })
	if out, err := wmrl(ctx, "replay"); err != nil || !strings.Contains(out, "REPRODUCED: identical") {
		t.Errorf("wmrl replay (%v):\n%s", err, out)
	}
	if out, err := wmrl(ctx, "compact"); err != nil || !strings.Contains(out, "run default: ") {
		t.Errorf("wmrl compact (%v):\n%s", err, out)
	}
	for _, cmd := range []string{"replay", "audit", "compact"} {
		if out, err := wmrl(ctx, cmd, "--run", "nope"); err == nil || err.Error() != "wmrl-data/archive holds no run nope (it holds default): give --run one of them" {
			t.Errorf("wmrl %s --run nope (%v):\n%s\nwant the runs it holds named", cmd, err, out)
		}
	}
	out, err := wmrl(ctx, "audit", "--expect-seeds", "0")
	if err != nil {
		t.Fatalf("wmrl audit (%v):\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join("audit-default", "index.html")); err != nil || !strings.Contains(out, "audit-default") {
		t.Errorf("wmrl audit without --out: %v; it said:\n%s", err, out)
	}
}

// A replay that does not reproduce its archive says whether the wmrl
// build that wrote the archive is the one replaying it, and says so only
// as far as the builds tell.
func TestAReplayThatDiffersNamesTheBuildThatWroteTheArchive(t *testing.T) {
	tagged := pipeline.Build{Version: "v1.2.0", Revision: "9492b48c1a2b33", Go: "go1.26.8"}
	untagged := pipeline.Build{Version: "(devel)", Go: "go1.26.8"}
	changed := tagged
	changed.Modified = true
	for _, c := range []struct {
		name   string
		builds []string
		this   pipeline.Build
		want   []string
	}{
		{"an upgrade", []string{"v1.1.0, commit 1111, go1.26.8", tagged.String()}, tagged,
			[]string{"written by wmrl v1.1.0, commit 1111, go1.26.8, then wmrl v1.2.0, commit 9492b48c1a2b", "this replay ran on wmrl v1.2.0", "a change between them may be why"}},
		{"files from before the build was kept", []string{""}, tagged,
			[]string{"written by a build from before the archive kept it;", "a change between them may be why"}},
		{"the same commit", []string{tagged.String()}, tagged, []string{"this same build (wmrl v1.2.0, commit 9492b48c1a2b", "not a change of wmrl"}},
		{"no commit on either side", []string{untagged.String()}, untagged, []string{"cannot tell whether they are the same code"}},
		{"changes not committed", []string{changed.String()}, changed, []string{"with changes not committed, cannot tell"}},
	} {
		got := writtenBy(c.builds, c.this)
		for _, w := range c.want {
			if !strings.Contains(got, w) {
				t.Errorf("%s: %q lacks %q", c.name, got, w)
			}
		}
	}
}

// A replay that reproduces an archive that other builds wrote says so:
// the upgrade computes the same on it. One that this build wrote whole
// says nothing more.
func TestAReplayThatReproducesNamesTheOtherBuildsThatWroteTheArchive(t *testing.T) {
	this := pipeline.Build{Version: "v1.2.0", Revision: "9492b48c1a2b33", Go: "go1.26.8"}
	untagged := pipeline.Build{Version: "(devel)", Go: "go1.26.8"}
	for _, c := range []struct {
		name   string
		builds []string
		this   pipeline.Build
		want   string // "": no line
	}{
		{"an upgrade", []string{"v1.1.0, commit 1111, go1.26.8", this.String()}, this,
			"written by wmrl v1.1.0, commit 1111, go1.26.8, then wmrl v1.2.0, commit 9492b48c1a2b, go1.26.8; this replay ran on wmrl v1.2.0, commit 9492b48c1a2b, go1.26.8: the builds between them compute the same on it"},
		{"files from before the build was kept", []string{""}, this, "written by a build from before the archive kept it; this replay ran on wmrl v1.2.0"},
		{"this build alone", []string{this.String()}, this, ""},
		{"a build without a commit alone", []string{untagged.String()}, untagged, ""},
	} {
		got := reproducedAcross(c.builds, c.this)
		if (c.want == "") != (got == "") || !strings.Contains(got, c.want) {
			t.Errorf("%s: %q, want %q", c.name, got, c.want)
		}
	}
}
