package pipeline

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// A server that crashed with its process (a `wmrl run` killed, a disk that
// filled) can lose what it had counted of its consumers' deliveries and
// acknowledgements, and deliver route the trajectories of steps planned
// before as new. Those its steps' plans took are copies, and are let go;
// before, route dead-lettered every one as a late trajectory ("step 322
// was already closed (a trainer resumed from a checkpoint ...)"): 184 of
// them after six SIGKILLs of a run here, a false alarm for each. Here the
// consumers are deleted, so every trajectory comes again as new.
func TestTrajectoriesOfPlannedStepsDeliveredAsNewAreCopies(t *testing.T) {
	t.Parallel() // waits far more than it computes: see the Makefile
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := testConfig(t)
	cfg.Steps = 4
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}

	srv, err := natsjs.StartServer(ctx, natsjs.ServerConfig{StoreDir: cfg.storeDir()})
	if err != nil {
		t.Fatal(err)
	}
	nc, js := clientOf(t, srv.URL())
	for _, kind := range []schemas.Kind{schemas.KindTraj, schemas.KindTrajs, schemas.KindStep} {
		if err := js.DeleteConsumer(ctx, StreamName("wmrl"), consumerName(StageRoute, "default", kind)); err != nil {
			t.Fatalf("consumer of %s: %v", kind, err)
		}
	}
	nc.Close()
	srv.Shutdown()

	cfg.Steps = 6
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if letters := readStored(t, cfg.DataDir, "wmrl.default.dlq"); len(letters) > 0 {
		var d schemas.DeadLetter
		json.Unmarshal(letters[0], &d)
		t.Errorf("%d dead letters, the first %s: %s; want none: each trajectory was planned once", len(letters), d.Stage, d.Reason)
	}
	steps := map[int64]int{}
	for _, b := range readStored(t, cfg.DataDir, "wmrl.default.update") {
		var u schemas.Update
		json.Unmarshal(b, &u)
		steps[u.Step]++
	}
	for s := range int64(6) {
		if steps[s] != 1 {
			t.Errorf("step %d updated %d times; want once", s, steps[s])
		}
	}
}
