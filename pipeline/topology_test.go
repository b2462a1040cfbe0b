package pipeline

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/wmrl/wmrl/schemas"
)

// A topology file is refused, saying why, when it names what is not there
// or a subject outside the prefix, and when it puts a stage before route
// on one of the two subjects trajectories come on and not the other: the
// other's trajectories would pass that stage without a word.
func TestATopologyIsRefusedSayingWhy(t *testing.T) {
	for _, tc := range []struct{ name, yaml, err string }{
		{"unknown stage", "stages: {rout: {in: {traj: wmrl.r.x}}}", `unknown stage "rout"`},
		{"unknown port", "stages: {route: {in: {pred: wmrl.r.x}}}", `stage route has no in port "pred"`},
		{"outside the prefix", "stages: {route: {in: {traj: other.r.x, trajs: other.r.y}}}", `must be a literal subject under "wmrl."`},
		{"a wildcard", "stages: {predict: {out: {pred: 'wmrl.r.*'}}}", "must be a literal subject"},
		{"traj alone", "stages: {route: {in: {traj: '{prefix}.{run}.traj_checked'}}}",
			`route's traj input is re-pointed (to "wmrl.r.traj_checked") and its trajs input is not: trajectories sent on wmrl.r.trajs would reach route without passing the stage that writes "wmrl.r.traj_checked"`},
		{"trajs alone", "stages: {route: {in: {trajs: wmrl.r.trajs_checked}}}",
			`route's trajs input is re-pointed (to "wmrl.r.trajs_checked") and its traj input is not`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "topology.yaml")
			if err := os.WriteFile(path, []byte(tc.yaml), 0o644); err != nil {
				t.Fatal(err)
			}
			if _, err := LoadTopology(path, "wmrl", "r"); err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%s: %v, want an error saying %q", tc.yaml, err, tc.err)
			}
		})
	}
	path := filepath.Join(t.TempDir(), "topology.yaml")
	both := "stages: {route: {in: {traj: '{prefix}.{run}.traj_checked', trajs: '{prefix}.{run}.trajs_checked'}}, predict: {out: {pred: wmrl.r.pred_raw}}}"
	if err := os.WriteFile(path, []byte(both), 0o644); err != nil {
		t.Fatal(err)
	}
	top, err := LoadTopology(path, "wmrl", "r")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ got, want string }{
		{top.In(StageRoute, schemas.KindTraj), "wmrl.r.traj_checked"}, {top.In(StageRoute, schemas.KindTrajs), "wmrl.r.trajs_checked"},
		{top.Out(StagePredict, schemas.KindPred), "wmrl.r.pred_raw"}, {top.In(StageFuse, schemas.KindPred), "wmrl.r.pred"},
		{top.Subject(schemas.KindTrajs), "wmrl.r.trajs"},
	} {
		if c.got != c.want {
			t.Errorf("port %q, want %q", c.got, c.want)
		}
	}
}
