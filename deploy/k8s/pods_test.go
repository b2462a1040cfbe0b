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
	"net"
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

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"gopkg.in/yaml.v3"
	corev1 "k8s.io/api/core/v1"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
	"github.com/wmrl/wmrl/connectors/openai/openaitest"
	"github.com/wmrl/wmrl/connectors/sandbox/fusiontest"
	"github.com/wmrl/wmrl/connectors/sandbox/sandboxtest"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/stagetest"
)

// pod is a replica of a Deployment, run here as a process of its own.
type pod struct {
	cmd   *exec.Cmd
	out   *stagetest.Output
	ports map[string]int // container port name -> port here
	done  chan struct{}  // closed once it ended
	ended error          // its Wait's error, once done is closed
}

// gone says why p will never answer (it ended), or nil.
func (p *pod) gone() error {
	select {
	case <-p.done:
		return fmt.Errorf("wmrl %s ended (%v):\n%s", strings.Join(p.cmd.Args[1:], " "), p.ended, p.out)
	default:
		return nil
	}
}

// probe asks p what pr asks, as long as Kubernetes would, and returns
// the answer.
func (p *pod) probe(t *testing.T, pr *corev1.Probe) string {
	t.Helper()
	return get(t, fmt.Sprintf("http://127.0.0.1:%d%s", p.ports[pr.HTTPGet.Port.StrVal], pr.HTTPGet.Path), "", probeWithin(pr), p.gone)
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
	where, here := volumesHere(t, o, w, c)

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
	settings := settingsHere(t, o, c, here, map[string]string{"nats": urls, "wm-url": judge.URL, "sandbox-url": fusion.URL})
	tasks, ok := settings["task"].(string)
	if !ok {
		t.Fatal("the settings name no task directory")
	}
	solutions := sandboxtest.Housing(t, filepath.Join(tasks, "housing"))
	asUser := runAs(t, w, c, where, bin)

	// The Secret as deploy/README.md has it made: the gateway's token.
	const token = "t0ken"
	secrets := map[string]map[string]string{"wmrl": {"http-token": token}}
	var pods []*pod
	for n := range w.replicas {
		pods = append(pods, startPod(t, c, n, bin, here, asUser, secrets))
	}

	var statuses []string
	for _, p := range pods {
		p.probe(t, c.StartupProbe)
		var h struct{ Status string }
		if err := json.Unmarshal([]byte(p.probe(t, c.LivenessProbe)), &h); err != nil {
			t.Fatal(err)
		}
		statuses = append(statuses, h.Status)
		p.probe(t, c.ReadinessProbe)
	}
	slices.Sort(statuses)
	if !slices.Equal(statuses, []string{"ok", "standby"}) {
		t.Errorf("the pods' health: %v; want one running the stages and one waiting as its standby", statuses)
	}
	run, _ := settings["run"].(string)
	for _, sp := range o.services["wmrl-gateway"].Spec.Ports {
		for _, p := range pods {
			var steps struct{ Next *int64 }
			body := get(t, fmt.Sprintf("http://127.0.0.1:%d/v1/runs/%s/steps", p.ports[sp.TargetPort.StrVal], run), token, 30*time.Second, p.gone)
			if err := json.Unmarshal([]byte(body), &steps); err != nil || steps.Next == nil {
				t.Errorf("the gateway behind the Service's port %s: %s (%v); want where the run is", sp.Name, body, err)
			}
		}
	}
	sts := o.statefulSets["wmrl-nats"]
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
	update := trainerStep(t, gateway, run, token, solutions, wmScore)
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

// volumesHere makes a directory here for each volume container c of w
// mounts, the ConfigMap's files written into its own, and returns them by
// mount path, with here, which maps a path in the pod to this machine.
func volumesHere(t *testing.T, o *objects, w workload, c corev1.Container) (map[string]string, func(string) string) {
	t.Helper()
	volume, cm := configVolume(t, o, w)
	where := map[string]string{}
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
	return where, func(path string) string {
		for mount, dir := range where {
			if rest, ok := strings.CutPrefix(path, mount); ok && (rest == "" || rest[0] == '/') {
				return dir + rest
			}
		}
		return path
	}
}

// settingsHere rewrites the settings file container c reads (--config,
// on its ConfigMap's volume) for this machine: nats, where the ConfigMap
// must name the NATS pods, becomes at["nats"]; the hosts of the URLs of
// the other keys of at become at's; paths on the volumes become here's.
// Every other setting stays as the ConfigMap has it.
func settingsHere(t *testing.T, o *objects, c corev1.Container, here func(string) string, at map[string]string) map[string]any {
	t.Helper()
	i := slices.Index(c.Args, "--config")
	if i < 0 || i+1 == len(c.Args) {
		t.Fatalf("the wmrl container's args %q give no --config", c.Args)
	}
	path := here(c.Args[i+1])
	b, err := os.ReadFile(path)
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
	for key, base := range at {
		if key == "nats" {
			settings[key] = base
			continue
		}
		u, err := url.Parse(fmt.Sprint(settings[key]))
		if err != nil || u.Host == "" {
			t.Fatalf("%s: %v is not a URL (%v)", key, settings[key], err)
		}
		settings[key] = base + u.Path
	}
	for k, v := range settings {
		if s, ok := v.(string); ok {
			settings[k] = here(s)
		}
	}
	if b, err = yaml.Marshal(settings); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return settings
}

// runAs is who w's pods run as here. As root, the pods run as their
// securityContext's user, their volumes (where) given to its fsGroup as
// Kubernetes does: a pod that writes beside its volumes, or cannot read
// them, fails here as it would there. Otherwise nil: as this test's user.
func runAs(t *testing.T, w workload, c corev1.Container, where map[string]string, bin string) *syscall.Credential {
	t.Helper()
	tmp, err := os.Stat(os.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	sc := w.pod.Spec.SecurityContext
	if os.Geteuid() != 0 || sc == nil || sc.RunAsUser == nil || tmp.Mode()&0o001 == 0 {
		t.Logf("not root, or the temporary directory %s is closed to other users: the pods run as this test's user", os.TempDir())
		return nil
	}
	reachable(t, bin)
	for _, m := range c.VolumeMounts {
		dir := where[m.MountPath]
		reachable(t, dir)
		// Kubernetes leaves a read-only volume's files as they are: the
		// operator gives them to the group (deploy/README.md).
		if err := fsGroup(dir, int(*sc.FSGroup), !m.ReadOnly); err != nil {
			t.Fatal(err)
		}
	}
	return &syscall.Credential{Uid: uint32(*sc.RunAsUser), Gid: uint32(*sc.RunAsGroup)}
}

// startPod starts replica n of container c: bin with its args, their
// addresses on free ports of this machine and their paths here's, in
// the image's working directory, as asUser, with its environment (the
// secrets' values for its secret references) and a pid space of its own.
func startPod(t *testing.T, c corev1.Container, n int, bin string, here func(string) string, asUser *syscall.Credential, secrets map[string]map[string]string) *pod {
	t.Helper()
	p := &pod{out: &stagetest.Output{}, ports: map[string]int{}, done: make(chan struct{})}
	args := slices.Clone(c.Args)
	for _, cp := range c.Ports {
		p.ports[cp.Name] = natstest.FreePort(t)
		found := false
		for j, a := range args {
			if _, port, err := net.SplitHostPort(a); err == nil && port == strconv.Itoa(int(cp.ContainerPort)) {
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
	return p
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

// trainerStep sends the gateway at base (run's) a step of groups of the
// example task's solutions (their paths) as a trainer does (next step,
// its trajectories, its watermark, then its update), and checks what
// comes back: every trajectory, scored by the world model (wmScore of
// its code) or, in an anchor group, by its execution.
func trainerStep(t *testing.T, base, run, token string, solutions []string, wmScore func(string) (float64, bool)) schemas.Update {
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
