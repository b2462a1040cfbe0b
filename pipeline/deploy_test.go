package pipeline

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"gopkg.in/yaml.v3"

	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
)

// exported is what a whole pipeline's /metrics serves after a short run:
// each metric family's type and label names.
func exported(t *testing.T) map[string]exportedFamily {
	t.Helper()
	cfg := testConfig(t)
	cfg.Steps = 3
	cfg.HTTPAddr = "127.0.0.1:0" // the gateway's metrics too
	fams, err := finished(t, cfg).Metrics().Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]exportedFamily{}
	for _, f := range fams {
		e := exportedFamily{typ: f.GetType(), labels: map[string]bool{}}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				e.labels[l.GetName()] = true
			}
		}
		out[f.GetName()] = e
	}
	return out
}

type exportedFamily struct {
	typ    dto.MetricType
	labels map[string]bool
}

var (
	metricName = regexp.MustCompile(`\b(?:wmrl|go|process)_[a-z_]+\b`)
	// A selector's matchers, and the labels of by (...) and on (...).
	matchers = regexp.MustCompile(`\{([^}]*)\}`)
	matcher  = regexp.MustCompile(`(\w+)\s*(?:=~|!~|!=|=)`)
	grouping = regexp.MustCompile(`\b(?:by|on|without|ignoring)\s*\(([^)]*)\)`)
)

// checkExpr fails for every metric or label expr names that the pipeline
// does not export: a dashboard or an alert that outlives a rename shows
// nothing, silently.
func checkExpr(t *testing.T, where, expr string, fams map[string]exportedFamily) {
	t.Helper()
	used := metricName.FindAllString(expr, -1)
	if len(used) == 0 {
		t.Errorf("%s: no wmrl metric in %q", where, expr)
	}
	labels := map[string]bool{"job": true, "instance": true}
	for _, name := range used {
		f, ok := fams[name]
		if !ok {
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if base, cut := strings.CutSuffix(name, suffix); cut {
					if f, ok = fams[base]; ok && f.typ != dto.MetricType_HISTOGRAM && f.typ != dto.MetricType_SUMMARY {
						ok = false
					}
					if ok && suffix == "_bucket" {
						labels["le"] = true
					}
					break
				}
			}
		}
		if !ok {
			t.Errorf("%s: metric %s is not exported (expr %q)", where, name, expr)
			continue
		}
		for l := range f.labels {
			labels[l] = true
		}
	}
	var names []string
	for _, m := range matchers.FindAllStringSubmatch(expr, -1) {
		for _, l := range matcher.FindAllStringSubmatch(m[1], -1) {
			names = append(names, l[1])
		}
	}
	for _, g := range grouping.FindAllStringSubmatch(expr, -1) {
		for _, l := range strings.Split(g[1], ",") {
			names = append(names, strings.TrimSpace(l))
		}
	}
	for _, l := range names {
		if l != "" && !labels[l] {
			t.Errorf("%s: label %q is on none of %v (expr %q)", where, l, used, expr)
		}
	}
}

// The Grafana dashboard and the Prometheus alerts in deploy/ use only
// metrics and labels the pipeline exports; the dashboard's panels do not
// overlap, and every alert says what it is about.
func TestDeployMonitoringMatchesTheMetrics(t *testing.T) {
	fams := exported(t)

	var dash struct {
		UID    string
		Panels []struct {
			Title   string
			GridPos struct{ X, Y, W, H int }
			Targets []struct{ Expr string }
		}
	}
	b, err := os.ReadFile(filepath.Join("..", "deploy", "grafana", "wmrl.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("deploy/grafana/wmrl.json: %v", err)
	}
	if dash.UID == "" || len(dash.Panels) < 8 {
		t.Fatalf("dashboard uid %q with %d panels", dash.UID, len(dash.Panels))
	}
	cells := map[[2]int]string{}
	for _, p := range dash.Panels {
		if p.Title == "" || p.GridPos.W <= 0 || p.GridPos.H <= 0 || p.GridPos.X+p.GridPos.W > 24 || len(p.Targets) == 0 {
			t.Errorf("panel %+v", p)
		}
		for x := p.GridPos.X; x < p.GridPos.X+p.GridPos.W; x++ {
			for y := p.GridPos.Y; y < p.GridPos.Y+p.GridPos.H; y++ {
				if other, ok := cells[[2]int{x, y}]; ok {
					t.Fatalf("panels %q and %q overlap at (%d, %d)", other, p.Title, x, y)
				}
				cells[[2]int{x, y}] = p.Title
			}
		}
		for _, tg := range p.Targets {
			checkExpr(t, "dashboard panel "+p.Title, tg.Expr, fams)
		}
	}

	rules := alertRules(t)
	for _, r := range rules {
		if r.Alert == "" || r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
			t.Errorf("alert %q lacks a name, summary or description", r.Alert)
		}
		if r.For != "" {
			if _, err := time.ParseDuration(r.For); err != nil {
				t.Errorf("alert %s: for %q: %v", r.Alert, r.For, err)
			}
		}
		checkExpr(t, "alert "+r.Alert, r.Expr, fams)
	}
	if len(rules) < 4 {
		t.Fatalf("%d alerts", len(rules))
	}

	var prom struct {
		RuleFiles     []string `yaml:"rule_files"`
		ScrapeConfigs []struct {
			JobName string `yaml:"job_name"`
		} `yaml:"scrape_configs"`
	}
	b, err = os.ReadFile(filepath.Join("..", "deploy", "prometheus", "prometheus.yml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &prom); err != nil || !slices.Contains(prom.RuleFiles, "alerts.yml") || len(prom.ScrapeConfigs) == 0 {
		t.Fatalf("deploy/prometheus/prometheus.yml: %v %+v", err, prom)
	}
}

// prometheusBinary is a Prometheus server to run (WMRL_PROMETHEUS, else
// prometheus on PATH), or the test skips; with WMRL_REQUIRE_PROMETHEUS=1
// it fails instead (.ci/run installs Debian's).
func prometheusBinary(t *testing.T) string {
	bin := os.Getenv("WMRL_PROMETHEUS")
	if bin == "" {
		bin = "prometheus"
	}
	path, err := exec.LookPath(bin)
	if err != nil {
		if os.Getenv("WMRL_REQUIRE_PROMETHEUS") == "1" {
			t.Fatalf("prometheus required: %v", err)
		}
		t.Skipf("no prometheus server (%v): set WMRL_PROMETHEUS, or run .ci/run", err)
	}
	return path
}

// vector is an instant query's answer.
type vector struct{ Result []sample }

type sample struct {
	Metric map[string]string
	Value  [2]any // time, and the value as a string
}

func (s sample) value() float64 {
	v, _ := s.Value[1].(string)
	f, err := strconv.ParseFloat(v, 64)
	if err != nil {
		return math.NaN()
	}
	return f
}

// promQuery asks a Prometheus server's HTTP API for path with params and
// decodes its data; a failed query fails the test with the server's error.
func promQuery(t *testing.T, base, path string, params url.Values, data any) error {
	t.Helper()
	resp, err := http.Get(base + path + "?" + params.Encode())
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var out struct {
		Status, Error string
		Data          json.RawMessage
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return err
	}
	if out.Status != "success" {
		return fmt.Errorf("%s %v: %s", path, params, out.Error)
	}
	return json.Unmarshal(out.Data, data)
}

// A real Prometheus scraping a running pipeline evaluates every query of
// the dashboard to a result, and every alert rule without error.
func TestPrometheusEvaluatesTheDashboardAndAlerts(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	bin := prometheusBinary(t)
	metrics := fmt.Sprintf("127.0.0.1:%d", natstest.FreePort(t))
	cfg := testConfig(t)
	cfg.MetricsAddr, cfg.HTTPAddr = metrics, "127.0.0.1:0"
	// A few steps a second, as a real run's pace is: every panel has its
	// series all the same, and the run does not take the cores the other
	// tests need (flat out, it took 22 s of CPU in 13).
	cfg.ExecLatency, cfg.InFlightSteps = 250*time.Millisecond, 1
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, err := Start(ctx, cfg) // runs until stopped
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	// A trainer asking for rewards meanwhile, for the gateway's panels.
	go func() {
		for ctx.Err() == nil {
			if resp, err := http.Post(p.HTTPURL()+"/v1/runs/default/rewards/slime", "application/json",
				strings.NewReader(`{"prompt":"Solve task 1.","response":"print(1)"}`)); err == nil {
				resp.Body.Close()
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()

	dir := t.TempDir()
	alerts, err := filepath.Abs(filepath.Join("..", "deploy", "prometheus", "alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	conf := fmt.Sprintf("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - %q\n"+
		"scrape_configs:\n  - job_name: wmrl\n    static_configs:\n      - targets: [%q]\n", alerts, metrics)
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	web := fmt.Sprintf("127.0.0.1:%d", natstest.FreePort(t))
	prom := exec.CommandContext(ctx, bin, "--config.file="+filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(dir, "data"), "--web.listen-address="+web)
	logFile, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	promLog := func() string { b, _ := os.ReadFile(logFile.Name()); return string(b) }
	prom.Stdout, prom.Stderr = logFile, logFile
	if err := prom.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { prom.Process.Kill(); prom.Wait() }()
	base := "http://" + web

	// Enough scrapes for rates: the first scrape's series, then five more.
	deadline := time.Now().Add(time.Minute)
	for {
		var up vector
		err := promQuery(t, base, "/api/v1/query", url.Values{"query": {`sum_over_time(up{job="wmrl"}[1m])`}}, &up)
		if err == nil && len(up.Result) == 1 && up.Result[0].value() >= 6 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("fewer than 6 good scrapes in a minute (%+v %v)\n%s", up, err, promLog())
		}
		time.Sleep(200 * time.Millisecond)
	}

	var dash struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	b, err := os.ReadFile(filepath.Join("..", "deploy", "grafana", "wmrl.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatal(err)
	}
	for _, panel := range dash.Panels {
		for _, tg := range panel.Targets {
			expr := strings.ReplaceAll(tg.Expr, "$job", "wmrl") // Grafana's variable, as the job selector sets it
			var res vector
			if err := promQuery(t, base, "/api/v1/query", url.Values{"query": {expr}}, &res); err != nil {
				t.Errorf("panel %q: %v", panel.Title, err)
			} else if len(res.Result) == 0 {
				t.Errorf("panel %q: no data for %s", panel.Title, expr)
			}
		}
	}

	var rules struct {
		Groups []struct {
			Rules []struct{ Name, Health, LastError string }
		}
	}
	waitFor(t, 30*time.Second, func() bool {
		if err := promQuery(t, base, "/api/v1/rules", nil, &rules); err != nil || len(rules.Groups) == 0 {
			return false
		}
		for _, r := range rules.Groups[0].Rules {
			if r.Health == "unknown" { // not evaluated yet
				return false
			}
		}
		return true
	})
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			n++
			if r.Health != "ok" {
				t.Errorf("alert %s: %s %s", r.Name, r.Health, r.LastError)
			}
		}
	}
	if n < 6 {
		t.Errorf("%d rules loaded\n%s", n, promLog())
	}
}

// alertRule is one rule of deploy/prometheus/alerts.yml.
type alertRule struct {
	Alert, Expr string
	For         string
	Annotations map[string]string
}

// alertRules reads every rule of deploy/prometheus/alerts.yml.
func alertRules(t *testing.T) []alertRule {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "deploy", "prometheus", "alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var file struct {
		Groups []struct{ Rules []alertRule }
	}
	if err := yaml.Unmarshal(b, &file); err != nil {
		t.Fatalf("deploy/prometheus/alerts.yml: %v", err)
	}
	var rules []alertRule
	for _, g := range file.Groups {
		rules = append(rules, g.Rules...)
	}
	return rules
}

// promtool is the rules tester shipped beside the Prometheus server.
func promtool(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(filepath.Dir(prometheusBinary(t)), "promtool")
	if _, err := os.Stat(bin); err != nil {
		if bin, err = exec.LookPath("promtool"); err != nil {
			t.Fatalf("promtool is not beside prometheus nor on the PATH: %v", err)
		}
	}
	return bin
}

// WMRLRewardRequestsFailing fires when over 5% of the reward requests of
// an instance are answered 5xx for 10 minutes, with its summary naming the
// share, and not at 1%, nor on a gateway nobody asks (promtool's rule
// tests, against alerts.yml as it is).
func TestRewardRequestsAlertFiresOnItsCondition(t *testing.T) {
	series := func(instance string, ok, failed int) string {
		return inputSeries(fmt.Sprintf(`wmrl_http_requests_total{instance=%q,endpoint="rewards_slime",code="200"}`, instance), fmt.Sprintf("0+%dx40", ok)) +
			inputSeries(fmt.Sprintf(`wmrl_http_requests_total{instance=%q,endpoint="rewards_slime",code="503"}`, instance), fmt.Sprintf("0+%dx40", failed)) +
			inputSeries(fmt.Sprintf(`wmrl_http_requests_total{instance=%q,endpoint="update",code="404"}`, instance), "0+50x40")
	}
	promtoolRuleTest(t, "WMRLRewardRequestsFailing", series("failing", 90, 10)+series("flaky", 99, 1)+series("idle", 0, 0),
		alertCheck{quietAt: "9m", firesAt: "25m", severity: "page", instance: "failing",
			summary: "10% of the reward requests to failing fail"})
}

// WMRLExecutionsScoreNothing fires when an hour's executions (32 or more)
// all failed, and not when one of them scored, nor on an instance that
// executed too few to say.
func TestExecutionsAlertFiresOnItsCondition(t *testing.T) {
	executions := func(instance, status, values string) string {
		return inputSeries(fmt.Sprintf(`wmrl_executions_total{instance=%q,status=%q}`, instance, status), values)
	}
	// Per minute: broken 2 crashed and none scored; learning the same but
	// one scored at minute 50; few 1 crashed every 4 minutes (15 an hour);
	// idle nothing. Sandbox errors are no scores, and no failures either.
	var input string
	for _, instance := range []string{"broken", "learning", "few", "idle"} {
		input += executions(instance, "sandbox_error", "0+5x120")
	}
	input += executions("broken", "crashed", "0+2x120") + executions("broken", "scored", "0+0x120") +
		executions("learning", "crashed", "0+2x120") + executions("learning", "scored", "0+0x50 1+0x70") +
		executions("few", "crashed", "0+0.25x120") + executions("few", "scored", "0+0x120") +
		executions("idle", "crashed", "0+0x120") + executions("idle", "scored", "0+0x120")
	promtoolRuleTest(t, "WMRLExecutionsScoreNothing", input,
		alertCheck{quietAt: "10m", firesAt: "70m", severity: "ticket", instance: "broken",
			summary: "None of the 120 executions in the last hour scored on broken"})
}

// WMRLUpdatesNearMaxPayload fires when an instance's updates pass 80% of
// its server's max_payload, and not below.
func TestUpdateSizeAlertFiresOnItsCondition(t *testing.T) {
	input := inputSeries(`wmrl_nats_max_payload_bytes{instance="big"}`, "8388608+0x60") +
		inputSeries(`wmrl_update_bytes{instance="big"}`, "1000000+0x20 7000000+0x40") +
		inputSeries(`wmrl_nats_max_payload_bytes{instance="small"}`, "8388608+0x60") +
		inputSeries(`wmrl_update_bytes{instance="small"}`, "6000000+0x60")
	promtoolRuleTest(t, "WMRLUpdatesNearMaxPayload", input,
		alertCheck{quietAt: "10m", firesAt: "30m", severity: "ticket", instance: "big",
			summary: "Step updates on big are 6.676MiB, over 80% of the server's max_payload"})
}

// WMRLStepWaitingForPredictions fires once a step has waited 15 minutes
// for a prediction, and not for steps that wait their two minutes and are
// fused (the gauge falls back).
func TestPredictionWaitAlertFiresOnItsCondition(t *testing.T) {
	input := inputSeries(`wmrl_prediction_wait_seconds{instance="held"}`, "0+60x30") +
		inputSeries(`wmrl_prediction_wait_seconds{instance="busy"}`, "0 60 120 0 60 120 0 60 120 0 60 120 0 60 120 0 60 120 0 60 120 0 60 120 0 60 120 0 60 120")
	promtoolRuleTest(t, "WMRLStepWaitingForPredictions", input,
		alertCheck{quietAt: "15m", firesAt: "16m", severity: "page", instance: "held",
			summary: "A step on held has waited 16m 0s for a group's prediction"})
}

// WMRLStepsClosedShort fires for a trainer whose steps close short every
// minute, once it has gone on for a while, and not for a few short steps.
func TestStepsClosedShortAlertFiresOnItsCondition(t *testing.T) {
	input := inputSeries(`wmrl_steps_closed_short_total{instance="dropping"}`, "0+1x90") +
		inputSeries(`wmrl_steps_closed_short_total{instance="rare"}`, "0 0 1x30 2x30 3x27")
	promtoolRuleTest(t, "WMRLStepsClosedShort", input,
		alertCheck{quietAt: "15m", firesAt: "30m", severity: "ticket", instance: "dropping",
			summary: "30 steps on dropping closed short of their watermark in the last hour"})
}

// WMRLBucketDeleted fires once a process has made a deleted bucket anew,
// naming the bucket, and not for a process whose buckets stay.
func TestBucketDeletedAlertFiresOnItsCondition(t *testing.T) {
	input := inputSeries(`wmrl_buckets_remade_total{instance="cleaned",bucket="WMRL_LEASES_WMRL"}`, "0x10 1x20") +
		inputSeries(`wmrl_buckets_remade_total{instance="cleaned",bucket="WMRL_STATE_WMRL"}`, "0x30") +
		inputSeries(`wmrl_buckets_remade_total{instance="kept",bucket="WMRL_LEASES_WMRL"}`, "0x30")
	promtoolRuleTest(t, "WMRLBucketDeleted", input,
		alertCheck{quietAt: "9m", firesAt: "12m", severity: "ticket", instance: "cleaned", labels: "bucket: WMRL_LEASES_WMRL",
			summary: "cleaned found the bucket WMRL_LEASES_WMRL deleted from the NATS server and made it anew"})
}

// WMRLNATSConnectionLost fires once a process has been without its server
// for 5 minutes, and not for a loss of two minutes that ended.
func TestConnectionLostAlertFiresOnItsCondition(t *testing.T) {
	input := inputSeries(`wmrl_nats_connected{instance="cut-off"}`, "1 1 0 0 0 0 0 0 0 0 0 0") +
		inputSeries(`wmrl_nats_connected{instance="blip"}`, "1 1 0 0 1 1 1 1 1 1 1 1")
	promtoolRuleTest(t, "WMRLNATSConnectionLost", input,
		alertCheck{quietAt: "6m", firesAt: "7m", severity: "page", instance: "cut-off",
			summary: "cut-off has been without its NATS server for 5 minutes"})
}

// WMRLCertificateExpiring fires once a server's certificate has less than
// 7 days left, not before, and not without TLS (0). Rule tests start at
// Unix time 0, so the expiry is 7 days and 10 minutes.
func TestCertificateAlertFiresOnItsCondition(t *testing.T) {
	input := inputSeries(`wmrl_tls_cert_not_after_seconds{instance="expiring",server="gateway"}`, "605400x20") +
		inputSeries(`wmrl_tls_cert_not_after_seconds{instance="expiring",server="nats"}`, "0x20") +
		inputSeries(`wmrl_tls_cert_not_after_seconds{instance="renewed",server="nats"}`, "605400x5 2592000x15")
	promtoolRuleTest(t, "WMRLCertificateExpiring", input,
		alertCheck{quietAt: "9m", firesAt: "11m", severity: "ticket", instance: "expiring", labels: "server: gateway",
			summary: "The certificate of the gateway server on expiring expires in 6d 23h 59m 0s"})
}

// WMRLStoreFillingUp fires when the store's use, at the last 6 hours'
// rate, reaches its limit within a day, or the disk's free room reaches 0,
// and not when it levels off below. Values grow by 10 MB a minute (14.4 GB
// a day) from 10 GB.
func TestStoreAlertFiresOnItsCondition(t *testing.T) {
	input := inputSeries(`wmrl_jetstream_store_bytes{instance="filling"}`, "10e9+10e6x120") +
		inputSeries(`wmrl_jetstream_store_limit_bytes{instance="filling"}`, "20e9x120") +
		inputSeries(`wmrl_jetstream_store_bytes{instance="roomy"}`, "10e9+10e6x120") +
		inputSeries(`wmrl_jetstream_store_limit_bytes{instance="roomy"}`, "100e9x120") +
		inputSeries(`wmrl_store_disk_free_bytes{instance="roomy"}`, "50e9-10e6x120") +
		inputSeries(`wmrl_jetstream_store_bytes{instance="unknown"}`, "10e9+10e6x120") +
		inputSeries(`wmrl_jetstream_store_limit_bytes{instance="unknown"}`, "0x120")
	promtoolRuleTest(t, "WMRLStoreFillingUp", input,
		alertCheck{quietAt: "20m", firesAt: "40m", severity: "ticket", instance: "filling",
			summary: "The JetStream store of filling, or its disk, fills within a day at the last 6 hours' rate"})
	// The disk, shared with other files, runs out before the store's limit.
	input = inputSeries(`wmrl_jetstream_store_bytes{instance="shared-disk"}`, "10e9+1e6x120") +
		inputSeries(`wmrl_jetstream_store_limit_bytes{instance="shared-disk"}`, "100e9x120") +
		inputSeries(`wmrl_store_disk_free_bytes{instance="shared-disk"}`, "10e9-10e6x120")
	promtoolRuleTest(t, "WMRLStoreFillingUp", input,
		alertCheck{quietAt: "20m", firesAt: "40m", severity: "ticket", instance: "shared-disk",
			summary: "The JetStream store of shared-disk, or its disk, fills within a day at the last 6 hours' rate"})
}

// WMRLStoreFull fires once the store has stood over 95% of its limit for
// 5 minutes, not for one half full, nor for one whose limit is not known
// (0).
func TestStoreFullAlertFiresOnItsCondition(t *testing.T) {
	input := inputSeries(`wmrl_jetstream_store_bytes{instance="full"}`, "90e9 97e9x20") +
		inputSeries(`wmrl_jetstream_store_limit_bytes{instance="full"}`, "100e9x20") +
		inputSeries(`wmrl_jetstream_store_bytes{instance="half"}`, "50e9x20") +
		inputSeries(`wmrl_jetstream_store_limit_bytes{instance="half"}`, "100e9x20") +
		inputSeries(`wmrl_jetstream_store_bytes{instance="unknown"}`, "97e9x20") +
		inputSeries(`wmrl_jetstream_store_limit_bytes{instance="unknown"}`, "0x20")
	promtoolRuleTest(t, "WMRLStoreFull", input,
		alertCheck{quietAt: "5m", firesAt: "6m", severity: "page", instance: "full",
			summary: "The JetStream store of full is 97% full"})
}

// WMRLWorldModelRankingFalling fires once the world model's mean
// within-group Spearman over 6 hours has stood 0.2 below the same a day
// before for 2 hours, and not for one that ranks as well as it did, nor in
// the run's first day (nothing to compare with). Per minute, 10 anchor
// groups ranked at 0.7 on average, from minute 1440 at 0.3 for falling.
func TestRankingFallAlertFiresOnItsCondition(t *testing.T) {
	spearman := func(instance, sum string) string {
		return inputSeries(fmt.Sprintf(`wmrl_wm_within_group_spearman_count{instance=%q}`, instance), "0+10x1900") +
			inputSeries(fmt.Sprintf(`wmrl_wm_within_group_spearman_sum{instance=%q}`, instance), sum)
	}
	input := spearman("falling", "0+7x1440 10080+3x460") + spearman("steady", "0+7x1900")
	promtoolRuleTest(t, "WMRLWorldModelRankingFalling", input,
		alertCheck{quietAt: "1700m", firesAt: "1800m", severity: "ticket", instance: "falling",
			summary: "The world model's within-group Spearman on anchors on falling fell by 0.40 in a day"})
}

// inputSeries is one of promtool's input_series entries.
func inputSeries(series, values string) string {
	return fmt.Sprintf("      - series: '%s'\n        values: '%s'\n", series, values)
}

// alertCheck is what promtool is to find: no alert at quietAt, and at
// firesAt exactly one, for instance, with its severity, summary and
// description.
type alertCheck struct {
	quietAt, firesAt, severity, instance, summary string
	// labels are the alert's other labels, as YAML map entries
	// ("server: gateway").
	labels string
}

// promtoolRuleTest runs promtool's rule tests of alert name against
// alerts.yml as it is, on input (input_series entries).
func promtoolRuleTest(t *testing.T, name, input string, want alertCheck) {
	t.Helper()
	bin := promtool(t)
	alerts, err := filepath.Abs(filepath.Join("..", "deploy", "prometheus", "alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	description := ""
	for _, r := range alertRules(t) {
		if r.Alert == name {
			description = r.Annotations["description"]
		}
	}
	if description == "" {
		t.Fatalf("alerts.yml has no %s with a description", name)
	}
	desc, _ := json.Marshal(description) // a JSON string is a YAML string
	extra := ""
	if want.labels != "" {
		extra = ", " + want.labels
	}
	tests := fmt.Sprintf(`rule_files:
  - %q
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
%s    alert_rule_test:
      - eval_time: %s
        alertname: %s
      - eval_time: %s
        alertname: %s
        exp_alerts:
          - exp_labels: {severity: %s, instance: %s%s}
            exp_annotations:
              summary: %q
              description: %s
`, alerts, input, want.quietAt, name, want.firesAt, name, want.severity, want.instance, extra, want.summary, desc)
	file := filepath.Join(t.TempDir(), "alerts_test.yml")
	if err := os.WriteFile(file, []byte(tests), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(bin, "test", "rules", file).CombinedOutput(); err != nil {
		t.Fatalf("promtool test rules: %v\n%s\n%s", err, out, tests)
	}
}
