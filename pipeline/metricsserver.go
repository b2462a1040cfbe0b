package pipeline

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/pprof"
	"os"
	"regexp"
	"strings"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/wmrl/wmrl/connectors/natsjs"
)

// metricsHandler serves Prometheus metrics at /metrics (and any path but
// the others, as before), the process's health at /healthz, and Go's
// profiles at /debug/pprof/, so a leak in a run of days can be looked at
// where it happens. Metrics and health go to whoever asks, as Prometheus
// and orchestrators expect. Profiles go to requests from this machine
// only, unless cfg.PprofRemote: they show the command line, and a CPU
// profile or a trace costs the run a core for as long as it is asked to
// run.
func (p *Pipeline) metricsHandler() http.Handler {
	prof := http.NewServeMux()
	prof.HandleFunc("/debug/pprof/", pprof.Index)
	prof.HandleFunc("/debug/pprof/cmdline", cmdline)
	prof.HandleFunc("/debug/pprof/profile", pprof.Profile)
	prof.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	prof.HandleFunc("/debug/pprof/trace", pprof.Trace)
	mux := http.NewServeMux()
	mux.Handle("/", promhttp.HandlerFor(p.metrics.Registry, promhttp.HandlerOpts{}))
	mux.Handle("/debug/pprof/", profilesFor(prof, p.cfg.PprofRemote))
	mux.HandleFunc("GET /healthz", p.healthz)
	return mux
}

// healthz answers an orchestrator's probe of this process (a Kubernetes
// liveness or readiness probe, a load balancer's check): 200 while its
// stages consume and its NATS connection is up, 200 with status "standby"
// while it waits for another process's lease to start, 503 with the reason and a
// Retry-After while it starts, stops or has lost its server (its stages
// then wait; nothing is lost, so a liveness probe should allow for a
// server's restart).
func (p *Pipeline) healthz(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	if waiting := p.standby.Load(); waiting != nil {
		// Alive and doing what it should: a liveness probe leaves it be, and
		// a rolling update goes on to stop the process it waits for.
		_ = enc.Encode(map[string]any{"status": "standby", "run": p.cfg.Run, "stages": p.cfg.Stages, "waiting": *waiting})
		return
	}
	if err := p.health(); err != nil {
		w.Header().Set("Retry-After", "1")
		w.WriteHeader(http.StatusServiceUnavailable)
		_ = enc.Encode(map[string]string{"status": "unavailable", "run": p.cfg.Run, "error": err.Error()})
		return
	}
	_ = enc.Encode(map[string]any{"status": "ok", "run": p.cfg.Run, "stages": p.cfg.Stages})
}

// health is nil while the process's stages consume and its NATS
// connection is up, else what it is doing instead.
func (p *Pipeline) health() error {
	switch {
	case !p.built.Load():
		return errors.New("starting: the stages are not consuming yet")
	case p.router.IsClosed():
		return errors.New("stopping")
	case !p.router.IsRunning():
		return errors.New("starting: the stages are not consuming yet")
	}
	return natsjs.Health(p.tr.nc)
}

// profilesFor lets requests from another machine through to h only when
// remote is set, and tells the others how to reach the profiles.
func profilesFor(h http.Handler, remote bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !remote && !natsjs.Loopback(r.RemoteAddr) {
			http.Error(w, fmt.Sprintf("Go's profiles are served to this machine only: they show the command line, "+
				"and a CPU profile costs the run a core. Ask from the machine itself (an SSH tunnel to the --metrics port), "+
				"or start the run with --pprof-remote (%s is not a loopback address)", r.RemoteAddr), http.StatusForbidden)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// cmdline is pprof's /debug/pprof/cmdline with the user info of URLs
// hidden as natsjs.Redact hides it in the run's output: --nats may carry
// a user's password, and a --sandbox-url or --wm-url one too.
func cmdline(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	args := make([]string, len(os.Args))
	for i, a := range os.Args {
		args[i] = redactArg(a)
	}
	fmt.Fprint(w, strings.Join(args, "\x00"))
}

// urlUserInfo matches a URL's scheme and user info anywhere in an
// argument (a flag's value, each URL of a list), up to the last '@' of
// its authority, as a password may hold an '@' unescaped.
var urlUserInfo = regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.-]*://)[^/\s,?#]*@`)

// redactArg writes the user info of every URL in a command-line argument
// as "***" ("--nats=nats://ann:secret@host" becomes
// "--nats=nats://***@host").
func redactArg(s string) string { return urlUserInfo.ReplaceAllString(s, "${1}***@") }
