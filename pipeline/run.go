package pipeline

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/gateway"
	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
	"github.com/wmrl/wmrl/stages/breaker"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/predict"
)

// Pipeline is a running pipeline process: some or all stages, optionally
// the simulated source, on one NATS connection.
type Pipeline struct {
	cfg           Config
	topo          *Topology
	tr            *transport
	metrics       *Metrics
	pub           *natsjs.Publisher
	router        *message.Router
	subs          []*natsjs.Subscriber // closed after the router, before the connection
	consumers     []string             // the durable consumers the subscribers read
	streamLost    chan struct{}        // an input's error said the stream or a consumer is not found
	notFoundTold  sync.Map             // stage and input told "not found" since the stream was last found whole
	fuse          *fuse.Stage
	calibrate     atomic.Pointer[calibrate.Stage] // told when the checkpoint bucket is made anew
	source        *simSource
	progress      *progress
	archived      *progress
	archiveWriter *archive.Writer
	// The outcome store, opened once (outcomes).
	outcomesOnce sync.Once
	outcomeStore outcomeStore
	outcomesErr  error
	lettered     lettered // late anchor groups whose pairs a dead letter holds up (--steps)
	gateway      *gateway.Gateway
	wm           predict.WorldModel
	wmBreaker    *breaker.Breaker // the world model's, shared by predict and the gateway
	wmReplies    *replies         // what its answers came to, told by predict and the gateway
	pairsOnce    sync.Once
	pairs        *pairsIndex // the pairs stored, as the pair stage asks (pairsStored)
	plansOnce    sync.Once
	plans        *plans // the plans stored, as route asks (plannedBefore)
	// httpListener is bound before the leases are taken, so Start fails
	// on a busy address and HTTPURL is known as soon as Start returns
	// (a standby's too, whose Start returns once it takes over).
	httpListener net.Listener
	httpTLS      *tls.Config // nil: plain HTTP
	dl           *deadLetters
	state        *natsjs.StateStore // checkpoints; opened by the first stage that keeps one
	leases       []*natsjs.Lease    // of the one-per-run stages it runs
	// standby: what the process waits for before it starts, while it
	// waits for a lease; built: the stages are built (router is set).
	standby atomic.Pointer[string]
	built   atomic.Bool
	// leaseLost: the stages another process took over (it stops, and
	// saves no checkpoint of theirs over the other's).
	leaseLost sync.Map

	started       time.Time
	disrupted     atomic.Int64 // unix ns: when route's inputs may last have gone astray (astray.go)
	summary       *stepSummary // of the steps fused since the last line (Config.StepSummary)
	doneOnce      sync.Once    // the closing line of a run of --steps
	beforeFitOnce sync.Once    // the line about the calibration before its first fit
	warmUpOnce    sync.Once    // the line about rho before the denoiser's warm-up ends
	models        worldModels  // the world models the fused steps were scored by (progress.go)

	cancel context.CancelFunc
	wg     sync.WaitGroup
	errMu  sync.Mutex
	err    error
	done   chan struct{}
}

// Run starts a pipeline and blocks until ctx is done, --steps updates were
// published, or a stage fails.
func Run(ctx context.Context, cfg Config) error {
	p, err := Start(ctx, cfg)
	if errors.Is(err, errStoppedWaiting) {
		if cfg.setDefaults(); !cfg.Quiet {
			fmt.Fprintf(cfg.Out, "%v\n", err)
		}
		return nil
	}
	if err != nil {
		return err
	}
	return p.Wait()
}

// Start connects, provisions the stream, rebuilds each stage's state from
// the retained messages and starts the stages; it returns once they
// consume.
func Start(ctx context.Context, cfg Config) (*Pipeline, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	topo, err := LoadTopology(cfg.TopologyFile, cfg.Prefix, cfg.Run)
	if err != nil {
		return nil, err
	}
	metrics := NewMetrics()
	tr, err := connect(ctx, &cfg, metrics)
	if err != nil {
		return nil, err
	}
	stopped := ctx.Err // the caller's: Ctrl-C, SIGTERM
	ctx, cancel := context.WithCancel(ctx)
	p := &Pipeline{cfg: cfg, topo: topo, tr: tr, metrics: metrics, started: time.Now(), summary: newStepSummary(time.Now()), cancel: cancel, done: make(chan struct{}),
		streamLost: make(chan struct{}, 1)}
	if tr.watch != nil {
		tr.watch.attach(p.metrics, p.fail, p.disruption)
	} else {
		p.metrics.NATSConnected.Set(1) // in process
	}
	if tr.srv != nil {
		p.expireHeld(ctx, p.cfg.Stages, "the process before this one")
		if open := cfg.exposure(); open != "" {
			p.notef("%s", open)
		}
		p.boundBeyondDisk(ctx)
		if until := tr.srv.CertificateNotAfter(); !until.IsZero() {
			p.presents(certNATS, "the embedded NATS server's certificate (--listen-cert)", until)
		}
	}
	for _, open := range []string{cfg.gatewayExposure(), cfg.metricsExposure()} {
		if open != "" {
			p.notef("%s", open)
		}
	}
	p.serveMetrics(ctx) // from the start: a process waiting for a lease answers /healthz too
	if cfg.HTTPAddr != "" {
		// Before the leases: the gateway reads and writes the stream and
		// needs none of the one-per-run stages, so a process waiting to
		// run them serves trainers meanwhile, as a replica behind a load
		// balancer must.
		err = p.serveGateway(ctx)
	}
	if err == nil {
		err = p.takeLeases(ctx)
	}
	if err == nil {
		p.standby.Store(nil)
		err = p.build(ctx)
	}
	if err == nil {
		p.built.Store(true)
	}
	if err != nil {
		cancel()    // closes the gateway, if it serves
		p.wg.Wait() // what the stages built so far started (the archive's writer releases its run)
		p.releaseLeases()
		tr.close()
		p.errMu.Lock()
		defer p.errMu.Unlock()
		if p.err != nil { // what stopped the start (the metrics address taken)
			return nil, p.err
		}
		if stopped() != nil && !errors.Is(err, errStoppedWaiting) {
			// Stopped (Ctrl-C, SIGTERM) while its stages read their state
			// from the stream: a stop, not a failure (a rehearsal's
			// SIGTERM exited 1 so, "scan ...: context canceled").
			err = fmt.Errorf("%w: it was reading its stages' state from the stream (%v)", errStoppedWaiting, err)
		}
		return nil, err
	}
	p.start(ctx)
	// Return once every stage consumes: a pipeline stopped while watermill's
	// router is still subscribing waits out the router's close timeout for
	// the handlers it had not started (5 s), and a caller publishing right
	// after Start should find the consumers in place.
	select {
	case <-p.router.Running():
		if cfg.Source == SourceExternal {
			p.notef("%s", p.ready())
		}
	case <-ctx.Done(): // failed, stopped or already complete while starting
		if err := p.Wait(); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// expireHeld has the server give again at once what the consumers of
// stages had delivered to a process gone (who) and that was never
// settled: a process killed (SIGKILL, the OOM killer) held whole steps,
// which would otherwise wait out the consumers' AckWait (30 s). On the
// embedded server, just started on its store, that is the process
// before this one, for every stage this one runs; on an external server,
// a process that no longer runs on this machine, or went silent, for the
// one-per-run stages taken from it (a one-per-run stage's consumers have
// no other reader). Consumers of outside stages are left alone: their process
// may be alive and still handling them. Failing, the start only waits
// as it did.
func (p *Pipeline) expireHeld(ctx context.Context, stages []string, who string) {
	own := map[string]bool{}
	for _, stage := range stages {
		for _, kind := range schemas.Kinds {
			own[consumerName(stage, p.cfg.Run, kind)] = true
		}
	}
	if _, err := natsjs.ExpirePending(ctx, p.tr.js, p.tr.stream, func(c string) bool { return own[c] }, 300*time.Millisecond); err != nil && ctx.Err() == nil {
		p.notef("restart: %v; what %s held comes again after the consumers' ack wait (30 s)", err, who)
	}
}

// ready is the line a process that waits for input from outside prints
// once it consumes: where its server is, what it runs, and where a
// trainer sends trajectories, so that a silent start is not mistaken for
// a hung one.
func (p *Pipeline) ready() string {
	where := "the embedded NATS server at " + p.tr.url
	if p.tr.srv == nil {
		where = "NATS at " + p.tr.url
	}
	stages := "no stages (the gateway alone)"
	if len(p.cfg.Stages) > 0 {
		stages = "stages " + strings.Join(p.cfg.Stages, ", ")
	}
	line := fmt.Sprintf("ready: run %s on %s, %s", p.cfg.Run, where, stages)
	if p.cfg.runs(StageRoute) {
		line += fmt.Sprintf("; trajectories go to %s (several at once, as a JSON array, to %s), step watermarks to %s",
			p.topo.In(StageRoute, schemas.KindTraj), p.topo.In(StageRoute, schemas.KindTrajs), p.topo.In(StageRoute, schemas.KindStep))
	}
	if u := p.HTTPURL(); u != "" {
		line += "; the trainer gateway is at " + u
	}
	return line
}

// HTTPURL is the gateway's base URL ("" without one).
func (p *Pipeline) HTTPURL() string {
	if p.httpListener == nil {
		return ""
	}
	if p.httpTLS != nil {
		return "https://" + p.httpListener.Addr().String()
	}
	return "http://" + p.httpListener.Addr().String()
}

// URL is the NATS server address other processes can use.
func (p *Pipeline) URL() string { return p.tr.url }

// Metrics exposes the collectors.
func (p *Pipeline) Metrics() *Metrics { return p.metrics }

// Stop ends the pipeline and waits for it.
func (p *Pipeline) Stop() error {
	p.cancel()
	return p.Wait()
}

// Wait blocks until the pipeline ends and returns the first stage error.
func (p *Pipeline) Wait() error {
	<-p.done
	p.errMu.Lock()
	defer p.errMu.Unlock()
	return p.err
}

func (p *Pipeline) fail(err error) {
	if err == nil || errors.Is(err, context.Canceled) {
		return
	}
	if errors.Is(err, nats.ErrConnectionClosed) && p.tr.watch != nil && !p.tr.watch.isStopping() {
		err = p.tr.watch.closedError(p.tr.nc.LastError())
	}
	p.errMu.Lock()
	if p.err == nil {
		p.err = err
	}
	p.errMu.Unlock()
	p.cancel()
}

func (p *Pipeline) go_(f func() error) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		p.fail(f())
	}()
}

func (p *Pipeline) stagePublisher(stage string) message.Publisher {
	var pub message.Publisher = countingPublisher{Publisher: p.pub, n: p.metrics.Out.WithLabelValues(stage)}
	if p.cfg.wrapPublisher != nil {
		pub = p.cfg.wrapPublisher(stage, pub)
	}
	return pub
}

func (p *Pipeline) subscribe(stage string, kind schemas.Kind, h message.NoPublishHandlerFunc) error {
	return p.subscribeTo(stage, kind, p.topo.In(stage, kind), h)
}

// subscribeTo has stage's handler of kind read subject.
func (p *Pipeline) subscribeTo(stage string, kind schemas.Kind, subject string, h message.NoPublishHandlerFunc) error {
	sub, err := natsjs.NewSubscriber(natsjs.SubscriberConfig{
		Conn:          p.tr.nc,
		Stream:        func(string) jetstream.StreamConfig { return StreamConfig(&p.cfg) },
		ConsumerGroup: consumerName(stage, p.cfg.Run, kind),
		AckWait:       p.cfg.ackWait,
		MaxAckPending: p.cfg.MaxAckPending,
		Prefetch:      1024,
		Logger:        inputLogger{p: p, stage: stage},
	})
	if err != nil {
		return err
	}
	p.router.AddNoPublisherHandler(stage+"/"+string(kind), subject, sub, h)
	p.subs = append(p.subs, sub)
	p.consumers = append(p.consumers, sub.Durable(subject))
	return nil
}

// inputLogger hears the errors a subscriber reads on after: it prints them
// (they come in a handful when a cluster node is lost, not per message) and
// counts them.
type inputLogger struct {
	watermill.NopLogger
	p     *Pipeline
	stage string
}

func (l inputLogger) Error(msg string, err error, fields watermill.LogFields) {
	l.p.inputError(l.stage, fmt.Sprintf("%s %v", msg, fields["topic"]), err)
}

func (l inputLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (p *Pipeline) inputError(stage, what string, err error) {
	p.disruption()
	p.metrics.InputErrors.WithLabelValues(stage).Inc()
	if !p.lostStream(err) {
		p.notef("%s: %s: %v (reading on)", stage, what, err)
		return
	}
	// Asked again every few hundred milliseconds until watchStream
	// knows: said once, not for each read.
	if _, told := p.notFoundTold.LoadOrStore(stage+" "+what, true); !told {
		p.notef("%s: %s: %v (reading on; checking whether it was deleted: if it is still gone %v from now, the process stops)", stage, what, err, p.cfg.goneAgain())
	}
}

// reader opens an in-order reader of subject for stage, from the first
// message after stream sequence after (0: the first retained), whose
// retries are printed and counted like the subscribers' errors.
func (p *Pipeline) reader(ctx context.Context, stage, subject string, after uint64) (*natsjs.Reader, error) {
	r, err := natsjs.NewReaderAfter(ctx, p.tr.js, p.tr.stream, subject, after, false)
	if err != nil {
		return nil, err
	}
	r.OnRetry = func(err error) { p.inputError(stage, "read "+subject, err) }
	return r, nil
}

// serveGateway builds the trainer gateway and serves it until ctx is done.
func (p *Pipeline) serveGateway(ctx context.Context) error {
	if err := p.newPublisher(); err != nil {
		return err
	}
	if err := p.buildGateway(); err != nil {
		return err
	}
	srv := &http.Server{Addr: p.cfg.HTTPAddr, Handler: p.gateway.Handler(), ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: log.New(&httpErrorLog{out: p.cfg.Out}, "", 0), ConnState: p.cfg.gatewayConnState}
	p.go_(func() error { return p.gateway.Run(ctx) })
	p.go_(func() error {
		defer p.gateway.Close() // the reward endpoints' world-model calls: those the drain let end are answered
		serve := func() error { return srv.Serve(p.httpListener) }
		if p.httpTLS != nil {
			srv.TLSConfig = p.httpTLS
			serve = func() error { return srv.ServeTLS(p.httpListener, "", "") }
		}
		served := make(chan error, 1)
		go func() { served <- serve() }()
		select {
		case err := <-served:
			if err != nil && !errors.Is(err, http.ErrServerClosed) && ctx.Err() == nil {
				return fmt.Errorf("pipeline: gateway on %s: %w", p.cfg.HTTPAddr, err)
			}
			return nil
		case <-ctx.Done():
		}
		// The process stops: no new connection is taken (a trainer's
		// next request goes to another gateway of the run), and the
		// requests in flight end first, up to HTTPDrain (long polls
		// answer 503 at once, reward requests under way get their
		// world model's answer). The connection to NATS outlives this.
		drain, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.cfg.HTTPDrain)
		defer cancel()
		if err := srv.Shutdown(drain); err != nil {
			// The reward endpoints' world-model calls still under way
			// end, so that their requests answer 503, asked again
			// elsewhere, rather than find their connection cut.
			p.gateway.Close()
			last, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			defer cancel()
			if err := srv.Shutdown(last); err != nil {
				p.notef("gateway: requests still running %v after the stop began were cut off (--http-drain)", p.cfg.HTTPDrain+time.Second)
				_ = srv.Close()
			}
		}
		<-served
		return nil
	})
	return nil
}

// consumerName is the durable JetStream consumer through which stage reads
// kind.
func consumerName(stage, run string, kind schemas.Kind) string {
	return natsjs.SafeName(fmt.Sprintf("%s_%s_%s", stage, run, kind))
}

func (p *Pipeline) start(ctx context.Context) {
	if p.tr.srv != nil || p.cfg.runs(StageRoute) {
		p.go_(func() error { p.watchStore(ctx); return nil })
	}
	if p.tr.srv != nil {
		p.go_(func() error { return p.watchServer(ctx) })
	}
	p.go_(func() error { return p.watchStream(ctx) })
	p.go_(func() error {
		err := p.router.Run(ctx)
		if errors.Is(err, natsjs.ErrClosed) && ctx.Err() != nil {
			return nil // stopped while the router subscribed: no error
		}
		return err
	})
	if p.cfg.StepSummary > 0 && p.fuse != nil {
		p.go_(func() error { p.summarize(ctx); return nil })
	}
	if p.source != nil {
		p.go_(func() error { return p.source.run(ctx) })
	}
	// A run whose steps were all fused before it started ends at once,
	// once its router has subscribed: stopped while the router
	// subscribes, it would wait out the router's close timeout (5 s) for
	// the handlers not started yet.
	go func() {
		select {
		case <-p.router.Running():
			p.finishIfComplete()
		case <-ctx.Done():
		}
	}()
	go func() {
		<-ctx.Done()
		_ = p.router.Close()
		// The router returns once its handlers have, which can be before
		// a subscriber has handed its messages back: Close waits for that
		// (a second Close waits for the first), so that the connection
		// closed below does not cut the hand-backs off.
		for _, s := range p.subs {
			_ = s.Close()
		}
		p.wg.Wait()
		p.releaseLeases()
		_ = p.pub.Close()
		p.tr.close()
		p.doneOnce.Do(p.sayStopped) // unless it said it was done
		close(p.done)
	}()
}

// serveMetrics serves /metrics, /healthz and the profiles on MetricsAddr,
// if set, until ctx is done.
func (p *Pipeline) serveMetrics(ctx context.Context) {
	if p.cfg.MetricsAddr == "" {
		return
	}
	srv := &http.Server{Addr: p.cfg.MetricsAddr, Handler: p.metricsHandler(), ReadHeaderTimeout: 10 * time.Second}
	p.go_(func() error {
		go func() { <-ctx.Done(); _ = srv.Close() }()
		if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("pipeline: metrics on %s: %w", p.cfg.MetricsAddr, err)
		}
		return nil
	})
}
