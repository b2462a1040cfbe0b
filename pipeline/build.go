package pipeline

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/gateway"
	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/tlsfiles"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/execute"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/pair"
	"github.com/wmrl/wmrl/stages/predict"
	"github.com/wmrl/wmrl/stages/route"
)

// This file builds each stage of the process: its handler, its
// subscriptions, and the state it rebuilds from the retained messages.

func (p *Pipeline) build(ctx context.Context) error {
	if err := p.newPublisher(); err != nil {
		return err
	}
	var err error
	if p.router, err = message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{}); err != nil {
		return err
	}
	p.dl = &deadLetters{pub: p.pub, subject: p.topo.Subject(schemas.KindDLQ), maxAttempts: p.cfg.MaxAttempts,
		maxPayload: int(p.tr.nc.MaxPayload()), metrics: p.metrics, notef: p.notef, onPanic: p.panicked}
	p.router.AddMiddleware(p.metrics.Middleware, p.dl.Middleware, recoverPanics)
	p.metrics.initStages(p.cfg.Stages)
	cfg := &p.cfg
	for _, stage := range cfg.Stages {
		var err error
		switch stage {
		case StageRoute:
			err = p.buildRoute(ctx)
		case StagePredict:
			var wm predict.WorldModel
			if wm, err = p.worldModel(); err == nil {
				h := &predict.Handler{Run: cfg.Run, Out: p.topo.Out(StagePredict, schemas.KindPred), Pub: p.stagePublisher(stage), WM: wm,
					LastAttempt: p.dl.lastAttempt, Breaker: p.worldModelBreaker(), Predicted: p.worldModelReplies().predicted}
				err = p.subscribe(stage, schemas.KindGroup, h.Handle)
			}
		case StageExecute:
			var exe execute.Executor
			if exe, err = p.buildExecutor(ctx); err != nil {
				return err
			}
			h := execute.NewHandler(cfg.Run, p.topo.Out(StageExecute, schemas.KindExecution), p.stagePublisher(stage), exe, cfg.ExecSlots)
			h.LastAttempt = p.dl.lastAttempt
			h.Executed = (&executions{metrics: p.metrics, notef: p.notef}).executed
			p.metrics.ExecutionSlots.Set(float64(cap(h.Slots)))
			h.Waiting = func(d int) { p.metrics.ExecutionsWaiting.WithLabelValues("slot").Add(float64(d)) }
			h.Busy = func(d int) { p.metrics.ExecutionSlotsBusy.Add(float64(d)) }
			h.CopiesOnce, h.Shared = cfg.ExecCopiesOnce, func(schemas.ExecItem) { p.metrics.ExecutionsShared.Inc() }
			h.Breaker = p.breaker(stage, "the executor", cfg.ExecDownAfter, cfg.ExecProbeEvery, p.metrics.ExecutorDown,
				"anchor groups are published at once with their executions ungraded (their steps use the world model for them)")
			if store, serr := p.outcomes(ctx); serr == nil {
				h.Store = store
				h.OnStoreError = func(err error) {
					p.dl.say(StageExecute, "outcome-store", "%v (best effort: at worst a redelivery runs the trajectory again)", err)
				}
			} else {
				p.notef("execute: %v; running without it: outcomes are kept in this process only", serr)
			}
			err = p.subscribe(stage, schemas.KindExec, h.Handle)
		case StagePair:
			h := pair.NewHandler(cfg.Run, p.topo.Out(StagePair, schemas.KindPairs), p.stagePublisher(stage))
			h.Wait, h.Redelivered, h.Stored = cfg.PairWait, redelivered, p.pairsStored
			h.LetGo = func(step int64, group, side string) {
				p.metrics.PairSidesLetGo.WithLabelValues(side).Inc()
				p.notef("pair: the %s of anchor group %d/%s came again after its pairs were stored (a pair process stopped before the server had its acknowledgement): let go", side, step, group)
			}
			if err = p.subscribe(stage, schemas.KindPred, h.HandlePred); err == nil {
				err = p.subscribe(stage, schemas.KindExecution, h.HandleExecution)
			}
		case StageCalibrate:
			err = p.buildCalibrate(ctx)
		case StageFuse:
			err = p.buildFuse(ctx)
		case StageArchive:
			err = p.buildArchive(ctx)
		}
		if err != nil {
			return fmt.Errorf("pipeline: stage %s: %w", stage, err)
		}
	}
	if cfg.Source == SourceSim {
		var err error
		if p.source, err = newSimSource(p); err != nil {
			return err
		}
		if err := p.source.resume(ctx); err != nil {
			return err
		}
	}
	return nil
}

func (p *Pipeline) buildRoute(ctx context.Context) error {
	cfg := &p.cfg
	p.disruption() // the process that ran route before may have ended holding inputs
	kinds := []schemas.Kind{schemas.KindTraj, schemas.KindTrajs, schemas.KindStep}
	var subs []*natsjs.Subscriber // route's, once subscribed
	h, err := route.NewHandler(route.Config{
		Run: cfg.Run, Scheduler: cfg.Anchors, StepTimeout: cfg.StepTimeout,
		Redelivered:   redelivered,
		Seq:           natsjs.StreamSeq,
		PlannedBefore: p.plannedBefore,
		Out: route.Topics{
			Group: p.topo.Out(StageRoute, schemas.KindGroup),
			Exec:  p.topo.Out(StageRoute, schemas.KindExec),
			Plan:  p.topo.Out(StageRoute, schemas.KindPlan),
		},
		InFlight:      p.execInFlight,
		MaxPayload:    int(p.tr.nc.MaxPayload()),
		Size:          natsjs.WireSize,
		OnShort:       p.closedShort,
		OnNoWatermark: p.noWatermark,
		OnDropped:     p.dropped,
		OnTaken: func(kind schemas.Kind, n int) {
			p.metrics.TrajectoriesIn.WithLabelValues(string(kind)).Add(float64(n))
		},
		WatermarkWait: cfg.StuckAfter,
		Reject: func(m *message.Message, item int, payload []byte, reason error) error {
			return p.dl.rejectItem(StageRoute, m, item, payload, reason)
		},
		Astray:     func(ctx context.Context) (int, error) { return p.inputsAstray(ctx, subs, kinds) },
		AstrayWait: astrayWait,
		OnAstray:   p.waitsForAstray,
	}, p.stagePublisher(StageRoute))
	if err != nil {
		return err
	}
	planned, err := p.stepsStored(ctx, StageRoute, p.topo.Out(StageRoute, schemas.KindPlan))
	if err != nil {
		return err
	}
	h.MarkClosed(planned...)
	if cfg.Anchors.MaxInFlight > 0 {
		sent, err := p.tr.groupsByMsgID(ctx, p.topo.Out(StageRoute, schemas.KindExec))
		if err != nil {
			return err
		}
		h.Resume(sent) // keeps those of steps planned already out
	}
	for i, handle := range []message.NoPublishHandlerFunc{h.HandleTraj, h.HandleTrajs, h.HandleStep} { // kinds' order
		if err := p.subscribe(StageRoute, kinds[i], handle); err != nil {
			return err
		}
		subs = append(subs, p.subs[len(p.subs)-1])
	}
	p.go_(func() error { return h.Run(ctx) })
	return nil
}

// execInFlight counts anchor groups sent for execution and not executed:
// what the execute stage's durable consumer has not acknowledged, queued or
// running (execute acknowledges a group once its execution is stored, or
// dead-lettered). That holds across restarts and wherever execute runs.
// With no consumer yet (execute not started), nothing is in flight.
func (p *Pipeline) execInFlight(ctx context.Context) (int, error) {
	name := p.cfg.ExecConsumer
	if name == "" {
		name = consumerName(StageExecute, p.cfg.Run, schemas.KindExec)
	}
	cons, err := p.tr.js.Consumer(ctx, p.tr.stream, name)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("consumer %s: %w", name, err)
	}
	info, err := cons.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("consumer %s: %w", name, err)
	}
	return int(info.NumPending) + info.NumAckPending, nil
}

func (p *Pipeline) buildCalibrate(ctx context.Context) error {
	cfg := &p.cfg
	deb, err := calibrate.NewDebiaser(cfg.Debiaser)
	if err != nil {
		return err
	}
	out := p.topo.Out(StageCalibrate, schemas.KindCalibration)
	var last schemas.Calibration
	if _, err := p.tr.last(ctx, out, &last); err != nil {
		return err
	}
	st := &calibrate.Stage{RunID: cfg.Run, Out: out, Pub: p.stagePublisher(StageCalibrate), Deb: deb, Published: last.Seq,
		DeadLetter: func(in calibrate.Input, reason error) {
			p.dl.reject(StageCalibrate, p.topo.In(StageCalibrate, schemas.KindPairs), in.Seq, reason, in.Data)
		},
	}
	retained, err := p.tr.stored(ctx, p.topo.In(StageCalibrate, schemas.KindPairs))
	if err != nil {
		return fmt.Errorf("calibrate: count the retained pair groups: %w", err)
	}
	if err := p.wireCalibrateCheckpoints(ctx, st, retained); err != nil {
		return err
	}
	sk, err := p.skipsOf(ctx, StageCalibrate, p.topo.In(StageCalibrate, schemas.KindPairs))
	if err != nil {
		return err
	}
	r, err := p.reader(ctx, StageCalibrate, p.topo.In(StageCalibrate, schemas.KindPairs), st.ReadsAfter())
	if err != nil {
		return err
	}
	st.Skip, st.Panicked = sk.has, sk.panicked
	st.FirstRetained = func(ctx context.Context) (uint64, error) {
		info, err := p.tr.info(ctx)
		if err != nil {
			return 0, err
		}
		return info.State.FirstSeq, nil
	}
	p.go_(func() error { defer r.Close(); return st.Run(ctx, p.inputOf(StageCalibrate, r)) })
	return nil
}

// UpdateBytesPerTrajectory is about what a trajectory adds to its step's
// update (386 on the housing task's real run; IDs of other lengths move it).
const UpdateBytesPerTrajectory = 400

func (p *Pipeline) buildFuse(ctx context.Context) error {
	cfg := &p.cfg
	out := p.topo.Out(StageFuse, schemas.KindUpdate)
	st, err := fuse.NewStage(fuse.StepsConfig{
		Run: cfg.Run, Debias: cfg.Debias, Denoiser: cfg.Denoiser, Norm: cfg.AdvantageNorm, AnchorDeadline: cfg.AnchorDeadline,
	}, out, p.stagePublisher(StageFuse))
	if err != nil {
		return err
	}
	published, err := p.stepsStored(ctx, StageFuse, out)
	if err != nil {
		return err
	}
	st.MarkPublished(published...)
	// The world models of the newest update stored, by this process or
	// one before it, for the note when they change (a restart onto
	// another); a read that fails leaves only that note out.
	var newest schemas.Update
	if ok, err := p.tr.last(ctx, out, &newest); ok && err == nil {
		p.models.seed(newest.Models())
	}
	if err := p.wireFuseCheckpoints(ctx, st); err != nil {
		return err
	}
	in := p.topo.In(StageFuse, schemas.KindCalibration)
	st.DeadLetter = func(c calibrate.Input, reason error) { p.dl.reject(StageFuse, in, c.Seq, reason, c.Data) }
	sk, err := p.skipsOf(ctx, StageFuse, in)
	if err != nil {
		return err
	}
	st.Skip, st.Panicked, st.FusePanicked = sk.has, sk.panicked, p.fusePanicked
	st.OnUpdate = p.onUpdate
	st.MaxPayload, st.Size = int(p.tr.nc.MaxPayload()), natsjs.WireSize
	p.metrics.MaxPayload.Set(float64(st.MaxPayload))
	st.OnUpdateBytes = func(n int) { p.metrics.UpdateBytes.Set(float64(n)) }
	st.StuckAfter = cfg.StuckAfter
	st.OnWait = func(d time.Duration) { p.metrics.PredictionWait.Set(d.Seconds()) }
	st.OnStuck = func(w fuse.Waiting) {
		p.notef("fuse: step %d has waited %v for the predictions of %s, which nothing has published. "+
			"A stage between predict and fuse may have given them up (wmrl dlq; wmrl dlq --resend sends them again once the cause is fixed), "+
			"or be down or behind (wmrl status); the step is fused when they come, and later steps go on meanwhile",
			w.Step, cfg.StuckAfter, groupsOf(w.Missing, w.Groups))
	}
	st.OnUnstuck = func(step int64, waited time.Duration) {
		p.notef("fuse: step %d got its last prediction and was fused, %v after its plan", step, waited.Round(time.Second))
	}
	if st.MaxPayload < natsjs.DefaultMaxPayload {
		// NATS's default is 1 MB: an external server left at it stops runs
		// of realistic steps; say so before the first one.
		p.notef("fuse: the NATS server takes messages of at most %.1f MiB, and a step's update is one message of about %d bytes a trajectory: "+
			"a step of over about %d trajectories will stop the run (set max_payload: 8MB, as deploy/nats does)",
			float64(st.MaxPayload)/(1<<20), UpdateBytesPerTrajectory, st.MaxPayload/UpdateBytesPerTrajectory)
	}
	p.fuse = st
	for _, k := range []schemas.Kind{schemas.KindPlan, schemas.KindPred, schemas.KindExecution} {
		h := map[schemas.Kind]message.NoPublishHandlerFunc{
			schemas.KindPlan: st.HandlePlan, schemas.KindPred: st.HandlePrediction, schemas.KindExecution: st.HandleExecution,
		}[k]
		if err := p.subscribe(StageFuse, k, h); err != nil {
			return err
		}
	}
	r, err := p.reader(ctx, StageFuse, in, st.ReadsAfter())
	if err != nil {
		return err
	}
	p.go_(func() error { defer r.Close(); return st.Run(ctx, p.inputOf(StageFuse, r), r.Last) })
	if p.cfg.Steps > 0 {
		done := slices.Clone(published)
		if len(published) > 0 {
			info, err := p.tr.info(ctx)
			if err != nil {
				return err
			}
			if info.State.FirstSeq > 1 {
				// The stream aged out its oldest messages: the steps below the
				// first update it holds were published before those it holds.
				for s := int64(0); s < slices.Min(published); s++ {
					done = append(done, s)
				}
			}
		}
		p.progress = newProgress(p.cfg.Steps, done)
	}
	return nil
}

// ArchiveCodeWait is how long the archive waits for an update's anchor
// groups' trajectories: they come before it, but for a restart's
// redeliveries, which come together or, rarely, after the consumers'
// AckWait (30 s; see README, Known limits).
const ArchiveCodeWait = 35 * time.Second

// recordedNorm is n as the archive's settings record it: empty for the
// default, as in the files from before they recorded it.
func recordedNorm(n fuse.Normalization) fuse.Normalization {
	if n == fuse.Standardize {
		return ""
	}
	return n
}

func (p *Pipeline) buildArchive(ctx context.Context) error {
	w, err := archive.OpenWriter(archive.WriterConfig{Dir: p.cfg.ArchiveRoot(), Run: p.cfg.Run,
		MaxRows: p.cfg.ArchiveMaxRows, MaxAge: p.cfg.ArchiveMaxAge,
		Settings: archive.Settings{Debias: p.cfg.Debias, Debiaser: p.cfg.Debiaser, Denoiser: p.cfg.Denoiser,
			AnchorFraction: p.cfg.Anchors.Fraction, AnchorMin: p.cfg.Anchors.MinPerStep,
			AnchorRounding: p.cfg.Anchors.Rounding, AnchorDeadline: p.cfg.AnchorDeadline.Seconds(),
			AdvantageNorm: recordedNorm(p.cfg.AdvantageNorm), Build: ReadBuild().String()}})
	if err != nil {
		return err
	}
	p.go_(func() error {
		<-ctx.Done()
		return w.Close() // the open file's rows are durable; its inputs are redelivered and skipped
	})
	st := archive.NewStage(p.cfg.Run, w)
	st.Stored = natsjs.Stored
	var otherNorms sync.Map // the pairs of advantages said, each once
	st.OnOtherAdvantages = func(step int64, fused, recorded fuse.Normalization) {
		if _, said := otherNorms.LoadOrStore([2]fuse.Normalization{fused, recorded}, true); !said {
			p.notef("archive: step %d's update was fused with %s advantages, and this process's archive stage records %s (its --advantage-norm) in its files: "+
				"the rows are archived, but a replay on the files' settings will not reproduce them; give this process the fuse stage's --advantage-norm (said once)", step, fused, recorded)
		}
	}
	p.archiveWriter = w
	if p.cfg.Steps > 0 {
		p.archived = newProgress(p.cfg.Steps, w.Archived())
		p.go_(func() error { return p.followLetters(ctx) })
		st.OnArchived = func(step int64, late bool) {
			if !late {
				p.metrics.Archived.Inc()
				p.archived.add(step)
			}
			p.finishIfComplete()
		}
	} else {
		st.OnArchived = func(_ int64, late bool) {
			if !late {
				p.metrics.Archived.Inc()
			}
		}
	}
	// A late anchor group's rows take their execution's status, seconds,
	// detail and copy from the outcomes execute keeps, and the rows of its
	// trajectories without a pair (ungraded, or a sandbox error) come from
	// there (an outside executor's leave the columns null and those
	// trajectories without rows).
	if store, err := p.outcomes(ctx); err == nil {
		st.Outcome = func(ctx context.Context, step int64, group, traj string) (schemas.ExecItem, bool, error) {
			return store.Load(ctx, execute.OutcomeKey(step, group, traj))
		}
		st.OnOutcomeError = func(err error) { p.dl.say(StageArchive, "outcome-store", "%v", err) }
	} else {
		p.notef("archive: %v; late anchor groups' rows are archived without their execution's status and seconds, and their trajectories without a pair (ungraded, or a sandbox error) without rows", err)
	}
	if err := p.subscribe(StageArchive, schemas.KindUpdate, st.HandleUpdate); err != nil {
		return err
	}
	if err := p.subscribe(StageArchive, schemas.KindCalibration, st.HandleCalibration); err != nil {
		return err
	}
	if p.cfg.ArchiveCode {
		// The anchor groups as execute gets them, wherever a topology
		// sends them, unless it names the archive's own.
		subject := p.topo.InOr(StageArchive, StageExecute, schemas.KindExec)
		st.CodeWait = ArchiveCodeWait
		var (
			mu   sync.Mutex
			said time.Time
		)
		st.OnNoCode = func(step int64, groups []string) {
			mu.Lock()
			defer mu.Unlock()
			if time.Since(said) < time.Minute {
				return
			}
			said = time.Now()
			p.notef("archive: the trajectories of step %d's anchor groups %s did not come on %s within %v: their rows are archived without prompt and response (said at most once a minute)",
				step, strings.Join(groups, ", "), subject, ArchiveCodeWait)
		}
		if err := p.subscribeTo(StageArchive, schemas.KindExec, subject, st.HandleExec); err != nil {
			return err
		}
	}
	if after := p.cfg.ArchiveCompactAfter; after > 0 {
		p.go_(func() error { p.compactArchive(ctx, after); return nil })
	}
	return nil
}

// compactArchive merges the run's closed archive files once they are
// older than after, every after/2 (at most every 30 minutes), until ctx
// ends. The archive loses nothing if a merge fails: it is said, at most
// once an hour, and tried again.
func (p *Pipeline) compactArchive(ctx context.Context, after time.Duration) {
	t := time.NewTicker(min(max(after/2, 10*time.Millisecond), 30*time.Minute))
	defer t.Stop()
	var said time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rep, err := archive.Compact(p.cfg.ArchiveRoot(), p.cfg.Run, archive.CompactConfig{MaxRows: int64(p.cfg.ArchiveMaxRows), MinAge: after})
		switch {
		case errors.Is(err, archive.ErrBusy): // a replay or audit is reading: next time
		case err != nil:
			if time.Since(said) > time.Hour {
				said = time.Now()
				p.notef("archive: merging files closed over %v ago: %v (the files are kept as they are; trying again)", after, err)
			}
		case rep.Merged > 0:
			p.metrics.ArchiveMerged.Add(float64(rep.FilesBefore - rep.FilesAfter))
		}
	}
}

// newPublisher makes the process's publisher, once: the gateway's, made
// before the stages', and theirs.
func (p *Pipeline) newPublisher() error {
	if p.pub != nil {
		return nil
	}
	var err error
	p.pub, err = natsjs.NewPublisher(natsjs.PublisherConfig{Conn: p.tr.nc})
	return err
}

func (p *Pipeline) buildGateway() error {
	wm, err := p.worldModel()
	if err != nil {
		return err
	}
	trajs := p.topo.Subject(schemas.KindTrajs)
	if p.cfg.trajsAlone {
		trajs = "" // every trajectory a message of its own (BenchmarkGatewayOneByOne)
	}
	g, err := gateway.New(gateway.Config{
		Run: p.cfg.Run, Stream: p.tr.stream, Token: p.cfg.HTTPToken, WorldModel: wm, Breaker: p.worldModelBreaker(),
		Remember:   cmp.Or(p.cfg.RewardMemory, -1), // the gateway's 0 is its default
		MaxPayload: int(p.tr.nc.MaxPayload()),
		Instrument: p.metrics.instrumentHTTP,
		Answered:   func(a gateway.Answer, n int) { p.metrics.RewardAnswers.WithLabelValues(string(a)).Add(float64(n)) },
		Predicted:  p.worldModelReplies().predicted,
		Subjects: gateway.Subjects{
			Traj: p.topo.Subject(schemas.KindTraj), Trajs: trajs, Step: p.topo.Subject(schemas.KindStep),
			Update: p.topo.Out(StageFuse, schemas.KindUpdate), Calibration: p.topo.Out(StageCalibrate, schemas.KindCalibration),
			Exec: p.topo.Out(StageRoute, schemas.KindExec), Execution: p.topo.Out(StageExecute, schemas.KindExecution),
			Plan: p.topo.Out(StageRoute, schemas.KindPlan),
		},
	}, p.tr.js, p.pub)
	if err != nil {
		return err
	}
	if p.cfg.HTTPCert != "" {
		certs, err := tlsfiles.Load(p.cfg.HTTPCert, p.cfg.HTTPKey, certRenewed(&p.cfg, p.metrics, certGateway, "the trainer gateway"))
		if err != nil {
			return fmt.Errorf("pipeline: gateway: %w", err)
		}
		p.httpTLS = &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: certs.GetCertificate}
		p.presents(certGateway, "the trainer gateway's certificate (--http-cert)", certs.NotAfter())
	}
	l, err := net.Listen("tcp", p.cfg.HTTPAddr)
	if err != nil {
		return fmt.Errorf("pipeline: gateway: %w", err)
	}
	p.gateway, p.httpListener = g, l
	return nil
}

// dropped says a group was not sent on to be scored: a trainer's input the
// server would refuse, which the step goes on without.
func (p *Pipeline) dropped(d route.Dropped) {
	p.notef("route: step %d's group %s: %s. The step went on without it: its update has the group skipped and its trajectories ungraded. "+
		"Raise the server's max_payload (deploy/nats sets 8MB; --nats-max-payload-mb for the embedded server, up to 64), or send smaller groups",
		d.Step, d.GroupID, d.Reason)
}

// closedShort says that a step was planned on its timeout with less than
// its watermark declared: a trainer whose groups fall short of their
// group_size (a rollout that failed, dropped rather than sent) has every
// such step wait out --step-timeout, which only this says.
func (p *Pipeline) closedShort(s route.Short) {
	p.metrics.ShortSteps.Inc()
	var what []string
	if s.Groups < s.Declared {
		what = append(what, fmt.Sprintf("%d of the %d groups its watermark declared came", s.Groups, s.Declared))
	}
	if n := len(s.Incomplete); n > 0 {
		gs := Few(s.Incomplete, 3, func(g route.ShortGroup) string { return fmt.Sprintf("%s %d of %d", g.GroupID, g.Got, g.Want) })
		what = append(what, fmt.Sprintf("%d group(s) with fewer trajectories than their group_size (%s)", n, gs))
	}
	p.notef("route: step %d closed %s after its watermark, on --step-timeout, with %s; it was planned with what came. "+
		"A trainer that drops a failed rollout should send its group with the group_size it has, and a watermark with the groups it sends, "+
		"or every such step waits this long", s.Step, s.Waited.Round(time.Millisecond), strings.Join(what, " and "))
}

// noWatermark says that a step has had trajectories for --stuck-after
// and no watermark, which a trainer may have forgotten to send.
func (p *Pipeline) noWatermark(n route.NoWatermark) {
	gaveUp := ""
	if n.NewerPlanned >= 0 {
		gaveUp = fmt.Sprintf("; step %d, after it, was planned already: if the trainer gave this one up (it crashed during it and resumed past it), "+
			"send its watermark with the %d groups it has, and route stops holding its trajectories (its update is made; nothing needs it)", n.NewerPlanned, n.Groups)
	}
	p.notef("route: step %d has had %d trajectories in %d groups for %v and no watermark: it is planned only once one comes "+
		"(%s, {\"groups\": n}; the Python client's close_step or send_step), after the step's last trajectory%s",
		n.Step, n.Trajectories, n.Groups, n.Waited.Round(time.Second), p.topo.In(StageRoute, schemas.KindStep), gaveUp)
}

// groupsOf names the groups of a step that a step of n groups misses: all
// of them up to five, then how many more.
func groupsOf(missing []string, n int) string {
	return fmt.Sprintf("%d of its %d groups (%s)", len(missing), n, Few(missing, 5, func(g string) string { return g }))
}
