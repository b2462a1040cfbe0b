package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
)

// report is what the run stored, against what it should have: steps
// 0..steps-1 of perStep trajectories each.
type report struct {
	steps              int64
	perStep, groupSize int

	updates, watermarks stepCounts
	// itemsShort: steps whose update has other than perStep items.
	itemsShort []int64
	// anchors and late: the anchor groups the updates name (executed in
	// time, or late), keyed step/group; failed: executed with fewer than
	// two scores, which calibrate if any pairs came.
	anchors, late, failed map[string]bool

	// calibrations: how often each anchor group was absorbed; seqs: how
	// often each sequence number was published (1..n once each).
	calibrations map[string]int
	seqs         map[int64]int

	deadLetters map[string]int // stage and reason, cut short
	// left: the messages each of the run's durable consumers still had
	// undelivered or unacknowledged once every process stopped, for those
	// with any. A run whose steps were all fused and archived has none:
	// one is a message a stage held for good (a side of an anchor group
	// whose other side had been paired already, held for --pair-wait and
	// then dead-lettered, in the rehearsals of seeds 51 and 55).
	left map[string]uint64

	archive archiveCounts
	// replay: `wmrl replay`'s verdict on the archive with the recorded
	// settings, or why it was not replayed; reproduced: the verdict is
	// REPRODUCED, or the archive was not replayed.
	replay     string
	reproduced bool

	// rewards: what the trainer gateways' reward endpoints answered for
	// anchors, asked during the kills.
	rewards rewardProbe
}

// stepCounts counts a subject's messages per step.
type stepCounts map[int64]int

func (c stepCounts) missingAndTwice(steps int64) (missing, twice []int64) {
	for s := range steps {
		switch n := c[s]; {
		case n == 0:
			missing = append(missing, s)
		case n > 1:
			twice = append(twice, s)
		}
	}
	for s := range c {
		if s < 0 || s >= steps {
			twice = append(twice, s) // a step nobody published
		}
	}
	slices.Sort(twice)
	return missing, twice
}

type archiveCounts struct {
	rows int
	// perStep: a step's rows, its late anchors' late rows apart.
	perStep map[int64]int
	// seen: the roots each trajectory has a row in, a bit each.
	seen map[string]uint64
	// trajTwice: trajectories with more than one row of their step in one
	// root; inBothRoots: with one in each of two roots (--archive-apart:
	// the holder's last file, written again by its successor).
	trajTwice, inBothRoots int
	// lateRows: late rows per late group; lateStray: late rows of a group
	// the updates do not name late.
	lateRows  map[string]int
	lateStray int
}

func newReport(steps int64, groups, size int) *report {
	return &report{
		steps: steps, perStep: groups * size, groupSize: size,
		updates: stepCounts{}, watermarks: stepCounts{},
		anchors: map[string]bool{}, late: map[string]bool{}, failed: map[string]bool{},
		calibrations: map[string]int{}, seqs: map[int64]int{}, deadLetters: map[string]int{}, left: map[string]uint64{},
		archive:    archiveCounts{perStep: map[int64]int{}, lateRows: map[string]int{}, seen: map[string]uint64{}},
		reproduced: true,
	}
}

func groupKey(step int64, group string) string { return fmt.Sprintf("%d/%s", step, group) }

// check reads the run's updates, watermarks, calibrations and dead letters
// from its stream, and its rows from every archive under o.dir.
func (r *runConn) check(ctx context.Context, o options, steps int64) (*report, error) {
	rep := newReport(steps, o.groups, o.size)
	stream := streamName(o.prefix)
	read := func(k schemas.Kind, fn func(data []byte) error) error {
		return natsjs.Scan(ctx, r.js, stream, r.subject(k), false, func(m natsjs.Record) error {
			if err := fn(m.Data); err != nil {
				return fmt.Errorf("%s seq %d: %w", m.Subject, m.Seq, err)
			}
			return nil
		})
	}
	err := read(schemas.KindUpdate, func(data []byte) error {
		var u schemas.Update
		if err := json.Unmarshal(data, &u); err != nil {
			return err
		}
		rep.addUpdate(u)
		return nil
	})
	if err == nil {
		err = read(schemas.KindStep, func(data []byte) error {
			var w schemas.StepClose
			if err := json.Unmarshal(data, &w); err != nil {
				return err
			}
			rep.watermarks[w.Step]++
			return nil
		})
	}
	if err == nil {
		err = read(schemas.KindCalibration, func(data []byte) error {
			var c schemas.Calibration
			if err := json.Unmarshal(data, &c); err != nil {
				return err
			}
			rep.calibrations[groupKey(c.Step, c.GroupID)]++
			rep.seqs[c.Seq]++
			return nil
		})
	}
	if err == nil {
		err = read(schemas.KindDLQ, func(data []byte) error {
			var d struct{ Stage, Reason string }
			if err := json.Unmarshal(data, &d); err != nil {
				return err
			}
			reason, _, _ := strings.Cut(d.Reason, "\n")
			if len(reason) > 120 {
				reason = reason[:120] + "..."
			}
			rep.deadLetters[d.Stage+": "+reason]++
			return nil
		})
	}
	if err == nil {
		err = r.readLeft(ctx, rep)
	}
	if err != nil {
		return nil, err
	}
	roots, err := filepath.Glob(filepath.Join(o.dir, "archive*"))
	if err != nil {
		return nil, err
	}
	for i, root := range roots {
		files, err := archive.Files(root, o.run)
		if err == nil {
			// The columns counted alone, as they stream by: a rehearsal of
			// hours has millions of rows.
			err = archive.ScanColumns(files, []string{"step", "group_id", "traj_id", "source"}, func(rows []archive.Row) error {
				rep.addRows(i, rows)
				return nil
			})
		}
		if err != nil {
			return nil, fmt.Errorf("archive %s: %w", root, err)
		}
	}
	return rep, nil
}

func (rep *report) addUpdate(u schemas.Update) {
	rep.updates[u.Step]++
	if len(u.Items) != rep.perStep {
		rep.itemsShort = append(rep.itemsShort, u.Step)
	}
	for _, it := range u.Items {
		if it.Source == archive.SourceAnchor {
			rep.anchors[groupKey(u.Step, it.GroupID)] = true
		}
	}
	for _, g := range u.LateAnchors {
		rep.late[groupKey(u.Step, g)] = true
	}
	for _, g := range u.FailedAnchors {
		rep.failed[groupKey(u.Step, g)] = true
	}
}

// addRows counts the rows of the archive root numbered root.
func (rep *report) addRows(root int, rows []archive.Row) {
	a := &rep.archive
	a.rows += len(rows)
	for _, row := range rows {
		if row.Source == archive.SourceLateAnchor {
			k := groupKey(row.Step, row.GroupID)
			if rep.late[k] {
				a.lateRows[k]++
			} else {
				a.lateStray++
			}
			continue
		}
		k := groupKey(row.Step, row.TrajID)
		switch roots := a.seen[k]; {
		case roots&(1<<root) != 0:
			a.trajTwice++
		case roots != 0:
			a.inBothRoots++
		default:
			a.perStep[row.Step]++
		}
		a.seen[k] |= 1 << root
	}
}

// replayArchive replays the run's archive with its recorded settings
// (`wmrl replay`), which must give what the run fused under the faults to
// the last digit. Archives apart (--archive-apart) are not replayed: each
// root holds part of the run, and a file written again in a second root.
func (rep *report) replayArchive(ctx context.Context, o options) error {
	roots, err := filepath.Glob(filepath.Join(o.dir, "archive*"))
	if err != nil {
		return err
	}
	if len(roots) != 1 {
		rep.replay = fmt.Sprintf("not replayed: the run's rows are in %d archive roots", len(roots))
		return nil
	}
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, o.wmrl, "replay", "--archive", roots[0], "--run", o.run)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	if ctx.Err() != nil {
		return ctx.Err()
	}
	for line := range strings.Lines(stdout.String()) {
		if strings.HasPrefix(line, "REPRODUCED") || strings.HasPrefix(line, "NOT REPRODUCED") {
			rep.replay = strings.TrimSpace(line)
		}
	}
	rep.reproduced = err == nil && strings.HasPrefix(rep.replay, "REPRODUCED")
	if rep.replay == "" {
		rep.replay = fmt.Sprintf("wmrl replay: %v: %s", err, strings.TrimSpace(stderr.String()))
	}
	return nil
}

// readLeft reads what the run's durable consumers still have, undelivered
// or unacknowledged.
func (r *runConn) readLeft(ctx context.Context, rep *report) error {
	s, err := r.streamOf(ctx)
	if err != nil || s == nil {
		return err
	}
	consumers := s.ListConsumers(ctx)
	for ci := range consumers.Info() {
		subjects := append([]string{ci.Config.FilterSubject}, ci.Config.FilterSubjects...)
		ours := slices.ContainsFunc(subjects, func(s string) bool { return s != "" && strings.HasPrefix(s, r.subject("")) })
		if n := ci.NumPending + uint64(ci.NumAckPending); ci.Config.Durable != "" && ours && n > 0 {
			rep.left[ci.Name] = n
		}
	}
	if err := consumers.Err(); err != nil {
		return fmt.Errorf("the run's consumers: %w", err)
	}
	return nil
}

// problems lists every way the run falls short; none is a PASS.
func (rep *report) problems() []string {
	var out []string
	add := func(format string, args ...any) { out = append(out, fmt.Sprintf(format, args...)) }
	for _, sc := range []struct {
		what string
		c    stepCounts
	}{{"update", rep.updates}, {"watermark", rep.watermarks}} {
		missing, twice := sc.c.missingAndTwice(rep.steps)
		if len(missing) > 0 {
			add("%d steps have no %s (the first: %d)", len(missing), sc.what, missing[0])
		}
		if len(twice) > 0 {
			add("%d steps have more than one %s, or one of a step never published (the first: %d)", len(twice), sc.what, twice[0])
		}
	}
	if len(rep.itemsShort) > 0 {
		add("%d updates have other than %d items (the first: step %d)", len(rep.itemsShort), rep.perStep, rep.itemsShort[0])
	}
	want := maps.Clone(rep.anchors)
	maps.Copy(want, rep.late)
	for k, n := range rep.calibrations {
		switch {
		case n > 1:
			add("anchor group %s was absorbed %d times", k, n)
		case !want[k] && !rep.failed[k]:
			add("anchor group %s was absorbed, and no update names it an anchor", k)
		}
	}
	for k := range want {
		if rep.calibrations[k] == 0 {
			add("anchor group %s was never absorbed by the calibration", k)
		}
	}
	for s, n := range rep.seqs {
		if n > 1 || s < 1 || s > int64(len(rep.seqs)) {
			add("calibration sequence number %d published %d times, of %d in all", s, n, len(rep.seqs))
		}
	}
	a := rep.archive
	short := 0
	for s := range rep.steps {
		if a.perStep[s] != rep.perStep {
			short++
		}
	}
	if short > 0 {
		add("%d steps have other than %d rows in the archives", short, rep.perStep)
	}
	if len(a.perStep) > int(rep.steps) {
		add("the archives hold rows of %d steps, of %d published", len(a.perStep), rep.steps)
	}
	if a.trajTwice > 0 {
		add("%d trajectories have more than one row of their step in one archive root", a.trajTwice)
	}
	for k := range rep.late {
		if n := a.lateRows[k]; n != rep.groupSize {
			add("late anchor group %s has %d late rows, want %d", k, n, rep.groupSize)
		}
	}
	if a.lateStray > 0 {
		add("%d late rows belong to groups no update names late", a.lateStray)
	}
	if n := total(rep.deadLetters); n > 0 {
		add("%d dead letters: each a message that needs `wmrl dlq`", n)
	}
	if !rep.reproduced {
		add("the archive, replayed with the recorded settings, is not what the run fused: %s", rep.replay)
	}
	out = append(out, rep.rewards.wrong...)
	for _, name := range slices.Sorted(maps.Keys(rep.left)) {
		add("consumer %s still has %d messages, undelivered or unacknowledged, once every step was fused and archived", name, rep.left[name])
	}
	return out
}

func total[K comparable](m map[K]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

func (rep *report) ok() bool { return len(rep.problems()) == 0 }

func (rep *report) print(w io.Writer) {
	late := 0
	for _, n := range rep.archive.lateRows {
		late += n
	}
	fmt.Fprintf(w, "steps 0-%d: %d updates, %d watermarks; %d anchor groups absorbed by the calibration (%d of them late, %d failed)\n",
		rep.steps-1, total(rep.updates), total(rep.watermarks), len(rep.calibrations), len(rep.late), len(rep.failed))
	fmt.Fprintf(w, "archives: %d rows, %d of them late anchor groups' late rows\n", rep.archive.rows, late)
	if n := rep.archive.inBothRoots; n > 0 {
		fmt.Fprintf(w, "  %d rows are in both roots: the rows of a file the holder closed and was killed before the server had its acknowledgements, which its successor wrote again in its own root\n", n)
	}
	if rep.replay != "" {
		fmt.Fprintf(w, "replay: %s\n", rep.replay)
	}
	rw := rep.rewards
	fmt.Fprintf(w, "reward endpoints, asked for %d anchors' rewards during the kills (%d of them again, a minute or more later): %d answered with the real score, %d otherwise, %d not at all\n",
		rw.asked, rw.again, rw.real, len(rw.wrong), rw.unanswered)
	fmt.Fprintf(w, "dead letters: %d\n", total(rep.deadLetters))
	for _, k := range slices.Sorted(maps.Keys(rep.deadLetters)) {
		fmt.Fprintf(w, "  %5d  %s\n", rep.deadLetters[k], k)
	}
	p := rep.problems()
	if len(p) == 0 {
		fmt.Fprintln(w, "PASS: every step's update and watermark stored once, every trajectory archived once, every anchor group absorbed once, nothing left held, the archive replays to what was fused, every anchor's reward answered was its real score")
		return
	}
	for i, s := range p {
		if i == 20 {
			fmt.Fprintf(w, "  ... and %d more\n", len(p)-20)
			break
		}
		fmt.Fprintln(w, "  "+s)
	}
	fmt.Fprintf(w, "FAIL: %d problems\n", len(p))
}
