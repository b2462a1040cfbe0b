// Package simrl runs the rl benchmark (connectors/sim/rl) through the
// streaming pipeline in this process: each training run starts a pipeline
// on its own embedded NATS server, publishes every step's trajectories and
// watermark on the public subjects as a trainer would, lets the route,
// predict, execute, pair, calibrate and fuse stages score them, and trains
// the policy on the fused advantages of the update. With the same seeds it
// gives the same numbers as the core packages (rl.NewCoreRewarder): that is
// the evidence that the benchmark measures what the pipeline does.
//
// One thing is arranged for that equality: the environment executes a
// step's anchor groups one at a time, in group order, each released once
// the calibration absorbed the one before (the calibration's map and the
// rho estimate depend on the order anchor groups arrive in, and a live
// pipeline absorbs them as they finish). Everything else is the pipeline as
// `wmrl run` builds it, but for the archive stage, which is left out.
package simrl

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/sim/rl"
	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/execute"
	"github.com/wmrl/wmrl/stages/fuse"
	"github.com/wmrl/wmrl/stages/predict"
)

// StepTimeout bounds the wait for one step's update.
const StepTimeout = 2 * time.Minute

// Meta keys of a trajectory's place in the simulation.
const (
	metaStep  = "rl_step"
	metaGroup = "rl_group"
	metaIndex = "rl_index"
	metaTask  = "rl_task"
	metaStyle = "rl_style"
)

// NewRewarder returns an rl.NewRewarder whose training runs each go
// through a fresh pipeline, keeping its store in a temporary folder under
// dir ("" for the system's), removed when the run ends.
func NewRewarder(dir string) rl.NewRewarder {
	return func(cfg rl.Config, env *rl.Env, m rl.Method) (rl.Rewarder, error) {
		return start(dir, cfg, env, m)
	}
}

type rewarder struct {
	dataDir string
	p       *pipeline.Pipeline
	nc      *nats.Conn
	js      jetstream.JetStream
	topo    *pipeline.Topology
	updates chan schemas.Update
	gate    *gate
	cancel  context.CancelFunc
	closed  bool
}

func start(dir string, cfg rl.Config, env *rl.Env, m rl.Method) (*rewarder, error) {
	dataDir, err := os.MkdirTemp(dir, "wmrl-simrl-")
	if err != nil {
		return nil, fmt.Errorf("simrl: %w", err)
	}
	r := &rewarder{dataDir: dataDir, updates: make(chan schemas.Update, 16), gate: newGate()}
	pc := pipeline.DefaultConfig()
	pc.Run, pc.DataDir, pc.Listen, pc.Quiet = rl.RunName, dataDir, "127.0.0.1:0", true
	pc.Source = pipeline.SourceExternal
	pc.Stages = slices.DeleteFunc(slices.Clone(pipeline.AllStages), func(s string) bool { return s == pipeline.StageArchive })
	pc.Groups, pc.GroupSize = cfg.Groups, cfg.GroupSize
	pc.Anchors = rl.SchedulerConfig(cfg, m)
	cc := rl.CorrectorConfig(cfg, m)
	pc.Debias, pc.Debiaser, pc.Denoiser = cc.Debias, cc.Debiaser, cc.Denoiser
	pc.AdvantageNorm = cfg.AdvantageNorm.Effective()
	// The core packages never drop an anchor for lateness: neither may the
	// pipeline here (a late anchor is a timing outcome, not the method).
	pc.AnchorDeadline, pc.StepTimeout = time.Hour, time.Hour
	// A slot per trajectory of a step: a gated execution holds its slot
	// while it waits, and must not starve the group it waits for.
	pc.ExecSlots = cfg.Groups * cfg.GroupSize
	pc.WorldModelImpl = worldModel{env}
	pc.ExecutorImpl = executor{env, r.gate}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	pc.OnUpdate = func(u schemas.Update, _ time.Duration) {
		select {
		case r.updates <- u:
		case <-ctx.Done(): // closing: nobody reads any more
		}
	}
	fail := func(err error) (*rewarder, error) {
		r.Close()
		return nil, fmt.Errorf("simrl: %w", err)
	}
	if r.topo, err = pipeline.LoadTopology("", pc.Prefix, pc.Run); err != nil {
		return fail(err)
	}
	if r.p, err = pipeline.Start(ctx, pc); err != nil {
		return fail(err)
	}
	if r.nc, err = nats.Connect(r.p.URL()); err != nil {
		return fail(err)
	}
	if r.js, err = jetstream.New(r.nc); err != nil {
		return fail(err)
	}
	// The gate follows plans and calibrations on their subjects, as an
	// extra stage in any language could.
	for kind, fn := range map[schemas.Kind]func([]byte) error{
		schemas.KindPlan: r.gate.plan, schemas.KindCalibration: r.gate.calibration,
	} {
		if _, err := r.nc.Subscribe(r.topo.Subject(kind), func(msg *nats.Msg) {
			if err := fn(msg.Data); err != nil {
				r.gate.fail(fmt.Errorf("%s: %w", kind, err))
			}
		}); err != nil {
			return fail(err)
		}
	}
	if err := r.nc.Flush(); err != nil {
		return fail(err)
	}
	return r, nil
}

// Reward publishes a step and waits for its update.
func (r *rewarder) Reward(step int, groups [][]rl.Traj) (rl.StepRewards, error) {
	ctx, cancel := context.WithTimeout(context.Background(), StepTimeout)
	defer cancel()
	var futures []jetstream.PubAckFuture
	publish := func(subject string, v any) error {
		b, err := json.Marshal(v)
		if err != nil {
			return err
		}
		f, err := r.js.PublishAsync(subject, b)
		futures = append(futures, f)
		return err
	}
	for g, trajs := range groups {
		gid := rl.GroupID(step, g)
		group := make([]schemas.Trajectory, len(trajs))
		for i, tr := range trajs {
			meta, err := schemas.NewMeta(map[string]any{metaStep: step, metaGroup: g, metaIndex: i, metaTask: tr.Task, metaStyle: tr.Style})
			if err != nil {
				return rl.StepRewards{}, err
			}
			group[i] = schemas.Trajectory{
				Schema: schemas.Version, Run: rl.RunName, Step: int64(step), GroupID: gid,
				TrajID: trajID(gid, i), GroupSize: len(trajs), TaskID: fmt.Sprintf("task-%d", tr.Task),
				Prompt: fmt.Sprintf("Solve task %d.", tr.Task), Response: fmt.Sprintf("style %d", tr.Style),
				PolicyVersion: int64(step),
				Meta:          meta,
			}
		}
		if err := publish(r.topo.Subject(schemas.KindTrajs), group); err != nil { // a group a message, as a trainer sends it
			return rl.StepRewards{}, err
		}
	}
	if err := publish(r.topo.Subject(schemas.KindStep), schemas.StepClose{Schema: schemas.Version, Run: rl.RunName, Step: int64(step), Groups: len(groups)}); err != nil {
		return rl.StepRewards{}, err
	}
	for _, f := range futures {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			return rl.StepRewards{}, fmt.Errorf("publish: %w", err)
		case <-ctx.Done():
			return rl.StepRewards{}, fmt.Errorf("publish: %w", ctx.Err())
		}
	}
	for {
		select {
		case u := <-r.updates:
			if u.Step != int64(step) {
				continue // a step of an earlier call, redelivered
			}
			return rewardsOf(u, groups)
		case err := <-r.gate.errs:
			return rl.StepRewards{}, err
		case <-ctx.Done():
			return rl.StepRewards{}, fmt.Errorf("no update for step %d within %v", step, StepTimeout)
		}
	}
}

func trajID(gid string, i int) string { return fmt.Sprintf("%s-t%d", gid, i) }

// rewardsOf reads a step's fused advantages off its update, refusing one
// that the core packages could not have produced.
func rewardsOf(u schemas.Update, groups [][]rl.Traj) (rl.StepRewards, error) {
	if len(u.LateAnchors) > 0 || len(u.FailedAnchors) > 0 || len(u.Skipped) > 0 {
		return rl.StepRewards{}, fmt.Errorf("step %d: late anchors %v, failed anchors %v, skipped groups %v", u.Step, u.LateAnchors, u.FailedAnchors, u.Skipped)
	}
	items := make(map[string]schemas.UpdateItem, len(u.Items))
	for _, it := range u.Items {
		items[it.TrajID] = it
	}
	out := rl.StepRewards{Rho: u.Rho, Anchor: make([]bool, len(groups)), Fused: make([][]float64, len(groups))}
	for g, trajs := range groups {
		gid := rl.GroupID(int(u.Step), g)
		out.Fused[g] = make([]float64, len(trajs))
		for i := range trajs {
			it, ok := items[trajID(gid, i)]
			if !ok {
				return out, fmt.Errorf("step %d: the update lacks %s", u.Step, trajID(gid, i))
			}
			out.Fused[g][i] = it.FusedAdvantage
			out.Anchor[g] = it.Source == fuse.SourceAnchor
		}
	}
	return out, nil
}

// Close stops the pipeline and removes its store.
func (r *rewarder) Close() error {
	if r.closed {
		return nil
	}
	r.closed = true
	var err error
	if r.nc != nil {
		r.nc.Close()
	}
	r.cancel() // first: it also releases an OnUpdate nobody reads
	if r.p != nil {
		err = r.p.Stop()
	}
	return errors.Join(err, os.RemoveAll(r.dataDir))
}

// worldModel scores a group with the environment's keyed draws.
type worldModel struct{ env *rl.Env }

func (w worldModel) Name() string { return "rl-" + w.env.Scenario.Name }

func (w worldModel) Predict(_ context.Context, trajs []schemas.Trajectory) ([]predict.Score, error) {
	out := make([]predict.Score, len(trajs))
	for k, t := range trajs {
		step, g, i, tr, err := place(t)
		if err != nil {
			return nil, err
		}
		out[k] = predict.Score{Value: w.env.PredictAt(step, g, i, tr), Graded: true}
	}
	return out, nil
}

// executor runs a trajectory in the environment once the gate opens for
// its group.
type executor struct {
	env  *rl.Env
	gate *gate
}

func (e executor) Execute(ctx context.Context, t schemas.Trajectory) (execute.Result, error) {
	step, g, i, tr, err := place(t)
	if err != nil {
		return execute.Result{Status: schemas.ExecSandboxError, Detail: err.Error()}, nil
	}
	if err := e.gate.wait(ctx, t.Step, t.GroupID); err != nil {
		return execute.Result{}, err
	}
	return execute.Result{Status: schemas.ExecScored, Score: e.env.ExecuteAt(step, g, i, tr)}, nil
}

// place reads a trajectory's place in the simulation from its Meta.
func place(t schemas.Trajectory) (step, g, i int, tr rl.Traj, err error) {
	vals := make([]int, 5)
	for k, key := range []string{metaStep, metaGroup, metaIndex, metaTask, metaStyle} {
		ok, err := t.Meta.Get(key, &vals[k])
		if err == nil && !ok {
			err = fmt.Errorf("no %s in %s", key, t.Meta)
		}
		if err != nil {
			return 0, 0, 0, tr, fmt.Errorf("simrl: trajectory %s: %w", t.TrajID, err)
		}
	}
	return vals[0], vals[1], vals[2], rl.Traj{Task: vals[3], Style: vals[4]}, nil
}

// gate releases a step's anchor groups in group order: one may execute
// once every anchor group before it in the step's plan is absorbed.
type gate struct {
	mu       sync.Mutex
	changed  chan struct{} // closed and replaced on every change
	anchors  map[int64][]string
	absorbed map[string]bool
	errs     chan error
}

func newGate() *gate {
	return &gate{changed: make(chan struct{}), anchors: map[int64][]string{}, absorbed: map[string]bool{}, errs: make(chan error, 1)}
}

func (g *gate) fail(err error) {
	select {
	case g.errs <- err:
	default:
	}
}

func (g *gate) plan(data []byte) error {
	var p schemas.Plan
	if err := json.Unmarshal(data, &p); err != nil {
		return err
	}
	var ids []string
	for _, pg := range p.Groups {
		if pg.Anchor {
			ids = append(ids, pg.GroupID)
		}
	}
	slices.Sort(ids)
	g.mu.Lock()
	g.anchors[p.Step] = ids
	g.signal()
	return nil
}

func (g *gate) calibration(data []byte) error {
	var c schemas.Calibration
	if err := json.Unmarshal(data, &c); err != nil {
		return err
	}
	g.mu.Lock()
	g.absorbed[fmt.Sprintf("%d/%s", c.Step, c.GroupID)] = true
	g.signal()
	return nil
}

// signal wakes the waiters; called with mu held, it releases it.
func (g *gate) signal() {
	close(g.changed)
	g.changed = make(chan struct{})
	g.mu.Unlock()
}

func (g *gate) open(step int64, group string) (bool, chan struct{}) {
	g.mu.Lock()
	defer g.mu.Unlock()
	ids, ok := g.anchors[step]
	if !ok {
		return false, g.changed
	}
	for _, id := range ids {
		if id >= group {
			break
		}
		if !g.absorbed[fmt.Sprintf("%d/%s", step, id)] {
			return false, g.changed
		}
	}
	return true, nil
}

func (g *gate) wait(ctx context.Context, step int64, group string) error {
	for {
		ok, changed := g.open(step, group)
		if ok {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
