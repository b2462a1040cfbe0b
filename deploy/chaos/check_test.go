package main

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
)

// run builds what a clean run of 3 steps of 2 groups of 2 stores: group
// g0 of each step is an anchor, step 1's late (fused on the world model,
// its late rows archived after).
func cleanRun() (rep *report, updates []schemas.Update, rows []archive.Row) {
	rep = newReport(3, 2, 2)
	for s := range int64(3) {
		u := schemas.Update{Step: s}
		for g := range 2 {
			for i := range 2 {
				src := archive.SourceWorldModel
				if g == 0 && s != 1 {
					src = archive.SourceAnchor
				}
				id := fmt.Sprintf("s%d-g%d-t%d", s, g, i)
				u.Items = append(u.Items, schemas.UpdateItem{TrajID: id, GroupID: fmt.Sprintf("g%d", g), Source: src})
				rows = append(rows, archive.Row{Step: s, GroupID: fmt.Sprintf("g%d", g), TrajID: id, Source: src})
			}
		}
		if s == 1 {
			u.LateAnchors = []string{"g0"}
			for i := range 2 {
				rows = append(rows, archive.Row{Step: s, GroupID: "g0", TrajID: fmt.Sprintf("s1-g0-t%d", i), Source: archive.SourceLateAnchor})
			}
		}
		updates = append(updates, u)
		rep.watermarks[s]++
		rep.calibrations[groupKey(s, "g0")]++
		rep.seqs[s+1]++
	}
	return rep, updates, rows
}

func TestACleanRunPasses(t *testing.T) {
	rep, updates, rows := cleanRun()
	for _, u := range updates {
		rep.addUpdate(u)
	}
	rep.addRows(0, rows)
	if p := rep.problems(); len(p) > 0 {
		t.Fatalf("a clean run has problems: %q", p)
	}
}

// Each way a run can lose or double something is named.
func TestTheCheckNamesWhatARunLostOrDoubled(t *testing.T) {
	for _, tc := range []struct {
		name  string
		spoil func(rep *report, updates []schemas.Update, rows []archive.Row) ([]schemas.Update, []archive.Row)
		want  string
	}{
		{"an update missing", func(_ *report, u []schemas.Update, r []archive.Row) ([]schemas.Update, []archive.Row) {
			return u[:2], r
		}, "1 steps have no update (the first: 2)"},
		{"an update twice", func(_ *report, u []schemas.Update, r []archive.Row) ([]schemas.Update, []archive.Row) {
			return append(u, u[0]), r
		}, "1 steps have more than one update"},
		{"an update short of an item", func(_ *report, u []schemas.Update, r []archive.Row) ([]schemas.Update, []archive.Row) {
			u[2].Items = u[2].Items[1:]
			return u, r
		}, "1 updates have other than 4 items (the first: step 2)"},
		{"a watermark twice", func(rep *report, u []schemas.Update, r []archive.Row) ([]schemas.Update, []archive.Row) {
			rep.watermarks[1]++
			return u, r
		}, "1 steps have more than one watermark"},
		{"an anchor group absorbed twice", func(rep *report, u []schemas.Update, r []archive.Row) ([]schemas.Update, []archive.Row) {
			rep.calibrations[groupKey(2, "g0")]++
			return u, r
		}, "anchor group 2/g0 was absorbed 2 times"},
		{"a late anchor group never absorbed", func(rep *report, u []schemas.Update, r []archive.Row) ([]schemas.Update, []archive.Row) {
			delete(rep.calibrations, groupKey(1, "g0"))
			return u, r
		}, "anchor group 1/g0 was never absorbed"},
		{"a calibration published twice", func(rep *report, u []schemas.Update, r []archive.Row) ([]schemas.Update, []archive.Row) {
			rep.seqs[2]++
			return u, r
		}, "calibration sequence number 2 published 2 times"},
		{"a row twice", func(_ *report, u []schemas.Update, r []archive.Row) ([]schemas.Update, []archive.Row) {
			return u, append(r, r[0])
		}, "1 trajectories have more than one row"},
		{"a row missing", func(_ *report, u []schemas.Update, r []archive.Row) ([]schemas.Update, []archive.Row) {
			return u, r[1:]
		}, "1 steps have other than 4 rows"},
		{"a late group's late rows missing", func(_ *report, u []schemas.Update, r []archive.Row) ([]schemas.Update, []archive.Row) {
			return u, slices.DeleteFunc(r, func(row archive.Row) bool { return row.Source == archive.SourceLateAnchor })
		}, "late anchor group 1/g0 has 0 late rows, want 2"},
		{"a dead letter", func(rep *report, u []schemas.Update, r []archive.Row) ([]schemas.Update, []archive.Row) {
			rep.deadLetters["pair: waited 10m0s"]++
			return u, r
		}, "1 dead letters"},
		{"an archive that does not replay", func(rep *report, u []schemas.Update, r []archive.Row) ([]schemas.Update, []archive.Row) {
			rep.replay, rep.reproduced = "NOT REPRODUCED (recorded settings; max |d fused| 0.5, max |d calibrated| 0)", false
			return u, r
		}, "is not what the run fused: NOT REPRODUCED"},
		{"a message left held", func(rep *report, u []schemas.Update, r []archive.Row) ([]schemas.Update, []archive.Row) {
			rep.left["pair_r_pred"] = 1
			return u, r
		}, "consumer pair_r_pred still has 1 messages"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep, updates, rows := cleanRun()
			updates, rows = tc.spoil(rep, updates, rows)
			for _, u := range updates {
				rep.addUpdate(u)
			}
			rep.addRows(0, rows)
			p := rep.problems()
			if !slices.ContainsFunc(p, func(s string) bool { return strings.Contains(s, tc.want) }) {
				t.Fatalf("problems %q do not say %q", p, tc.want)
			}
			if rep.ok() {
				t.Fatal("ok")
			}
		})
	}
}

// With --archive-apart a successor can write the holder's last file again
// in its own root: counted, not a failure. Twice in one root is one.
func TestRowsInBothRootsAreCountedRowsTwiceInOneFail(t *testing.T) {
	rep, updates, rows := cleanRun()
	for _, u := range updates {
		rep.addUpdate(u)
	}
	rep.addRows(0, rows)
	rep.addRows(1, rows[:4])
	if p := rep.problems(); len(p) > 0 || rep.archive.inBothRoots != 4 {
		t.Fatalf("problems %q, %d rows in both roots; want none and 4", p, rep.archive.inBothRoots)
	}
	rep.addRows(1, rows[:1])
	if p := rep.problems(); !slices.ContainsFunc(p, func(s string) bool {
		return strings.Contains(s, "1 trajectories have more than one row of their step in one archive root")
	}) {
		t.Fatalf("problems %q", p)
	}
}

// What the run's durable consumers still have once every process stopped
// is read: a message delivered and not acknowledged, or not delivered yet.
// Other runs' consumers, and consumers with nothing left, are not named.
func TestTheCheckReadsWhatTheRunsConsumersStillHave(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, tr := rehearsalServer(t, ctx)
	consumer := rehearsalStream(t, ctx, tr)
	held, acked := consumer("pair_r_pred", "rehearse.r.pred"), consumer("fuse_r_pred", "rehearse.r.pred")
	consumer("pair_other_pred", "rehearse.other.pred")
	consumer("route_r_step", "rehearse.r.step")
	for _, subject := range []string{"rehearse.r.pred", "rehearse.other.pred", "rehearse.r.step"} {
		if _, err := tr.js.Publish(ctx, subject, []byte("{}")); err != nil {
			t.Fatal(err)
		}
	}
	fetchOne(t, held)
	if err := fetchOne(t, acked).DoubleAck(ctx); err != nil {
		t.Fatal(err)
	}
	rep := newReport(0, 1, 2)
	if err := tr.readLeft(ctx, rep); err != nil {
		t.Fatal(err)
	}
	if want := map[string]uint64{"pair_r_pred": 1, "route_r_step": 1}; !maps.Equal(rep.left, want) {
		t.Errorf("left %v; want %v (delivered and not acknowledged, not delivered)", rep.left, want)
	}
}

// The archive is replayed by the wmrl binary given: its verdict is read
// from what it prints, and a replay that fails without one is a problem
// too, with what it said. Rows in two roots are not replayed.
func TestTheArchiveIsReplayedByTheBinaryGiven(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name, script string
		roots        []string
		want         string
		reproduced   bool
	}{
		{"reproduced", "echo 'replayed run r: 3 steps'; echo 'REPRODUCED: identical to the archive within 1e-9 (recorded settings)'",
			[]string{"archive"}, "REPRODUCED: identical to the archive within 1e-9 (recorded settings)", true},
		{"not reproduced", "echo 'NOT REPRODUCED (recorded settings; max |d fused| 0.5)'; exit 1",
			[]string{"archive"}, "NOT REPRODUCED (recorded settings; max |d fused| 0.5)", false},
		{"no verdict", "echo 'wmrl: no run r in archive' >&2; exit 1",
			[]string{"archive"}, "wmrl replay: exit status 1: wmrl: no run r in archive", false},
		{"two roots", "exit 1", []string{"archive-1", "archive-2"}, "not replayed: the run's rows are in 2 archive roots", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			bin := filepath.Join(dir, "wmrl")
			args := filepath.Join(dir, "args")
			script := fmt.Sprintf("#!/bin/sh\necho \"$@\" > %s\n%s\n", args, c.script)
			if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
				t.Fatal(err)
			}
			for _, r := range c.roots {
				if err := os.Mkdir(filepath.Join(dir, r), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			rep := newReport(0, 1, 2)
			if err := rep.replayArchive(ctx, options{dir: dir, wmrl: bin, run: "r"}); err != nil {
				t.Fatal(err)
			}
			if rep.replay != c.want || rep.reproduced != c.reproduced {
				t.Errorf("replay %q, reproduced %v; want %q, %v", rep.replay, rep.reproduced, c.want, c.reproduced)
			}
			if got, _ := os.ReadFile(args); len(c.roots) == 1 && string(got) != "replay --archive "+filepath.Join(dir, "archive")+" --run r\n" {
				t.Errorf("wmrl was given %q", got)
			}
			if named := slices.ContainsFunc(rep.problems(), func(s string) bool { return strings.Contains(s, c.want) }); named == c.reproduced {
				t.Errorf("problems %q: the replay's %q named %v", rep.problems(), c.want, named)
			}
		})
	}
}
