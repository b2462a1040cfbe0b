package natstest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"
)

// Secure is a JetStream server locked down as a shared cluster is: TLS
// under a CA of its own, a certificate required of every client, and a
// user who proves who it is with a credentials file (the server in
// operator mode, accounts in JWTs) or with an NKey.
type Secure struct {
	URL string
	// CA, Cert and Key are PEM files: the CA that signed the server's
	// certificate, and a client certificate it signed, with its key.
	CA, Cert, Key string
	// Creds (operator mode) or NKey (a seed file): the user's proof.
	Creds, NKey string
}

// StartSecure runs a Secure server for the test; withCreds picks a
// credentials file, else an NKey.
func StartSecure(t testing.TB, withCreds bool) *Secure {
	t.Helper()
	dir := t.TempDir()
	pki := NewPKI(t)
	s := &Secure{CA: pki.CA, Cert: pki.ClientCert, Key: pki.ClientKey}
	tlsConfig, err := server.GenTLSConfig(&server.TLSConfigOpts{CertFile: pki.ServerCert, KeyFile: pki.ServerKey, CaFile: s.CA, Verify: true})
	if err != nil {
		t.Fatal(err)
	}
	opts := &server.Options{
		ServerName: "secure", Host: "127.0.0.1", Port: FreePort(t),
		JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true,
		TLS: true, TLSVerify: true, TLSConfig: tlsConfig, TLSTimeout: 5,
	}
	if withCreds {
		s.Creds = filepath.Join(dir, "user.creds")
		operatorMode(t, opts, s.Creds)
	} else {
		s.NKey = filepath.Join(dir, "user.nk")
		user := must(t, nkeys.CreateUser)
		pub := must(t, user.PublicKey)
		writeFile(t, s.NKey, must(t, user.Seed))
		opts.Nkeys = []*server.NkeyUser{{Nkey: pub}}
	}
	n := &Node{Opts: opts}
	n.Start(t)
	t.Cleanup(n.Stop)
	s.URL = fmt.Sprintf("tls://127.0.0.1:%d", opts.Port)
	return s
}

// PKI is a test's certificate authority and what it signed, as PEM
// files: a certificate for a server on 127.0.0.1 and one for a client,
// each with its key.
type PKI struct {
	CA                    string
	ServerCert, ServerKey string
	ClientCert, ClientKey string

	t     testing.TB
	ca    *x509.Certificate
	caKey *ecdsa.PrivateKey
}

// NewPKI makes a CA in a temporary directory and signs a server's and a
// client's certificate with it.
func NewPKI(t testing.TB) *PKI {
	t.Helper()
	dir := t.TempDir()
	p := &PKI{
		CA:         filepath.Join(dir, "ca.pem"),
		ServerCert: filepath.Join(dir, "server.pem"), ServerKey: filepath.Join(dir, "server-key.pem"),
		ClientCert: filepath.Join(dir, "client.pem"), ClientKey: filepath.Join(dir, "client-key.pem"),
	}
	p.t = t
	p.ca, p.caKey = certificate(t, nil, nil, "wmrl test CA", p.CA, "")
	p.RenewServer()
	certificate(t, p.ca, p.caKey, "wmrl client", p.ClientCert, p.ClientKey)
	return p
}

// RenewServer writes a new certificate and key for the server over the
// old files, and returns the certificate.
func (p *PKI) RenewServer() *x509.Certificate {
	cert, _ := certificate(p.t, p.ca, p.caKey, "127.0.0.1", p.ServerCert, p.ServerKey)
	return cert
}

// operatorMode trusts a new operator whose account may use JetStream,
// and writes the credentials of one of its users to creds.
func operatorMode(t testing.TB, opts *server.Options, creds string) {
	operator := must(t, nkeys.CreateOperator)
	claims := jwt.NewOperatorClaims(must(t, operator.PublicKey))
	oc, err := jwt.DecodeOperatorClaims(encode(t, claims, operator))
	if err != nil {
		t.Fatal(err)
	}
	resolver := &server.MemAccResolver{}
	newAccount := func(js bool) (nkeys.KeyPair, string) {
		kp := must(t, nkeys.CreateAccount)
		pub := must(t, kp.PublicKey)
		ac := jwt.NewAccountClaims(pub)
		if js {
			ac.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
		}
		if err := resolver.Store(pub, encode(t, ac, operator)); err != nil {
			t.Fatal(err)
		}
		return kp, pub
	}
	_, system := newAccount(false)
	account, _ := newAccount(true)
	user := must(t, nkeys.CreateUser)
	userJWT := encode(t, jwt.NewUserClaims(must(t, user.PublicKey)), account)
	file, err := jwt.FormatUserConfig(userJWT, must(t, user.Seed))
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, creds, file)
	opts.TrustedOperators = []*jwt.OperatorClaims{oc}
	opts.AccountResolver = resolver
	opts.SystemAccount = system
}

func encode(t testing.TB, c interface {
	Encode(nkeys.KeyPair) (string, error)
}, signer nkeys.KeyPair) string {
	s, err := c.Encode(signer)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// certificate writes a certificate for name (PEM) to certFile, signed by
// parent, or self-signed as a CA when parent is nil, and its key to
// keyFile unless that is empty.
func certificate(t testing.TB, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, name, certFile, keyFile string) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	if ip := net.ParseIP(name); ip != nil {
		tmpl.IPAddresses = []net.IP{ip}
	}
	signer, signerKey := parent, parentKey
	if parent == nil {
		tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
		tmpl.KeyUsage |= x509.KeyUsageCertSign
		signer, signerKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, signer, &key.PublicKey, signerKey)
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	if keyFile != "" {
		b, err := x509.MarshalECPrivateKey(key)
		if err != nil {
			t.Fatal(err)
		}
		writeFile(t, keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: b}))
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

func writeFile[T string | []byte](t testing.TB, path string, data T) {
	t.Helper()
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
}

func must[T any](t testing.TB, f func() (T, error)) T {
	t.Helper()
	v, err := f()
	if err != nil {
		t.Fatal(err)
	}
	return v
}
