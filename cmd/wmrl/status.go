package main

import (
	"cmp"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/fuse"
)

func statusCommand() *cobra.Command {
	var (
		src    pipeline.StreamSource
		run    string
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show where a run is: the last step received, fused and calibrated, dead letters and the newest one's reason, and each consumer's backlog",
		Long: `Show where a run is, from its stream: the newest step watermark and
calibration, and the highest step fused (not the newest update stored
when a step held back was fused after later ones), with their age and
the world model that scored that step, the steps planned and not fused (one
held back behind a later fused step waits for an anchor group within its
deadline, or for a prediction that a stage between predict and fuse may
have dead-lettered), the dead letters with the newest one's
reason ("given up": a service it needs is down, "rejected": bad input),
and for every durable consumer of the run's subjects (the stages', and
outside stages' own) its backlog, the messages in flight and redelivered,
the pull requests waiting (0 with a backlog: nothing is reading) and its
last delivery.
A stalled run shows as a consumer whose backlog grows while its last
delivery gets old.

Reads a running pipeline's server with --nats URL, or a stopped one's
--data directory.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			st, err := pipeline.ReadStatus(cmd.Context(), src, run)
			if err != nil {
				return err
			}
			if asJSON {
				return writeStatusJSON(cmd.OutOrStdout(), st, run, time.Now())
			}
			where := natsjs.Redact(src.NATSURL)
			if where == "" {
				where = src.DataDir
			}
			writeStatus(cmd.OutOrStdout(), st, where, src.Prefix, run, time.Now())
			return nil
		},
	}
	streamSourceFlags(cmd.Flags(), &src, &run)
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the status as one JSON document (snake_case keys; null where the run has none yet) for scripts")
	return cmd
}

// storeNearlyFull is the share of the store's limit in use from which
// status says what a full store does: a message that would cross the
// limit is refused, so a store in use holds a little less than it.
const storeNearlyFull = 0.95

func writeStatus(w io.Writer, st *pipeline.Status, where, prefix, run string, now time.Time) {
	ago := func(t time.Time) string {
		return fmt.Sprintf("%s, %s ago", t.UTC().Format(time.RFC3339), now.Sub(t).Round(time.Second))
	}
	var kept uint64
	for _, n := range st.Subjects {
		kept += n
	}
	fmt.Fprintf(w, "run %s in stream %s at %s: %d messages kept", run, st.Stream, where, kept)
	if st.MaxAge > 0 {
		fmt.Fprintf(w, " (retention %s)", st.MaxAge)
	}
	if len(st.OtherRuns) > 0 {
		fmt.Fprintf(w, "; the stream holds runs %s: give --run one of them", strings.Join(st.OtherRuns, ", "))
	}
	fmt.Fprintln(w)
	switch {
	case st.StoreLimit > 0:
		share := float64(st.StoreUsed) / float64(st.StoreLimit)
		fmt.Fprintf(w, "store:           the stream %s; the JetStream account %s of its limit %s (%.0f%%)\n",
			gb(float64(st.Bytes)), gb(float64(st.StoreUsed)), gb(float64(st.StoreLimit)), 100*share)
		if share >= storeNearlyFull {
			fmt.Fprintln(w, "                 at its limit the server stores nothing, and every stage waits for room: free its disk, raise its limit (max_file_store, wmrl run's --nats-max-store-gb, the account's), or shorten --retention")
		}
	default:
		fmt.Fprintf(w, "store:           the stream %s; the JetStream account %s, its limit not known\n", gb(float64(st.Bytes)), gb(float64(st.StoreUsed)))
	}
	switch s := st.LastStep; {
	case s == nil:
		fmt.Fprintln(w, "steps received:  none yet")
	default:
		fmt.Fprintf(w, "steps received:  up to %d (its watermark %s)\n", s.Step, ago(st.LastStepAt))
	}
	if n := st.LastTrajStep; n != nil && (st.LastStep == nil || *n > st.LastStep.Step) {
		fmt.Fprintf(w, "trajectories:    of step %d, the newest %s, whose watermark has not come: a step is planned only once it does\n", *n, ago(st.LastTrajAt))
	}
	switch u := st.LastUpdate; {
	case u == nil:
		fmt.Fprintln(w, "steps fused:     none yet")
	default:
		centred := ""
		if u.AdvantageNorm == string(fuse.CenterOnly) {
			centred = ", advantages centred (Dr. GRPO)"
		}
		fmt.Fprintf(w, "steps fused:     up to %d (%s): rho %.3f, D %.3f, calibration v%d, groups %d, anchors %d%s%s\n",
			u.Step, ago(st.LastUpdateAt), u.Rho, u.D, u.CalibrationVersion, u.Groups, u.Anchors, centred, scoredBy(u))
	}
	if next, ok := nextStep(st); ok {
		fmt.Fprintf(w, "next step:       %d (a closed step takes no more trajectories: a trainer resumed from a checkpoint numbers its steps on from here)\n", next)
	}
	writeUnfused(w, st, now)
	switch c := st.LastCalibration; {
	case c == nil:
		fmt.Fprintln(w, "calibration:     no anchor group absorbed yet")
	default:
		fmt.Fprintf(w, "calibration:     v%d after %d anchor groups, the last of step %d (%s)\n", c.Version, c.Seq, c.Step, ago(st.LastCalibAt))
	}
	fmt.Fprintf(w, "dead letters:    %d on %s", st.DeadLetters, schemas.Subject(prefix, run, schemas.KindDLQ))
	if st.DeadLetters > 0 {
		fmt.Fprint(w, " (wmrl dlq lists them)")
	}
	fmt.Fprintln(w)
	// The newest one says whether a service is down now ("gave up at
	// once: the world model is down since ...") or an input was bad.
	if dl := st.LastDeadLetter; dl != nil {
		kind := "rejected"
		if pipeline.GivenUp(*dl) {
			kind = "given up"
		}
		stage := dl.Stage
		if stage == "" {
			stage = "-"
		}
		fmt.Fprintf(w, "newest of them:  %s by %s, %s: %s\n", kind, stage, ago(st.LastDeadLetterAt), cut(oneLine(dl.Reason), 240))
	}
	writeExecutions(w, st.Executions, ago)
	writeAnchors(w, st.Anchors, ago)
	writeRunners(w, st.Runners, now)
	if len(st.Consumers) == 0 {
		fmt.Fprintln(w, "consumers:       none of the run's subjects has one")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "consumer\tsubject\tbacklog\tin flight\tredelivered\tpulls waiting\tlast delivery\t")
	unread := 0
	for _, c := range st.Consumers {
		last := "-" // none, or not known (a server started on a stopped store)
		if c.LastDelivery != nil {
			last = now.Sub(*c.LastDelivery).Round(time.Second).String() + " ago"
		}
		mark := ""
		if c.Backlog > 0 && c.Waiting == 0 {
			mark, unread = " *", unread+1
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%s%s\t\n", c.Name, c.Subject, c.Backlog, c.InFlight, c.Redelivered, c.Waiting, last, mark)
	}
	tw.Flush()
	if unread > 0 {
		fmt.Fprintf(w, "* %d consumer(s) with a backlog and no pull request waiting: nothing reads them; is their stage running?\n", unread)
	}
}

// scoredBy names the world models that scored u, for its line: whether a
// restart onto another --wm-model took, or which predict processes score.
func scoredBy(u *schemas.Update) string {
	names := u.Models()
	for i, m := range names {
		if m == "" {
			names[i] = "(not named)"
		}
	}
	switch len(names) {
	case 0:
		return ""
	case 1:
		return ", world model " + names[0]
	}
	return ", world models " + strings.Join(names, ", ")
}

// writeUnfused names the steps planned and not fused: those behind a
// later fused step first, since a step held there for long waits for a
// prediction nothing will publish.
func writeUnfused(w io.Writer, st *pipeline.Status, now time.Time) {
	if len(st.Unfused) == 0 {
		return
	}
	var behind, ahead []pipeline.UnfusedStep
	for _, u := range st.Unfused {
		if st.LastUpdate != nil && u.Step < st.LastUpdate.Step {
			behind = append(behind, u)
		} else {
			ahead = append(ahead, u)
		}
	}
	list := func(us []pipeline.UnfusedStep) string {
		return pipeline.Few(us, 5, func(u pipeline.UnfusedStep) string {
			return fmt.Sprintf("%d (planned %s ago)", u.Step, now.Sub(u.Planned).Round(time.Second))
		})
	}
	if len(behind) > 0 {
		fmt.Fprintf(w, "held back:       step %s, not fused while later steps are: each waits for an anchor group (up to --anchor-deadline) "+
			"or for a group's prediction, which has no deadline (one that a stage between predict and fuse gave up is in wmrl dlq, and wmrl dlq --resend sends it back)\n", list(behind))
	}
	if len(ahead) > 0 {
		fmt.Fprintf(w, "being fused:     step %s\n", list(ahead))
	}
}

// durationText is d as 1h or 24h (not 1h0m0s).
func durationText(d time.Duration) string {
	return strings.TrimSuffix(strings.TrimSuffix(d.String(), "0s"), "0m")
}

// writeExecutions says how the last hour's anchor executions ended (all
// processes'), and the newest that did not score: a run of them failing
// alike is more often the sandbox's setup than the policy.
func writeExecutions(w io.Writer, es pipeline.ExecutionsStatus, ago func(time.Time) string) {
	window := durationText(pipeline.ExecutionsWindow)
	if es.Groups == 0 {
		fmt.Fprintf(w, "executions:      none in the last %s\n", window)
		return
	}

	var parts []string
	total := 0
	for _, s := range schemas.ExecStatuses {
		if n := es.ByStatus[s]; n > 0 {
			parts = append(parts, fmt.Sprintf("%s %d", s, n))
			total += n
		}
	}
	shared := ""
	if es.Shared > 0 {
		shared = fmt.Sprintf("; %d more trajectories took a copy's (--exec-copies-once)", es.Shared)
	}
	if es.Capped {
		fmt.Fprintf(w, "executions:      %d in the newest %d anchor groups (since %s): %s%s\n", total, es.Groups, ago(es.Since), strings.Join(parts, ", "), shared)
	} else {
		fmt.Fprintf(w, "executions:      %d in the last %s (%d anchor groups): %s%s\n", total, window, es.Groups, strings.Join(parts, ", "), shared)
	}
	if es.Slowest.Max > 0 {
		secs := func(q pipeline.TimeQuantiles) string {
			return fmt.Sprintf("median %s, p99 %s, max %s", seconds(q.Median), seconds(q.P99), seconds(q.Max))
		}
		line := fmt.Sprintf("a group's slowest %s (a step waits for it up to --anchor-deadline)", secs(es.Slowest))
		if es.Seconds.Max > 0 {
			line = fmt.Sprintf("each took %s; %s", secs(es.Seconds), line)
		}
		fmt.Fprintf(w, "%17s%s\n", "", line)
	}
	if f := es.NewestFailure; f.Status != "" {
		fmt.Fprintf(w, "newest failure:  %s, %s: %s\n", f.Status, ago(es.NewestFailureAt), cut(oneLine(f.Detail), 240))
	}
	causes := slices.SortedFunc(maps.Keys(es.ByCause), func(a, b string) int {
		return cmp.Or(cmp.Compare(es.ByCause[b], es.ByCause[a]), cmp.Compare(a, b))
	})
	for i, c := range causes[:min(3, len(causes))] {
		label := strings.Repeat(" ", 17)
		if i == 0 {
			label = "failure causes:  "
		}
		fmt.Fprintf(w, "%s%d %s\n", label, es.ByCause[c], cut(oneLine(c), 160))
	}
}

// writeAnchors says how many of the anchor groups of the window's steps
// missed --anchor-deadline, or were executed with fewer than two scores:
// the step used the world model's rewards for them.
func writeAnchors(w io.Writer, as pipeline.AnchorsStatus, ago func(time.Time) string) {
	if as.Groups == 0 {
		return
	}
	line := fmt.Sprintf("%d of %d (%.1f%%) missed --anchor-deadline", as.Late, as.Groups, 100*float64(as.Late)/float64(as.Groups))
	if as.Late == 0 {
		line = fmt.Sprintf("none of %d missed --anchor-deadline", as.Groups)
	}
	if as.Failed > 0 {
		line += fmt.Sprintf(", %d were executed with fewer than two scores,", as.Failed)
	}
	if as.Capped {
		line += fmt.Sprintf(" in the %d steps fused since %s", as.Steps, ago(as.Since))
	} else {
		line += fmt.Sprintf(" in the %d steps fused in the last %s", as.Steps, durationText(pipeline.UnfusedWindow))
	}
	if as.Late+as.Failed > 0 {
		line += ": the steps used the world model's rewards for them"
	}
	fmt.Fprintf(w, "anchor groups:   %s\n", line)
}

// cut shortens s to at most n runes, marking the cut.
func cut(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n-1]) + "…"
}

// gb writes a byte count in the unit that suits it.
func gb(n float64) string { return pipeline.FormatBytes(int64(n)) }

// nextStep is one past the newest step closed, fused or sent a
// trajectory, as the gateway's GET .../steps gives it; ok is false before
// any.
func nextStep(st *pipeline.Status) (int64, bool) {
	next, ok := int64(0), false
	if s := st.LastTrajStep; s != nil && *s >= 0 {
		next, ok = *s+1, true
	}
	if s := st.LastStep; s != nil {
		next, ok = max(next, s.Step+1), true
	}
	if u := st.LastUpdate; u != nil {
		next, ok = max(next, u.Step+1), true
	}
	return next, ok
}

// writeRunners says which process runs each one-per-run stage, a line per
// process, as the stages' leases say.
func writeRunners(w io.Writer, rs []pipeline.StageRunner, now time.Time) {
	var order []string
	by := map[string][]string{}
	held := map[string]pipeline.StageRunner{}
	var none []string
	for _, r := range rs {
		if r.Holder == nil {
			none = append(none, r.Stage)
			continue
		}
		if _, ok := by[r.Holder.ID]; !ok {
			order = append(order, r.Holder.ID)
			held[r.Holder.ID] = r
		}
		by[r.Holder.ID] = append(by[r.Holder.ID], r.Stage)
	}
	head := "one per run:     "
	for _, id := range order {
		r := held[id]
		ended, lapses := "", max(r.Renewed.Add(pipeline.LeaseTTL).Sub(now), 0).Round(time.Second)
		switch {
		case r.Ended:
			ended = fmt.Sprintf("; it no longer runs: its lease lapses in %s, and a process started for it on this machine takes over at once", lapses)
		case r.Silent:
			ended = fmt.Sprintf("; its process answers no request (killed, or cut off from the server): a process waiting for the stage takes it over once it has neither answered nor renewed for %s, else its lease lapses in %s",
				natsjs.SilentAfter(pipeline.LeaseTTL), lapses)
		}
		fmt.Fprintf(w, "%s%s: %s (renewed %s ago%s)\n", head, strings.Join(by[id], ", "), r.Holder, now.Sub(r.Renewed).Round(time.Second), ended)
		head = strings.Repeat(" ", len(head))
	}
	if len(none) > 0 {
		them := "it"
		if len(none) > 1 {
			them = "them"
		}
		fmt.Fprintf(w, "%s%s: no process runs %s (stopped, or a wmrl from before leases)\n", head, strings.Join(none, ", "), them)
	}
}

// seconds writes a duration given in seconds as Go does, to the
// millisecond (1m2.5s, 350ms).
func seconds(s float64) string {
	return time.Duration(s * float64(time.Second)).Round(time.Millisecond).String()
}
