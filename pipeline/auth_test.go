package pipeline

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
	"github.com/wmrl/wmrl/schemas"
)

// On a server locked down as a shared cluster is (TLS under a CA of its
// own, a certificate asked of every client, a user of an account in
// operator mode), the pipeline runs with its credentials, and status
// reads the run with them.
func TestThePipelineRunsOnALockedDownServer(t *testing.T) {
	s := natstest.StartSecure(t, true)
	cfg := testConfig(t)
	cfg.NATSURL, cfg.Steps = s.URL, 3
	cfg.NATSAuth = natsjs.Auth{Creds: s.Creds, CA: s.CA, Cert: s.Cert, Key: s.Key}
	var fused atomic.Int64
	cfg.OnUpdate = func(schemas.Update, time.Duration) { fused.Add(1) }
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if n := fused.Load(); n != 3 {
		t.Fatalf("%d steps fused, want 3", n)
	}
	src := StreamSource{NATSURL: s.URL, Auth: cfg.NATSAuth, Prefix: cfg.Prefix}
	st, err := ReadStatus(ctx, src, cfg.Run)
	if err != nil {
		t.Fatal(err)
	}
	if st.LastUpdate == nil || st.LastUpdate.Step != 2 {
		t.Fatalf("status on the locked-down server: last update %+v, want step 2", st.LastUpdate)
	}
	src.Auth.Creds = ""
	if _, err := ReadStatus(ctx, src, cfg.Run); err == nil || !strings.Contains(err.Error(), "Authorization Violation") {
		t.Errorf("status without the credentials: %v, want an authorization violation", err)
	}
}

// A run's embedded server, given a certificate and a client CA, lets a
// stage on another machine in over TLS with a certificate of its own: the
// run's steps are fused only when that stage predicts them.
func TestAStageReachesTheEmbeddedServerOverTLS(t *testing.T) {
	pki := natstest.NewPKI(t)
	cfg := testConfig(t)
	cfg.Steps, cfg.NATSAuth.Token = 3, "t0ken"
	cfg.ListenTLS = natsjs.ServerTLS{Cert: pki.ServerCert, Key: pki.ServerKey, ClientCA: pki.CA}
	cfg.Stages = slices.DeleteFunc(slices.Clone(AllStages), func(s string) bool { return s == StagePredict })
	var fused atomic.Int64
	cfg.OnUpdate = func(schemas.Update, time.Duration) { fused.Add(1) }
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	run := started(t, ctx, cfg)
	if !strings.HasPrefix(run.URL(), "tls://") {
		t.Fatalf("the run's server is at %s, want a tls:// URL", run.URL())
	}
	auth := natsjs.Auth{Token: "t0ken", CA: pki.CA, Cert: pki.ClientCert, Key: pki.ClientKey}
	noCert := auth
	noCert.Cert, noCert.Key = "", ""
	noCA := auth
	noCA.CA = ""
	// The run waits for its predictions, so its server is up for these.
	for _, tc := range []struct {
		name string
		auth natsjs.Auth
		want string
	}{
		{"without a client certificate", noCert, "give --nats-cert and --nats-key"},
		{"without the CA", noCA, "give --nats-ca with the CA that signed the server's certificate"},
	} {
		if _, err := ReadStatus(ctx, StreamSource{NATSURL: run.URL(), Auth: tc.auth, Prefix: cfg.Prefix}, cfg.Run); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("status %s: %v, want it refused, saying %q", tc.name, err, tc.want)
		}
	}
	if _, err := ReadStatus(ctx, StreamSource{NATSURL: run.URL(), Auth: auth, Prefix: cfg.Prefix}, cfg.Run); err != nil {
		t.Errorf("status with a client certificate: %v", err)
	}
	stage := testConfig(t)
	stage.NATSURL, stage.Stages, stage.Source, stage.NATSAuth = run.URL(), []string{StagePredict}, SourceExternal, auth
	started(t, ctx, stage)
	if err := run.Wait(); err != nil {
		t.Fatal(err)
	}
	if n := fused.Load(); n != 3 {
		t.Fatalf("%d steps fused, want 3", n)
	}
}

// A start whose credentials the server refuses says so while it waits,
// and never prints the password of a URL.
func TestARefusedStartSaysWhyWithoutThePassword(t *testing.T) {
	srv, err := natsjs.StartServer(context.Background(), natsjs.ServerConfig{StoreDir: t.TempDir(), Listen: "127.0.0.1:0", Auth: natsjs.Auth{User: "trainer", Password: "right"}})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	cfg := testConfig(t)
	cfg.NATSURL = strings.Replace(srv.URL(), "nats://", "nats://trainer:wr0ng-pa55@", 1)
	cfg.StartupWait = 3 * time.Second
	var out bytes.Buffer
	cfg.Out, cfg.Quiet = &lockedWriter{w: &out}, false
	err = Run(context.Background(), cfg)
	said := out.String()
	if err != nil {
		said += err.Error()
	}
	if err == nil || !strings.Contains(said, "Authorization Violation") {
		t.Errorf("refused start: %v, printed %q; want it to name the authorization violation", err, said)
	}
	if strings.Contains(said, "wr0ng-pa55") {
		t.Errorf("the URL's password was printed: %q", said)
	}
}

// An embedded server that other machines reach is named as the run starts
// when it asks them for nothing, or asks for a secret without TLS.
func TestAnOpenEmbeddedServerBeyondThisMachineIsNamed(t *testing.T) {
	pki := natstest.NewPKI(t)
	tls := natsjs.ServerTLS{Cert: pki.ServerCert, Key: pki.ServerKey}
	verified := natsjs.ServerTLS{Cert: pki.ServerCert, Key: pki.ServerKey, ClientCA: pki.CA}
	for _, tc := range []struct {
		listen, token string
		tls           natsjs.ServerTLS
		want          string // "" when nothing is said
	}{
		{"0.0.0.0:0", "", natsjs.ServerTLS{}, "asks clients for nothing"},
		{"0.0.0.0:0", "", tls, "asks clients for nothing"},
		{"0.0.0.0:0", "t0ken", natsjs.ServerTLS{}, "without TLS: the token it asks for"},
		{"0.0.0.0:0", "t0ken", tls, ""},
		{"0.0.0.0:0", "", verified, ""},
		{"127.0.0.1:0", "", natsjs.ServerTLS{}, ""},
	} {
		cfg := testConfig(t)
		cfg.Listen, cfg.Steps, cfg.NATSAuth.Token, cfg.ListenTLS = tc.listen, 1, tc.token, tc.tls
		var out bytes.Buffer
		cfg.Out, cfg.Quiet = &lockedWriter{w: &out}, false
		if err := Run(context.Background(), cfg); err != nil {
			t.Fatal(err)
		}
		said := out.String()
		named := strings.Contains(said, "beyond this machine")
		if named != (tc.want != "") || !strings.Contains(said, tc.want) {
			t.Errorf("listen %s, token %q, TLS %+v: printed %q; want %q", tc.listen, tc.token, tc.tls, said, tc.want)
		}
	}
}

// A start against an address where no server answers says that, not only
// that its requests timed out.
func TestAStartWithNoServerSaysSo(t *testing.T) {
	cfg := testConfig(t)
	cfg.NATSURL = fmt.Sprintf("nats://127.0.0.1:%d", natstest.FreePort(t))
	cfg.StartupWait = 2 * time.Second
	err := Run(context.Background(), cfg)
	if err == nil || !strings.Contains(err.Error(), "no connection to the server yet") {
		t.Errorf("start with no server: %v, want it to say there is no connection", err)
	}
}

// A process that waits for input from outside says, once it consumes,
// where its server is and where trajectories go: silence would look hung.
func TestAProcessWaitingForInputSaysWhereItListens(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPAddr = SourceExternal, "127.0.0.1:0"
	var out syncBuffer
	cfg.Out, cfg.Quiet = &out, false
	run := started(t, ctx, cfg)
	want := fmt.Sprintf("ready: run default on the embedded NATS server at %s, stages %s; trajectories go to wmrl.default.traj (several at once, as a JSON array, to wmrl.default.trajs), step watermarks to wmrl.default.step; the trainer gateway is at %s\n",
		run.URL(), strings.Join(AllStages, ", "), run.HTTPURL())
	if out.String() != want {
		t.Errorf("the run printed %q, want %q", out.String(), want)
	}
	stage := testConfig(t)
	stage.NATSURL, stage.Stages, stage.Source = run.URL(), []string{StagePredict}, SourceExternal
	out.Reset()
	stage.Out, stage.Quiet = &out, false
	started(t, ctx, stage)
	if want := "ready: run default on NATS at " + run.URL() + ", stages predict\n"; out.String() != want {
		t.Errorf("a stage printed %q, want %q", out.String(), want)
	}
}

// The embedded server's certificate is exported with its expiry, pointed
// out at the start when it is near, and a renewal in place is taken up by
// the next connection, said and exported.
func TestARenewedListenCertificateIsSaidAndExported(t *testing.T) {
	pki := natstest.NewPKI(t) // certificates valid for a day: near
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := testConfig(t)
	cfg.Source, cfg.ListenTLS = SourceExternal, natsjs.ServerTLS{Cert: pki.ServerCert, Key: pki.ServerKey}
	var out syncBuffer
	cfg.Out, cfg.Quiet = &out, false
	run := started(t, ctx, cfg)
	first, err := tls.LoadX509KeyPair(pki.ServerCert, pki.ServerKey)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := testutil.ToFloat64(run.Metrics().CertNotAfter.WithLabelValues(certNATS)), float64(first.Leaf.NotAfter.Unix()); got != want {
		t.Errorf("wmrl_tls_cert_not_after_seconds{server=\"nats\"} %v at the start, want %v", got, want)
	}
	if !strings.Contains(out.String(), "the embedded NATS server's certificate (--listen-cert) expires at "+first.Leaf.NotAfter.UTC().Format(time.RFC3339)) {
		t.Errorf("a certificate a day from its expiry was not pointed out; printed %q", out.String())
	}
	renewed := pki.RenewServer()
	for _, f := range []string{pki.ServerCert, pki.ServerKey} {
		if err := os.Chtimes(f, time.Now().Add(time.Minute), time.Now().Add(time.Minute)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := ReadStatus(ctx, StreamSource{NATSURL: run.URL(), Auth: natsjs.Auth{CA: pki.CA}, Prefix: cfg.Prefix}, cfg.Run); err != nil {
		t.Fatal(err)
	}
	if want := "nats: the embedded server presents its renewed certificate, valid until " + renewed.NotAfter.UTC().Format(time.RFC3339) + "\n"; !strings.Contains(out.String(), want) {
		t.Errorf("printed %q, want %q", out.String(), want)
	}
	if got, want := testutil.ToFloat64(run.Metrics().CertNotAfter.WithLabelValues(certNATS)), float64(renewed.NotAfter.Unix()); got != want {
		t.Errorf("wmrl_tls_cert_not_after_seconds{server=\"nats\"} %v after the renewal, want %v", got, want)
	}
}

// A gateway that other machines reach is named when it asks for no token,
// or asks for one without TLS.
func TestAnOpenGatewayBeyondThisMachineIsNamed(t *testing.T) {
	for _, tc := range []struct {
		addr, token, cert string
		want              string
	}{
		{"0.0.0.0:8080", "", "", "asks for no token"},
		{"0.0.0.0:8080", "", "c.pem", "asks for no token"},
		{"0.0.0.0:8080", "t0ken", "", "without TLS: its bearer token"},
		{"0.0.0.0:8080", "t0ken", "c.pem", ""},
		{"127.0.0.1:8080", "", "", ""},
		{"localhost:8080", "", "", ""},
		{":8080", "", "", "asks for no token"}, // every interface
		{"", "", "", ""},
	} {
		c := Config{HTTPAddr: tc.addr, HTTPToken: tc.token, HTTPCert: tc.cert}
		if got := c.gatewayExposure(); (got == "") != (tc.want == "") || !strings.Contains(got, tc.want) {
			t.Errorf("gateway %q, token %q, cert %q: %q; want %q", tc.addr, tc.token, tc.cert, got, tc.want)
		}
	}
}

// The gateway's certificate, renewed in place, is presented to the next
// trainer that connects, said and exported.
func TestARenewedGatewayCertificateIsTakenUp(t *testing.T) {
	pki := natstest.NewPKI(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := testConfig(t)
	cfg.Source, cfg.HTTPAddr, cfg.HTTPCert, cfg.HTTPKey = SourceExternal, "127.0.0.1:0", pki.ServerCert, pki.ServerKey
	var out syncBuffer
	cfg.Out, cfg.Quiet = &out, false
	run := started(t, ctx, cfg)
	pool := x509.NewCertPool()
	pem, err := os.ReadFile(pki.CA)
	if err != nil || !pool.AppendCertsFromPEM(pem) {
		t.Fatalf("CA %s: %v", pki.CA, err)
	}
	served := func() *big.Int {
		t.Helper()
		// A client of its own each time: a new connection, a new handshake.
		c := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
		resp, err := c.Get(run.HTTPURL() + "/v1/runs/default/calibration")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.TLS.PeerCertificates[0].SerialNumber
	}
	first := served()
	// A TCP health check on the HTTPS port: its handshake error is the
	// pipeline's to print, not Go's default log's.
	probe, err := net.Dial("tcp", strings.TrimPrefix(run.HTTPURL(), "https://"))
	if err != nil {
		t.Fatal(err)
	}
	probe.Close()
	waitFor(t, 10*time.Second, func() bool {
		return strings.Contains(out.String(), "gateway: http: TLS handshake error from 127.0.0.1:")
	})
	renewed := pki.RenewServer()
	for _, f := range []string{pki.ServerCert, pki.ServerKey} {
		if err := os.Chtimes(f, time.Now().Add(time.Minute), time.Now().Add(time.Minute)); err != nil {
			t.Fatal(err)
		}
	}
	if got := served(); got.Cmp(renewed.SerialNumber) != 0 || got.Cmp(first) == 0 {
		t.Fatalf("after the renewal the gateway presented serial %v; want the new %v (the old was %v)", got, renewed.SerialNumber, first)
	}
	if want := "the trainer gateway presents its renewed certificate, valid until " + renewed.NotAfter.UTC().Format(time.RFC3339) + "\n"; !strings.Contains(out.String(), want) {
		t.Errorf("printed %q, want %q", out.String(), want)
	}
	if got, want := testutil.ToFloat64(run.Metrics().CertNotAfter.WithLabelValues(certGateway)), float64(renewed.NotAfter.Unix()); got != want {
		t.Errorf("wmrl_tls_cert_not_after_seconds{server=\"gateway\"} %v after the renewal, want %v", got, want)
	}
}
