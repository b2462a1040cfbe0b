package pipeline

import (
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
)

// A non-loopback address of this machine, through which a connection
// comes from "another machine" as far as the server can tell.
func outsideAddress(t *testing.T) string {
	t.Helper()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() && !n.IP.IsLinkLocalUnicast() {
			return n.IP.String()
		}
	}
	t.Skip("this machine has no IPv4 address but loopback's")
	return ""
}

// get asks url and returns the status and body.
func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// The metrics address serves its metrics to every machine, and Go's
// profiles, which show the command line and cost CPU, only to this one
// unless --pprof-remote says otherwise; over a real listener on every
// interface, asked through loopback and through this machine's own
// network address.
func TestProfilesGoToThisMachineOnly(t *testing.T) {
	outside := outsideAddress(t)
	for _, remote := range []bool{false, true} {
		p := &Pipeline{cfg: Config{PprofRemote: remote}, metrics: NewMetrics()}
		p.metrics.Steps.Set(7)
		ln, err := net.Listen("tcp", "0.0.0.0:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: p.metricsHandler()}
		go srv.Serve(ln)
		port := ln.Addr().(*net.TCPAddr).Port
		for _, host := range []string{"127.0.0.1", outside} {
			base := "http://" + net.JoinHostPort(host, strconv.Itoa(port))
			if code, body := get(t, base+"/metrics"); code != http.StatusOK || !strings.Contains(body, "wmrl_steps_published 7") {
				t.Errorf("pprof-remote %v, /metrics from %s: %d %.200q", remote, host, code, body)
			}
			code, body := get(t, base+"/debug/pprof/cmdline")
			switch {
			case host == outside && !remote:
				if code != http.StatusForbidden || !strings.Contains(body, "--pprof-remote") || !strings.Contains(body, outside) {
					t.Errorf("profiles to %s without --pprof-remote: %d %q; want 403 naming the flag and the address", host, code, body)
				}
			case code != http.StatusOK || !strings.Contains(body, "pipeline.test"):
				t.Errorf("pprof-remote %v, profiles to %s: %d %.200q; want the command line", remote, host, code, body)
			}
		}
		srv.Close()
	}
}

// The command line the profiles show hides every URL's password (or a
// token in the user info), in a flag's value and in each URL of a list.
func TestTheProfilesCommandLineHidesPasswords(t *testing.T) {
	for _, tc := range []struct{ arg, want string }{
		{"--nats=nats://ann:s3cret@h1:4222,nats://ann:s3cret@h2:4222", "--nats=nats://***@h1:4222,nats://***@h2:4222"},
		{"tls://t0k3n@10.0.0.1:4222", "tls://***@10.0.0.1:4222"},
		{"http://u:p@sandbox:8080/run_code?x=a@b", "http://***@sandbox:8080/run_code?x=a@b"},
		{"nats://ann:p@ss@h1:4222", "nats://***@h1:4222"},
		{"nats://h1:4222", "nats://h1:4222"},
		{"--wm-url=http://vllm:8000/v1", "--wm-url=http://vllm:8000/v1"},
		{"someone@example.com", "someone@example.com"},
	} {
		if got := redactArg(tc.arg); got != tc.want {
			t.Errorf("%q: %q, want %q", tc.arg, got, tc.want)
		}
	}
}

// --pprof-remote on an address other machines reach is said at start.
func TestRemoteProfilesAreNamed(t *testing.T) {
	for _, tc := range []struct {
		addr   string
		remote bool
		want   bool
	}{
		{"0.0.0.0:9090", true, true},
		{":9090", true, true},
		{"10.1.2.3:9090", true, true},
		{"0.0.0.0:9090", false, false},
		{"127.0.0.1:9090", true, false},
		{"localhost:9090", true, false},
		{"", true, false},
	} {
		c := Config{MetricsAddr: tc.addr, PprofRemote: tc.remote}
		if got := c.metricsExposure(); (got != "") != tc.want || tc.want && !strings.Contains(got, tc.addr) {
			t.Errorf("--metrics %q, --pprof-remote %v: %q", tc.addr, tc.remote, got)
		}
	}
}
