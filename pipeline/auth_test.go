package pipeline

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

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

// An embedded server that other machines reach, asking them for nothing,
// is named as the run starts; one that asks for a token is not.
func TestAnOpenEmbeddedServerBeyondThisMachineIsNamed(t *testing.T) {
	for _, token := range []string{"", "t0ken"} {
		cfg := testConfig(t)
		cfg.Listen, cfg.Steps, cfg.NATSAuth.Token = "0.0.0.0:0", 1, token
		var out bytes.Buffer
		cfg.Out, cfg.Quiet = &lockedWriter{w: &out}, false
		if err := Run(context.Background(), cfg); err != nil {
			t.Fatal(err)
		}
		if named := strings.Contains(out.String(), "asks clients for nothing"); named != (token == "") {
			t.Errorf("token %q: named %v; printed %q", token, named, out.String())
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
