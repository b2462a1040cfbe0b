package natsjs

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/nats-io/nats.go"
)

// Auth is what a NATS server may ask of a client: a user and password or
// a token, a credentials file or an NKey seed, and TLS. The zero Auth
// asks nothing.
type Auth struct {
	// User and Password, or Token. A URL's own user info (nats://u:p@host)
	// works too; these keep the secret out of the command line.
	User, Password, Token string
	// Creds is a user credentials file (a JWT and its NKey seed, as nsc
	// writes them); NKey is a file holding a user's NKey seed.
	Creds, NKey string
	// CA is a PEM file of the authority that signed the server's
	// certificate (default: the system's); Cert and Key are this client's
	// certificate and key, for a server that verifies its clients.
	CA, Cert, Key string
}

// AuthFromEnv reads the secrets of an Auth from WMRL_NATS_USER,
// WMRL_NATS_PASSWORD and WMRL_NATS_TOKEN.
func AuthFromEnv() Auth {
	return Auth{User: os.Getenv("WMRL_NATS_USER"), Password: os.Getenv("WMRL_NATS_PASSWORD"), Token: os.Getenv("WMRL_NATS_TOKEN")}
}

// ForClient says whether a sets anything only a client uses: a
// credentials file, an NKey seed or TLS.
func (a Auth) ForClient() bool {
	return a.Creds != "" || a.NKey != "" || a.CA != "" || a.Cert != "" || a.Key != ""
}

// Check names what does not go together, and files that cannot be read.
func (a Auth) Check() error {
	var errs []error
	if a.Token != "" && (a.User != "" || a.Password != "") {
		errs = append(errs, errors.New("a token and a user: give one of them"))
	}
	if a.Password != "" && a.User == "" {
		errs = append(errs, errors.New("a password without a user"))
	}
	if a.Creds != "" && a.NKey != "" {
		errs = append(errs, errors.New("a credentials file and an NKey seed: give one of them"))
	}
	if (a.Cert == "") != (a.Key == "") {
		errs = append(errs, errors.New("a client certificate needs its key, and a key its certificate"))
	}
	errs = append(errs, unreadable("NATS ", []namedFile{
		{"credentials file", a.Creds}, {"NKey seed", a.NKey}, {"CA", a.CA},
		{"client certificate", a.Cert}, {"client key", a.Key},
	})...)
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("natsjs: %w", err)
	}
	return nil
}

// namedFile is a file a flag gave, with what it is meant to hold.
type namedFile struct{ what, path string }

// unreadable names each given file that cannot be read.
func unreadable(prefix string, files []namedFile) []error {
	var errs []error
	for _, f := range files {
		if f.path == "" {
			continue
		}
		if _, err := os.ReadFile(f.path); err != nil {
			errs = append(errs, fmt.Errorf("%s%s: %w", prefix, f.what, err))
		}
	}
	return errs
}

// Options are the nats.go options that present a to the server.
func (a Auth) Options() ([]nats.Option, error) {
	if err := a.Check(); err != nil {
		return nil, err
	}
	var opts []nats.Option
	switch {
	case a.Token != "":
		opts = append(opts, nats.Token(a.Token))
	case a.User != "":
		opts = append(opts, nats.UserInfo(a.User, a.Password))
	}
	switch {
	case a.Creds != "":
		opts = append(opts, nats.UserCredentials(a.Creds))
	case a.NKey != "":
		o, err := nats.NkeyOptionFromSeed(a.NKey)
		if err != nil {
			return nil, fmt.Errorf("natsjs: NKey seed %s: %w", a.NKey, err)
		}
		opts = append(opts, o)
	}
	if a.CA != "" {
		opts = append(opts, nats.RootCAs(a.CA))
	}
	if a.Cert != "" {
		opts = append(opts, nats.ClientCert(a.Cert, a.Key))
	}
	return opts, nil
}

// Redact hides the user info of every URL in a comma-separated list, so
// that a password or token given in a URL does not reach a log:
// nats://u:p@host:4222 is printed nats://***@host:4222. NATS URLs have no
// path, so everything before the last '@' is user info, escaped or not.
func Redact(urls string) string {
	parts := strings.Split(urls, ",")
	for i, p := range parts {
		p = strings.TrimSpace(p)
		scheme, rest, ok := strings.Cut(p, "://")
		if !ok {
			scheme, rest = "", p
		}
		if at := strings.LastIndex(rest, "@"); at >= 0 {
			rest = "***@" + rest[at+1:]
		}
		if ok {
			rest = scheme + "://" + rest
		}
		parts[i] = rest
	}
	return strings.Join(parts, ",")
}
