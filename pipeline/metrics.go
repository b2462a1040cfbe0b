package pipeline

import (
	"errors"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/wmrl/wmrl/connectors/gateway"
	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/openai"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/fuse"
)

// The servers whose certificates CertNotAfter follows.
const (
	certNATS    = "nats"
	certGateway = "gateway"
)

// Metrics are the pipeline's Prometheus collectors, on a registry of their
// own so several pipelines can live in one test process.
type Metrics struct {
	Registry *prometheus.Registry

	In, Out, Errors, Redeliveries, DeadLetters *prometheus.CounterVec
	Checkpoints, CheckpointErrors              *prometheus.CounterVec
	InputErrors                                *prometheus.CounterVec
	Latency                                    *prometheus.HistogramVec
	// StartReads counts, by stage (calibrate, fuse), the messages a stage
	// read at its start to rebuild its state, up to its input's newest
	// message then: what a restart costs beyond its checkpoint.
	StartReads *prometheus.CounterVec

	Rho, D, Pairs, Version, Steps prometheus.Gauge
	// WMDown is 1 while this process gives up on the world model's groups
	// without asking it, ExecutorDown while it publishes anchor groups
	// without running them (breaker.Breaker).
	WMDown, ExecutorDown prometheus.Gauge
	StepLatency          prometheus.Histogram
	Archived             prometheus.Counter
	// ArchiveMerged counts archive files merged away (inputs less outputs).
	ArchiveMerged prometheus.Counter
	// Lost counts, by kind (stepLosses), what of the fused steps did not
	// reach the gradient as planned.
	Lost *prometheus.CounterVec
	// BucketsRemade counts, by bucket, the key-value buckets this process
	// found gone from the server and made anew.
	BucketsRemade *prometheus.CounterVec
	// WithinSpearman: the world model's within-group rank correlation on
	// each anchor group executed in time, raw scores against true ones.
	WithinSpearman prometheus.Histogram
	// HTTPRequests and HTTPSeconds count and time the trainer gateway's
	// requests by endpoint (and status code): what a trainer sees of the
	// pipeline, reward latency and 503s included.
	HTTPRequests *prometheus.CounterVec
	HTTPSeconds  *prometheus.HistogramVec
	// WMRequests, WMRequestSeconds and WMTokens count, time and weigh the
	// requests this process's OpenAI-compatible world model made.
	WMRequests       *prometheus.CounterVec
	WMRequestSeconds prometheus.Histogram
	WMTokens         *prometheus.CounterVec
	// RewardAnswers counts the solutions the gateway's reward endpoints
	// scored, by where the score came from (gateway.Answers).
	RewardAnswers *prometheus.CounterVec
	// Executions counts the anchor executions this process ran, by
	// status; ExecutionSeconds times them.
	Executions       *prometheus.CounterVec
	ExecutionSeconds prometheus.Histogram
	// ExecutionsShared counts the anchor trajectories that took the
	// execution of a copy of their solution (--exec-copies-once).
	ExecutionsShared prometheus.Counter
	// PairSidesLetGo counts, by side (prediction, execution), the sides
	// of anchor groups the pair stage let go because their group's pairs
	// were stored: each is a side delivered again after a pair process
	// stopped, or lost its connection, before its acknowledgement.
	PairSidesLetGo *prometheus.CounterVec
	// ExecutionsWaiting are the executions waiting, by what for: a slot
	// (--exec-slots all busy), a user (--exec-uids) or a set of GPUs
	// (--exec-gpus); ExecutionSlots and ExecutionSlotsBusy, the slots
	// and those taken.
	ExecutionsWaiting                  *prometheus.GaugeVec
	ExecutionSlots, ExecutionSlotsBusy prometheus.Gauge
	// UpdateBytes is the size of the newest update this process published,
	// which must fit the server's max_payload (MaxPayload): a step over it
	// stops the run.
	UpdateBytes, MaxPayload prometheus.Gauge
	// PredictionWait is how long the longest-waiting planned step has
	// waited for a group's prediction: it grows without end for a step
	// whose prediction a stage dead-lettered.
	PredictionWait prometheus.Gauge
	// NATSConnected is 1 while the process's connection to its NATS
	// server is up; NATSReconnects counts its reconnections.
	NATSConnected  prometheus.Gauge
	NATSReconnects prometheus.Counter
	// ShortSteps counts steps route planned on their timeout with less
	// than their watermark declared.
	ShortSteps prometheus.Counter
	// AstraySteps counts steps that waited past their timeout for route's
	// inputs astray (pipeline/astray.go).
	AstraySteps prometheus.Counter
	// StreamBytes is what the run's stream holds; StoreBytes and
	// StoreLimit the JetStream account's store and its limit (0: none
	// known); StoreDiskFree the room left on the embedded server's disk.
	StreamBytes, StoreBytes, StoreLimit, StoreDiskFree prometheus.Gauge
	// CertNotAfter is when the certificate a server of this process shows
	// its clients expires (Unix seconds; 0 without TLS), by server: nats
	// (the embedded one) and gateway.
	CertNotAfter *prometheus.GaugeVec
	// TrajectoriesFused counts the trajectories of the updates this
	// process published: what the step losses of trajectories are a share
	// of (route's messages are not, since a trajs message holds many).
	TrajectoriesFused prometheus.Counter
	// TrajectoriesIn counts, by the subject they came on (traj, trajs),
	// the trajectories route took, each once: copies, trajectories
	// delivered again and rejected ones are not counted. Messages In
	// counts route's messages, of which a trajs message holds many.
	TrajectoriesIn *prometheus.CounterVec
	// Standby is 1 for each one-per-run stage this process waits to run
	// while another process holds its lease, 0 once it runs it.
	Standby *prometheus.GaugeVec
	// WorldModel is 1 for the world model this process asks, labelled
	// with its name (predict.WorldModel's Name, as predictions carry it),
	// once it has built it: which one a run is on.
	WorldModel *prometheus.GaugeVec
}

// NewMetrics registers the collectors, with the Go runtime's (go_*) and
// the process's (process_*: resident memory, CPU, open files), which a run
// of days is watched by.
func NewMetrics() *Metrics {
	r := prometheus.NewRegistry()
	r.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	b := ReadBuild()
	build := prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "wmrl", Name: "build_info",
		Help: "1, labelled with which build of wmrl this process runs: its module version, commit (empty when the binary records none), whether the tree had changes not committed, and Go release."},
		[]string{"version", "revision", "modified", "go_version"})
	build.WithLabelValues(b.Version, b.Revision, strconv.FormatBool(b.Modified), b.Go).Set(1)
	r.MustRegister(build)
	cv := func(name, help string) *prometheus.CounterVec {
		c := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "wmrl", Name: name, Help: help}, []string{"stage"})
		r.MustRegister(c)
		return c
	}
	g := func(name, help string) prometheus.Gauge {
		x := prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "wmrl", Name: name, Help: help})
		r.MustRegister(x)
		return x
	}
	m := &Metrics{
		Registry:     r,
		In:           cv("messages_in_total", "Messages handled, per stage handler."),
		Out:          cv("messages_out_total", "Messages published, per stage."),
		Errors:       cv("handler_errors_total", "Handler errors (nacked for redelivery or dead-lettered)."),
		Redeliveries: cv("redeliveries_total", "Messages received more than once."),
		DeadLetters:  cv("dead_letters_total", "Messages sent to the dead-letter subject."),
		Checkpoints:  cv("checkpoints_total", "Checkpoints saved, per stage (calibrate, fuse)."),
		CheckpointErrors: cv("checkpoint_errors_total",
			"Checkpoints not saved; a restart then rebuilds from the retained messages, which --retention ages out."),
		StartReads: cv("start_reads_total",
			"Messages a stage (calibrate, fuse) read at its start to rebuild its state, those on its input then; a restart from a checkpoint reads those after it alone."),
		InputErrors: cv("input_errors_total",
			"Errors reading a stage's input that the stage reads on after (a missed heartbeat, a consumer lost with a cluster node)."),
		Latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "wmrl", Name: "handler_seconds", Help: "Handler latency (joins include the time inputs are held).",
			Buckets: prometheus.ExponentialBuckets(1e-4, 4, 10),
		}, []string{"stage"}),
		Rho:     g("rho", "Anchor weight rho of the last update."),
		D:       g("disagreement", "Tracked world-model disagreement (D or advantage gap) of the last update."),
		Pairs:   g("calibration_pairs", "Anchor pairs absorbed by the calibration."),
		Version: g("calibration_version", "Isotonic map version."),
		Steps:   g("steps_published", "Highest step whose update was published."),
		WMDown: g("wm_down", "1 while this process's predict stage gives up on groups, and its gateway answers reward requests 503, "+
			"without asking the world model, after --wm-down-after calls (or twice --wm-concurrency requests) in a row failed; one call every --wm-probe-every tries it."),
		ExecutorDown: g("executor_down", "1 while this process's execute stage publishes anchor groups without running them, "+
			"after --exec-down-after executions in a row failed; one execution every --exec-probe-every tries it."),
		UpdateBytes: g("update_bytes", "Size of the newest step update this process published: one message, which must fit the server's max_payload."),
		MaxPayload:  g("nats_max_payload_bytes", "The NATS server's max_payload, as this process's connection reports it."),
		PredictionWait: g("prediction_wait_seconds", "How long the planned step that has waited longest for one of its groups' predictions has waited (0: none waits). "+
			"A prediction has no deadline: a step whose group a stage between predict and fuse dead-lettered waits until it is sent again (wmrl dlq --resend)."),
		StreamBytes: g("stream_bytes", "Bytes the run's JetStream stream holds: every message for its retention (--retention)."),
		StoreBytes:  g("jetstream_store_bytes", "Bytes of file storage the JetStream account uses (every stream of it, this run's among them)."),
		StoreLimit: g("jetstream_store_limit_bytes", "The JetStream account's file storage limit, or the embedded server's (--nats-max-store-gb, else three quarters of what its disk gives the store, what it holds and the free room, read every 30 s); 0 when none is known. "+
			"At it, the server refuses to store, and every stage stops until room is made."),
		StoreDiskFree: g("store_disk_free_bytes", "Free bytes of the disk under the embedded server's store (0 with an external server)."),
		NATSConnected: g("nats_connected", "1 while this process's connection to its NATS server is up, 0 while it is lost and reconnecting (its stages wait meanwhile)."),
		StepLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "wmrl", Name: "step_latency_seconds", Help: "From a step's close (last input) to its update.",
			Buckets: prometheus.ExponentialBuckets(1e-3, 2, 16),
		}),
	}
	m.TrajectoriesFused = prometheus.NewCounter(prometheus.CounterOpts{Namespace: "wmrl", Name: "trajectories_fused_total",
		Help: "Trajectories in the updates this process published: what wm_ungraded and sandbox_error of step_losses_total are shares of."})
	r.MustRegister(m.TrajectoriesFused)
	m.WorldModel = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "wmrl", Name: "world_model_info",
		Help: "1 for the world model this process asks (predict, or the gateway's reward endpoints), labelled with its name (--wm-model, with its own --wm-template's digest, --wm-samples and --wm-temperature when set, or sim): after a restart onto another, which one the run is on."},
		[]string{"model"})
	r.MustRegister(m.WorldModel)
	m.TrajectoriesIn = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "wmrl", Name: "trajectories_received_total",
		Help: "Trajectories route took into their steps, each once, by the subject they came on: traj (one a message) or trajs (a group or more a message, which the pipeline handles at a higher rate)."},
		[]string{"subject"})
	for _, k := range []schemas.Kind{schemas.KindTraj, schemas.KindTrajs} {
		m.TrajectoriesIn.WithLabelValues(string(k)) // present at 0 from the start, so a rate is defined
	}
	r.MustRegister(m.TrajectoriesIn)
	m.Lost = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "wmrl", Name: "step_losses_total",
		Help: "What of the fused steps did not reach the gradient as planned, by kind: wm_ungraded and sandbox_error (trajectories), skipped_group, late_anchor, failed_anchor (groups)."},
		[]string{"kind"})
	for _, l := range stepLosses(schemas.Update{}) {
		m.Lost.WithLabelValues(l.kind) // present at 0 from the start, so a rate is defined
	}
	m.BucketsRemade = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "wmrl", Name: "buckets_remade_total",
		Help: "Key-value buckets (the leases, checkpoints and executions' outcomes) this process found gone from the NATS server, deleted by hand or by a tool, and made anew, by bucket."},
		[]string{"bucket"})
	r.MustRegister(m.BucketsRemade)
	m.CertNotAfter = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "wmrl", Name: "tls_cert_not_after_seconds",
		Help: "When the certificate a server of this process presents expires, in Unix seconds (0 without TLS), by server: nats (the embedded one, --listen-cert) and gateway (--http-cert). It follows renewals of the files."},
		[]string{"server"})
	for _, server := range []string{certNATS, certGateway} {
		m.CertNotAfter.WithLabelValues(server) // 0 until a server presents one
	}
	m.Standby = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "wmrl", Name: "stage_standby",
		Help: "1 for each one-per-run stage (route, pair, calibrate, fuse, archive) this process waits to run while another process runs it (holds its lease), 0 once it runs it: with none at 1 for a stage, the loss of its process stalls the run until it is started again."},
		[]string{"stage"})
	m.NATSReconnects = prometheus.NewCounter(prometheus.CounterOpts{Namespace: "wmrl", Name: "nats_reconnects_total",
		Help: "Reconnections of this process's connection to its NATS server, after it was lost."})
	m.ShortSteps = prometheus.NewCounter(prometheus.CounterOpts{Namespace: "wmrl", Name: "steps_closed_short_total",
		Help: "Steps planned on their --step-timeout with fewer groups than their watermark declared, or groups with fewer trajectories than their group_size: each waited out the timeout."})
	m.AstraySteps = prometheus.NewCounter(prometheus.CounterOpts{Namespace: "wmrl", Name: "steps_waited_for_astray_total",
		Help: "Steps whose --step-timeout came while they lacked groups and route's inputs were delivered and not acknowledged outside this process (lost at a server's failover, or held by a process that ended): each waited up to a minute more for them to be delivered again."})
	m.Archived = prometheus.NewCounter(prometheus.CounterOpts{Namespace: "wmrl", Name: "steps_archived_total",
		Help: "Step updates whose rows are in closed, synced archive files."})
	m.ArchiveMerged = prometheus.NewCounter(prometheus.CounterOpts{Namespace: "wmrl", Name: "archive_files_merged_total",
		Help: "Closed archive files merged away into larger ones (--archive-compact-after)."})
	m.WithinSpearman = prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: "wmrl", Name: "wm_within_group_spearman",
		Help: "The world model's rank correlation with the true scores inside each anchor group (what GRPO's advantages depend on); " +
			"rate(_sum)/rate(_count) is its mean over the window, as the audit's within_group_spearman is over the run.",
		Buckets: prometheus.LinearBuckets(-0.8, 0.2, 10)})
	m.HTTPRequests = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "wmrl", Name: "http_requests_total",
		Help: "Requests the trainer gateway answered, by endpoint and status code."}, []string{"endpoint", "code"})
	m.HTTPSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "wmrl", Name: "http_request_seconds",
		Help:    "Time the trainer gateway took to answer, by endpoint (an update's long poll included).",
		Buckets: prometheus.ExponentialBuckets(1e-3, 4, 10)}, []string{"endpoint"})
	m.RewardAnswers = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "wmrl", Name: "reward_solutions_total",
		Help: "Solutions the trainer gateway's reward endpoints scored, by answer: execution (executed as an anchor: its real score), " +
			"world_model (asked) and remembered (the same solution's world-model score, from a call under way or within 15 minutes: not asked again)."},
		[]string{"answer"})
	for _, a := range gateway.Answers {
		m.RewardAnswers.WithLabelValues(string(a))
	}
	m.WMRequests = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "wmrl", Name: "wm_requests_total",
		Help: "Requests this process made to its OpenAI-compatible world model (--world-model openai), by outcome: answered, " +
			"refused (a 4xx or a reply that is not chat completions: those trajectories ungraded) and failed (timeout, connection error, 429, 5xx: retried)."},
		[]string{"outcome"})
	for _, o := range []string{openai.RequestAnswered, openai.RequestRefused, openai.RequestFailed} {
		m.WMRequests.WithLabelValues(o)
	}
	m.WMRequestSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: "wmrl", Name: "wm_request_seconds",
		Help:    "How long the world model's requests took, whatever their outcome (a request of --wm-samples replies is one).",
		Buckets: prometheus.ExponentialBuckets(0.05, 2, 14)})
	m.WMTokens = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "wmrl", Name: "wm_tokens_total",
		Help: "Tokens the world model's answered requests used, by kind (prompt, completion), as its server reports them in usage."},
		[]string{"kind"})
	m.WMTokens.WithLabelValues("prompt")
	m.WMTokens.WithLabelValues("completion")
	m.Executions = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "wmrl", Name: "executions_total",
		Help: "Anchor executions this process ran, by status: scored, invalid_submission, crashed and timed_out (all scores; the last three 0), " +
			"sandbox_error (no score)."}, []string{"status"})
	for _, s := range schemas.ExecStatuses {
		m.Executions.WithLabelValues(s)
	}
	m.ExecutionSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: "wmrl", Name: "execution_seconds",
		Help:    "How long the anchor executions this process ran took (the executor's own timing).",
		Buckets: prometheus.ExponentialBuckets(0.1, 2, 16)})
	m.ExecutionsShared = prometheus.NewCounter(prometheus.CounterOpts{Namespace: "wmrl", Name: "executions_shared_total",
		Help: "Anchor trajectories this process did not execute because a copy of their solution (the same task, prompt and response), in their group or another, was, whose outcome they took (--exec-copies-once)."})
	m.ExecutionsWaiting = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "wmrl", Name: "executions_waiting",
		Help: "Anchor executions of this process waiting to start, by what for: slot (every one of --exec-slots busy), user (every one of --exec-uids taken, here or by another wmrl process on the machine), gpus (every set of --exec-gpus taken, likewise)."},
		[]string{"for"})
	for _, what := range []string{"slot", "user", "gpus"} {
		m.ExecutionsWaiting.WithLabelValues(what)
	}
	m.ExecutionSlots = prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "wmrl", Name: "execution_slots",
		Help: "Executions this process runs at once at most (--exec-slots; 0 without an execute stage)."})
	m.ExecutionSlotsBusy = prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "wmrl", Name: "execution_slots_busy",
		Help: "Of those, the ones taken: an execution under way, or waiting for a user or a set of GPUs."})
	r.MustRegister(m.ExecutionsWaiting, m.ExecutionSlots, m.ExecutionSlotsBusy)
	m.PairSidesLetGo = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "wmrl", Name: "pair_sides_let_go_total",
		Help: "Sides of anchor groups (prediction, execution) this process's pair stage let go, not held or dead-lettered, because their group's pairs were already stored: " +
			"each came again after a pair process stopped, or lost its connection, before the server had its acknowledgement."},
		[]string{"side"})
	for _, side := range []string{"prediction", "execution"} {
		m.PairSidesLetGo.WithLabelValues(side)
	}
	r.MustRegister(m.PairSidesLetGo)
	r.MustRegister(m.Latency, m.StepLatency, m.NATSReconnects, m.ShortSteps, m.AstraySteps, m.CertNotAfter, m.Standby, m.Archived, m.ArchiveMerged, m.Lost, m.WithinSpearman, m.HTTPRequests, m.HTTPSeconds,
		m.RewardAnswers, m.WMRequests, m.WMRequestSeconds, m.WMTokens, m.Executions, m.ExecutionSeconds, m.ExecutionsShared)
	return m
}

// ObserveWMRequest counts, times and weighs one world-model request.
func (m *Metrics) ObserveWMRequest(r openai.Request) {
	m.WMRequests.WithLabelValues(r.Outcome).Inc()
	m.WMRequestSeconds.Observe(r.Duration.Seconds())
	m.WMTokens.WithLabelValues("prompt").Add(float64(r.Usage.PromptTokens))
	m.WMTokens.WithLabelValues("completion").Add(float64(r.Usage.CompletionTokens))
}

// instrumentHTTP counts and times one gateway endpoint's requests. Its
// series exist at 0 from the start (code 200), as initStages' do.
func (m *Metrics) instrumentHTTP(endpoint string, h http.Handler) http.Handler {
	m.HTTPRequests.WithLabelValues(endpoint, "200")
	m.HTTPSeconds.WithLabelValues(endpoint)
	l := prometheus.Labels{"endpoint": endpoint}
	return promhttp.InstrumentHandlerDuration(m.HTTPSeconds.MustCurryWith(l),
		promhttp.InstrumentHandlerCounter(m.HTTPRequests.MustCurryWith(l), h))
}

// initStages makes the failure counters of the stages this process runs
// exist at 0 from the start: Prometheus sees no increase in a series whose
// first sample is already 1, so an alert on the first dead letter of a run
// (increase(wmrl_dead_letters_total[15m]) > 0) needs the series before it.
func (m *Metrics) initStages(stages []string) {
	for _, s := range stages {
		for _, c := range []*prometheus.CounterVec{m.Errors, m.Redeliveries, m.DeadLetters, m.InputErrors} {
			c.WithLabelValues(s)
		}
		if s == StageCalibrate || s == StageFuse {
			m.Checkpoints.WithLabelValues(s)
			m.CheckpointErrors.WithLabelValues(s)
		}
	}
}

// stageOf is the stage part of a handler name "stage/kind".
func stageOf(handler string) string {
	s, _, _ := strings.Cut(handler, "/")
	return s
}

// Middleware counts, times and flags redeliveries of every handled message.
func (m *Metrics) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		stage := stageOf(message.HandlerNameFromCtx(msg.Context()))
		m.In.WithLabelValues(stage).Inc()
		if redelivered(msg) {
			m.Redeliveries.WithLabelValues(stage).Inc()
		}
		start := time.Now()
		out, err := h(msg)
		m.Latency.WithLabelValues(stage).Observe(time.Since(start).Seconds())
		if err != nil {
			m.Errors.WithLabelValues(stage).Inc()
		}
		return out, err
	}
}

// ObserveUpdate records an update's figures.
func (m *Metrics) ObserveUpdate(u schemas.Update) {
	m.Rho.Set(u.Rho)
	m.D.Set(u.D)
	m.Pairs.Set(float64(u.PairsTotal))
	m.Version.Set(float64(u.CalibrationVersion))
	m.Steps.Set(float64(u.Step))
	m.StepLatency.Observe(u.PublishedAt.Sub(u.ClosedAt).Seconds())
	m.TrajectoriesFused.Add(float64(len(u.Items)))
	for _, l := range stepLosses(u) {
		m.Lost.WithLabelValues(l.kind).Add(float64(l.n))
	}
	for _, r := range withinSpearman(u) {
		m.WithinSpearman.Observe(r)
	}
}

// withinSpearman is the world model's within-group rank correlation on
// each of u's anchor groups that was executed in time, over the
// trajectories both scored, as the audit computes it; a group whose scores
// are constant on either side has none.
func withinSpearman(u schemas.Update) []float64 {
	var out []float64
	var pred, truth []float64
	for i, it := range u.Items {
		if it.Source == fuse.SourceAnchor && it.Predicted != nil && it.TrueScore != nil {
			pred, truth = append(pred, *it.Predicted), append(truth, *it.TrueScore)
		}
		if i+1 < len(u.Items) && u.Items[i+1].GroupID == it.GroupID {
			continue
		}
		if r := fuse.Spearman(pred, truth); !math.IsNaN(r) {
			out = append(out, r)
		}
		pred, truth = pred[:0], truth[:0]
	}
	return out
}

// countingPublisher counts a stage's published messages.
type countingPublisher struct {
	message.Publisher
	n prometheus.Counter
}

func (p countingPublisher) Publish(topic string, msgs ...*message.Message) error {
	err := p.Publisher.Publish(topic, msgs...)
	if err == nil {
		p.n.Add(float64(len(msgs)))
	}
	return err
}

// redelivered reports whether JetStream delivered msg before.
func redelivered(msg *message.Message) bool {
	n, _ := strconv.Atoi(msg.Metadata.Get(natsjs.MetaDeliveries))
	return n > 1
}

// isPoison reports whether a handler error means the message can never be
// used.
func isPoison(err error) bool {
	return errors.Is(err, schemas.ErrInvalid) || errors.Is(err, schemas.ErrUnusable)
}
