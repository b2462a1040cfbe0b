package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/wmrl/wmrl/connectors/natsjs"
)

// storeLimit holds the run's account at a store limit of 1 byte, so that
// every write is refused, and lifts it.
type storeLimit interface {
	hold() error
	lift() error
}

// embeddedLimit is the embedded server's account limit, set in place.
type embeddedLimit struct{ srv *natsjs.Server }

func (l embeddedLimit) hold() error { return l.srv.LimitAccountStore(1) }
func (l embeddedLimit) lift() error { return l.srv.LimitAccountStore(l.srv.StoreLimit()) }

// accountFile is the limit of the account the rehearsal's nats-servers
// give their one user (an operator's per-user limit on a shared NATS):
// the file every node's configuration includes, written anew and read
// again by each running node on SIGHUP. A node started meanwhile reads
// the file as it is. nats-server lets a reload lower an account's limit,
// where it refuses to lower a server's max_file_store.
type accountFile struct {
	path     string
	password string
	// pidFiles are the nodes' pid files (pid_file in their configurations).
	pidFiles []string
}

// chaosUser is the account's one user.
const chaosUser = "wmrl"

// newAccountFile writes the account's file in dir, unlimited, with a
// password made here.
func newAccountFile(dir string) (*accountFile, error) {
	pw := make([]byte, 12)
	if _, err := rand.Read(pw); err != nil {
		return nil, err
	}
	a := &accountFile{path: filepath.Join(dir, "account.conf"), password: hex.EncodeToString(pw)}
	return a, a.write(-1)
}

// include is what a node's configuration adds: the account, and where its
// pid goes (one of pidFiles).
func (a *accountFile) include(pidFile string) string {
	return fmt.Sprintf("pid_file: %q\ninclude %q\n", pidFile, filepath.Base(a.path))
}

// url is a client URL of host:port with the account's user in it.
func (a *accountFile) url(hostPort string) string {
	return fmt.Sprintf("nats://%s:%s@%s", chaosUser, a.password, hostPort)
}

func (a *accountFile) write(maxFile int64) error {
	text := fmt.Sprintf("# Written by the rehearsal: the run's account, its store limit (-1: none).\n"+
		"accounts { WMRL { users: [{user: %q, password: %q}], jetstream { max_file: %d, max_mem: -1 } } }\n",
		chaosUser, a.password, maxFile)
	tmp := a.path + ".tmp"
	if err := os.WriteFile(tmp, []byte(text), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, a.path)
}

func (a *accountFile) hold() error { return a.reload(1) }
func (a *accountFile) lift() error { return a.reload(-1) }

// reload writes the limit and has every running node read it again. A
// node that is down (killed, starting again) reads it as it starts.
func (a *accountFile) reload(maxFile int64) error {
	if err := a.write(maxFile); err != nil {
		return err
	}
	var errs []error
	for _, f := range a.pidFiles {
		if err := hangUp(f); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// hangUp sends SIGHUP (reload) to the nats-server whose pid the file
// holds, if it runs: a node killed by SIGKILL leaves its pid file behind,
// and the pid may be another process's by now.
func hangUp(pidFile string) error {
	b, err := os.ReadFile(pidFile)
	if errors.Is(err, os.ErrNotExist) {
		return nil // not started yet
	}
	if err != nil {
		return err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return fmt.Errorf("%s: %w", pidFile, err)
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || !strings.Contains(string(cmdline), "nats-server") {
		return nil // gone
	}
	if err := syscall.Kill(pid, syscall.SIGHUP); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("reload nats-server %d: %w", pid, err)
	}
	return nil
}

// fillStore holds the run's account at a store limit of 1 byte (every
// write refused: the stages' outputs, the leases' renewals, the trainer's
// trajectories) for 5 to 40 s, every 30 to 90 s, for d, and returns how
// often. The longest holds outlast the leases' 30 s TTL, and a failing
// message's deliveries. The limit is lifted whenever it returns.
func fillStore(ctx context.Context, l storeLimit, d time.Duration, rng *mrand.Rand) int {
	end := time.Now().Add(d)
	n := 0
	lift := func() {
		if err := l.lift(); err != nil {
			say("store: %v", err)
		}
	}
	defer lift()
	for {
		wait := 30*time.Second + time.Duration(rng.Int64N(int64(60*time.Second)))
		hold := 5*time.Second + time.Duration(rng.Int64N(int64(35*time.Second)))
		if time.Now().Add(wait+hold).After(end) || sleepCtx(ctx, wait) != nil {
			return n
		}
		if err := l.hold(); err != nil {
			say("store: %v", err)
			return n
		}
		n++
		say("store full %d: every write refused for %v", n, hold.Round(time.Second))
		if sleepCtx(ctx, hold) != nil {
			return n
		}
		lift()
		say("store full %d: room again", n)
	}
}
