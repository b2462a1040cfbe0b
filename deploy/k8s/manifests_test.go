// Package k8s holds wmrl's Kubernetes manifests and their tests. No
// cluster runs here, so the tests take the manifests apart as Kubernetes
// would: every document decoded strictly into its kind's API type, the
// names and ports between them checked, the NATS nodes' configuration
// parsed by nats-server's own parser and run as a cluster, and the wmrl
// pods' command lines and settings run by the real binary on it, probed
// where the probes point.
package k8s

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"gopkg.in/yaml.v3"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	k8syaml "sigs.k8s.io/yaml"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
	"github.com/wmrl/wmrl/connectors/openai/openaitest"
	"github.com/wmrl/wmrl/connectors/sandbox/fusiontest"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/stagetest"
)

// objects are the manifests' documents by kind and name.
type objects struct {
	configMaps   map[string]*corev1.ConfigMap
	services     map[string]*corev1.Service
	claims       map[string]*corev1.PersistentVolumeClaim
	deployments  map[string]*appsv1.Deployment
	statefulSets map[string]*appsv1.StatefulSet
	budgets      map[string]*policyv1.PodDisruptionBudget
}

// workload is a Deployment's or a StatefulSet's pods.
type workload struct {
	kind, name string
	replicas   int
	selector   *metav1.LabelSelector
	pod        corev1.PodTemplateSpec
	claims     []corev1.PersistentVolumeClaim // a StatefulSet's volumeClaimTemplates
}

func (o *objects) workloads() []workload {
	var out []workload
	for _, d := range o.deployments {
		out = append(out, workload{"Deployment", d.Name, int(*d.Spec.Replicas), d.Spec.Selector, d.Spec.Template, nil})
	}
	for _, s := range o.statefulSets {
		out = append(out, workload{"StatefulSet", s.Name, int(*s.Spec.Replicas), s.Spec.Selector, s.Spec.Template, s.Spec.VolumeClaimTemplates})
	}
	slices.SortFunc(out, func(a, b workload) int { return strings.Compare(a.name, b.name) })
	return out
}

// load decodes every document of every manifest strictly: a field the
// API type does not have (a typo, an indentation gone wrong) is an error,
// as kubectl's server-side validation would make it.
func load(t *testing.T) *objects {
	t.Helper()
	o := &objects{map[string]*corev1.ConfigMap{}, map[string]*corev1.Service{}, map[string]*corev1.PersistentVolumeClaim{},
		map[string]*appsv1.Deployment{}, map[string]*appsv1.StatefulSet{}, map[string]*policyv1.PodDisruptionBudget{}}
	files, _ := filepath.Glob("*.yaml")
	if len(files) == 0 {
		t.Fatal("no manifests (*.yaml) here")
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range strings.Split(string(b), "\n---\n") {
			var tm metav1.TypeMeta
			if err := k8syaml.Unmarshal([]byte(doc), &tm); err != nil {
				t.Fatalf("%s, document %d: %v", f, i+1, err)
			}
			where := fmt.Sprintf("%s, document %d (%s)", f, i+1, tm.Kind)
			switch tm.APIVersion + " " + tm.Kind {
			case "v1 ConfigMap":
				put(t, where, o.configMaps, &corev1.ConfigMap{}, doc)
			case "v1 Service":
				put(t, where, o.services, &corev1.Service{}, doc)
			case "v1 PersistentVolumeClaim":
				put(t, where, o.claims, &corev1.PersistentVolumeClaim{}, doc)
			case "apps/v1 Deployment":
				put(t, where, o.deployments, &appsv1.Deployment{}, doc)
			case "apps/v1 StatefulSet":
				put(t, where, o.statefulSets, &appsv1.StatefulSet{}, doc)
			case "policy/v1 PodDisruptionBudget":
				put(t, where, o.budgets, &policyv1.PodDisruptionBudget{}, doc)
			default:
				t.Fatalf("%s: kind %q of %q, which this test does not know: add it", where, tm.Kind, tm.APIVersion)
			}
		}
	}
	return o
}

// put decodes doc strictly into obj and indexes it by its name.
func put[T metav1.Object](t *testing.T, where string, m map[string]T, obj T, doc string) {
	t.Helper()
	if err := k8syaml.UnmarshalStrict([]byte(doc), obj); err != nil {
		t.Fatalf("%s: %v", where, err)
	}
	switch _, dup := m[obj.GetName()]; {
	case obj.GetName() == "":
		t.Fatalf("%s: no name", where)
	case dup:
		t.Fatalf("%s: a second one named %s", where, obj.GetName())
	}
	m[obj.GetName()] = obj
}

// The names and ports between the manifests' objects are each other's.
func TestTheManifestsNameEachOther(t *testing.T) {
	o := load(t)
	ws := o.workloads()
	if len(ws) == 0 {
		t.Fatal("no workloads")
	}
	selects := func(sel *metav1.LabelSelector, w workload) bool {
		s, err := metav1.LabelSelectorAsSelector(sel)
		if err != nil {
			t.Fatal(err)
		}
		return !s.Empty() && s.Matches(labels.Set(w.pod.Labels))
	}
	for _, w := range ws {
		if !selects(w.selector, w) {
			t.Errorf("%s %s: its selector does not select its own pods' labels %v", w.kind, w.name, w.pod.Labels)
		}
		for _, other := range ws {
			if other.name != w.name && selects(w.selector, other) {
				t.Errorf("%s %s's selector also selects %s's pods", w.kind, w.name, other.name)
			}
		}
		volumes := map[string]bool{}
		for _, v := range w.pod.Spec.Volumes {
			volumes[v.Name] = true
			if cm := v.ConfigMap; cm != nil && o.configMaps[cm.Name] == nil {
				t.Errorf("%s %s: volume %s is ConfigMap %s, which no manifest makes", w.kind, w.name, v.Name, cm.Name)
			}
			if pvc := v.PersistentVolumeClaim; pvc != nil && o.claims[pvc.ClaimName] == nil {
				t.Errorf("%s %s: volume %s is claim %s, which no manifest makes", w.kind, w.name, v.Name, pvc.ClaimName)
			}
		}
		for _, c := range w.claims {
			volumes[c.Name] = true
		}
		for _, c := range w.pod.Spec.Containers {
			ports := map[string]bool{}
			for _, p := range c.Ports {
				ports[p.Name] = true
			}
			for _, m := range c.VolumeMounts {
				if !volumes[m.Name] {
					t.Errorf("%s %s: container %s mounts %s, which is not one of its volumes", w.kind, w.name, c.Name, m.Name)
				}
			}
			for what, p := range map[string]*corev1.Probe{"startup": c.StartupProbe, "liveness": c.LivenessProbe, "readiness": c.ReadinessProbe} {
				switch {
				case p == nil:
					t.Errorf("%s %s: container %s has no %s probe", w.kind, w.name, c.Name, what)
				case p.HTTPGet == nil || !ports[p.HTTPGet.Port.StrVal]:
					t.Errorf("%s %s: container %s's %s probe is not an HTTP GET on one of its named ports", w.kind, w.name, c.Name, what)
				}
			}
			if c.Resources.Limits.Memory().IsZero() {
				t.Errorf("%s %s: container %s has no memory limit (which wmrl sets its GOMEMLIMIT from, and nats-server its own)", w.kind, w.name, c.Name)
			}
		}
	}
	for _, s := range o.services {
		var picked []workload
		for _, w := range ws {
			if selects(&metav1.LabelSelector{MatchLabels: s.Spec.Selector}, w) {
				picked = append(picked, w)
			}
		}
		if len(picked) != 1 {
			t.Errorf("Service %s selects %d workloads' pods; want one", s.Name, len(picked))
			continue
		}
		for _, p := range s.Spec.Ports {
			if !slices.ContainsFunc(picked[0].pod.Spec.Containers, func(c corev1.Container) bool {
				return slices.ContainsFunc(c.Ports, func(cp corev1.ContainerPort) bool { return cp.Name == p.TargetPort.StrVal })
			}) {
				t.Errorf("Service %s: port %s targets %q, which %s's containers do not name", s.Name, p.Name, p.TargetPort.String(), picked[0].name)
			}
		}
	}
	for _, s := range o.statefulSets {
		if svc := o.services[s.Spec.ServiceName]; svc == nil || svc.Spec.ClusterIP != corev1.ClusterIPNone {
			t.Errorf("StatefulSet %s: its serviceName %q is not a headless Service (the pods' stable names come from one)", s.Name, s.Spec.ServiceName)
		}
	}
	for _, b := range o.budgets {
		if !slices.ContainsFunc(ws, func(w workload) bool { return selects(b.Spec.Selector, w) }) {
			t.Errorf("PodDisruptionBudget %s selects no workload's pods", b.Name)
		}
	}
}

// container is the one container of a workload's pods.
func container(t *testing.T, w workload) corev1.Container {
	t.Helper()
	if len(w.pod.Spec.Containers) != 1 {
		t.Fatalf("%s has %d containers; this test knows one", w.name, len(w.pod.Spec.Containers))
	}
	return w.pod.Spec.Containers[0]
}

func port(t *testing.T, c corev1.Container, name string) int {
	t.Helper()
	for _, p := range c.Ports {
		if p.Name == name {
			return int(p.ContainerPort)
		}
	}
	t.Fatalf("container %s has no port named %s", c.Name, name)
	return 0
}

// mountOf is where container c mounts volume.
func mountOf(t *testing.T, w workload, c corev1.Container, volume string) string {
	t.Helper()
	for _, m := range c.VolumeMounts {
		if m.Name == volume {
			return m.MountPath
		}
	}
	t.Fatalf("%s mounts no volume %s", w.name, volume)
	return ""
}

// configVolume is the volume of w that is a ConfigMap, and the ConfigMap.
func configVolume(t *testing.T, o *objects, w workload) (string, *corev1.ConfigMap) {
	t.Helper()
	for _, v := range w.pod.Spec.Volumes {
		if v.ConfigMap != nil {
			return v.Name, o.configMaps[v.ConfigMap.Name]
		}
	}
	t.Fatalf("%s has no ConfigMap volume", w.name)
	return "", nil
}

func find(t *testing.T, o *objects, name string) workload {
	t.Helper()
	for _, w := range o.workloads() {
		if w.name == name {
			return w
		}
	}
	t.Fatalf("no workload %s", name)
	return workload{}
}

// get asks url until it answers 200 or the time runs out, and returns
// the last answer's body; with token, if not "", as its bearer. gone, if
// not nil, says why the server will never answer (its process ended),
// which ends the wait at once.
func get(t *testing.T, url, token string, within time.Duration, gone func() error) string {
	t.Helper()
	var last string
	for deadline := time.Now().Add(within); ; time.Sleep(100 * time.Millisecond) {
		if gone != nil {
			if err := gone(); err != nil {
				t.Fatalf("GET %s: %v", url, err)
			}
		}
		req, err := http.NewRequest("GET", url, nil)
		if err != nil {
			t.Fatal(err)
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return string(b)
			}
			last = fmt.Sprintf("%s: %s", resp.Status, b)
		} else {
			last = err.Error()
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET %s: not 200 within %s: %s", url, within, last)
		}
	}
}

// probeWithin is how long Kubernetes gives a probe before it acts: a
// startup probe's every attempt, another's failure threshold.
func probeWithin(p *corev1.Probe) time.Duration {
	return time.Duration(max(p.PeriodSeconds, 1)*max(p.FailureThreshold, 3)) * time.Second
}

// natsCluster runs the StatefulSet's nodes as Kubernetes would start
// them: each pod's nats.conf from the ConfigMap, parsed by nats-server's
// own parser with the pod's environment; only the addresses move to this
// machine's loopback (the pods' names do not resolve here) and the stores
// to the test's directories. It checks what the configuration must say
// for wmrl and for the pods' names, probes the nodes where the probes
// point, and returns the client URLs.
func natsCluster(t *testing.T, o *objects) string {
	t.Helper()
	w := find(t, o, "wmrl-nats")
	sts := o.statefulSets[w.name]
	c := container(t, w)
	volume, cm := configVolume(t, o, w)
	i := slices.Index(c.Args, "--config")
	if i < 0 || i+1 == len(c.Args) {
		t.Fatalf("nats-server's args %q give no --config", c.Args)
	}
	dir := mountOf(t, w, c, volume)
	name, ok := strings.CutPrefix(c.Args[i+1], dir+"/")
	if !ok || cm.Data[name] == "" {
		t.Fatalf("--config %s is not a key of ConfigMap %s mounted at %s", c.Args[i+1], cm.Name, dir)
	}
	conf := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(conf, []byte(cm.Data[name]), 0o644); err != nil {
		t.Fatal(err)
	}
	podEnv := func(pod string) {
		for _, e := range c.Env {
			switch {
			case e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.name":
				t.Setenv(e.Name, pod)
			case e.ValueFrom == nil:
				t.Setenv(e.Name, e.Value)
			default:
				t.Fatalf("nats-server's env %s: a source this test does not know", e.Name)
			}
		}
	}
	mounted := func(path string) bool {
		return slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return strings.HasPrefix(path, m.MountPath+"/") })
	}
	var opts []*server.Options
	var routes []*url.URL
	for n := range w.replicas {
		pod := fmt.Sprintf("%s-%d", sts.Name, n)
		podEnv(pod)
		opt, err := server.ProcessConfigFile(conf)
		if err != nil {
			t.Fatalf("nats-server's parser, as pod %s: %v", pod, err)
		}
		if opt.ServerName != pod {
			t.Errorf("pod %s's server_name is %q; want the pod's name (a node's name must be its own, and stay so across restarts)", pod, opt.ServerName)
		}
		if opt.MaxPayload != 8<<20 || !opt.JetStream || opt.Cluster.Name == "" {
			t.Errorf("max_payload %d, JetStream %v, cluster %q; want 8 MiB (wmrl's updates and checkpoints are single messages), JetStream on, a cluster", opt.MaxPayload, opt.JetStream, opt.Cluster.Name)
		}
		if opt.Port != port(t, c, "client") || opt.Cluster.Port != port(t, c, "cluster") || opt.HTTPPort != port(t, c, "monitor") {
			t.Errorf("the server listens on %d, routes on %d, monitors on %d; the container's ports say otherwise", opt.Port, opt.Cluster.Port, opt.HTTPPort)
		}
		var hosts []string
		for _, r := range opt.Routes {
			hosts = append(hosts, r.Host)
		}
		var want []string
		for m := range w.replicas {
			want = append(want, fmt.Sprintf("%s-%d.%s:%d", sts.Name, m, sts.Spec.ServiceName, port(t, c, "cluster")))
		}
		if !slices.Equal(hosts, want) {
			t.Errorf("routes %v; want the StatefulSet's %d pods by their stable names, %v", hosts, w.replicas, want)
		}
		if claimed := mountOf(t, w, c, sts.Spec.VolumeClaimTemplates[0].Name); !strings.HasPrefix(opt.StoreDir, claimed+"/") || !mounted(opt.PidFile) {
			t.Errorf("store_dir %s must be on the pod's claim (%s: it outlives the pod), and pid_file %s on a volume", opt.StoreDir, claimed, opt.PidFile)
		}
		if stop := c.Lifecycle.PreStop.Exec.Command; !slices.Contains(stop, "ldm="+opt.PidFile) {
			t.Errorf("preStop %q does not signal lame duck mode to the server's pid_file %s", stop, opt.PidFile)
		}
		if claim := sts.Spec.VolumeClaimTemplates[0].Spec.Resources.Requests.Storage(); opt.JetStreamMaxStore <= 0 || opt.JetStreamMaxStore >= claim.Value() {
			t.Errorf("max_file_store %d; want a limit below the volume's %s, so that the server refuses writes before the disk is full", opt.JetStreamMaxStore, claim)
		}
		// On this machine: loopback addresses, stores of the test's.
		opt.Host, opt.Port = "127.0.0.1", natstest.FreePort(t)
		opt.Cluster.Host, opt.Cluster.Port = "127.0.0.1", natstest.FreePort(t)
		opt.HTTPHost, opt.HTTPPort = "127.0.0.1", natstest.FreePort(t)
		opt.StoreDir, opt.PidFile = t.TempDir(), filepath.Join(t.TempDir(), "nats.pid")
		opt.NoLog, opt.NoSigs = true, true
		routes = append(routes, &url.URL{Scheme: "nats-route", Host: fmt.Sprintf("127.0.0.1:%d", opt.Cluster.Port)})
		opts = append(opts, opt)
	}
	for _, opt := range opts {
		opt.Routes = routes
	}
	_, urls := natstest.Start(t, opts)
	for _, opt := range opts {
		for _, p := range []*corev1.Probe{c.StartupProbe, c.LivenessProbe, c.ReadinessProbe} {
			get(t, fmt.Sprintf("http://127.0.0.1:%d%s", opt.HTTPPort, p.HTTPGet.Path), "", probeWithin(p), nil)
		}
	}
	return urls
}

// The NATS nodes' configuration, as nats-server reads it in each pod,
// makes the cluster wmrl needs, and the wmrl pods run on it with their
// command line and settings as the manifests give them: both become
// ready where their probes ask, one runs the one-per-run stages and the
// other waits as its standby, the Service's port reaches each one's
// gateway, a trainer's step through it is scored by the world model and
// its anchors executed in Sandbox Fusion at the ConfigMap's URLs and
// archived on the archive's volume, the run's stream is on three nodes,
// and SIGTERM stops both cleanly within the pod's grace period.
func TestThePodsRunAsTheManifestsSay(t *testing.T) {
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("python3 (to make the example task the pods read) not installed")
	}
	o := load(t)
	urls := natsCluster(t, o)
	bin := filepath.Join(t.TempDir(), "wmrl")
	if out, err := exec.Command("go", "build", "-o", bin, "../../cmd/wmrl").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}

	w := find(t, o, "wmrl")
	c := container(t, w)
	if len(c.Command) != 1 || c.Command[0] != "wmrl" {
		t.Fatalf("the wmrl container's command %q; want wmrl", c.Command)
	}
	// The pods' volumes, as directories of this machine.
	volume, cm := configVolume(t, o, w)
	where := map[string]string{} // mount path -> directory here
	for _, m := range c.VolumeMounts {
		dir := t.TempDir()
		where[m.MountPath] = dir
		if m.Name == volume {
			for k, v := range cm.Data {
				if err := os.WriteFile(filepath.Join(dir, k), []byte(v), 0o644); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	here := func(path string) string {
		for mount, dir := range where {
			if rest, ok := strings.CutPrefix(path, mount); ok && (rest == "" || rest[0] == '/') {
				return dir + rest
			}
		}
		return path
	}
	// The settings file: the pods' names for the NATS nodes become this
	// machine's addresses of them, and paths on the volumes these
	// directories; every other setting is as the ConfigMap has it.
	i := slices.Index(c.Args, "--config")
	if i < 0 || i+1 == len(c.Args) {
		t.Fatalf("the wmrl container's args %q give no --config", c.Args)
	}
	confPath := here(c.Args[i+1])
	b, err := os.ReadFile(confPath)
	if err != nil {
		t.Fatalf("--config %s is not a file of a mounted ConfigMap: %v", c.Args[i+1], err)
	}
	var settings map[string]any
	if err := yaml.Unmarshal(b, &settings); err != nil {
		t.Fatal(err)
	}
	sts := o.statefulSets["wmrl-nats"]
	var podURLs []string
	for n := range int(*sts.Spec.Replicas) {
		podURLs = append(podURLs, fmt.Sprintf("nats://%s-%d.%s:%d", sts.Name, n, sts.Spec.ServiceName, port(t, container(t, find(t, o, sts.Name)), "client")))
	}
	if settings["nats"] != strings.Join(podURLs, ",") {
		t.Errorf("nats: %v; want the NATS pods' client URLs, %s", settings["nats"], strings.Join(podURLs, ","))
	}
	settings["nats"] = urls
	// The world model and Sandbox Fusion the ConfigMap names, here: a
	// judge that scores each solution by a hash of its code, and a
	// Sandbox Fusion that runs it with python3.
	wmScore := func(code string) (float64, bool) {
		h := fnv.New32a()
		h.Write([]byte(code))
		return float64(h.Sum32()%1000) / 1000, true
	}
	judge := openaitest.Judge(t, wmScore)
	fusion, executions := fusiontest.Server(t, 0)
	for key, srv := range map[string]string{"wm-url": judge.URL, "sandbox-url": fusion.URL} {
		u, err := url.Parse(fmt.Sprint(settings[key]))
		if err != nil || u.Host == "" {
			t.Fatalf("%s: %v is not a URL (%v)", key, settings[key], err)
		}
		settings[key] = srv + u.Path
	}
	for k, v := range settings {
		if s, ok := v.(string); ok {
			settings[k] = here(s)
		}
	}
	if b, err = yaml.Marshal(settings); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(confPath, b, 0o644); err != nil {
		t.Fatal(err)
	}
	// The tasks the pods read: the example task.
	tasks, ok := settings["task"].(string)
	if !ok {
		t.Fatal("the settings name no task directory")
	}
	housing := filepath.Join(tasks, "housing")
	if err := os.MkdirAll(housing, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"generate.py", "task.json"} {
		b, err := os.ReadFile(filepath.Join("../../examples/tasks/housing", f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(housing, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.Command("python3", filepath.Join(housing, "generate.py")).CombinedOutput(); err != nil {
		t.Fatalf("generate the example task: %v\n%s", err, out)
	}

	// As root, the pods run as their securityContext's user, their
	// volumes given to its fsGroup as Kubernetes does: a pod that writes
	// beside its volumes, or cannot read them, fails here as it would
	// there.
	var asUser *syscall.Credential
	tmp, err := os.Stat(os.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if sc := w.pod.Spec.SecurityContext; os.Geteuid() == 0 && sc != nil && sc.RunAsUser != nil && tmp.Mode()&0o001 != 0 {
		asUser = &syscall.Credential{Uid: uint32(*sc.RunAsUser), Gid: uint32(*sc.RunAsGroup)}
		reachable(t, bin)
		for _, m := range c.VolumeMounts {
			dir := where[m.MountPath]
			reachable(t, dir)
			// Kubernetes leaves a read-only volume's files as they are:
			// the operator gives them to the group (deploy/README.md).
			if err := fsGroup(dir, int(*sc.FSGroup), !m.ReadOnly); err != nil {
				t.Fatal(err)
			}
		}
	} else {
		t.Logf("not root, or the temporary directory %s is closed to other users: the pods run as this test's user", os.TempDir())
	}

	// The Secret as deploy/README.md has it made: the gateway's token.
	const token = "t0ken"
	secrets := map[string]map[string]string{"wmrl": {"http-token": token}}

	// Each replica, as a pod of its own: its ports on free ports of this
	// machine, its pid space its own.
	type pod struct {
		cmd   *exec.Cmd
		out   *stagetest.Output
		ports map[string]int // container port name -> port here
		done  chan struct{}  // closed once it ended
		ended error          // its Wait's error, once done is closed
	}
	var pods []*pod
	for n := range w.replicas {
		p := &pod{out: &stagetest.Output{}, ports: map[string]int{}, done: make(chan struct{})}
		args := slices.Clone(c.Args)
		for _, cp := range c.Ports {
			p.ports[cp.Name] = natstest.FreePort(t)
			found := false
			for j, a := range args {
				if _, port, err := netSplit(a); err == nil && port == int(cp.ContainerPort) {
					args[j], found = fmt.Sprintf("127.0.0.1:%d", p.ports[cp.Name]), true
				}
			}
			if !found {
				t.Fatalf("no argument of %q listens on the container's port %s (%d)", c.Args, cp.Name, cp.ContainerPort)
			}
		}
		for j := range args {
			args[j] = here(args[j])
		}
		p.cmd = exec.Command(bin, args...)
		p.cmd.Dir = "/" // the image's: no WORKDIR, and a read-only root
		if asUser != nil {
			p.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: asUser}
		}
		p.cmd.Env = append(os.Environ(), fmt.Sprintf("%s=pod-%d", natsjs.MachineEnv, n))
		for _, e := range c.Env {
			switch ref := e.ValueFrom; {
			case ref == nil:
				p.cmd.Env = append(p.cmd.Env, e.Name+"="+e.Value)
			case ref.SecretKeyRef == nil:
				t.Fatalf("env %s: a source this test does not know", e.Name)
			case secrets[ref.SecretKeyRef.Name][ref.SecretKeyRef.Key] != "":
				p.cmd.Env = append(p.cmd.Env, e.Name+"="+secrets[ref.SecretKeyRef.Name][ref.SecretKeyRef.Key])
			case ref.SecretKeyRef.Optional == nil || !*ref.SecretKeyRef.Optional:
				t.Fatalf("env %s: secret %s's key %s, which deploy/README.md does not have made, and the pod needs", e.Name, ref.SecretKeyRef.Name, ref.SecretKeyRef.Key)
			}
		}
		p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
		if err := p.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		go func() { p.ended = p.cmd.Wait(); close(p.done) }()
		t.Cleanup(func() {
			p.cmd.Process.Kill()
			<-p.done
		})
		pods = append(pods, p)
	}
	gone := func(p *pod) func() error {
		return func() error {
			select {
			case <-p.done:
				return fmt.Errorf("wmrl %s ended (%v):\n%s", strings.Join(p.cmd.Args[1:], " "), p.ended, p.out)
			default:
				return nil
			}
		}
	}
	probe := func(p *pod, pr *corev1.Probe) string {
		return get(t, fmt.Sprintf("http://127.0.0.1:%d%s", p.ports[pr.HTTPGet.Port.StrVal], pr.HTTPGet.Path), "", probeWithin(pr), gone(p))
	}
	var statuses []string
	for _, p := range pods {
		probe(p, c.StartupProbe)
		var h struct{ Status string }
		if err := json.Unmarshal([]byte(probe(p, c.LivenessProbe)), &h); err != nil {
			t.Fatal(err)
		}
		statuses = append(statuses, h.Status)
		probe(p, c.ReadinessProbe)
	}
	slices.Sort(statuses)
	if !slices.Equal(statuses, []string{"ok", "standby"}) {
		t.Errorf("the pods' health: %v; want one running the stages and one waiting as its standby", statuses)
	}
	run, _ := settings["run"].(string)
	for _, sp := range o.services["wmrl-gateway"].Spec.Ports {
		for _, p := range pods {
			var steps struct{ Next *int64 }
			body := get(t, fmt.Sprintf("http://127.0.0.1:%d/v1/runs/%s/steps", p.ports[sp.TargetPort.StrVal], run), token, 30*time.Second, gone(p))
			if err := json.Unmarshal([]byte(body), &steps); err != nil || steps.Next == nil {
				t.Errorf("the gateway behind the Service's port %s: %s (%v); want where the run is", sp.Name, body, err)
			}
		}
	}
	nc, err := nats.Connect(urls)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	prefix, _ := settings["prefix"].(string)
	s, err := js.Stream(ctx, pipeline.StreamName(cmp.Or(prefix, "wmrl")))
	if err != nil {
		t.Fatal(err)
	}
	if want, _ := settings["replicas"].(int); s.CachedInfo().Config.Replicas != want || want != int(*sts.Spec.Replicas) {
		t.Errorf("the stream is on %d nodes; the settings ask %d, and the cluster has %d", s.CachedInfo().Config.Replicas, want, *sts.Spec.Replicas)
	}

	// A trainer's step through the Service: the world model scores every
	// trajectory, Sandbox Fusion executes the anchor groups, the update
	// comes back with every trajectory, and the archive on its volume
	// gets the step's rows.
	gateway := fmt.Sprintf("http://127.0.0.1:%d/v1/runs/%s", pods[0].ports[o.services["wmrl-gateway"].Spec.Ports[0].TargetPort.StrVal], run)
	update := trainerStep(t, gateway, run, token, wmScore)
	if executions.Load() == 0 || update.Anchors == 0 {
		t.Errorf("%d anchor groups, %d executions in Sandbox Fusion; want the anchors executed there", update.Anchors, executions.Load())
	}
	archived := filepath.Join(fmt.Sprint(settings["archive"]), "run="+run) // a directory here already
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(200 * time.Millisecond) {
		if files, _ := filepath.Glob(filepath.Join(archived, "*.parquet")); len(files) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no archive file in %s a minute after the step was fused", archived)
		}
	}

	// A stopping pod lets its gateway's requests run for --http-drain,
	// then hands back what it holds, saves its checkpoints and releases
	// its leases (up to 5 s against a server that does not answer):
	// Kubernetes must not kill it before.
	grace := time.Duration(*w.pod.Spec.TerminationGracePeriodSeconds) * time.Second
	drain := pipeline.DefaultConfig().HTTPDrain
	if d, ok := settings["http-drain"].(string); ok {
		if drain, err = time.ParseDuration(d); err != nil {
			t.Fatal(err)
		}
	}
	if grace < drain+15*time.Second {
		t.Errorf("terminationGracePeriodSeconds %s leaves a stopping pod less than 15 s past its --http-drain of %s", grace, drain)
	}
	for _, p := range pods {
		p.cmd.Process.Signal(syscall.SIGTERM)
	}
	for n, p := range pods {
		select {
		case <-p.done:
			if p.ended != nil {
				t.Errorf("pod %d, stopped by SIGTERM: %v\n%s", n, p.ended, p.out)
			}
		case <-time.After(grace):
			t.Errorf("pod %d had not stopped %s after SIGTERM, when Kubernetes kills it\n%s", n, grace, p.out)
		}
	}
	if t.Failed() {
		for n, p := range pods {
			t.Logf("pod %d:\n%s", n, p.out)
		}
	}
}

// netSplit reads an address argument (0.0.0.0:8080, :8080).
func netSplit(a string) (string, int, error) {
	host, p, ok := strings.Cut(a, ":")
	if !ok || strings.Contains(p, ":") || strings.Contains(a, "/") {
		return "", 0, fmt.Errorf("not an address")
	}
	n, err := strconv.Atoi(p)
	return host, n, err
}

// reachable opens the directories above path (a test's temporary
// directories are 0700) to other users, as far as the temporary root.
func reachable(t *testing.T, path string) {
	t.Helper()
	for dir := filepath.Dir(path); strings.HasPrefix(dir, os.TempDir()+"/"); dir = filepath.Dir(dir) {
		if err := os.Chmod(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

// fsGroup does to dir what Kubernetes does to a pod's writable volume
// for its securityContext's fsGroup: every file's group becomes gid,
// which may read and write it, and directories pass the group on
// (setgid). Not writable, it does what deploy/README.md asks of the
// tasks' volume: chgrp -R gid, chmod -R g+rX.
func fsGroup(dir string, gid int, writable bool) error {
	return filepath.Walk(dir, func(path string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if err := os.Lchown(path, -1, gid); err != nil {
			return err
		}
		mode := fi.Mode().Perm() | 0o040
		if writable {
			mode |= 0o020
		}
		if fi.IsDir() {
			mode |= 0o010
			if writable {
				mode |= os.ModeSetgid
			}
		}
		return os.Chmod(path, mode)
	})
}

// The image the Dockerfile builds is the one the manifests run: Go of
// go.mod's release, wmrl on the PATH under the name the pods' command
// gives, as the user their securityContext names. No Docker engine runs
// here, so the image itself is not built by the tests.
func TestTheDockerfileBuildsWhatThePodsRun(t *testing.T) {
	b, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	mod, err := os.ReadFile("../../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	var goVersion string
	for _, l := range strings.Split(string(mod), "\n") {
		if v, ok := strings.CutPrefix(l, "go "); ok {
			goVersion = v
		}
	}
	var from []string
	var built, copied, user string
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		switch {
		case len(f) > 1 && f[0] == "FROM":
			from = append(from, f[1])
		case len(f) > 3 && f[0] == "RUN" && slices.Contains(f, "build") && f[len(f)-3] == "-o":
			built = f[len(f)-2] + " " + f[len(f)-1] // -o OUT PKG
		case len(f) > 2 && f[0] == "COPY" && strings.HasPrefix(f[1], "--from="):
			copied = f[2] + " " + f[3]
		case len(f) > 1 && f[0] == "USER":
			user = f[1]
		}
	}
	release := strings.Join(strings.Split(goVersion, ".")[:2], ".")
	if len(from) != 2 || !strings.HasPrefix(from[0], "golang:"+release+"-") {
		t.Errorf("stages FROM %v; want a golang:%s build stage (go.mod's go %s), then the image", from, release, goVersion)
	}
	out, pkg, _ := strings.Cut(built, " ")
	if pkg != "./cmd/wmrl" || copied != out+" /usr/local/bin/wmrl" {
		t.Errorf("builds %q and copies %q; want ./cmd/wmrl built, and copied to /usr/local/bin/wmrl", built, copied)
	}
	w := find(t, load(t), "wmrl")
	sc := w.pod.Spec.SecurityContext
	if c := container(t, w); len(c.Command) != 1 || c.Command[0] != "wmrl" {
		t.Errorf("the pods' command %q is not the binary the image puts on the PATH", c.Command)
	}
	if want := fmt.Sprintf("%d:%d", *sc.RunAsUser, *sc.RunAsGroup); user != want {
		t.Errorf("the image's USER %s; the pods run as %s", user, want)
	}
}

// trainerStep sends the gateway at base (run's) a step of groups of the example
// task's solutions as a trainer does (next step, its trajectories, its
// watermark, then its update), and checks what comes back: every
// trajectory, scored by the world model (wmScore of its code) or, in an
// anchor group, by its execution.
func trainerStep(t *testing.T, base, run, token string, wmScore func(string) (float64, bool)) schemas.Update {
	t.Helper()
	call := func(method, path string, body any, auth bool) (int, []byte) {
		var r io.Reader
		if body != nil {
			b, _ := json.Marshal(body)
			r = bytes.NewReader(b)
		}
		req, _ := http.NewRequest(method, base+path, r)
		if auth {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, b
	}
	if code, b := call("GET", "/steps", nil, false); code != http.StatusUnauthorized {
		t.Errorf("without the Secret's token: %d %s; want 401", code, b)
	}
	code, b := call("GET", "/steps", nil, true)
	var where struct{ Next *int64 }
	if json.Unmarshal(b, &where) != nil || code != http.StatusOK || where.Next == nil {
		t.Fatalf("where the run is: %d %s", code, b)
	}
	solutions, _ := filepath.Glob("../../examples/tasks/housing/solutions/*.py")
	if len(solutions) < 4 {
		t.Fatalf("%d example solutions; want 4 or more", len(solutions))
	}
	const groups, size = 4, 4
	var trajs []schemas.Trajectory
	code4 := map[string]string{}
	for g := range groups {
		for i := range size {
			src, err := os.ReadFile(solutions[(g+i)%len(solutions)])
			if err != nil {
				t.Fatal(err)
			}
			id := fmt.Sprintf("g%d-%d", g, i)
			code4[id] = string(src)
			trajs = append(trajs, schemas.Trajectory{Schema: schemas.Version, Run: run, Step: *where.Next, GroupID: fmt.Sprintf("g%d", g),
				TrajID: id, GroupSize: size, TaskID: "housing", Prompt: "Predict the house prices.", Response: string(src)})
		}
	}
	if code, b := call("POST", "/trajectories", trajs, true); code != http.StatusAccepted {
		t.Fatalf("trajectories: %d %s", code, b)
	}
	if code, b := call("POST", fmt.Sprintf("/steps/%d/close", *where.Next), map[string]int{"groups": groups}, true); code/100 != 2 {
		t.Fatalf("watermark: %d %s", code, b)
	}
	var u schemas.Update
	for deadline := time.Now().Add(2 * time.Minute); ; {
		code, b := call("GET", fmt.Sprintf("/steps/%d/update?wait=30", *where.Next), nil, true)
		if code == http.StatusOK {
			if err := json.Unmarshal(b, &u); err != nil {
				t.Fatal(err)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no update for step %d in 2 minutes: %d %s", *where.Next, code, b)
		}
	}
	if len(u.Items) != groups*size {
		t.Fatalf("the update has %d items; want the %d trajectories", len(u.Items), groups*size)
	}
	for _, it := range u.Items {
		want, _ := wmScore(code4[it.TrajID])
		switch {
		case it.Predicted == nil || math.Abs(*it.Predicted-want) > 1e-9:
			t.Errorf("%s: predicted %v; the world model scored it %v", it.TrajID, it.Predicted, want)
		case it.Source == "anchor" && (it.ExecStatus == "" || it.ExecStatus == schemas.ExecSandboxError || it.TrueScore == nil || it.Reward == nil || *it.Reward != *it.TrueScore):
			t.Errorf("%s: an anchor whose execution ended %q (%s), true score %v, reward %v", it.TrajID, it.ExecStatus, it.ExecDetail, it.TrueScore, it.Reward)
		}
	}
	return u
}
