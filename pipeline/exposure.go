package pipeline

import (
	"fmt"
	"net"

	"github.com/wmrl/wmrl/connectors/natsjs"
)

// This file says what a run's servers leave open to the machines they
// reach beyond this one, for the run to warn of at its start.

// exposure says what an embedded server's --listen leaves open to the
// machines it reaches beyond this one, or "" when nothing is: a server
// that asks clients for nothing, or a secret it asks for sent in clear.
func (c *Config) exposure() string {
	if c.NATSURL != "" || natsjs.Loopback(c.Listen) {
		return ""
	}
	secret := "password"
	if c.NATSAuth.Token != "" {
		secret = "token"
	}
	switch {
	case c.NATSAuth.User == "" && c.NATSAuth.Token == "" && c.ListenTLS.ClientCA == "":
		return fmt.Sprintf("the embedded NATS server listens on %s, beyond this machine, and asks clients for nothing: whoever reaches it can publish "+
			"trajectories and read the run. Set WMRL_NATS_TOKEN (or WMRL_NATS_USER and WMRL_NATS_PASSWORD) to have it ask for one, "+
			"or give --listen-client-ca to have it ask for a certificate", c.Listen)
	case !c.ListenTLS.On():
		return fmt.Sprintf("the embedded NATS server listens on %s, beyond this machine, without TLS: the %s it asks for, and every message, "+
			"cross the network in clear. Give --listen-cert and --listen-key to have it speak TLS", c.Listen, secret)
	}
	return ""
}

// beyondThisMachine says whether an HTTP server listening on addr is
// reached from other machines. Unlike the embedded server's --listen, an
// address without a host (":8080") is every interface's.
func beyondThisMachine(addr string) bool {
	host, _, _ := net.SplitHostPort(addr)
	return addr != "" && (host == "" || !natsjs.Loopback(addr))
}

// metricsExposure says what --metrics leaves open to the machines it
// reaches beyond this one, or "" when nothing worse than the metrics
// themselves is.
func (c *Config) metricsExposure() string {
	if !c.PprofRemote || !beyondThisMachine(c.MetricsAddr) {
		return ""
	}
	return fmt.Sprintf("--pprof-remote serves Go's profiles on %s, beyond this machine, to whoever reaches it: "+
		"the command line (its URLs' user info hidden), the heap, and CPU profiles and traces that each cost the run a core while they are taken", c.MetricsAddr)
}

// gatewayExposure says what the gateway's address leaves open to the
// machines it reaches beyond this one, or "" when nothing is.
func (c *Config) gatewayExposure() string {
	if !beyondThisMachine(c.HTTPAddr) {
		return ""
	}
	switch {
	case c.HTTPToken == "":
		return fmt.Sprintf("the trainer gateway listens on %s, beyond this machine, and asks for no token: whoever reaches it can publish "+
			"trajectories and read the run's updates. Set WMRL_HTTP_TOKEN to have it ask for one", c.HTTPAddr)
	case c.HTTPCert == "":
		return fmt.Sprintf("the trainer gateway listens on %s, beyond this machine, without TLS: its bearer token, and every trajectory, "+
			"cross the network in clear. Give --http-cert and --http-key to have it speak HTTPS", c.HTTPAddr)
	}
	return ""
}
