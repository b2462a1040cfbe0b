// Package tlsfiles serves a TLS certificate from files that are renewed in
// place, for servers that run for days under short-lived certificates: the
// embedded NATS server and the trainer gateway.
package tlsfiles

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"sync"
	"time"
)

// Reloader hands each TLS handshake the certificate as last read from its
// files, reading them again whenever either has changed since. A pair that
// does not load (the certificate renewed before its key) leaves the one
// before in use, and is tried again at the next handshake.
type Reloader struct {
	cert, key string
	on        func(notAfter time.Time, err error)

	mu      sync.Mutex
	current *tls.Certificate
	loaded  time.Time // the files' newest modification at the last read
	failed  time.Time // ... at the last failed read, said once
}

// Load reads the certificate and key (PEM files) for a server. on, if
// set, hears of each renewal read later: the new certificate's expiry, or
// why it could not be loaded.
func Load(cert, key string, on func(notAfter time.Time, err error)) (*Reloader, error) {
	r := &Reloader{cert: cert, key: key, on: on}
	mod, err := r.modified()
	if err != nil {
		return nil, err
	}
	c, err := r.read()
	if err != nil {
		return nil, err
	}
	r.current, r.loaded = c, mod
	return r, nil
}

func (r *Reloader) modified() (time.Time, error) {
	var newest time.Time
	for _, f := range []string{r.cert, r.key} {
		fi, err := os.Stat(f)
		if err != nil {
			return time.Time{}, err
		}
		if fi.ModTime().After(newest) {
			newest = fi.ModTime()
		}
	}
	return newest, nil
}

func (r *Reloader) read() (*tls.Certificate, error) {
	c, err := tls.LoadX509KeyPair(r.cert, r.key)
	if err != nil {
		return nil, fmt.Errorf("certificate %s and key %s: %w", r.cert, r.key, err)
	}
	if c.Leaf == nil {
		if c.Leaf, err = x509.ParseCertificate(c.Certificate[0]); err != nil {
			return nil, fmt.Errorf("certificate %s: %w", r.cert, err)
		}
	}
	return &c, nil
}

// GetCertificate is tls.Config's GetCertificate.
func (r *Reloader) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	mod, err := r.modified()
	if err != nil || mod.Equal(r.loaded) {
		return r.current, nil // a file renamed into place a moment later is read then
	}
	c, err := r.read()
	if err != nil {
		if !mod.Equal(r.failed) && r.on != nil {
			r.on(time.Time{}, err)
		}
		r.failed = mod
		return r.current, nil
	}
	r.current, r.loaded = c, mod
	if r.on != nil {
		r.on(c.Leaf.NotAfter, nil)
	}
	return r.current, nil
}

// NotAfter is when the certificate in use expires.
func (r *Reloader) NotAfter() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.current.Leaf.NotAfter
}
