package natsjs_test

import (
	"bufio"
	"context"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
)

// connect dials url presenting a, and says whether JetStream answers.
func connect(url string, a natsjs.Auth) error {
	opts, err := a.Options()
	if err != nil {
		return err
	}
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	_, err = js.AccountInfo(context.Background())
	return err
}

// A locked-down server lets in the client that presents everything it
// asks for, and no client that leaves one thing out.
func TestSecuredServersLetInOnlyWhoPresentsWhatTheyAsk(t *testing.T) {
	for _, withCreds := range []bool{true, false} {
		s := natstest.StartSecure(t, withCreds)
		all := natsjs.Auth{Creds: s.Creds, NKey: s.NKey, CA: s.CA, Cert: s.Cert, Key: s.Key}
		if err := connect(s.URL, all); err != nil {
			t.Fatalf("creds %v: everything presented: %v", withCreds, err)
		}
		noUser := all
		noUser.Creds, noUser.NKey = "", ""
		noCA := all
		noCA.CA = ""
		noCert := all
		noCert.Cert, noCert.Key = "", ""
		for name, a := range map[string]natsjs.Auth{"no user": noUser, "no CA": noCA, "no client certificate": noCert} {
			if err := connect(s.URL, a); err == nil {
				t.Errorf("creds %v, %s: let in", withCreds, name)
			}
		}
	}
}

// The embedded server asks every client for the user and password, or
// the token, it was given, its own in-process connections included.
func TestTheEmbeddedServerAsksForItsUserOrToken(t *testing.T) {
	for _, a := range []natsjs.Auth{{User: "trainer", Password: "s3cret"}, {Token: "t0ken"}} {
		srv, err := natsjs.StartServer(context.Background(), natsjs.ServerConfig{StoreDir: t.TempDir(), Listen: "127.0.0.1:0", Auth: a})
		if err != nil {
			t.Fatal(err)
		}
		nc, err := srv.Connect("own")
		if err != nil {
			t.Errorf("%+v: its own connection: %v", a, err)
		} else {
			nc.Close()
		}
		if err := connect(srv.URL(), a); err != nil {
			t.Errorf("%+v: a client with it: %v", a, err)
		}
		if err := connect(srv.URL(), natsjs.Auth{}); err == nil || !strings.Contains(err.Error(), "Authorization Violation") {
			t.Errorf("%+v: a client without it: %v, want an authorization violation", a, err)
		}
		srv.Shutdown()
	}
}

// Given a certificate, the embedded server speaks TLS to every client that
// comes over the network, and with a client CA asks each for a
// certificate that CA signed; its own in-process connections need neither.
func TestTheEmbeddedServerSpeaksTLSWhenGivenACertificate(t *testing.T) {
	pki := natstest.NewPKI(t)
	for _, verify := range []bool{false, true} {
		tls := natsjs.ServerTLS{Cert: pki.ServerCert, Key: pki.ServerKey}
		if verify {
			tls.ClientCA = pki.CA
		}
		token := natsjs.Auth{Token: "t0ken"}
		srv, err := natsjs.StartServer(context.Background(), natsjs.ServerConfig{StoreDir: t.TempDir(), Listen: "127.0.0.1:0", Auth: token, TLS: tls})
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(srv.URL(), "tls://127.0.0.1:") {
			t.Errorf("verify %v: URL %s, want tls://127.0.0.1:port", verify, srv.URL())
		}
		if info := firstLine(t, strings.TrimPrefix(srv.URL(), "tls://")); !strings.Contains(info, `"tls_required":true`) {
			t.Errorf("verify %v: the server's INFO %s does not require TLS", verify, info)
		}
		nc, err := srv.Connect("own")
		if err != nil {
			t.Errorf("verify %v: its own connection: %v", verify, err)
		} else {
			nc.Close()
		}
		withCert := natsjs.Auth{Token: token.Token, CA: pki.CA, Cert: pki.ClientCert, Key: pki.ClientKey}
		if err := connect(srv.URL(), withCert); err != nil {
			t.Errorf("verify %v: a client with the CA, a certificate and the token: %v", verify, err)
		}
		noCA := withCert
		noCA.CA = ""
		if err := connect(srv.URL(), noCA); err == nil || !strings.Contains(err.Error(), "certificate") {
			t.Errorf("verify %v: a client that does not trust the server's CA: %v, want a certificate error", verify, err)
		}
		noCert := withCert
		noCert.Cert, noCert.Key = "", ""
		if err := connect(srv.URL(), noCert); (err == nil) == verify {
			t.Errorf("verify %v: a client without a certificate of its own: %v", verify, err)
		}
		noToken := withCert
		noToken.Token = ""
		if err := connect(srv.URL(), noToken); err == nil || !strings.Contains(err.Error(), "Authorization Violation") {
			t.Errorf("verify %v: a client without the token: %v, want an authorization violation", verify, err)
		}
		srv.Shutdown()
	}
}

// The embedded server reads its certificate again when the files change:
// a renewal serves the next connection without a restart, and a pair that
// does not load is said once and leaves the one before in use.
func TestARenewedCertificateServesTheNextConnection(t *testing.T) {
	pki := natstest.NewPKI(t)
	var mu sync.Mutex
	var expiries []time.Time
	var failures []error
	srv, err := natsjs.StartServer(context.Background(), natsjs.ServerConfig{
		StoreDir: t.TempDir(), Listen: "127.0.0.1:0", TLS: natsjs.ServerTLS{Cert: pki.ServerCert, Key: pki.ServerKey},
		OnCertificate: func(notAfter time.Time, err error) {
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failures = append(failures, err)
			} else {
				expiries = append(expiries, notAfter)
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	served := func() *big.Int {
		t.Helper()
		opts, err := natsjs.Auth{CA: pki.CA}.Options()
		if err != nil {
			t.Fatal(err)
		}
		nc, err := nats.Connect(srv.URL(), opts...)
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		st, err := nc.TLSConnectionState()
		if err != nil {
			t.Fatal(err)
		}
		return st.PeerCertificates[0].SerialNumber
	}
	// Modification times a minute apart, whatever the file system's
	// resolution.
	touch := func(at time.Duration) {
		for _, f := range []string{pki.ServerCert, pki.ServerKey} {
			if err := os.Chtimes(f, time.Now().Add(at), time.Now().Add(at)); err != nil {
				t.Fatal(err)
			}
		}
	}
	first := served()
	renewed := pki.RenewServer()
	touch(time.Minute)
	if got := served(); got.Cmp(renewed.SerialNumber) != 0 || got.Cmp(first) == 0 {
		t.Fatalf("after the renewal the server presented serial %v; want the new %v (the old was %v)", got, renewed.SerialNumber, first)
	}
	if err := os.WriteFile(pki.ServerKey, []byte("half written"), 0o600); err != nil {
		t.Fatal(err)
	}
	touch(2 * time.Minute)
	for range 2 {
		if got := served(); got.Cmp(renewed.SerialNumber) != 0 {
			t.Fatalf("with a key that does not load the server presented serial %v; want the one before, %v", got, renewed.SerialNumber)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(expiries) != 1 || !expiries[0].Equal(renewed.NotAfter) {
		t.Errorf("renewals heard: %v; want one, valid until %v", expiries, renewed.NotAfter)
	}
	if len(failures) != 1 {
		t.Errorf("failed loads heard: %v; want one, for two connections", failures)
	}
}

// The embedded server reads its client CA file again when it changes: a
// CA added to the bundle in place admits its clients from the next
// connection on, and a bundle that does not load is said once while the
// CAs before stay trusted.
func TestAClientCAAddedInPlaceIsTrustedByTheNextConnection(t *testing.T) {
	pki, other := natstest.NewPKI(t), natstest.NewPKI(t)
	bundle := filepath.Join(t.TempDir(), "client-ca.pem")
	write := func(at time.Duration, files ...string) {
		t.Helper()
		var b []byte
		for _, f := range files {
			c, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			b = append(b, c...)
		}
		if len(files) == 0 {
			b = []byte("-----BEGIN CERTIFICATE-----\nhalf written")
		}
		if err := os.WriteFile(bundle, b, 0o600); err != nil {
			t.Fatal(err)
		}
		// Modification times a minute apart, whatever the file system's
		// resolution.
		if err := os.Chtimes(bundle, time.Now().Add(at), time.Now().Add(at)); err != nil {
			t.Fatal(err)
		}
	}
	write(0, pki.CA)
	var mu sync.Mutex
	var counts []int
	var failures []error
	srv, err := natsjs.StartServer(context.Background(), natsjs.ServerConfig{
		StoreDir: t.TempDir(), Listen: "127.0.0.1:0", TLS: natsjs.ServerTLS{Cert: pki.ServerCert, Key: pki.ServerKey, ClientCA: bundle},
		OnClientCA: func(n int, err error) {
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failures = append(failures, err)
			} else {
				counts = append(counts, n)
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	ours := natsjs.Auth{CA: pki.CA, Cert: pki.ClientCert, Key: pki.ClientKey}
	theirs := natsjs.Auth{CA: pki.CA, Cert: other.ClientCert, Key: other.ClientKey} // signed by the other CA
	if err := connect(srv.URL(), ours); err != nil {
		t.Fatalf("a client of the trusted CA: %v", err)
	}
	if err := connect(srv.URL(), theirs); err == nil {
		t.Fatal("a client of a CA not in the bundle was admitted")
	}
	write(time.Minute, pki.CA, other.CA)
	for _, a := range []natsjs.Auth{ours, theirs} {
		if err := connect(srv.URL(), a); err != nil {
			t.Errorf("after the other CA was added to the bundle, client %s: %v", a.Cert, err)
		}
	}
	write(2 * time.Minute)
	for range 2 {
		for _, a := range []natsjs.Auth{ours, theirs} {
			if err := connect(srv.URL(), a); err != nil {
				t.Errorf("with a bundle that does not load, client %s: %v; want the CAs before trusted", a.Cert, err)
			}
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(counts, []int{2}) {
		t.Errorf("changes heard: %v; want one, of 2 CAs", counts)
	}
	if len(failures) != 1 || !strings.Contains(failures[0].Error(), bundle) {
		t.Errorf("failed loads heard: %v; want one naming %s, for four connections", failures, bundle)
	}
}

// firstLine is what a server at addr says first to a client over TCP.
func firstLine(t *testing.T, addr string) string {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	return line
}

func TestServerTLSNamesWhatDoesNotGoTogether(t *testing.T) {
	pki := natstest.NewPKI(t)
	notPEM := filepath.Join(t.TempDir(), "cert.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		tls  natsjs.ServerTLS
		want string
	}{
		{natsjs.ServerTLS{Cert: pki.ServerCert}, "the server's certificate needs its key"},
		{natsjs.ServerTLS{Key: pki.ServerKey}, "the server's certificate needs its key"},
		{natsjs.ServerTLS{ClientCA: pki.CA}, "a CA for client certificates needs the server's own certificate"},
		{natsjs.ServerTLS{Cert: "/no/such/cert.pem", Key: pki.ServerKey}, "server certificate: open /no/such/cert.pem"},
		{natsjs.ServerTLS{Cert: notPEM, Key: pki.ServerKey}, "embedded server's TLS: error parsing X509 certificate/key pair"},
	} {
		_, err := natsjs.StartServer(context.Background(), natsjs.ServerConfig{StoreDir: t.TempDir(), Listen: "127.0.0.1:0", TLS: tc.tls})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.tls, err, tc.want)
		}
	}
}

func TestAuthNamesWhatDoesNotGoTogether(t *testing.T) {
	for _, tc := range []struct {
		a    natsjs.Auth
		want string
	}{
		{natsjs.Auth{Token: "x", User: "u"}, "a token and a user"},
		{natsjs.Auth{Password: "p"}, "a password without a user"},
		{natsjs.Auth{Creds: "a", NKey: "b"}, "a credentials file and an NKey seed"},
		{natsjs.Auth{Cert: "c"}, "a client certificate needs its key"},
		{natsjs.Auth{CA: "/no/such/ca.pem"}, "NATS CA: open /no/such/ca.pem"},
	} {
		if _, err := tc.a.Options(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.a, err, tc.want)
		}
	}
}

// A password or token in a URL never reaches what is printed.
func TestRedactHidesUserInfo(t *testing.T) {
	for in, want := range map[string]string{
		"nats://u:p4ss@h:4222":                     "nats://***@h:4222",
		"tls://t0ken@a:1, nats://b:2,nats://u:p@c": "tls://***@a:1,nats://b:2,nats://***@c",
		"nats://127.0.0.1:4222":                    "nats://127.0.0.1:4222",
		"127.0.0.1:4222":                           "127.0.0.1:4222",
		"u:p@h:4222":                               "***@h:4222",
		"nats://u:pa/ss@h":                         "nats://***@h",
	} {
		if got := natsjs.Redact(in); got != want {
			t.Errorf("Redact(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestLoopbackTellsWhatOnlyThisMachineReaches(t *testing.T) {
	for listen, want := range map[string]bool{
		"": true, "127.0.0.1:4222": true, ":4222": true, "localhost:0": true, "[::1]:4222": true, "127.0.0.2:1": true,
		"0.0.0.0:4222": false, "10.1.2.3:4222": false, "[::]:4222": false, "trainer-7:4222": false,
	} {
		if got := natsjs.Loopback(listen); got != want {
			t.Errorf("Loopback(%q) = %v, want %v", listen, got, want)
		}
	}
}
