package pipeline

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"gopkg.in/yaml.v3"
)

// exported is what a whole pipeline's /metrics serves after a short run:
// each metric family's type and label names.
func exported(t *testing.T) map[string]exportedFamily {
	t.Helper()
	cfg := testConfig(t)
	cfg.Steps = 3
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

	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert, Expr string
				For         string
				Annotations map[string]string
			}
		}
	}
	b, err = os.ReadFile(filepath.Join("..", "deploy", "prometheus", "alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &rules); err != nil {
		t.Fatalf("deploy/prometheus/alerts.yml: %v", err)
	}
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			n++
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
	}
	if n < 4 {
		t.Fatalf("%d alerts", n)
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
