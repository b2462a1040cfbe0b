package pipeline

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"gonum.org/v1/gonum/stat"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
)

// Status is a run's state as its stream shows it, read from outside the
// pipeline: what it last received, fused and calibrated, and how far
// behind each consumer of its subjects is. It answers "is it stalled, and
// where" without Prometheus.
type Status struct {
	Stream   string
	Messages uint64
	Bytes    uint64
	// StoreUsed is the file storage the JetStream account uses (every
	// stream of it, or of its tier: accountStore); StoreLimit its limit, or the embedded server's, 0
	// when none is known. At the limit every stage stops.
	StoreUsed  uint64
	StoreLimit int64
	First      time.Time // oldest message kept
	MaxAge     time.Duration
	// Per subject of the run: messages kept.
	Subjects map[string]uint64
	// OtherRuns, when the run has no message in the stream (a --run
	// mistyped), are the runs that have some.
	OtherRuns []string
	// The newest step watermark, update and calibration (nil: none yet),
	// with when each was stored.
	LastStep   *schemas.StepClose
	LastStepAt time.Time
	// LastTrajStep is the step of the newest trajectory (nil: none), with
	// when it was stored: one past LastStep's waits for its watermark.
	LastTrajStep *int64
	LastTrajAt   time.Time
	// LastUpdate is the update of the highest step fused: not the newest
	// stored when a step held back (by a late anchor group, or a
	// prediction sent back from the dead letters) was fused after later
	// ones.
	LastUpdate      *schemas.Update
	LastUpdateAt    time.Time
	LastCalibration *schemas.Calibration
	LastCalibAt     time.Time
	// Unfused: the steps planned (route stored their plan) whose update
	// is not stored, in step order, among the plans of the last
	// UnfusedWindow or about the newest UnfusedMax. One below
	// LastUpdate's step waits for something later steps did not: an
	// anchor group within its deadline, or a group's prediction, which
	// has no deadline (a stage between predict and fuse dead-lettered it).
	Unfused     []UnfusedStep
	DeadLetters uint64
	// The newest dead letter (nil: none), with when it was stored: its
	// reason says whether something is down right now ("gave up at
	// once: ... is down since ...") or an input was bad.
	LastDeadLetter   *schemas.DeadLetter
	LastDeadLetterAt time.Time
	// Consumers: every durable consumer of one of the run's subjects
	// (the stages', and outside stages' of their own), by name.
	Consumers []ConsumerStatus
	// Executions: the anchor executions stored over the last
	// ExecutionsWindow, whichever process ran them, or over about the
	// newest ExecutionsMax groups of it.
	Executions ExecutionsStatus
	// Anchors: what became of the anchor groups of the steps fused in
	// Unfused's window.
	Anchors AnchorsStatus
	// Runners: which process runs each one-per-run stage (route, pair,
	// calibrate, fuse, archive, in that order), as its lease says.
	Runners []StageRunner
}

// StageRunner is the process that holds a one-per-run stage's lease (nil:
// none does), and when it last renewed it. Ended: that process was of
// this machine and no longer runs (killed): its lease lapses LeaseTTL
// after Renewed, and a process started for the stage here takes it at
// once. Silent: that process answered no request (natsjs.Unanswered):
// killed, or cut off from the server for now; a process waiting for the
// stage takes it once it has been so, without renewing its lease, for
// natsjs.SilentAfter(LeaseTTL).
type StageRunner struct {
	Stage   string
	Holder  *natsjs.Holder
	Renewed time.Time
	Ended   bool
	Silent  bool
}

// ExecutionsWindow is how far back Status looks at executions, and
// ExecutionsMax about how many groups at most it reads: a simulated run
// stores tens of thousands an hour, which took 13 s more to read.
const (
	ExecutionsWindow = time.Hour
	ExecutionsMax    = 2000
)

// UnfusedWindow and UnfusedMax bound the plans Status looks at for steps
// not fused: a held step older than that is still in the run's output and
// wmrl_prediction_wait_seconds.
const (
	UnfusedWindow = 24 * time.Hour
	UnfusedMax    = 200
)

// AnchorsStatus is what became of the anchor groups of the steps fused in
// a window, as their updates say: how many missed --anchor-deadline (the
// step used the world model's rewards for them, and their executions
// still feed the calibration), and how many were executed with fewer
// than two scores. A deadline set too short shows here first.
type AnchorsStatus struct {
	// Since: where the window starts, that of Unfused: UnfusedWindow ago,
	// or later when that held more than UnfusedMax plans (Capped).
	Since  time.Time
	Capped bool
	Steps  int
	// Groups: the steps' anchor groups (used, late and failed); Late and
	// Failed among them.
	Groups, Late, Failed int
}

// add counts a step's anchor groups.
func (as *AnchorsStatus) add(used, late, failed int) {
	as.Steps++
	as.Groups, as.Late, as.Failed = as.Groups+used+late+failed, as.Late+late, as.Failed+failed
}

// ExecutionsStatus is how the anchor executions of a window ended.
type ExecutionsStatus struct {
	// Since: where the window starts; later than ExecutionsWindow ago when
	// it held more than ExecutionsMax groups.
	Since    time.Time
	Capped   bool
	Groups   int
	ByStatus map[string]int // execution status to trajectories executed
	// Shared: the trajectories not executed, that took a copy's outcome
	// (--exec-copies-once); not in ByStatus.
	Shared int
	// ByCause counts the executions that did not score by execute.Cause
	// of their detail.
	ByCause map[string]int
	// The newest execution that failed or gave no score (zero: none),
	// its status and detail, and when its group was stored.
	NewestFailure   schemas.ExecItem
	NewestFailureAt time.Time
	// Seconds: how long the executions took (copies and sandbox errors,
	// which may not have run, left out), and Slowest each group's slowest
	// execution, what a step waits for up to --anchor-deadline (zero: no
	// execution).
	Seconds, Slowest TimeQuantiles
}

// TimeQuantiles are the median, 99th percentile and maximum of a set of
// durations in seconds (the empirical distribution).
type TimeQuantiles struct {
	Median, P99, Max float64
}

// timeQuantiles of xs, which it sorts; zero when empty.
func timeQuantiles(xs []float64) TimeQuantiles {
	if len(xs) == 0 {
		return TimeQuantiles{}
	}
	slices.Sort(xs)
	return TimeQuantiles{Median: stat.Quantile(0.5, stat.Empirical, xs, nil), P99: stat.Quantile(0.99, stat.Empirical, xs, nil), Max: xs[len(xs)-1]}
}

// UnfusedStep is a step planned and not fused, with when its plan was
// stored.
type UnfusedStep struct {
	Step    int64
	Planned time.Time
}

// ConsumerStatus is how far one durable consumer has got.
type ConsumerStatus struct {
	Name, Subject string
	Backlog       uint64     // messages not delivered yet
	InFlight      int        // delivered, not acknowledged
	Redelivered   int        // of those, delivered more than once
	Waiting       int        // pull requests waiting: a reader is there
	LastDelivery  *time.Time // nil: never
}

// ReadStatus reads run's status from the source's stream.
func ReadStatus(ctx context.Context, src StreamSource, run string) (*Status, error) {
	c, err := src.open(ctx, false)
	if err != nil {
		return nil, err
	}
	defer c.close()
	stream, err := c.js.Stream(ctx, c.stream)
	if err != nil {
		return nil, fmt.Errorf("pipeline: status at %s: %w", c.url, err)
	}
	prefix := src.Prefix + "." + run + "."
	info, err := stream.Info(ctx, jetstream.WithSubjectFilter(prefix+">"))
	if err != nil {
		return nil, fmt.Errorf("pipeline: status at %s: %w", c.url, err)
	}
	st := &Status{Stream: c.stream, Messages: info.State.Msgs, Bytes: info.State.Bytes, First: info.State.FirstTime,
		MaxAge: info.Config.MaxAge, Subjects: info.State.Subjects}
	st.DeadLetters = st.Subjects[schemas.Subject(src.Prefix, run, schemas.KindDLQ)]
	if len(st.Subjects) == 0 {
		if st.OtherRuns, err = runsIn(ctx, stream, src.Prefix); err != nil {
			return nil, fmt.Errorf("pipeline: status at %s: %w", c.url, err)
		}
	}
	if ai, err := c.js.AccountInfo(ctx); err == nil {
		st.StoreUsed, st.StoreLimit = accountStore(ai, info.Config.Replicas)
	}
	if st.StoreLimit == 0 && c.srv != nil {
		st.StoreLimit = c.srv.StoreLimit()
	}
	if err := readNewest(ctx, stream, st, src.Prefix, run); err != nil {
		return nil, err
	}
	var highest natsjs.Record
	if st.Unfused, st.Anchors, highest, err = readUnfused(ctx, c, stream, st, src.Prefix, run); err != nil {
		return nil, err
	}
	if step, ok := schemas.StepOfMsgID(highest.MsgID); ok && st.LastUpdate != nil && step > st.LastUpdate.Step {
		m, err := stream.GetMsg(ctx, highest.Seq)
		if err != nil {
			return nil, fmt.Errorf("pipeline: status: update of step %d (stream seq %d): %w", step, highest.Seq, err)
		}
		var u schemas.Update
		if err := json.Unmarshal(m.Data, &u); err != nil {
			return nil, fmt.Errorf("pipeline: status: update of step %d (stream seq %d): %w", step, highest.Seq, err)
		}
		st.LastUpdate, st.LastUpdateAt = &u, m.Time
	}
	if st.Consumers, err = readConsumers(ctx, stream, prefix); err != nil {
		return nil, err
	}
	if st.Executions, err = readExecutions(ctx, c, stream, st, schemas.Subject(src.Prefix, run, schemas.KindExecution)); err != nil {
		return nil, err
	}
	if st.Runners, err = readRunners(ctx, c, src.Prefix, run); err != nil {
		return nil, err
	}
	return st, nil
}

// readNewest reads the run's newest watermark, trajectory, update,
// calibration and dead letter, each by its subject.
func readNewest(ctx context.Context, stream jetstream.Stream, st *Status, prefix, run string) error {
	last := func(kind schemas.Kind, v any) (time.Time, bool, error) {
		m, err := stream.GetLastMsgForSubject(ctx, schemas.Subject(prefix, run, kind))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return time.Time{}, false, nil
		}
		if err != nil {
			return time.Time{}, false, fmt.Errorf("pipeline: status: last %s: %w", kind, err)
		}
		if err := json.Unmarshal(m.Data, v); err != nil {
			return time.Time{}, false, fmt.Errorf("pipeline: status: last %s (stream seq %d): %w", kind, m.Sequence, err)
		}
		return m.Time, true, nil
	}
	var (
		step schemas.StepClose
		up   schemas.Update
		cal  schemas.Calibration
		dl   schemas.DeadLetter
		ok   bool
		err  error
	)
	if st.LastStepAt, ok, err = last(schemas.KindStep, &step); err != nil {
		return err
	} else if ok {
		st.LastStep = &step
	}
	// The newest trajectory is anyone's input, malformed maybe (it is
	// then dead-lettered): it says nothing of the step then. It came alone
	// or in a trajs message, whose newest step it gives.
	for _, kind := range []schemas.Kind{schemas.KindTraj, schemas.KindTrajs} {
		m, err := stream.GetLastMsgForSubject(ctx, schemas.Subject(prefix, run, kind))
		if errors.Is(err, jetstream.ErrMsgNotFound) || err == nil && st.LastTrajStep != nil && m.Time.Before(st.LastTrajAt) {
			continue
		} else if err != nil {
			return fmt.Errorf("pipeline: status: last %s: %w", kind, err)
		}
		if step, ok := schemas.NewestStep(kind, m.Data); ok {
			st.LastTrajStep, st.LastTrajAt = &step, m.Time
		}
	}
	if st.LastUpdateAt, ok, err = last(schemas.KindUpdate, &up); err != nil {
		return err
	} else if ok {
		st.LastUpdate = &up
	}
	if st.LastCalibAt, ok, err = last(schemas.KindCalibration, &cal); err != nil {
		return err
	} else if ok {
		st.LastCalibration = &cal
	}
	if st.LastDeadLetterAt, ok, err = last(schemas.KindDLQ, &dl); err != nil {
		return err
	} else if ok {
		st.LastDeadLetter = &dl
	}
	return nil
}

// readConsumers lists the durable consumers of the run's subjects (those
// whose subjects start with prefix), by name.
func readConsumers(ctx context.Context, stream jetstream.Stream, prefix string) ([]ConsumerStatus, error) {
	var out []ConsumerStatus
	consumers := stream.ListConsumers(ctx)
	for ci := range consumers.Info() {
		subject := ci.Config.FilterSubject
		if subject == "" && len(ci.Config.FilterSubjects) == 1 {
			subject = ci.Config.FilterSubjects[0]
		}
		if ci.Config.Durable == "" || !strings.HasPrefix(subject, prefix) {
			continue // readers (ordered, ephemeral) and other runs'
		}
		out = append(out, ConsumerStatus{Name: ci.Name, Subject: subject, Backlog: ci.NumPending,
			InFlight: ci.NumAckPending, Redelivered: ci.NumRedelivered, Waiting: ci.NumWaiting, LastDelivery: ci.Delivered.Last})
	}
	if err := consumers.Err(); err != nil {
		return nil, fmt.Errorf("pipeline: status: consumers: %w", err)
	}
	slices.SortFunc(out, func(a, b ConsumerStatus) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// readRunners reads the leases of the run's one-per-run stages.
func readRunners(ctx context.Context, c *streamConn, prefix, run string) ([]StageRunner, error) {
	ls, err := natsjs.ReadLeases(ctx, c.js, LeaseBucket(prefix))
	if err != nil {
		return nil, fmt.Errorf("pipeline: status: %w", err)
	}
	out := make([]StageRunner, len(onePerRun))
	silent := map[string]bool{} // by holder: one process often holds them all
	for i, stage := range onePerRun {
		out[i].Stage = stage
		if ls == nil {
			continue
		}
		if out[i].Holder, out[i].Renewed, err = ls.Held(ctx, leaseKey(run, stage)); err != nil {
			return nil, fmt.Errorf("pipeline: status: %w", err)
		}
		if h := out[i].Holder; h != nil {
			if out[i].Ended = h.Ended(); !out[i].Ended {
				s, asked := silent[h.ID]
				if !asked {
					s = natsjs.Unanswered(c.js.Conn(), *h)
					silent[h.ID] = s
				}
				out[i].Silent = s
			}
		}
	}
	return out, nil
}

// windowStart is where a look at the newest messages of subject starts:
// window ago, or later, at the stream message about max messages of
// subject before its last (by the subject's share of the stream), when
// the window holds more.
func windowStart(ctx context.Context, stream jetstream.Stream, st *Status, subject string, window time.Duration, max int) (since time.Time, capped bool) {
	since = time.Now().Add(-window)
	kept := st.Subjects[subject]
	if kept <= uint64(max) {
		return since, false
	}
	last, err := stream.GetLastMsgForSubject(ctx, subject)
	if err != nil {
		return since, false
	}
	back := uint64(float64(max) * float64(st.Messages) / float64(kept))
	if last.Sequence <= back {
		return since, false
	}
	if m, err := stream.GetMsg(ctx, last.Sequence-back); err == nil && m.Time.After(since) {
		return m.Time, true
	}
	return since, false
}

// readExecutions sums up the executions stored on subject over the last
// ExecutionsWindow, or about its newest ExecutionsMax groups.
func readExecutions(ctx context.Context, c *streamConn, stream jetstream.Stream, st *Status, subject string) (ExecutionsStatus, error) {
	es := ExecutionsStatus{ByStatus: map[string]int{}, ByCause: map[string]int{}}
	if st.Subjects[subject] == 0 {
		es.Since = time.Now().Add(-ExecutionsWindow)
		return es, nil
	}
	es.Since, es.Capped = windowStart(ctx, stream, st, subject, ExecutionsWindow, ExecutionsMax)
	var each, slowest []float64
	err := natsjs.ScanSince(ctx, c.js, c.stream, subject, es.Since, false, func(rec natsjs.Record) error {
		var e schemas.Execution
		if json.Unmarshal(rec.Data, &e) == nil {
			es.Groups++
			slow := 0.0
			for _, it := range e.Items {
				slow = max(slow, it.Seconds)
				if it.CopyOf != "" {
					es.Shared++
					continue
				}
				if it.Status != schemas.ExecSandboxError {
					each = append(each, it.Seconds)
				}
				es.ByStatus[it.Status]++
				if it.Status != schemas.ExecScored {
					es.NewestFailure, es.NewestFailureAt = it, rec.Time
					es.ByCause[execute.Cause(it.Detail)]++
				}
			}
			if len(e.Items) > 0 {
				slowest = append(slowest, slow)
			}
		}
		return nil
	})
	if err != nil {
		return es, fmt.Errorf("pipeline: status: executions: %w", err)
	}
	es.Seconds, es.Slowest = timeQuantiles(each), timeQuantiles(slowest)
	return es, nil
}

// readUnfused lists the steps whose plan is stored and whose update is
// not, among the plans of the last UnfusedWindow (or about the newest
// UnfusedMax), from the two subjects' message IDs (headers only): reading
// every plan and update took status 4 s longer on a simulated run's store
// of 5,000 steps, and these bounds keep it as fast as before. It also
// gives the record (headers only) of the highest step's update over
// that window, and sums up the anchor groups of the updates stored in
// it: from their headers (schemas.HeaderAnchors and the others), and,
// for an update without them (stored before they were added, or by a
// stage in fuse's place), from the update itself.
func readUnfused(ctx context.Context, c *streamConn, stream jetstream.Stream, st *Status, prefix, run string) ([]UnfusedStep, AnchorsStatus, natsjs.Record, error) {
	var highest natsjs.Record
	var as AnchorsStatus
	plans := schemas.Subject(prefix, run, schemas.KindPlan)
	if st.Subjects[plans] == 0 {
		return nil, as, highest, nil
	}
	since, capped := windowStart(ctx, stream, st, plans, UnfusedWindow, UnfusedMax)
	as.Since, as.Capped = since, capped
	read := func(subject string, fn func(natsjs.Record)) error {
		if err := natsjs.ScanSince(ctx, c.js, c.stream, subject, since, true, func(r natsjs.Record) error { fn(r); return nil }); err != nil {
			return fmt.Errorf("pipeline: status: %w", err)
		}
		return nil
	}
	fused := map[int64]bool{}
	top := int64(-1)
	var bare []uint64 // updates without the anchor-group headers
	if err := read(schemas.Subject(prefix, run, schemas.KindUpdate), func(r natsjs.Record) {
		step, ok := schemas.StepOfMsgID(r.MsgID)
		if !ok {
			return
		}
		if !fused[step] {
			if used, late, failed, ok := anchorCounts(r.Header); ok {
				as.add(used, late, failed)
			} else {
				bare = append(bare, r.Seq)
			}
		}
		fused[step] = true
		if step > top {
			top, highest = step, r
		}
	}); err != nil {
		return nil, as, highest, err
	}
	for _, seq := range bare {
		m, err := stream.GetMsg(ctx, seq)
		if err != nil {
			return nil, as, highest, fmt.Errorf("pipeline: status: update at stream seq %d: %w", seq, err)
		}
		var u struct { // the items, most of an update, are passed over
			Anchors       int      `json:"anchors"`
			LateAnchors   []string `json:"late_anchors"`
			FailedAnchors []string `json:"failed_anchors"`
		}
		if json.Unmarshal(m.Data, &u) == nil {
			as.add(u.Anchors, len(u.LateAnchors), len(u.FailedAnchors))
		}
	}
	var out []UnfusedStep
	if err := read(plans, func(r natsjs.Record) {
		if step, ok := schemas.StepOfMsgID(r.MsgID); ok && !fused[step] {
			out = append(out, UnfusedStep{Step: step, Planned: r.Time})
		}
	}); err != nil {
		return nil, as, highest, err
	}
	slices.SortFunc(out, func(a, b UnfusedStep) int { return cmp.Compare(a.Step, b.Step) })
	return slices.CompactFunc(out, func(a, b UnfusedStep) bool { return a.Step == b.Step }), as, highest, nil
}

// anchorCounts reads an update's anchor-group headers.
func anchorCounts(h nats.Header) (used, late, failed int, ok bool) {
	var errs [3]error
	used, errs[0] = strconv.Atoi(h.Get(schemas.HeaderAnchors))
	late, errs[1] = strconv.Atoi(h.Get(schemas.HeaderLateAnchors))
	failed, errs[2] = strconv.Atoi(h.Get(schemas.HeaderFailedAnchors))
	return used, late, failed, errors.Join(errs[:]...) == nil
}

// runsIn lists the runs of which stream holds a message under prefix.
func runsIn(ctx context.Context, stream jetstream.Stream, prefix string) ([]string, error) {
	all, err := stream.Info(ctx, jetstream.WithSubjectFilter(prefix+".*.>"))
	if err != nil {
		return nil, err
	}
	var runs []string
	for subject := range all.State.Subjects {
		r, _, _ := strings.Cut(strings.TrimPrefix(subject, prefix+"."), ".")
		if !slices.Contains(runs, r) {
			runs = append(runs, r)
		}
	}
	slices.Sort(runs)
	return runs, nil
}

// runHeld returns an error naming the runs the stream holds when it holds
// no message of run: a --run mistyped read as a run without dead letters.
func runHeld(ctx context.Context, c *streamConn, prefix, run string) error {
	stream, err := c.js.Stream(ctx, c.stream)
	if err != nil {
		return fmt.Errorf("pipeline: %s at %s: %w", c.stream, c.url, err)
	}
	info, err := stream.Info(ctx, jetstream.WithSubjectFilter(prefix+"."+run+".>"))
	if err != nil {
		return fmt.Errorf("pipeline: %s at %s: %w", c.stream, c.url, err)
	}
	if len(info.State.Subjects) > 0 {
		return nil
	}
	runs, err := runsIn(ctx, stream, prefix)
	if err != nil {
		return fmt.Errorf("pipeline: %s at %s: %w", c.stream, c.url, err)
	}
	if len(runs) == 0 {
		return fmt.Errorf("pipeline: the stream %s at %s holds no run yet (--run %s)", c.stream, c.url, run)
	}
	return fmt.Errorf("pipeline: the stream %s at %s holds nothing of run %s (it holds %s): give --run one of them", c.stream, c.url, run, strings.Join(runs, ", "))
}
