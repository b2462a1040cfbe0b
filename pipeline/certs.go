package pipeline

import (
	"fmt"
	"time"
)

// This file says what becomes of the servers' certificates: renewed,
// not loading, near their expiry.

// certRenewed says, of a renewal of server's certificate files, that
// what (the server, as a subject) presents the new certificate, or that
// the pair does not load yet (whatever Quiet says); and exports the new
// expiry. The embedded server's is made before the pipeline, with its
// metrics.
func certRenewed(cfg *Config, m *Metrics, server, what string) func(time.Time, error) {
	return func(until time.Time, err error) {
		if err != nil {
			fmt.Fprintf(cfg.Out, "%s's renewed certificate does not load (%v); it presents the one before until it does\n", what, err)
			return
		}
		m.CertNotAfter.WithLabelValues(server).Set(float64(until.Unix()))
		if !cfg.Quiet {
			fmt.Fprintf(cfg.Out, "%s presents its renewed certificate, valid until %s\n", what, until.UTC().Format(time.RFC3339))
		}
	}
}

// clientCARead says that the embedded server's --listen-client-ca file
// changed: how many CAs it now trusts, or that the file does not load and
// the CAs before stay trusted (whatever Quiet says).
func clientCARead(cfg *Config) func(int, error) {
	return func(n int, err error) {
		if err != nil {
			fmt.Fprintf(cfg.Out, "nats: the embedded server's client CA file changed and does not load (%v); it trusts the CAs before until it does\n", err)
			return
		}
		if !cfg.Quiet {
			fmt.Fprintf(cfg.Out, "nats: the embedded server read its client CA file again: it trusts %d CA certificate(s) for the next connections\n", n)
		}
	}
}

// presents exports the expiry of the certificate a server starts with, and
// points it out when it is near.
func (p *Pipeline) presents(server, what string, until time.Time) {
	p.metrics.CertNotAfter.WithLabelValues(server).Set(float64(until.Unix()))
	if left := time.Until(until); left < certWarnAhead {
		p.notef("%s expires at %s, in %v: renew it and its key in place; they are read again when they change",
			what, until.UTC().Format(time.RFC3339), left.Round(time.Minute))
	}
}
