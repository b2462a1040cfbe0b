// Package k8s holds wmrl's Kubernetes manifests and their tests. No
// cluster runs here, so the tests take the manifests apart as Kubernetes
// would: every document decoded strictly into its kind's API type, the
// names and ports between them checked, the NATS nodes' configuration
// parsed by nats-server's own parser and run as a cluster, and the wmrl
// pods' command lines and settings run by the real binary on it, probed
// where the probes point.
package k8s

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	k8syaml "sigs.k8s.io/yaml"
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
