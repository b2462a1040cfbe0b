package pipeline

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/wmrl/wmrl/connectors/gateway"
	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/openai"
	"github.com/wmrl/wmrl/connectors/sandbox"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/execute"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/pair"
	"github.com/wmrl/wmrl/stages/predict"
	"github.com/wmrl/wmrl/stages/route"
)

// Pipeline is a running pipeline process: some or all stages, optionally
// the simulated source, on one NATS connection.
type Pipeline struct {
	cfg      Config
	topo     *Topology
	tr       *transport
	metrics  *Metrics
	pub      *natsjs.Publisher
	router   *message.Router
	fuse     *fuse.Stage
	source   *simSource
	progress *progress
	gateway  *gateway.Gateway
	wm       predict.WorldModel
	// httpListener is bound in build, so Start fails on a busy address and
	// HTTPURL is known as soon as Start returns.
	httpListener net.Listener
	dl           *deadLetters

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
	if err != nil {
		return err
	}
	return p.Wait()
}

// Start connects, provisions the stream, rebuilds each stage's state from
// the retained messages and starts the stages.
func Start(ctx context.Context, cfg Config) (*Pipeline, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	topo, err := LoadTopology(cfg.TopologyFile, cfg.Prefix, cfg.Run)
	if err != nil {
		return nil, err
	}
	tr, err := connect(ctx, &cfg)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	p := &Pipeline{cfg: cfg, topo: topo, tr: tr, metrics: NewMetrics(), cancel: cancel, done: make(chan struct{})}
	if err := p.build(ctx); err != nil {
		if p.httpListener != nil {
			p.httpListener.Close()
		}
		cancel()
		tr.close()
		return nil, err
	}
	p.start(ctx)
	return p, nil
}

// HTTPURL is the gateway's base URL ("" without one).
func (p *Pipeline) HTTPURL() string {
	if p.httpListener == nil {
		return ""
	}
	return "http://" + p.httpListener.Addr().String()
}

// worldModel builds the configured world model once per process.
func (p *Pipeline) worldModel() (predict.WorldModel, error) {
	if p.wm != nil {
		return p.wm, nil
	}
	switch p.cfg.WorldModel {
	case "openai":
		cfg := openai.Config{BaseURL: p.cfg.WMURL, Model: p.cfg.WMModel, APIKey: p.cfg.WMAPIKey, Samples: p.cfg.WMSamples,
			Temperature: p.cfg.WMTemperature, MaxTokens: p.cfg.WMMaxTokens}
		if p.cfg.WMTemplateFile != "" {
			var err error
			if cfg.Template, err = openai.LoadTemplate(p.cfg.WMTemplateFile); err != nil {
				return nil, err
			}
		}
		wm, err := openai.New(cfg)
		if err != nil {
			return nil, err
		}
		p.wm = wm
	default:
		p.wm = sim.DefaultWorldModel()
	}
	return p.wm, nil
}

func (p *Pipeline) buildGateway() error {
	wm, err := p.worldModel()
	if err != nil {
		return err
	}
	g, err := gateway.New(gateway.Config{
		Run: p.cfg.Run, Stream: p.tr.stream, Token: p.cfg.HTTPToken, WorldModel: wm,
		Subjects: gateway.Subjects{
			Traj: p.topo.Subject(schemas.KindTraj), Step: p.topo.Subject(schemas.KindStep),
			Update: p.topo.Out(StageFuse, schemas.KindUpdate), Calibration: p.topo.Out(StageCalibrate, schemas.KindCalibration),
			Exec: p.topo.Out(StageRoute, schemas.KindExec), Execution: p.topo.Out(StageExecute, schemas.KindExecution),
		},
	}, p.tr.js, p.pub)
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", p.cfg.HTTPAddr)
	if err != nil {
		return fmt.Errorf("pipeline: gateway: %w", err)
	}
	p.gateway, p.httpListener = g, l
	return nil
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
	return countingPublisher{Publisher: p.pub, n: p.metrics.Out.WithLabelValues(stage)}
}

func (p *Pipeline) subscribe(stage string, kind schemas.Kind, h message.NoPublishHandlerFunc) error {
	sub, err := natsjs.NewSubscriber(natsjs.SubscriberConfig{
		Conn:          p.tr.nc,
		Stream:        func(string) jetstream.StreamConfig { return StreamConfig(&p.cfg) },
		ConsumerGroup: fmt.Sprintf("%s_%s_%s", stage, p.cfg.Run, kind),
		MaxAckPending: p.cfg.MaxAckPending,
		Prefetch:      1024,
	})
	if err != nil {
		return err
	}
	p.router.AddNoPublisherHandler(stage+"/"+string(kind), p.topo.In(stage, kind), sub, h)
	return nil
}

func (p *Pipeline) build(ctx context.Context) error {
	var err error
	if p.pub, err = natsjs.NewPublisher(natsjs.PublisherConfig{Conn: p.tr.nc}); err != nil {
		return err
	}
	if p.router, err = message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{}); err != nil {
		return err
	}
	p.dl = &deadLetters{pub: p.pub, subject: p.topo.Subject(schemas.KindDLQ), maxAttempts: p.cfg.MaxAttempts, metrics: p.metrics}
	p.router.AddMiddleware(p.metrics.Middleware, p.dl.Middleware)
	cfg := &p.cfg
	for _, stage := range cfg.Stages {
		var err error
		switch stage {
		case StageRoute:
			err = p.buildRoute(ctx)
		case StagePredict:
			var wm predict.WorldModel
			if wm, err = p.worldModel(); err == nil {
				h := &predict.Handler{Run: cfg.Run, Out: p.topo.Out(StagePredict, schemas.KindPred), Pub: p.stagePublisher(stage), WM: wm}
				err = p.subscribe(stage, schemas.KindGroup, h.Handle)
			}
		case StageExecute:
			var exe execute.Executor = &sim.Executor{Latency: cfg.ExecLatency, Noise: 0.02}
			if cfg.executor() != "sim" {
				var task *sandbox.Task
				if task, err = sandbox.LoadTask(cfg.TaskDir); err != nil {
					return err
				}
				exe = &sandbox.Subprocess{Task: task}
				if cfg.executor() == "sandbox-fusion" {
					exe = &sandbox.Fusion{URL: cfg.SandboxURL, Task: task}
				}
			}
			h := execute.NewHandler(cfg.Run, p.topo.Out(StageExecute, schemas.KindExecution), p.stagePublisher(stage), exe, cfg.ExecSlots)
			err = p.subscribe(stage, schemas.KindExec, h.Handle)
		case StagePair:
			h := pair.NewHandler(cfg.Run, p.topo.Out(StagePair, schemas.KindPairs), p.stagePublisher(stage))
			if err = p.subscribe(stage, schemas.KindPred, h.HandlePred); err == nil {
				err = p.subscribe(stage, schemas.KindExecution, h.HandleExecution)
			}
		case StageCalibrate:
			err = p.buildCalibrate(ctx)
		case StageFuse:
			err = p.buildFuse(ctx)
		}
		if err != nil {
			return fmt.Errorf("pipeline: stage %s: %w", stage, err)
		}
	}
	if cfg.HTTPAddr != "" {
		if err := p.buildGateway(); err != nil {
			return err
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
	h, err := route.NewHandler(route.Config{
		Run: cfg.Run, Scheduler: cfg.Anchors, StepTimeout: cfg.StepTimeout,
		Redelivered: func(m *message.Message) bool {
			return m.Metadata.Get(natsjs.MetaDeliveries) > "1" || len(m.Metadata.Get(natsjs.MetaDeliveries)) > 1
		},
		Out: route.Topics{
			Group: p.topo.Out(StageRoute, schemas.KindGroup),
			Exec:  p.topo.Out(StageRoute, schemas.KindExec),
			Plan:  p.topo.Out(StageRoute, schemas.KindPlan),
		},
	}, p.stagePublisher(StageRoute))
	if err != nil {
		return err
	}
	planned, err := p.tr.stepsByMsgID(ctx, p.topo.Out(StageRoute, schemas.KindPlan))
	if err != nil {
		return err
	}
	h.MarkClosed(planned...)
	if err := p.subscribe(StageRoute, schemas.KindTraj, h.HandleTraj); err != nil {
		return err
	}
	if err := p.subscribe(StageRoute, schemas.KindStep, h.HandleStep); err != nil {
		return err
	}
	p.go_(func() error { h.Run(ctx); return nil })
	return nil
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
		DeadLetter: func(payload []byte, reason error) {
			_ = p.dl.send(StageCalibrate, p.topo.In(StageCalibrate, schemas.KindPairs), reason.Error(), payload)
		},
	}
	r, err := natsjs.NewReader(ctx, p.tr.js, p.tr.stream, p.topo.In(StageCalibrate, schemas.KindPairs), false)
	if err != nil {
		return err
	}
	p.go_(func() error { defer r.Close(); return st.Run(ctx, readerSource{r}) })
	return nil
}

func (p *Pipeline) buildFuse(ctx context.Context) error {
	cfg := &p.cfg
	out := p.topo.Out(StageFuse, schemas.KindUpdate)
	st, err := fuse.NewStage(fuse.StepsConfig{
		Run: cfg.Run, Debias: cfg.Debias, Denoiser: cfg.Denoiser, AnchorDeadline: cfg.AnchorDeadline,
	}, out, p.stagePublisher(StageFuse))
	if err != nil {
		return err
	}
	published, err := p.tr.stepsByMsgID(ctx, out)
	if err != nil {
		return err
	}
	st.MarkPublished(published...)
	st.OnUpdate = p.onUpdate
	p.fuse = st
	for _, k := range []schemas.Kind{schemas.KindPlan, schemas.KindPred, schemas.KindExecution} {
		h := map[schemas.Kind]message.NoPublishHandlerFunc{
			schemas.KindPlan: st.HandlePlan, schemas.KindPred: st.HandlePrediction, schemas.KindExecution: st.HandleExecution,
		}[k]
		if err := p.subscribe(StageFuse, k, h); err != nil {
			return err
		}
	}
	r, err := natsjs.NewReader(ctx, p.tr.js, p.tr.stream, p.topo.In(StageFuse, schemas.KindCalibration), false)
	if err != nil {
		return err
	}
	p.go_(func() error { defer r.Close(); return st.Run(ctx, readerSource{r}, r.Backlog) })
	if p.cfg.Steps > 0 {
		p.progress = newProgress(p.cfg.Steps, published)
	}
	return nil
}

func (p *Pipeline) start(ctx context.Context) {
	if p.gateway != nil {
		srv := &http.Server{Addr: p.cfg.HTTPAddr, Handler: p.gateway.Handler(), ReadHeaderTimeout: 10 * time.Second}
		p.go_(func() error { return p.gateway.Run(ctx) })
		p.go_(func() error {
			go func() { <-ctx.Done(); _ = srv.Close() }()
			if err := srv.Serve(p.httpListener); err != nil && !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("pipeline: gateway on %s: %w", p.cfg.HTTPAddr, err)
			}
			return nil
		})
	}
	if p.cfg.MetricsAddr != "" {
		srv := &http.Server{Addr: p.cfg.MetricsAddr, Handler: promhttp.HandlerFor(p.metrics.Registry, promhttp.HandlerOpts{})}
		p.go_(func() error {
			go func() { <-ctx.Done(); _ = srv.Close() }()
			if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("pipeline: metrics on %s: %w", p.cfg.MetricsAddr, err)
			}
			return nil
		})
	}
	p.go_(func() error { return p.router.Run(ctx) })
	if p.source != nil {
		p.go_(func() error { return p.source.run(ctx) })
	}
	if p.progress != nil && p.progress.complete() {
		p.cancel()
	}
	go func() {
		<-ctx.Done()
		_ = p.router.Close()
		p.wg.Wait()
		_ = p.pub.Close()
		p.tr.close()
		close(p.done)
	}()
}
