package tlsfiles_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/natsjs/natstest"
	"github.com/wmrl/wmrl/connectors/tlsfiles"
)

// A pair that cannot be read is refused at the start, naming the files;
// later, a renewal is read once its files change, and a pair that does not
// load is said once while the one before stays in use.
func TestReloaderReadsRenewalsAndKeepsTheLastGoodPair(t *testing.T) {
	pki := natstest.NewPKI(t)
	if _, err := tlsfiles.Load(filepath.Join(t.TempDir(), "none.pem"), pki.ServerKey, nil); err == nil || !strings.Contains(err.Error(), "none.pem") {
		t.Errorf("a missing certificate: %v, want it named", err)
	}
	if _, err := tlsfiles.Load(pki.ServerCert, pki.ClientKey, nil); err == nil || !strings.Contains(err.Error(), "private key does not match public key") {
		t.Errorf("a key of another certificate: %v, want a mismatch", err)
	}
	var heard []error
	var renewals []time.Time
	r, err := tlsfiles.Load(pki.ServerCert, pki.ServerKey, func(until time.Time, err error) {
		if err != nil {
			heard = append(heard, err)
		} else {
			renewals = append(renewals, until)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	touch := func(at time.Duration) {
		for _, f := range []string{pki.ServerCert, pki.ServerKey} {
			if err := os.Chtimes(f, time.Now().Add(at), time.Now().Add(at)); err != nil {
				t.Fatal(err)
			}
		}
	}
	serial := func() string {
		c, err := r.GetCertificate(nil)
		if err != nil {
			t.Fatal(err)
		}
		return c.Leaf.SerialNumber.String()
	}
	first := serial()
	if serial() != first || len(renewals) != 0 {
		t.Fatalf("unchanged files were read again: %v", renewals)
	}
	renewed := pki.RenewServer()
	touch(time.Minute)
	if got := serial(); got != renewed.SerialNumber.String() || !r.NotAfter().Equal(renewed.NotAfter) {
		t.Fatalf("after the renewal: serial %s, expiry %v; want %s, %v", got, r.NotAfter(), renewed.SerialNumber, renewed.NotAfter)
	}
	if err := os.WriteFile(pki.ServerCert, []byte("half written"), 0o600); err != nil {
		t.Fatal(err)
	}
	touch(2 * time.Minute)
	for range 3 {
		if got := serial(); got != renewed.SerialNumber.String() {
			t.Fatalf("with a certificate that does not load: serial %s, want the one before, %s", got, renewed.SerialNumber)
		}
	}
	if len(renewals) != 1 || len(heard) != 1 {
		t.Errorf("heard %d renewals and %d failures (%v); want 1 and 1", len(renewals), len(heard), heard)
	}
}

// A client CA file that cannot be used is refused at the start, naming
// the file and what is wrong; a bundle is counted whole.
func TestCAsNameWhatIsWrongWithTheFile(t *testing.T) {
	pki, other := natstest.NewPKI(t), natstest.NewPKI(t)
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty.pem")
	broken := filepath.Join(dir, "broken.pem")
	bundle := filepath.Join(dir, "bundle.pem")
	ours, _ := os.ReadFile(pki.CA)
	theirs, _ := os.ReadFile(other.CA)
	for f, b := range map[string]string{
		empty:  "not PEM at all\n",
		broken: "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
		bundle: string(ours) + "# a comment between\n" + string(theirs),
	} {
		if err := os.WriteFile(f, []byte(b), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for f, want := range map[string]string{
		filepath.Join(dir, "none.pem"): "none.pem",
		empty:                          "no PEM certificate in it",
		broken:                         "broken.pem: certificate 1:",
	} {
		if _, err := tlsfiles.LoadCAs(f, nil); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", filepath.Base(f), err, want)
		}
	}
	cas, err := tlsfiles.LoadCAs(bundle, nil)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(cas.Pool().Subjects()); n != 2 { //nolint:staticcheck // not a system pool
		t.Errorf("the bundle gave %d CAs, want 2", n)
	}
}
