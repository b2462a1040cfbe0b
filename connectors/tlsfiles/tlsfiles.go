// Package tlsfiles serves TLS material from files that are renewed in
// place, for servers that run for days under short-lived certificates: the
// embedded NATS server and the trainer gateway.
package tlsfiles

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"sync"
	"time"
)

// watched holds what was last read from a set of files, reading them again
// at the next use after any has changed. What does not load (a certificate
// renewed before its key) leaves what was read before in use, is said
// once, and is tried again at the next use.
type watched[T any] struct {
	files []string
	read  func() (T, error)
	on    func(T, error)

	mu      sync.Mutex
	current T
	loaded  time.Time // the files' newest modification at the last read
	failed  time.Time // ... at the last failed read, said once
}

func (w *watched[T]) load() error {
	mod, err := w.modified()
	if err != nil {
		return err
	}
	v, err := w.read()
	if err != nil {
		return err
	}
	w.current, w.loaded = v, mod
	return nil
}

func (w *watched[T]) modified() (time.Time, error) {
	var newest time.Time
	for _, f := range w.files {
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

// get is what the files hold now, or the last that loaded.
func (w *watched[T]) get() T {
	w.mu.Lock()
	defer w.mu.Unlock()
	mod, err := w.modified()
	if err != nil || mod.Equal(w.loaded) {
		return w.current // a file renamed into place a moment later is read then
	}
	v, err := w.read()
	if err != nil {
		if !mod.Equal(w.failed) && w.on != nil {
			var zero T
			w.on(zero, err)
		}
		w.failed = mod
		return w.current
	}
	w.current, w.loaded = v, mod
	if w.on != nil {
		w.on(v, nil)
	}
	return v
}

// Reloader hands each TLS handshake the certificate as last read from its
// files, reading them again whenever either has changed since. A pair that
// does not load (the certificate renewed before its key) leaves the one
// before in use, and is tried again at the next handshake.
type Reloader struct{ w watched[*tls.Certificate] }

// Load reads the certificate and key (PEM files) for a server. on, if
// set, hears of each renewal read later: the new certificate's expiry, or
// why it could not be loaded.
func Load(cert, key string, on func(notAfter time.Time, err error)) (*Reloader, error) {
	r := &Reloader{w: watched[*tls.Certificate]{files: []string{cert, key}, read: func() (*tls.Certificate, error) { return readPair(cert, key) }}}
	if on != nil {
		r.w.on = func(c *tls.Certificate, err error) {
			if err != nil {
				on(time.Time{}, err)
				return
			}
			on(c.Leaf.NotAfter, nil)
		}
	}
	if err := r.w.load(); err != nil {
		return nil, err
	}
	return r, nil
}

func readPair(cert, key string) (*tls.Certificate, error) {
	c, err := tls.LoadX509KeyPair(cert, key)
	if err != nil {
		return nil, fmt.Errorf("certificate %s and key %s: %w", cert, key, err)
	}
	if c.Leaf == nil {
		if c.Leaf, err = x509.ParseCertificate(c.Certificate[0]); err != nil {
			return nil, fmt.Errorf("certificate %s: %w", cert, err)
		}
	}
	return &c, nil
}

// GetCertificate is tls.Config's GetCertificate.
func (r *Reloader) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	return r.w.get(), nil
}

// NotAfter is when the certificate in use expires.
func (r *Reloader) NotAfter() time.Time {
	r.w.mu.Lock()
	defer r.w.mu.Unlock()
	return r.w.current.Leaf.NotAfter
}

// CAs is a pool of CA certificates as last read from a PEM file (one CA,
// or a bundle), read again whenever the file changes: a CA added to a
// trust bundle in place, before clients get certificates it signed, is
// trusted from the next handshake on without a restart. A bundle that
// does not load leaves the one before in use.
type CAs struct{ w watched[caBundle] }

type caBundle struct {
	pool *x509.CertPool
	n    int
}

// LoadCAs reads a PEM file of CA certificates. on, if set, hears of each
// change read later: how many certificates the file now holds, or why it
// could not be loaded.
func LoadCAs(file string, on func(certificates int, err error)) (*CAs, error) {
	c := &CAs{w: watched[caBundle]{files: []string{file}, read: func() (caBundle, error) { return readCAs(file) }}}
	if on != nil {
		c.w.on = func(b caBundle, err error) { on(b.n, err) }
	}
	if err := c.w.load(); err != nil {
		return nil, err
	}
	return c, nil
}

func readCAs(file string) (caBundle, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return caBundle{}, err
	}
	pool := x509.NewCertPool()
	n := 0
	for rest := b; ; {
		var block *pem.Block
		if block, rest = pem.Decode(rest); block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return caBundle{}, fmt.Errorf("CA file %s: certificate %d: %w", file, n+1, err)
		}
		pool.AddCert(c)
		n++
	}
	if n == 0 {
		return caBundle{}, fmt.Errorf("CA file %s: no PEM certificate in it", file)
	}
	return caBundle{pool: pool, n: n}, nil
}

// Pool is the CA certificates the file holds now, or the last that loaded.
func (c *CAs) Pool() *x509.CertPool { return c.w.get().pool }
