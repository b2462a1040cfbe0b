package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/connectors/openai"
	"github.com/wmrl/wmrl/schemas"
)

// streamR starts a server with a stream S of subjects r.>, for one test,
// and publishes a value to a subject with a message ID.
func streamR(t *testing.T, ctx context.Context) (jetstream.JetStream, func(subject, id string, v any)) {
	t.Helper()
	srv, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	nc, err := srv.Connect("gateway-test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, _ := jetstream.New(nc)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"r.>"}}); err != nil {
		t.Fatal(err)
	}
	return js, func(subject, id string, v any) {
		t.Helper()
		b, _ := json.Marshal(v)
		if _, err := js.Publish(ctx, subject, b, jetstream.WithMsgID(id)); err != nil {
			t.Fatal(err)
		}
	}
}

// A gateway that starts on a long run reads the updates from the newest
// stored on whole, and indexes those before it from their IDs alone (a
// trainer asking for one gets it from the stream); it puts the newest
// calibration fuse takes in force without reading the others; it knows the
// planned steps from the plans' IDs. Before, it read every update whole
// before it served a new one.
func TestAStartReadsOnlyTheNewUpdatesWhole(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, publish := streamR(t, ctx)
	update := func(step int64) {
		publish("r.update", fmt.Sprintf("r/update/%d", step), schemas.Update{Schema: schemas.Version, Run: "r", Step: step, Rho: float64(step)})
	}
	calibration := func(version int64, y []float64) {
		publish("r.calibration", fmt.Sprintf("r/calibration/%d", version),
			schemas.Calibration{Schema: schemas.Version, Run: "r", Seq: version, Version: version, Map: &schemas.Thresholds{X: []float64{0, 1}, Y: y}})
	}
	for step := range int64(300) {
		publish("r.plan", fmt.Sprintf("r/plan/%d", step), schemas.Plan{Schema: schemas.Version, Run: "r", Step: step})
		update(step)
	}
	calibration(1, []float64{0.1, 0.5})
	calibration(2, []float64{0.2, 0.6})
	calibration(3, []float64{0.6, 0.2}) // a map going down: fuse refuses it

	g, err := New(Config{Run: "r", Stream: "S", KeepUpdates: 16, WorldModel: &openai.WorldModel{},
		Subjects: Subjects{Update: "r.update", Plan: "r.plan", Calibration: "r.calibration", Exec: "r.exec", Execution: "r.execution"}}, js, nil)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(g.Handler())
	defer hs.Close()
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get(hs.URL + "/v1/runs/r" + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	until(t, "the updates stored before the start are indexed", func() bool {
		g.updates.mu.Lock()
		defer g.updates.mu.Unlock()
		return !g.updates.loading && len(g.updates.seq) == 300
	})
	for _, step := range []int64{0, 150, 299} {
		if code, body := get(fmt.Sprintf("/steps/%d/update", step)); code != http.StatusOK || !strings.Contains(body, fmt.Sprintf(`"step":%d,`, step)) {
			t.Errorf("step %d's update: %d %s", step, code, body)
		}
	}
	update(300)
	if code, body := get("/steps/300/update?wait=10"); code != http.StatusOK || !strings.Contains(body, `"step":300,`) {
		t.Errorf("step 300's update, stored after the start: %d %s", code, body)
	}
	g.updates.mu.Lock()
	whole := g.updates.whole.Len()
	g.updates.mu.Unlock()
	if whole != 2 {
		t.Errorf("%d updates read whole; want 2 (the newest at the start, and step 300)", whole)
	}
	if code, body := get("/steps"); code != http.StatusOK || !strings.Contains(body, `"planned":299`) || !strings.Contains(body, `"fused":300`) {
		t.Errorf("steps: %d %s; want planned 299, fused 300", code, body)
	}
	if st := g.cal.Load(); st == nil || st.c.Version != 2 {
		t.Errorf("calibration in force: %+v; want version 2, the newest fuse takes", st)
	}
	calibration(4, []float64{0.3, 0.7})
	until(t, "calibration 4 is in force", func() bool { st := g.cal.Load(); return st != nil && st.c.Version == 4 })
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run: %v", err)
	}
}

// The updates stored before the start are indexed newest first: those of
// the newest KeepUpdates steps, which a trainer a few steps behind asks
// for, then the rest; each once, the newest, read whole, not at all.
// Before, the index went from the first retained, and a step just behind
// the newest waited for the whole read (2.5 to 10.9 s at 13,704 steps).
func TestTheNewestUpdatesAreIndexedFirst(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, publish := streamR(t, ctx)
	for step := range int64(300) {
		publish("r.update", fmt.Sprintf("r/update/%d", step), schemas.Update{Schema: schemas.Version, Run: "r", Step: step})
		publish("r.plan", fmt.Sprintf("r/plan/%d", step), schemas.Plan{Schema: schemas.Version, Run: "r", Step: step})
	}
	g, err := New(Config{Run: "r", Stream: "S", KeepUpdates: 16, WorldModel: &openai.WorldModel{},
		Subjects: Subjects{Update: "r.update", Plan: "r.plan"}}, js, nil)
	if err != nil {
		t.Fatal(err)
	}
	var order []int64
	g.updates.indexed = func(step int64) { order = append(order, step) }
	last, data, err := newestOn(ctx, js, "S", "r.update")
	if err != nil {
		t.Fatal(err)
	}
	if err := g.indexUpdates(ctx, "r.update", last, data); err != nil {
		t.Fatal(err)
	}
	var want []int64
	for step := range int64(16) {
		want = append(want, 283+step)
	}
	for step := range int64(283) {
		want = append(want, step)
	}
	if !slices.Equal(order, want) {
		t.Errorf("indexed %d updates in the order %v ... %v; want steps 283 to 298, then 0 to 282", len(order), order[:min(20, len(order))], order[max(0, len(order)-3):])
	}

	// The plans alike, the newest first of all; then the gateway follows
	// the new ones, and a stop is no error.
	added := make(chan int64, 400)
	g.planned.added = func(step int64) { added <- step }
	g.planned.setLoading(true) // as Run does
	follows, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- g.followPlans(follows) }()
	next := func() int64 {
		t.Helper()
		select {
		case step := <-added:
			return step
		case <-ctx.Done():
			t.Fatal("no more plans read")
			return 0
		}
	}
	var plans []int64
	for len(plans) < 300 {
		plans = append(plans, next())
	}
	if want = append([]int64{299}, want...); !slices.Equal(plans, want) {
		t.Errorf("read %d plans in the order %v ... %v; want steps 299, 283 to 298, then 0 to 282", len(plans), plans[:min(20, len(plans))], plans[max(0, len(plans)-3):])
	}
	publish("r.plan", "r/plan/300", schemas.Plan{Schema: schemas.Version, Run: "r", Step: 300})
	if step := next(); step != 300 {
		t.Errorf("a plan stored after the start: step %d; want 300", step)
	}
	if g.planned.unsure(-1) {
		t.Errorf("the plans stored before the start are read, and a trajectory of a step before them is still not taken")
	}
	stop()
	if err := <-done; err != nil {
		t.Errorf("followPlans stopped: %v; want nil", err)
	}
}

// A stop while the plans stored before the start are read is a stop: no
// error, and the gateway no longer holds trajectories back for them.
func TestAStopWhileThePlansAreReadIsAStop(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, publish := streamR(t, ctx)
	for step := range int64(300) {
		publish("r.plan", fmt.Sprintf("r/plan/%d", step), schemas.Plan{Schema: schemas.Version, Run: "r", Step: step})
	}
	g, err := New(Config{Run: "r", Stream: "S", KeepUpdates: 16, WorldModel: &openai.WorldModel{}, Subjects: Subjects{Plan: "r.plan"}}, js, nil)
	if err != nil {
		t.Fatal(err)
	}
	follows, stop := context.WithCancel(ctx)
	n := 0
	g.planned.added = func(int64) {
		if n++; n == 20 {
			stop() // the read is under way: this runs in it
		}
	}
	g.planned.setLoading(true)
	if err := g.followPlans(follows); err != nil {
		t.Errorf("followPlans stopped while it read the stored plans: %v; want nil", err)
	}
	if g.planned.unsure(-1) {
		t.Errorf("a stopped read of the plans still holds trajectories back")
	}
}

// While the updates stored before the start are being indexed, a step not
// found may be among them: the answer is a 503 to ask again, not a 404.
func TestAStepNotFoundWhileTheOldUpdatesAreReadIsA503(t *testing.T) {
	g, url := newGateway(t, "http://127.0.0.1:1", nil)
	g.updates.setLoading(true)
	resp, err := http.Get(url + "/steps/5/update")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
		t.Errorf("while indexing: %d, Retry-After %q; want 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	g.updates.setLoading(false)
	if resp, err = http.Get(url + "/steps/5/update"); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("once indexed: %d; want 404", resp.StatusCode)
	}
}

// While the plans stored before the start are read, a trajectory for a
// step at or before the newest plan may be one of a planned step: it is
// answered 503, to send again, not stored for route to dead-letter after a
// 202. One past the newest plan is taken; once the plans are read, one of
// a planned step is a 409 and of another step taken.
func TestATrajectoryWhileThePlansAreReadIsA503(t *testing.T) {
	t.Parallel()
	pub := &keeping{}
	g, err := New(Config{Run: "r", WorldModel: &openai.WorldModel{}}, nil, pub)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(g.Handler())
	defer srv.Close()
	send := func(step int64, want int) {
		t.Helper()
		body := fmt.Sprintf(`[{"schema":1,"run":"r","step":%d,"group_id":"g","traj_id":"t","group_size":1,"task_id":"x","prompt":"p","response":"r","policy_version":0}]`, step)
		resp, err := http.Post(srv.URL+"/v1/runs/r/trajectories", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("a trajectory of step %d: %d %s; want %d", step, resp.StatusCode, b, want)
		}
		if want == http.StatusServiceUnavailable && (resp.Header.Get("Retry-After") == "" || !strings.Contains(string(b), fmt.Sprintf("step %d may be", step))) {
			t.Errorf("a trajectory of step %d while the plans are read: Retry-After %q, %s; want a Retry-After and why", step, resp.Header.Get("Retry-After"), b)
		}
	}
	g.planned.setLoading(true)
	send(3, http.StatusAccepted) // before the newest plan is known: a new run's first step is taken at once
	g.planned.add(10)            // the newest plan, read first
	send(4, http.StatusServiceUnavailable)
	send(10, http.StatusConflict)
	send(11, http.StatusAccepted)
	g.planned.add(4)
	send(4, http.StatusConflict)
	send(5, http.StatusServiceUnavailable)
	g.planned.setLoading(false)
	send(5, http.StatusAccepted)
	if got := pub.steps(); !slices.Equal(got, []int64{3, 11, 5}) {
		t.Errorf("stored trajectories of steps %v; want 3, 11, then 5", got)
	}
}

// keeping is a publisher that keeps what it is given.
type keeping struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (k *keeping) Publish(_ string, msgs ...*message.Message) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.msgs = append(k.msgs, msgs...)
	return nil
}

func (k *keeping) Close() error { return nil }

// steps are the steps of the trajectories published, in order.
func (k *keeping) steps() []int64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	var steps []int64
	for _, m := range k.msgs {
		var t schemas.Trajectory
		if json.Unmarshal(m.Payload, &t) == nil {
			steps = append(steps, t.Step)
		}
	}
	return steps
}

// A gateway that starts on a long run reads the anchor groups and
// executions of the newest steps alone, as many as the real scores it
// keeps fill, and has their scores; one whose run is shorter reads them
// all. Before, a start read every retained one whole.
func TestAStartReadsTheAnchorsOfTheNewestStepsAlone(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	js, publish := streamR(t, ctx)
	solution := func(step int64, gid string, i int) (prompt, response string) {
		return fmt.Sprintf("task of %s", gid), fmt.Sprintf("solution %d of group %s, step %d", i, gid, step)
	}
	score := func(step int64, i int) float64 { return float64(step%50)/100 + float64(i)/1000 }
	known := func(tr *truths, step int64, gid string, i int) bool {
		_, ok := tr.lookup(solution(step, gid, i))
		return ok
	}
	// A step: two anchor groups of 4 and two groups for the world model
	// alone; the anchors' executions come a step later, as they do.
	step := func(step int64) {
		plan := schemas.Plan{Schema: schemas.Version, Run: "r", Step: step}
		for k := range 4 {
			gid := fmt.Sprintf("g%d-%d", step, k)
			pg := schemas.PlanGroup{GroupID: gid, Anchor: k < 2}
			gr := schemas.Group{Schema: schemas.Version, Run: "r", Step: step, GroupID: gid, Anchor: true}
			for i := range 4 {
				id := fmt.Sprintf("%s-%d", gid, i)
				pg.TrajIDs = append(pg.TrajIDs, id)
				prompt, response := solution(step, gid, i)
				gr.Trajectories = append(gr.Trajectories, schemas.Trajectory{Schema: schemas.Version, Run: "r", Step: step, GroupID: gid, TrajID: id, Prompt: prompt, Response: response})
			}
			plan.Groups = append(plan.Groups, pg)
			if pg.Anchor {
				publish("r.exec", fmt.Sprintf("r/exec/%d/%s", step, gid), gr)
			}
		}
		publish("r.plan", fmt.Sprintf("r/plan/%d", step), plan)
		if step == 0 {
			return
		}
		for k := range 2 {
			gid := fmt.Sprintf("g%d-%d", step-1, k)
			e := schemas.Execution{Schema: schemas.Version, Run: "r", Step: step - 1, GroupID: gid}
			for i := range 4 {
				s := score(step-1, i)
				e.Items = append(e.Items, schemas.ExecItem{TrajID: fmt.Sprintf("%s-%d", gid, i), Score: &s, Status: "ok"})
			}
			publish("r.execution", fmt.Sprintf("r/execution/%d/%s", step-1, gid), e)
		}
	}
	for s := range int64(200) {
		step(s)
	}
	start := func(keep int) *Gateway {
		t.Helper()
		g, err := New(Config{Run: "r", Stream: "S", WorldModel: &openai.WorldModel{},
			Subjects: Subjects{Update: "r.update", Plan: "r.plan", Calibration: "r.calibration", Exec: "r.exec", Execution: "r.execution"}}, js, nil)
		if err != nil {
			t.Fatal(err)
		}
		g.truths = newTruths(keep)
		go g.Run(ctx)
		return g
	}
	read := func(g *Gateway) int {
		g.truths.mu.Lock()
		defer g.truths.mu.Unlock()
		return g.truths.groups
	}
	// 80 scores kept, 8 anchored trajectories a step: the anchor groups
	// of steps 188 to 199 (one step more, for a step's anchors the newest
	// plan does not show all of; and the newest, executed later).
	// The groups and the executions are read apart: a step's execution
	// may be matched before the next step's groups are read, so wait for
	// both. A start that read older steps too would have read more than 24
	// groups by the time step 198's last anchor is known.
	g := start(80)
	until(t, "the newest step's anchors are read", func() bool { return read(g) >= 24 && known(g.truths, 198, "g198-1", 3) })
	if n := read(g); n != 24 {
		t.Errorf("%d anchor groups read at the start; want 24, those of steps 188 to 199", n)
	}
	for _, a := range []struct {
		step int64
		gid  string
		i    int
	}{{198, "g198-0", 0}, {190, "g190-1", 2}} {
		if got, ok := g.truths.lookup(solution(a.step, a.gid, a.i)); !ok || got != score(a.step, a.i) {
			t.Errorf("step %d's anchor %s-%d: %v %v; want its real score %v", a.step, a.gid, a.i, got, ok, score(a.step, a.i))
		}
	}
	step(200)
	until(t, "an anchor executed after the start has its real score", func() bool { return known(g.truths, 199, "g199-0", 1) })

	all := start(100_000)
	until(t, "every anchor is read by a gateway that keeps them all", func() bool { return read(all) == 402 })
	if !known(all.truths, 0, "g0-1", 0) {
		t.Errorf("the first step's anchors: no real score, in a run shorter than the scores kept")
	}
}
