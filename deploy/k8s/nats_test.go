package k8s

import (
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	corev1 "k8s.io/api/core/v1"

	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
)

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
