package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/wmrl/wmrl/connectors/natsjs"
)

// cast is the processes of the rehearsal, each logging to a file of its
// own (every start appends to it).
type cast struct {
	dir   string
	names []string
	procs map[string]*proc
}

type proc struct {
	args []string
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited
	// started: when cmd was; quick: how many times in a row it ended by
	// itself within quickExit of that.
	started time.Time
	quick   int
	// killed: this rehearsal stopped it; an exit otherwise is the
	// process's own, and it is started again.
	killed bool
	// machine: the machine it runs as on (natsjs.MachineEnv), for wmrl's
	// processes: a process judges whether a lease's holder still runs
	// only on its own machine.
	machine string
}

func (c *cast) add(name string, args []string) {
	if c.procs == nil {
		c.procs = map[string]*proc{}
	}
	c.names = append(c.names, name)
	c.procs[name] = &proc{args: args}
}

func (c *cast) startAll() error {
	if err := os.MkdirAll(filepath.Join(c.dir, "logs"), 0o755); err != nil {
		return err
	}
	for _, n := range c.names {
		if err := c.start(n); err != nil {
			return err
		}
	}
	return nil
}

func (c *cast) start(name string) error {
	p := c.procs[name]
	log, err := os.OpenFile(filepath.Join(c.dir, "logs", name+".log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	fmt.Fprintf(log, "=== started %s\n", time.Now().Format(time.RFC3339))
	cmd := exec.Command(p.args[0], p.args[1:]...)
	cmd.Stdout, cmd.Stderr = log, log
	if p.machine != "" {
		cmd.Env = append(os.Environ(), natsjs.MachineEnv+"="+p.machine)
	}
	// A rehearsal that is killed stops its processes too, rather than
	// leave them running on its --dir (the next one's, maybe).
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		log.Close()
		return fmt.Errorf("%s: %w", name, err)
	}
	p.cmd, p.done, p.killed, p.started = cmd, make(chan struct{}), false, time.Now()
	go func(done chan struct{}) {
		_ = cmd.Wait()
		log.Close()
		close(done)
	}(p.done)
	return nil
}

func exited(p *proc) bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// restartExited starts again a process that ended by itself (a stage
// that stopped on an error, a trainer that failed), as a supervisor
// would, and says so; one that ends as it starts (a wrong flag, a bug),
// quickTries times in a row, ends the rehearsal instead.
func (c *cast) restartExited() error {
	for _, n := range c.names {
		p := c.procs[n]
		if p.killed || !exited(p) {
			continue
		}
		if err := c.quickExit(n); err != nil {
			return err
		}
		say("%s ended by itself (%s); starting it again", n, p.cmd.ProcessState)
		if err := c.start(n); err != nil {
			return err
		}
	}
	return nil
}

const (
	quickExit  = 3 * time.Second
	quickTries = 5
)

// quickExit counts an exit of name within quickExit of its start, and
// fails once it is the quickTries-th in a row, with the end of its log.
func (c *cast) quickExit(name string) error {
	p := c.procs[name]
	if time.Since(p.started) > quickExit {
		p.quick = 0
		return nil
	}
	if p.quick++; p.quick < quickTries {
		return nil
	}
	log := filepath.Join(c.dir, "logs", name+".log")
	b, _ := os.ReadFile(log)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return fmt.Errorf("%s ended by itself within %v of its start %d times in a row (%s); the end of %s:\n%s",
		name, quickExit, p.quick, p.cmd.ProcessState, log, strings.Join(lines[max(0, len(lines)-5):], "\n"))
}

// signal sends sig to a process and waits for it to end: 40 s, then
// SIGKILL, for a SIGTERM.
func (c *cast) signal(name string, sig syscall.Signal) {
	p := c.procs[name]
	if exited(p) {
		return
	}
	p.killed = true
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(40 * time.Second):
		say("%s did not stop within 40s of %s; killing it", name, sigName[sig])
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

var sigName = map[syscall.Signal]string{syscall.SIGKILL: "SIGKILL", syscall.SIGTERM: "SIGTERM"}

// kill stops a random process every 5 to 20 s for d, and starts it again
// 0.5 to 3 s later; every fourth is one of servers, when there are any.
// It returns how many it stopped.
func (c *cast) kill(ctx context.Context, d time.Duration, rng, moves *rand.Rand, servers []string) (int, error) {
	others := slices.DeleteFunc(slices.Clone(c.names), func(n string) bool { return slices.Contains(servers, n) })
	end := time.Now().Add(d)
	kills := 0
	for time.Now().Before(end) {
		next := time.Now().Add(5*time.Second + time.Duration(rng.Int64N(int64(15*time.Second))))
		for time.Now().Before(next) {
			if err := sleepCtx(ctx, 500*time.Millisecond); err != nil {
				return kills, err
			}
			if err := c.restartExited(); err != nil {
				return kills, err
			}
		}
		name := others[rng.IntN(len(others))]
		switch {
		case len(servers) == 1 && kills%4 == 3:
			name = servers[0]
		case len(servers) > 1 && kills%4 == 3:
			name = servers[rng.IntN(len(servers))]
		}
		sig := syscall.SIGKILL
		if rng.Float64() < 0.3 {
			sig = syscall.SIGTERM
		}
		c.signal(name, sig)
		kills++
		p, moved := c.procs[name], ""
		// Half the wmrl processes killed start again on another machine,
		// as a pod rescheduled: their successor there, and the stage's
		// other process, wait out the killed one's lease; on its own
		// machine it takes over at once.
		if p.machine != "" && moves.Float64() < 0.5 {
			p.machine = fmt.Sprintf("%s-after-kill-%d", name, kills)
			moved = "; starts again on another machine"
		}
		say("kill %d: %s, %s (%s)%s", kills, name, sigName[sig], p.cmd.ProcessState, moved)
		if err := sleepCtx(ctx, 500*time.Millisecond+time.Duration(rng.Int64N(int64(2500*time.Millisecond)))); err != nil {
			return kills, err
		}
		if err := c.start(name); err != nil {
			return kills, err
		}
	}
	return kills, nil
}

// waitFor waits for name to end with status 0, starting it again when it
// fails.
func (c *cast) waitFor(ctx context.Context, name string, limit time.Duration) error {
	return c.whileWaiting(ctx, limit, func() (bool, error) {
		p := c.procs[name]
		if !exited(p) {
			return false, nil
		}
		if p.cmd.ProcessState.Success() {
			p.killed = true // done, not to be started again
			return true, nil
		}
		if err := c.quickExit(name); err != nil {
			return false, err
		}
		say("%s ended (%s); starting it again", name, p.cmd.ProcessState)
		return false, c.start(name)
	})
}

// whileWaiting asks done every half second until it says so, for at most
// limit, and meanwhile starts again any process that ends by itself.
func (c *cast) whileWaiting(ctx context.Context, limit time.Duration, done func() (bool, error)) error {
	deadline := time.Now().Add(limit)
	for {
		if ok, err := done(); ok || err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not done within %v: see the logs in %s", limit, filepath.Join(c.dir, "logs"))
		}
		if err := c.restartExited(); err != nil {
			return err
		}
		if err := sleepCtx(ctx, 500*time.Millisecond); err != nil {
			return err
		}
	}
}

// stopAll stops every process but those named at once with SIGTERM, as
// an operator stops a deployment: one at a time, each holder stopped would
// hand its stage to its standby, stopped next.
func (c *cast) stopAll(except ...string) {
	var names []string
	for _, n := range c.names {
		if p := c.procs[n]; !slices.Contains(except, n) && !exited(p) {
			p.killed = true
			_ = p.cmd.Process.Signal(syscall.SIGTERM)
			names = append(names, n)
		}
	}
	for _, n := range names {
		c.signal(n, syscall.SIGTERM)
	}
}
