package pipeline

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/stages/archive"
)

// The archive stage merges its closed files in the background while it
// keeps writing: the run ends with few files, and every step's rows in
// them exactly once.
func TestArchiveMergesItsFilesWhileItWrites(t *testing.T) {
	cfg := testConfig(t)
	cfg.Steps = 30
	cfg.ArchiveMaxAge = 5 * time.Millisecond // a file every few steps
	cfg.ArchiveCompactAfter = 40 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	merged := testutil.ToFloat64(p.Metrics().ArchiveMerged)
	if merged == 0 {
		t.Fatal("no file was merged while the run wrote")
	}
	files, err := archive.Files(cfg.ArchiveRoot(), cfg.Run)
	if err != nil {
		t.Fatal(err)
	}
	rows, err := archive.ReadAll(cfg.ArchiveRoot(), cfg.Run)
	if err != nil {
		t.Fatal(err)
	}
	ups := decodeUpdates(t, readStored(t, cfg.DataDir, "wmrl.default.update"))
	want := 0
	for _, u := range ups {
		want += len(u.Items)
	}
	seen := map[string]int{}
	for _, r := range rows {
		if r.Source != archive.SourceLateAnchor {
			seen[r.TrajID]++
		}
	}
	if len(seen) != want {
		t.Errorf("%d trajectories archived, want the %d of %d updates", len(seen), want, len(ups))
	}
	for id, n := range seen {
		if n != 1 {
			t.Errorf("%s archived %d times", id, n)
		}
	}
	t.Logf("%v files merged away while writing; %d left, %d rows", merged, len(files), len(rows))
}
