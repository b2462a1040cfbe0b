// Command chaos rehearses the failures of a split deployment before a
// training run meets them. It runs a run's stages as processes of their
// own, two of each (`wmrl stage NAME`; each route process serves a trainer
// gateway, the standby's too), and a simulated trainer as another, which
// publishes to NATS and posts through the gateways, against a NATS server;
// for a while it kills one of them at random every few seconds (SIGKILL
// mostly, SIGTERM otherwise) and starts it again, deletes one of the run's
// key-value buckets now and then (--delete-buckets), and, on the embedded
// server or its own nats-servers, fills the store now and then
// (--store-full).
// Then it lets the trainer finish, stops everything, and checks what the
// run stored: every step's update once, with every trajectory; every
// watermark once; every anchor group absorbed by the calibration once;
// every trajectory in the Parquet archives once (a late anchor group's
// once more, as its late rows); which dead letters there are; that no
// consumer of the run still holds a message; and that the archive,
// replayed with the recorded settings (`wmrl replay`), gives what the run
// fused. It prints PASS or FAIL and exits 1 on FAIL.
//
//	go run ./deploy/chaos                 # 5 minutes of kills on an embedded server
//	go run ./deploy/chaos --for 20m --nats nats://10.0.0.5:4222
//	go run ./deploy/chaos --nats-server ./nats-server --cluster 3
//
// The last runs the server too, as a three-node cluster whose nodes it
// kills as well.
//
// On a server of your own it uses a stream of its own (--prefix): the
// rehearsal of a cluster, its failovers and its latencies, is the point.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/schemas"
)

type options struct {
	dur             time.Duration
	seed            uint64
	wmrl, nats, dir string
	prefix, run     string
	groups, size    int
	keep            bool
	// archiveApart gives each archive process a root of its own.
	archiveApart bool
	// natsServer: a nats-server binary to run as one of the processes
	// killed, instead of the embedded server; cluster such servers as
	// the nodes of one JetStream cluster, the stream replicated on each.
	natsServer string
	cluster    int
	// storeFull: hold the run's account at its store limit now and then,
	// so that every write is refused for a while (the embedded server's,
	// or the account of its own nats-servers).
	storeFull bool
	// deleteBuckets: delete one of the run's key-value buckets now and
	// then, as by hand or by a tool that cleans up streams.
	deleteBuckets bool
	// oneProcess: the run is one `wmrl run` process, its embedded server
	// and every stage in it, killed whole.
	oneProcess bool
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "trainer" {
		err := trainerMain(os.Args[2:])
		switch {
		case errors.Is(err, context.Canceled): // SIGTERM, SIGINT: a stop, not a failure
			fmt.Println("trainer: stopped")
		case err != nil:
			fmt.Fprintln(os.Stderr, "trainer:", err)
			os.Exit(1)
		}
		return
	}
	var o options
	flag.DurationVar(&o.dur, "for", 5*time.Minute, "how long to kill processes")
	flag.Uint64Var(&o.seed, "seed", 1, "seed of which process is killed when, and how")
	flag.StringVar(&o.wmrl, "wmrl", "", "the wmrl binary to run (default: go build ./cmd/wmrl into --dir)")
	flag.StringVar(&o.nats, "nats", "", "NATS server (default: one embedded in this process, in --dir)")
	flag.StringVar(&o.natsServer, "nats-server", "", "a nats-server binary to run on a store in --dir instead of the embedded server, as one more process it kills (every fourth kill) and starts again (go build -o nats-server github.com/nats-io/nats-server/v2)")
	flag.IntVar(&o.cluster, "cluster", 1, "with --nats-server, run this many as the nodes of a JetStream cluster, the run's stream and buckets replicated on each (--replicas); every fourth kill is one node's")
	flag.StringVar(&o.dir, "dir", "", "directory of the logs, archives and the embedded server's store (default: a new one in the temporary directory)")
	flag.StringVar(&o.prefix, "prefix", "wmrlchaos", "subject prefix: the stream is WMRL_<PREFIX>")
	flag.StringVar(&o.run, "run", "", "run name (default: chaos-<the time>)")
	flag.IntVar(&o.groups, "groups", 16, "groups per step")
	flag.IntVar(&o.size, "group-size", 8, "trajectories per group")
	flag.BoolVar(&o.keep, "keep", false, "keep --dir when it was made here")
	flag.BoolVar(&o.storeFull, "store-full", true, "every 30 to 90 s, hold the run's account at its store limit for 5 to 40 s, as a full disk or an operator's limit does: every write is refused (the embedded server's account, or with --nats-server the account its nodes give the rehearsal's user, lowered by a reload of its file; a server of your own, --nats, is left alone)")
	flag.BoolVar(&o.deleteBuckets, "delete-buckets", true, "every 45 to 120 s, delete one of the run's key-value buckets (its leases, checkpoints or executions' outcomes), as `nats kv rm` by hand or a tool that cleans up does: the processes make it anew")
	flag.BoolVar(&o.archiveApart, "archive-apart", false, "give each archive process an --archive of its own, as on two machines' disks, instead of one they share")
	flag.BoolVar(&o.oneProcess, "one-process", false, "run the pipeline as one `wmrl run --source external` process, its embedded server's store and its archive in --dir, serving one trainer gateway, instead of two processes of each stage on a server apart: a kill stops the server with every stage, as on a machine that runs the main job (no full stores: the server is the killed process's own)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ok, err := rehearse(ctx, o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		os.Exit(2)
	}
	if !ok {
		os.Exit(1)
	}
}

func rehearse(ctx context.Context, o options) (bool, error) {
	if err := o.validate(); err != nil {
		return false, err
	}
	if o.run == "" {
		o.run = "chaos-" + time.Now().UTC().Format("20060102-150405")
	}
	if o.dir == "" {
		d, err := os.MkdirTemp("", "wmrl-chaos-")
		if err != nil {
			return false, err
		}
		o.dir = d
		if !o.keep {
			defer os.RemoveAll(d)
		}
	}
	unlock, err := lockDir(o.dir)
	if err != nil {
		return false, err
	}
	defer unlock()
	if err := roomFor(o.dir, o.dur); err != nil {
		return false, err
	}
	if o.wmrl == "" {
		o.wmrl = filepath.Join(o.dir, "wmrl")
		say("building ./cmd/wmrl")
		if out, err := exec.Command("go", "build", "-o", o.wmrl, "./cmd/wmrl").CombinedOutput(); err != nil {
			return false, fmt.Errorf("go build ./cmd/wmrl (run this from the repository's root, or give --wmrl): %v\n%s", err, out)
		}
	}
	c := &cast{dir: o.dir}
	var servers []string // the processes that are NATS servers
	var embedded *natsjs.Server
	var acct *accountFile // with --nats-server --store-full
	var listen string     // with --one-process: its server's client address
	switch {
	case o.oneProcess:
		ports, err := freePorts(1)
		if err != nil {
			return false, err
		}
		listen = fmt.Sprintf("127.0.0.1:%d", ports[0])
		o.nats = "nats://" + listen
	case o.natsServer != "":
		if o.storeFull {
			if acct, err = newAccountFile(o.dir); err != nil {
				return false, err
			}
		}
		nodes, url, err := serverArgs(o, acct)
		if err != nil {
			return false, err
		}
		for _, n := range nodes {
			c.add(n.name, n.args)
			servers = append(servers, n.name)
		}
		o.nats = url
	case o.nats == "":
		if embedded, err = natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: filepath.Join(o.dir, "nats"), MaxPayload: 8 << 20}); err != nil {
			return false, err
		}
		defer embedded.Shutdown()
		o.nats = embedded.URL()
	}
	self, err := os.Executable()
	if err != nil {
		return false, err
	}
	say("run %s, stream %s on %s; logs in %s", o.run, streamName(o.prefix), natsjs.Redact(o.nats), filepath.Join(o.dir, "logs"))
	run := []string{"--nats", o.nats, "--prefix", o.prefix, "--run", o.run}
	// Each route process serves a trainer gateway, the standby's too, and
	// the trainer posts odd steps through both in turn.
	routes := 2
	if o.oneProcess {
		routes = 1
	}
	gatewayPorts, err := freePorts(routes)
	if err != nil {
		return false, err
	}
	var gateways []string
	for _, port := range gatewayPorts {
		gateways = append(gateways, fmt.Sprintf("http://127.0.0.1:%d", port))
	}
	trainer := func(steps int64) []string {
		return append([]string{self, "trainer", "--steps", fmt.Sprint(steps), "--groups", fmt.Sprint(o.groups), "--group-size", fmt.Sprint(o.size),
			"--http", strings.Join(gateways, ",")}, run...)
	}
	common := run
	if o.cluster > 1 {
		common = append(slices.Clip(run), "--replicas", fmt.Sprint(o.cluster))
	}
	c.add("trainer", trainer(1<<40))
	if o.oneProcess {
		c.add(runProcess, oneProcessArgs(o, listen, gatewayPorts[0]))
	} else {
		addStages(c, o, common, gatewayPorts)
	}
	if err := c.startAll(); err != nil {
		return false, err
	}
	defer c.stopAll()
	stopProgress, err := progress(ctx, o)
	if err != nil {
		return false, err
	}
	defer stopProgress()

	fills := make(chan int, 1)
	switch {
	case o.storeFull && embedded != nil:
		go func() { fills <- fillStore(ctx, embeddedLimit{embedded}, o.dur, rand.New(rand.NewPCG(o.seed, 1))) }()
	case o.storeFull && acct != nil:
		go func() { fills <- fillStore(ctx, acct, o.dur, rand.New(rand.NewPCG(o.seed, 1))) }()
	case o.storeFull && o.oneProcess:
		say("no full stores: the server is the killed process's own")
		fills <- 0
	case o.storeFull:
		say("no full stores: a server of your own (--nats) is left alone")
		fills <- 0
	default:
		fills <- 0
	}
	probed := make(chan rewardProbe, 1)
	go func() {
		conn, err := dialRun(ctx, o.nats, o.prefix, o.run)
		if err != nil {
			say("reward probe: %v", err)
			probed <- rewardProbe{}
			return
		}
		defer conn.close()
		probed <- rehearsalProber(conn, newGateways(gateways, o.run), trainerPolicy(o.run, o.groups, o.size)).run(ctx, o.dur)
	}()
	deleted := make(chan int, 1)
	if o.deleteBuckets {
		go func() { deleted <- deleteBuckets(ctx, o, rand.New(rand.NewPCG(o.seed, 2))) }()
	} else {
		deleted <- 0
	}
	kills, err := c.kill(ctx, o.dur, rand.New(rand.NewPCG(o.seed, 0)), rand.New(rand.NewPCG(o.seed, 3)), servers)
	if err != nil {
		return false, err
	}
	full, gone := <-fills, <-deleted
	tr, err := dialRun(ctx, o.nats, o.prefix, o.run)
	if err != nil {
		return false, err
	}
	defer tr.close()
	// The trainer ends at a step boundary: killed, it resumes after the
	// newest watermark and publishes 20 steps more.
	c.signal("trainer", syscall.SIGKILL)
	var last int64
	// The server may be starting again after a kill.
	if err := c.whileWaiting(ctx, time.Minute, func() (bool, error) {
		var err error
		last, _, err = tr.lastStep(ctx, schemas.KindStep)
		return err == nil, nil
	}); err != nil {
		return false, fmt.Errorf("reading the newest watermark: %w", err)
	}
	target := last + 1 + 20
	say("%d kills, %d full stores and %d buckets deleted in %v; the trainer ends at step %d", kills, full, gone, o.dur, target-1)
	c.procs["trainer"].args = trainer(target)
	if err := c.start("trainer"); err != nil {
		return false, err
	}
	// The trainer ends once every step's update is stored. One that does
	// not finish is checked all the same: the check says what it lacks.
	if err := c.waitFor(ctx, "trainer", 15*time.Minute); err != nil {
		if ctx.Err() != nil {
			return false, err
		}
		say("the trainer: %v", err)
	}
	// The archive may still hold some updates then: one waits up to 35 s
	// for its anchor groups' code, which a node's loss can delay by the
	// consumers' 30 s AckWait. Stopped then, it hands them back, and the
	// check would count as lost a step that a restart archives (a cluster
	// rehearsal of seed 6 ended so, step 4161 missing; the archive stage
	// started again archived it whole). So the archive's consumers are let
	// run dry first, and stay dry for 5 s (a late calibration may come).
	var dry time.Time
	if err := c.whileWaiting(ctx, 3*time.Minute, func() (bool, error) {
		if !tr.archiveDrained(ctx) {
			dry = time.Time{}
			return false, nil
		}
		if dry.IsZero() {
			dry = time.Now()
		}
		return time.Since(dry) >= 5*time.Second, nil
	}); err != nil {
		if ctx.Err() != nil {
			return false, err
		}
		say("the archive: %v; checking what it has", err)
	}
	stopProgress()
	c.stopAll(servers...)
	if o.oneProcess {
		// The server stopped with the run: its store is read by one of
		// this process's own.
		srv, conn, err := openStore(ctx, o)
		if err != nil {
			return false, err
		}
		defer srv.Shutdown()
		defer conn.close()
		tr = conn
	}
	say("every process stopped; checking what the run stored")
	r, err := tr.check(ctx, o, target)
	if err != nil {
		return false, err
	}
	say("replaying the archive with the run's recorded settings")
	if err := r.replayArchive(ctx, o); err != nil {
		return false, err
	}
	r.rewards = <-probed
	r.print(os.Stdout)
	return r.ok(), nil
}

// deleteBuckets deletes one of the run's key-value buckets, the leases,
// the checkpoints or the executions' outcomes, every 45 to 120 s for
// o.dur, and returns how many it deleted. Their users make them anew: a
// lease's holder writes it again, a stage's next checkpoint is saved to
// it, and an anchor group whose outcome is gone is executed again if it
// is delivered again.
func deleteBuckets(ctx context.Context, o options, rng *rand.Rand) int {
	conn, err := dialRun(ctx, o.nats, o.prefix, o.run)
	if err != nil {
		say("buckets: %v", err)
		return 0
	}
	defer conn.close()
	buckets := []string{pipeline.LeaseBucket(o.prefix), pipeline.StateBucket(o.prefix), pipeline.OutcomeBucket(o.prefix)}
	end := time.Now().Add(o.dur)
	n := 0
	for {
		wait := 45*time.Second + time.Duration(rng.Int64N(int64(75*time.Second)))
		b := buckets[rng.IntN(len(buckets))]
		if time.Now().Add(wait).After(end) || sleepCtx(ctx, wait) != nil {
			return n
		}
		del, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := conn.js.DeleteKeyValue(del, b)
		cancel()
		if err != nil {
			say("bucket %s not deleted: %v", b, err) // a node down, or the store full
			continue
		}
		n++
		say("bucket %s deleted (%d)", b, n)
	}
}

// addStages adds two processes of each stage, each on a machine of its
// own: the one-per-run stages' second waits as a standby, predict's and
// execute's share the work. Each route process serves a trainer gateway
// on its port of gatewayPorts; common are the flags every stage gets.
func addStages(c *cast, o options, common []string, gatewayPorts []int) {
	for _, s := range pipeline.AllStages {
		for i := 1; i <= 2; i++ {
			args := append([]string{o.wmrl, "stage", s}, common...)
			if s == pipeline.StageArchive {
				root := filepath.Join(o.dir, "archive")
				if o.archiveApart {
					root += fmt.Sprint(i)
				}
				args = append(args, "--archive", root)
			}
			if s == pipeline.StageRoute {
				args = append(args, "--http", fmt.Sprintf("127.0.0.1:%d", gatewayPorts[i-1]))
			}
			name := fmt.Sprintf("%s-%d", s, i)
			c.add(name, args)
			c.procs[name].machine = name
		}
	}
}

// validate refuses options that do not go together, before anything is
// started or built.
func (o options) validate() error {
	switch {
	case o.natsServer != "" && o.nats != "":
		return fmt.Errorf("--nats and --nats-server: give one")
	case o.cluster < 1 || o.cluster > 5:
		return fmt.Errorf("--cluster %d: want 1 to 5 nodes (JetStream's replicas)", o.cluster)
	case o.cluster > 1 && o.natsServer == "":
		return fmt.Errorf("--cluster %d needs --nats-server: the embedded server is a single node", o.cluster)
	case o.oneProcess && (o.nats != "" || o.natsServer != ""):
		return fmt.Errorf("--one-process runs the server in the wmrl process it kills: give neither --nats nor --nats-server")
	case o.oneProcess && o.archiveApart:
		return fmt.Errorf("--one-process has one archive process: --archive-apart needs two")
	}
	return nil
}

// runProcess names the `wmrl run` process of --one-process.
const runProcess = "wmrl-run"

// oneProcessArgs is the command of --one-process's `wmrl run`: every stage
// and the embedded server (client address listen, the store in o.dir/nats)
// in one process, serving the trainer gateway on gatewayPort, waiting for
// the trainer's trajectories, and archiving to o.dir/archive.
func oneProcessArgs(o options, listen string, gatewayPort int) []string {
	return []string{o.wmrl, "run", "--source", "external", "--data", o.dir, "--listen", listen,
		"--http", fmt.Sprintf("127.0.0.1:%d", gatewayPort), "--prefix", o.prefix, "--run", o.run,
		"--step-summary", "30s"}
}

// openStore starts a server of this process on --one-process's store,
// which the run's own server left when it stopped, and dials the run on
// it.
func openStore(ctx context.Context, o options) (*natsjs.Server, *runConn, error) {
	srv, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: filepath.Join(o.dir, "nats"), MaxPayload: 8 << 20})
	if err != nil {
		return nil, nil, fmt.Errorf("opening the stopped run's store to check it: %w", err)
	}
	conn, err := dialRun(ctx, srv.URL(), o.prefix, o.run)
	if err != nil {
		srv.Shutdown()
		return nil, nil, err
	}
	return srv, conn, nil
}

// lockDir takes dir for this rehearsal: another one there would restart
// its processes on this one's files (its servers' stores).
func lockDir(dir string) (unlock func(), err error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(dir, ".chaos.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("--dir %s: another rehearsal uses it (%w); give another directory, or stop that one", dir, err)
	}
	return func() { f.Close() }, nil
}

// node is a nats-server process of the rehearsal.
type node struct {
	name string
	args []string
}

// serverArgs writes the configurations of o.cluster nats-servers on free
// ports of 127.0.0.1 (one: a single server; more: the nodes of a cluster
// named wmrlchaos, routed to each other, as deploy/nats's files), each
// with its store in o.dir, and returns their commands and the client URLs.
// With acct, each includes its account, and the URLs name its user.
func serverArgs(o options, acct *accountFile) (nodes []node, urls string, err error) {
	ports, err := freePorts(2 * o.cluster)
	if err != nil {
		return nil, "", err
	}
	var routes, clients []string
	for i := range o.cluster {
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", ports[o.cluster+i]))
		client := fmt.Sprintf("nats://127.0.0.1:%d", ports[i])
		if acct != nil {
			client = acct.url(fmt.Sprintf("127.0.0.1:%d", ports[i]))
		}
		clients = append(clients, client)
	}
	for i := range o.cluster {
		name, store := "nats-server", filepath.Join(o.dir, "nats")
		if o.cluster > 1 {
			name = fmt.Sprintf("nats-%d", i+1)
			store = filepath.Join(o.dir, name)
		}
		text := fmt.Sprintf("server_name: %s\nlisten: 127.0.0.1:%d\nmax_payload: 8MB\njetstream { store_dir: %q }\n", name, ports[i], store)
		if o.cluster > 1 {
			text += fmt.Sprintf("cluster {\n  name: wmrlchaos\n  listen: 127.0.0.1:%d\n  routes: [\n    %s\n  ]\n}\n", ports[o.cluster+i], strings.Join(routes, "\n    "))
		}
		if acct != nil {
			pid := filepath.Join(o.dir, name+".pid")
			acct.pidFiles = append(acct.pidFiles, pid)
			text += acct.include(pid)
		}
		conf := filepath.Join(o.dir, name+".conf")
		if err := os.WriteFile(conf, []byte(text), 0o644); err != nil {
			return nil, "", err
		}
		nodes = append(nodes, node{name: name, args: []string{o.natsServer, "-c", conf}})
	}
	return nodes, strings.Join(clients, ","), nil
}

// freePorts finds n ports of 127.0.0.1 free now, each a different one.
func freePorts(n int) ([]int, error) {
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// progress says every 30 s how many steps the run fused, until stopped.
func progress(ctx context.Context, o options) (stop func(), err error) {
	r, err := dialRun(ctx, o.nats, o.prefix, o.run)
	if err != nil {
		return nil, err
	}
	done := make(chan struct{})
	var once sync.Once
	go func() {
		defer r.close()
		t := time.NewTicker(30 * time.Second)
		defer t.Stop()
		var prev uint64
		at := time.Now()
		for {
			select {
			case <-done:
				return
			case now := <-t.C:
				n, err := r.count(ctx, schemas.KindUpdate)
				if err != nil {
					say("progress: %v", err)
					continue
				}
				say("%d steps fused, %.0f a second over the last %v", n, float64(n-prev)/now.Sub(at).Seconds(), now.Sub(at).Round(time.Second))
				prev, at = n, now
			}
		}
	}()
	return func() { once.Do(func() { close(done) }) }, nil
}

func say(format string, args ...any) {
	fmt.Printf("%s %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

// roomPerMinute is what a rehearsal keeps in its directory for each
// minute of it, about: those of seeds 47 to 63 kept 1.2 to 4.3 GB over 8
// and 15 minutes (the servers' stores, the archives, the logs).
const roomPerMinute = 512 << 20

// roomFor refuses a rehearsal whose directory's disk has less room than
// it keeps for dur: a disk that fills under it stops its servers, and the
// rehearsal fails for that alone (seed 64 did, on this machine's disk).
func roomFor(dir string, dur time.Duration) error {
	free, _, err := natsjs.DiskRoom(dir)
	if err != nil {
		return err
	}
	if need := int64(max(dur.Minutes(), 2) * roomPerMinute); free < need {
		return fmt.Errorf("the disk of %s has %.1f GB free; a rehearsal of %v keeps about %.1f GB there: make room, or give --dir on another disk",
			dir, float64(free)/1e9, dur, float64(need)/1e9)
	}
	return nil
}

// sleepCtx waits d, or less when ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
