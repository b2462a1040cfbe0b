package main

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/schemas"
)

// streamSourceFlags binds the flags of the commands that read a run's
// stream from outside its pipeline (dlq, status).
func streamSourceFlags(fs *pflag.FlagSet, src *pipeline.StreamSource, run *string) {
	def := pipeline.DefaultConfig()
	fs.StringVar(&src.NATSURL, "nats", "", "URL of the server of a running pipeline (default: open the store in --data, which its pipeline must not be using)")
	natsAuthFlags(fs, &src.Auth)
	fs.StringVar(&src.DataDir, "data", def.DataDir, "data directory of a stopped pipeline's embedded server")
	fs.StringVar(&src.Prefix, "prefix", def.Prefix, "subject prefix")
	fs.StringVar(run, "run", def.Run, "run name")
}

func dlqCommand() *cobra.Command {
	var (
		src    pipeline.StreamSource
		run    string
		stage  string
		since  time.Duration
		follow bool
		asJSON bool
		resend bool
		dryRun bool
	)
	cmd := &cobra.Command{
		Use:   "dlq",
		Short: "Show a run's dead letters (what no stage could use, with the reason), from a running pipeline's server or a stopped one's data",
		Long: `Show a run's dead letters: the messages no stage could use, each with
its stage, the subject it came on, the reason, and what it was about.
Poison input is dead-lettered at once ("rejected"). A message whose
handler kept failing is dead-lettered after its last delivery ("gave up
after N deliveries"), or at once while what it needs is down ("gave up at
once": a world model whose calls keep failing): those are what an outage
cost ("given up" in the summary).

--resend sends those given up back to the subjects they came on, once
their cause is fixed, and removes them from the dead letters: a step
waits for every group's prediction, so a stage between predict and fuse
that gave one up holds its step until it is sent again. It keeps
rejected input, and the dead letters of steps already fused: the
pipeline's own stages record what they give up as ungraded, so those
steps went on without it, and sending it again would change nothing.
--dry-run says what --resend would do. With --stage and --since it
considers only those.

Reads the stream of a running pipeline with --nats URL (the embedded
server of 'wmrl run' listens on 127.0.0.1:4222 by default), or of a
stopped one from its --data directory.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if since < 0 {
				return fmt.Errorf("--since %v: want how far back from now, such as 15m (0: all)", since)
			}
			if stage != "" && !slices.Contains(pipeline.AllStages, stage) {
				fmt.Fprintf(cmd.ErrOrStderr(), "note: %s is not one of this build's stages (%s); showing the dead letters an outside stage of that name sent\n", stage, strings.Join(pipeline.AllStages, ", "))
			}
			out := cmd.OutOrStdout()
			chosen := chooseDeadLetters(stage, since)
			if resend || dryRun {
				if follow {
					return fmt.Errorf("--resend sends the dead letters stored now: leave out --follow")
				}
				return resendDeadLetters(cmd, src, run, chosen, dryRun, asJSON)
			}
			var sum dlqSummary
			src.Note = func(s string) { fmt.Fprintln(cmd.ErrOrStderr(), "dlq: "+s) }
			err := pipeline.ReadDeadLetters(cmd.Context(), src, run, follow, func(dl schemas.DeadLetter) error {
				if !chosen(dl) {
					return nil
				}
				sum.add(dl)
				return writeDeadLetter(out, dl, asJSON)
			})
			if err != nil {
				return err
			}
			if !asJSON {
				sum.write(out, schemas.Subject(src.Prefix, run, schemas.KindDLQ))
			}
			return nil
		},
	}
	fs := cmd.Flags()
	streamSourceFlags(fs, &src, &run)
	fs.StringVar(&stage, "stage", "", "only the dead letters of this stage")
	fs.DurationVar(&since, "since", 0, "only the dead letters of the last this long")
	fs.BoolVar(&follow, "follow", false, "after the stored ones, show new dead letters as they come, until Ctrl-C (through restarts of the server)")
	fs.BoolVar(&asJSON, "json", false, "one JSON object per dead letter, as stored (subject, stage, reason, payload, time, seq; payload_bytes when the payload was cut to fit)")
	fs.BoolVar(&resend, "resend", false, "send the dead letters given up (for an outage) back to their subjects and remove them, but those of steps fused already")
	fs.BoolVar(&dryRun, "dry-run", false, "say what --resend would send and keep, and change nothing")
	return cmd
}

// keptWhy says why --resend keeps a dead letter.
var keptWhy = map[pipeline.Resend]string{
	pipeline.KeptRejected:  "rejected input, which would be rejected again",
	pipeline.KeptFused:     "their steps are fused already (they trained without them): sending them again would change nothing",
	pipeline.KeptElsewhere: "they came on a subject outside the run",
	pipeline.KeptCut:       "their payloads were cut to fit the server's max_payload, and the whole messages are past the stream's retention",
}

// chooseDeadLetters picks the dead letters of stage (any if empty) of the
// last since (all if 0).
func chooseDeadLetters(stage string, since time.Duration) func(schemas.DeadLetter) bool {
	var after time.Time
	if since > 0 {
		after = time.Now().Add(-since)
	}
	return func(dl schemas.DeadLetter) bool {
		return (stage == "" || dl.Stage == stage) && (after.IsZero() || !dl.Time.Before(after))
	}
}

// writeDeadLetter writes one dead letter on a line: as stored (JSON), or
// for reading.
func writeDeadLetter(w io.Writer, dl schemas.DeadLetter, asJSON bool) error {
	if asJSON {
		b, err := json.Marshal(dl)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(w, "%s\n", b)
		return err
	}
	_, err := fmt.Fprintln(w, dlqLine(dl))
	return err
}

// resendDeadLetters runs dlq --resend: a line for each dead letter sent
// again (as JSON with --json), then what was sent and kept, and why.
func resendDeadLetters(cmd *cobra.Command, src pipeline.StreamSource, run string, chosen func(schemas.DeadLetter) bool, dryRun, asJSON bool) error {
	out := cmd.OutOrStdout()
	opt := pipeline.ResendOptions{DryRun: dryRun, Select: chosen}
	counts := map[pipeline.Resend]int{}
	bySubject := map[string]int{}
	var subjects []string
	err := pipeline.ResendDeadLetters(cmd.Context(), src, run, opt, func(dl schemas.DeadLetter, what pipeline.Resend) error {
		counts[what]++
		if what != pipeline.Resent {
			return nil
		}
		if bySubject[dl.Subject]++; bySubject[dl.Subject] == 1 {
			subjects = append(subjects, dl.Subject)
		}
		return writeDeadLetter(out, dl, asJSON)
	})
	// What was sent is said even when a later one failed; nothing, when
	// none was read (a --run the stream does not hold).
	if err != nil && len(counts) == 0 {
		return err
	}
	verb := "sent again"
	if dryRun {
		verb = "would send again"
	}
	var to []string
	for _, s := range subjects {
		to = append(to, fmt.Sprintf("%d to %s", bySubject[s], s))
	}
	line := fmt.Sprintf("%s %d dead letter", verb, counts[pipeline.Resent])
	if counts[pipeline.Resent] != 1 {
		line += "s"
	}
	if len(to) > 0 {
		line += " (" + strings.Join(to, ", ") + ")"
	}
	for _, k := range []pipeline.Resend{pipeline.KeptFused, pipeline.KeptRejected, pipeline.KeptElsewhere, pipeline.KeptCut} {
		if counts[k] > 0 {
			line += fmt.Sprintf("; kept %d: %s", counts[k], keptWhy[k])
		}
	}
	if asJSON {
		fmt.Fprintln(cmd.ErrOrStderr(), line) // stdout stays JSON lines
	} else {
		fmt.Fprintln(out, line)
	}
	return err
}

// dlqLine is one dead letter on one line: when, which stage, the subject it
// came on, what it was about, and why.
func dlqLine(dl schemas.DeadLetter) string {
	when := "-"
	if !dl.Time.IsZero() {
		when = dl.Time.UTC().Format("2006-01-02T15:04:05.000Z")
	}
	stage, subject := dl.Stage, dl.Subject
	if stage == "" {
		stage = "-"
	}
	if subject == "" {
		subject = "-"
	}
	what := about(dl.Payload)
	if dl.PayloadBytes > 0 {
		what = fmt.Sprintf("[payload cut to %d of %d bytes; the whole at stream sequence %d]", len(dl.Payload), dl.PayloadBytes, dl.Seq)
	}
	return fmt.Sprintf("%s  %-9s %-22s %s  %s", when, stage, subject, what, oneLine(dl.Reason))
}

// about names what a payload was about (its step, group, trajectory or
// task), or says that it is not a JSON object.
func about(payload string) string {
	var m map[string]any
	if err := json.Unmarshal([]byte(payload), &m); err != nil {
		return fmt.Sprintf("[%d bytes, not a JSON object]", len(payload))
	}
	var parts []string
	if v, ok := m["step"].(float64); ok {
		parts = append(parts, fmt.Sprintf("step %d", int64(v)))
	}
	for _, k := range []string{"group_id", "traj_id", "task_id"} {
		if v, ok := m[k].(string); ok && v != "" {
			parts = append(parts, strings.TrimSuffix(k, "_id")+" "+v)
		}
	}
	if len(parts) == 0 {
		return fmt.Sprintf("[%d bytes]", len(payload))
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// dlqSummary counts dead letters by stage, and within a stage those given
// up for an outage apart from those rejected.
type dlqSummary struct {
	n           int
	first, last time.Time
	stages      []string
	rejected    map[string]int
	gaveUp      map[string]int
}

func (s *dlqSummary) add(dl schemas.DeadLetter) {
	if s.rejected == nil {
		s.rejected, s.gaveUp = map[string]int{}, map[string]int{}
	}
	st := dl.Stage
	if st == "" {
		st = "-"
	}
	if s.rejected[st]+s.gaveUp[st] == 0 {
		s.stages = append(s.stages, st)
	}
	if pipeline.GivenUp(dl) {
		s.gaveUp[st]++
	} else {
		s.rejected[st]++
	}
	s.n++
	if !dl.Time.IsZero() && (s.first.IsZero() || dl.Time.Before(s.first)) {
		s.first = dl.Time
	}
	if dl.Time.After(s.last) {
		s.last = dl.Time
	}
}

func (s *dlqSummary) write(w io.Writer, subject string) {
	if s.n == 0 {
		fmt.Fprintf(w, "no dead letters on %s\n", subject)
		return
	}
	var parts []string
	for _, st := range s.stages {
		parts = append(parts, fmt.Sprintf("%s %d (rejected %d, given up %d)", st, s.rejected[st]+s.gaveUp[st], s.rejected[st], s.gaveUp[st]))
	}
	span := ""
	if !s.first.IsZero() {
		span = fmt.Sprintf(", %s to %s", s.first.UTC().Format(time.RFC3339), s.last.UTC().Format(time.RFC3339))
	}
	fmt.Fprintf(w, "%d dead letters on %s%s: %s\n", s.n, subject, span, strings.Join(parts, "; "))
}
