package schemas

import (
	"errors"
	"math"
	"strconv"
	"strings"
	"testing"
)

// Every score an internal message carries is bounded by MaxScore, and
// what the stages compute from scores by twice it: beyond, the message is
// invalid, naming the value and where it is; at the bound, it is taken.
func TestDecodeRefusesScoresBeyondMaxScore(t *testing.T) {
	head := `"schema":1,"run":"r","step":2,"group_id":"g"`
	for _, tc := range []struct {
		kind    string
		payload string // %v is where the score goes
		v       Internal
		want    string
		max     float64
	}{
		{"pred", `{` + head + `,"items":[{"traj_id":"t0","score":0.5},{"traj_id":"t1","score":%v}]}`, &Prediction{}, "trajectory t1: score", MaxScore},
		{"pred spread", `{` + head + `,"items":[{"traj_id":"t1","score":0.5,"spread":%v}]}`, &Prediction{}, "trajectory t1: spread", MaxScore},
		{"execution", `{` + head + `,"items":[{"traj_id":"t1","score":%v,"status":"scored"}]}`, &Execution{}, "trajectory t1: score", MaxScore},
		{"execution seconds", `{` + head + `,"items":[{"traj_id":"t1","score":null,"seconds":%v}]}`, &Execution{}, "trajectory t1: seconds", MaxScore},
		{"pairs", `{` + head + `,"pairs":[{"traj_id":"t1","predicted":0.5,"true":%v}]}`, &PairGroup{}, "trajectory t1: true", MaxScore},
		{"calibration map", `{` + head + `,"seq":1,"map":{"x":[0,1],"y":[0,%v]}}`, &Calibration{}, "map y", maxDerived},
		{"calibration pair", `{` + head + `,"seq":1,"pairs":[{"traj_id":"t1","before":%v}]}`, &Calibration{}, "trajectory t1: before", maxDerived},
		{"update rho", `{"schema":1,"run":"r","step":2,"rho":%v}`, &Update{}, "rho", maxDerived},
		{"update item", `{"schema":1,"run":"r","step":2,"rho":1,"items":[{"traj_id":"t1","calibrated":%v}]}`, &Update{}, "trajectory t1: calibrated", maxDerived},
	} {
		for _, v := range []float64{tc.max, -tc.max, 0.25} {
			if err := Decode([]byte(strings.Replace(tc.payload, "%v", num(v), 1)), "r", tc.v); err != nil {
				t.Errorf("%s: %v refused: %v", tc.kind, v, err)
			}
		}
		for _, v := range []float64{math.Nextafter(tc.max, math.Inf(1)), -1e300, math.MaxFloat64} {
			err := Decode([]byte(strings.Replace(tc.payload, "%v", num(v), 1)), "r", tc.v)
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want+" "+num(v)+" is beyond ±"+num(tc.max)) {
				t.Errorf("%s: %v: got %v, want an ErrInvalid naming %q", tc.kind, v, err, tc.want)
			}
		}
	}
	var c Calibration
	err := Decode([]byte(`{"schema":1,"run":"r","seq":1,"map":{"x":[0,1],"y":[0]}}`), "r", &c)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "map has 2 thresholds x and 1 values y") {
		t.Errorf("a map with fewer values than thresholds: %v", err)
	}
}

// num is v as the error writes it (%g), which JSON reads.
func num(v float64) string { return strconv.FormatFloat(v, 'g', -1, 64) }
