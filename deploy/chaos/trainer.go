package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/schemas"
)

// inFlight: steps the trainer publishes ahead of the newest update, as
// `wmrl run`'s simulated source does.
const inFlight = 4

func streamName(prefix string) string { return pipeline.StreamName(prefix) }

// runConn is a connection to a run's stream.
type runConn struct {
	nc          *nats.Conn
	js          jetstream.JetStream
	stream      jetstream.Stream // once it exists
	prefix, run string
}

func dialRun(ctx context.Context, url, prefix, run string) (*runConn, error) {
	nc, err := nats.Connect(url, nats.Name("wmrl chaos"), nats.MaxReconnects(-1), nats.RetryOnFailedConnect(true))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", url, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, err
	}
	return &runConn{nc: nc, js: js, prefix: prefix, run: run}, nil
}

func (r *runConn) close() { r.nc.Close() }

func (r *runConn) subject(k schemas.Kind) string { return r.prefix + "." + r.run + "." + string(k) }

// streamOf is the run's stream, asked for once it exists (nil before).
func (r *runConn) streamOf(ctx context.Context) (jetstream.Stream, error) {
	if r.stream == nil {
		s, err := r.js.Stream(ctx, streamName(r.prefix))
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		r.stream = s
	}
	return r.stream, nil
}

// lastMsg is the payload of the newest message on the run's subject of
// kind k; ok is false when there is none (or no stream yet).
func (r *runConn) lastMsg(ctx context.Context, k schemas.Kind) (data []byte, ok bool, err error) {
	s, err := r.streamOf(ctx)
	if s == nil || err != nil {
		return nil, false, err
	}
	m, err := s.GetLastMsgForSubject(ctx, r.subject(k))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	return m.Data, true, nil
}

// lastStep reads the step of the newest message on the run's subject of
// kind k; ok is false when there is none (or no stream yet).
func (r *runConn) lastStep(ctx context.Context, k schemas.Kind) (step int64, ok bool, err error) {
	data, ok, err := r.lastMsg(ctx, k)
	if !ok || err != nil {
		return 0, false, err
	}
	var v struct {
		Step int64 `json:"step"`
	}
	if err := json.Unmarshal(data, &v); err != nil {
		return 0, false, fmt.Errorf("%s: %w", r.subject(k), err)
	}
	return v.Step, true, nil
}

// count is how many messages the run's subject of kind k holds.
func (r *runConn) count(ctx context.Context, k schemas.Kind) (uint64, error) {
	s, err := r.streamOf(ctx)
	if s == nil || err != nil {
		return 0, err
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(r.subject(k)))
	if err != nil {
		return 0, err
	}
	return info.State.Subjects[r.subject(k)], nil
}

// trainerMain plays the trainer: the simulated policy's steps, published
// on the run's public subjects from the step after the newest watermark,
// at most inFlight ahead of the updates. It ends, status 0, once every
// step's update is stored.
func trainerMain(args []string) error {
	fs := flag.NewFlagSet("trainer", flag.ContinueOnError)
	url := fs.String("nats", "", "server")
	prefix := fs.String("prefix", "", "subject prefix")
	run := fs.String("run", "", "run")
	steps := fs.Int64("steps", 0, "steps in all")
	groups := fs.Int("groups", 16, "groups per step")
	size := fs.Int("group-size", 8, "trajectories per group")
	gatewayURLs := fs.String("http", "", "trainer gateways (comma-separated base URLs) that odd steps are posted through, in turn")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	r, err := dialRun(ctx, *url, *prefix, *run)
	if err != nil {
		return err
	}
	defer r.close()
	pub, err := natsjs.NewPublisher(natsjs.PublisherConfig{Conn: r.nc})
	if err != nil {
		return err
	}
	// The stream is the stages' to make, with their settings.
	for {
		if s, err := r.streamOf(ctx); s != nil && err == nil {
			break
		}
		if err := sleepCtx(ctx, time.Second); err != nil {
			return err
		}
	}
	// Asked as the cluster elects the stream's leader, the last step went
	// unanswered, and the trainer ended at its first start (seed 39).
	type last struct {
		step int64
		ok   bool
	}
	newest, err := askAgain(ctx, "reading the last step", func() (last, error) {
		step, ok, err := r.lastStep(ctx, schemas.KindStep)
		return last{step, ok}, err
	})
	if err != nil {
		return err
	}
	next := int64(0)
	if newest.ok {
		next = newest.step + 1
	}
	var gw *gateways
	if *gatewayURLs != "" {
		gw = newGateways(strings.Split(*gatewayURLs, ","), *run)
	}
	fmt.Printf("publishing steps %d to %d\n", next, *steps-1)
	policy := trainerPolicy(*run, *groups, *size)
	// fused counts the updates stored, waiting out a server that does not
	// answer (it restarts), as a trainer waits for its rewards. It counts:
	// the newest update is not the newest step's when a step held back (a
	// late anchor group) is fused after later ones.
	fused := func() (int64, error) {
		n, err := askAgain(ctx, "counting the updates", func() (uint64, error) { return r.count(ctx, schemas.KindUpdate) })
		return int64(n), err
	}
	for step := next; step < *steps; step++ {
		for {
			n, err := fused()
			if err != nil {
				return err
			}
			if step-n < inFlight {
				break
			}
			if err := sleepCtx(ctx, 20*time.Millisecond); err != nil {
				return err
			}
		}
		trajs, wm := policy.Step(step)
		if gw != nil && step%2 == 1 {
			if err := gw.postStep(ctx, step, trajs, wm.Groups); err != nil {
				return err
			}
			continue
		}
		// Every other group's trajectories in one trajs message, the
		// others one by one: route takes a step from both at once.
		var alone, batched []*message.Message
		for i, group := range schemas.ByGroup(trajs) {
			if i%2 == 1 {
				m, err := schemas.NewTrajsMessage(group)
				if err != nil {
					return err
				}
				batched = append(batched, m)
				continue
			}
			for _, t := range group {
				m, err := schemas.NewTrajMessage(t)
				if err != nil {
					return err
				}
				alone = append(alone, m)
			}
		}
		if err := publish(ctx, pub, r.subject(schemas.KindTraj), alone...); err != nil {
			return err
		}
		if err := publish(ctx, pub, r.subject(schemas.KindTrajs), batched...); err != nil {
			return err
		}
		m, err := schemas.NewMessage(fmt.Sprintf("%s/step/%d", wm.Run, step), wm)
		if err != nil {
			return err
		}
		if err := publish(ctx, pub, r.subject(schemas.KindStep), m); err != nil {
			return err
		}
	}
	for {
		n, err := fused()
		if err != nil {
			return err
		}
		if n >= *steps {
			fmt.Printf("%d updates stored, every step's\n", n)
			return nil
		}
		if err := sleepCtx(ctx, 200*time.Millisecond); err != nil {
			return err
		}
	}
}

// trainerPolicy is the trainer's simulated policy: the reward probe makes
// its solutions again from it.
func trainerPolicy(run string, groups, size int) *sim.Policy {
	return &sim.Policy{Run: run, Tasks: 32, Groups: groups, GroupSize: size}
}

// askAgain calls ask until it answers, saying why each time it did not and
// asking again a second later, or until ctx ends: a server that does not
// answer (it restarts, or its cluster elects a leader) is waited out, as a
// trainer waits for its rewards.
func askAgain[T any](ctx context.Context, what string, ask func() (T, error)) (T, error) {
	for {
		v, err := ask()
		if err == nil || ctx.Err() != nil {
			return v, cmp.Or(ctx.Err(), err)
		}
		fmt.Printf("%s: %v; trying again\n", what, err)
		if err := sleepCtx(ctx, time.Second); err != nil {
			return v, err
		}
	}
}

// archiveDrained reports whether the archive stage's durable consumers
// (its updates', calibrations' and anchor groups') have nothing left:
// none undelivered, none delivered and not acknowledged, and their ack
// floor at the newest message of their subjects. The server counts a
// consumer's pending messages apart from storing them: just after a
// publish is acknowledged the count may not have it yet (its test read
// dry so in 2% of runs). An error (a node starting again) reads as not
// yet.
func (r *runConn) archiveDrained(ctx context.Context) bool {
	s, err := r.streamOf(ctx)
	if err != nil || s == nil {
		return false
	}
	prefix := natsjs.SafeName(pipeline.StageArchive + "_" + r.run + "_")
	names := s.ConsumerNames(ctx)
	found := 0
	for name := range names.Name() {
		if !strings.HasPrefix(name, prefix) {
			continue
		}
		c, err := s.Consumer(ctx, name)
		if err != nil {
			return false
		}
		info, err := c.Info(ctx)
		if err != nil || info.NumPending > 0 || info.NumAckPending > 0 {
			return false
		}
		for _, subject := range append([]string{info.Config.FilterSubject}, info.Config.FilterSubjects...) {
			if subject == "" {
				continue
			}
			last, err := s.GetLastMsgForSubject(ctx, subject)
			if errors.Is(err, jetstream.ErrMsgNotFound) {
				continue
			}
			if err != nil || info.AckFloor.Stream < last.Sequence {
				return false
			}
		}
		found++
	}
	return names.Err() == nil && found > 0
}

// gateways posts steps through trainer gateways, a request to each in
// turn, trying the next on a refused connection, a timeout or a 5xx (its
// process was killed, or has lost its server), as a trainer behind a load
// balancer does. Any other refusal ends the trainer: it is the pipeline's
// answer to a request it should take.
type gateways struct {
	bases  []string
	next   int
	client *http.Client
	sleep  func(context.Context, time.Duration) error
}

func newGateways(urls []string, run string) *gateways {
	g := &gateways{client: &http.Client{Timeout: 30 * time.Second}, sleep: sleepCtx}
	for _, u := range urls {
		g.bases = append(g.bases, strings.TrimSuffix(u, "/")+"/v1/runs/"+run)
	}
	return g
}

// postStep posts a step's trajectories in one request, then its close.
func (g *gateways) postStep(ctx context.Context, step int64, trajs []schemas.Trajectory, groups int) error {
	body, err := json.Marshal(trajs)
	if err != nil {
		return err
	}
	if err := g.post(ctx, "/trajectories", body); err != nil {
		return err
	}
	return g.post(ctx, fmt.Sprintf("/steps/%d/close", step), fmt.Appendf(nil, `{"groups": %d}`, groups))
}

func (g *gateways) post(ctx context.Context, path string, body []byte) error {
	var wait time.Duration // the shortest Retry-After of this round of gateways (0: none said)
	for failed := 1; ; failed++ {
		url, resp, b, err := g.send(ctx, path, body)
		if err == nil {
			switch {
			case resp.StatusCode == http.StatusAccepted:
				return nil
			case resp.StatusCode < 500 && resp.StatusCode != http.StatusTooManyRequests:
				return fmt.Errorf("POST %s: %s: %s", url, resp.Status, bytes.TrimSpace(b))
			}
			err = fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(b))
			if d, ok := retryAfter(resp.Header.Get("Retry-After")); ok && (wait == 0 || d < wait) {
				wait = d
			}
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		fmt.Printf("POST %s: %v; trying the next gateway\n", url, err)
		if failed%len(g.bases) != 0 {
			continue // another may answer at once
		}
		// Every gateway failed: wait as long as the first of them asked
		// (10 s for a full store), or 100 ms when none said.
		if err := g.sleep(ctx, max(wait, 100*time.Millisecond)); err != nil {
			return err
		}
		wait = 0
	}
}

// send posts body to path of the next gateway, in turn: it returns the
// URL asked and the answer with its body, or why there is none.
func (g *gateways) send(ctx context.Context, path string, body []byte) (url string, resp *http.Response, b []byte, err error) {
	url = g.bases[g.next%len(g.bases)] + path
	g.next++
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return url, nil, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err = g.client.Do(req)
	if err != nil {
		return url, nil, nil, err
	}
	defer resp.Body.Close()
	b, err = io.ReadAll(resp.Body)
	return url, resp, b, err
}

// retryAfter reads a Retry-After of seconds; its HTTP-date form, which
// the gateway does not send, reads as unsaid.
func retryAfter(v string) (time.Duration, bool) {
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil || n < 0 {
		return 0, false
	}
	return time.Duration(n) * time.Second, true
}

// publish publishes msgs, waiting out a full store as a trainer should
// (its messages carry de-duplication IDs, so sending them again stores
// each once).
func publish(ctx context.Context, pub *natsjs.Publisher, subject string, msgs ...*message.Message) error {
	for said := false; ; said = true {
		err := pub.Publish(subject, msgs...)
		if !natsjs.StoreFull(err) {
			return err
		}
		if !said {
			fmt.Printf("publish to %s: %v; waiting for room\n", subject, err)
		}
		if err := sleepCtx(ctx, time.Second); err != nil {
			return err
		}
	}
}
