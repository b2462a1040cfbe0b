package fuse

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/calibrate"
)

// FuzzAnyScoresFuseToFiniteNumbers feeds steps of scores the wire can carry
// (any finite float64 an outside stage, a world model or an executor might
// send) through the calibrate and fuse cores, each message as JSON through
// schemas.Decode as the stages read it. Whatever Decode accepts must give a
// calibration and an update that encode (JSON has no NaN or infinity: one
// that does not would stop its stage for good) and that their readers
// take, with finite numbers and rho in its bounds. Run it longer with make fuzz.
func FuzzAnyScoresFuseToFiniteNumbers(f *testing.F) {
	f.Add(floatBytes(0.1, 0.9, 0.3, 0.7, 0.5, 0.2, 0.8, 0.4))
	f.Add(floatBytes(1e308, -1e308, 1.7e308, 0.5, 1e154, -1e154, 5e-324, 0))
	f.Add(floatBytes(0.5, 0.5, 0.5, 0.5000000001, 1e-300, 0, 1, 1))
	f.Add(floatBytes(1e100, -1e100, 1e100, 1e100, -1e100, 0.5, 1e-9, 1e100))
	f.Fuzz(func(t *testing.T, data []byte) {
		xs := floats(data)
		if len(xs) == 0 {
			return
		}
		next := func() float64 { v := xs[0]; xs = append(xs[1:], v); return v }
		deb, err := calibrate.NewDebiaser(calibrate.DebiaserConfig{MinPairs: 2, RefitEvery: 2, Bins: int(data[0] % 3 * 5), BeforeFit: calibrate.BeforeFitMean})
		if err != nil {
			t.Fatal(err)
		}
		cal := &calibrate.Stage{RunID: "r", Deb: deb}
		steps, err := NewSteps(StepsConfig{Run: "r", Debias: true, AnchorDeadline: time.Hour, Denoiser: DenoiserConfig{Warmup: 2}})
		if err != nil {
			t.Fatal(err)
		}
		n := 2 + int(data[0]%7)
		t0 := time.Unix(0, 0)
		for step := range int64(8) {
			plan := schemas.Plan{Schema: schemas.Version, Run: "r", Step: step}
			for _, g := range []string{"a", "w"} {
				pg := schemas.PlanGroup{GroupID: g, Anchor: g == "a"}
				for i := range n {
					pg.TrajIDs = append(pg.TrajIDs, fmt.Sprintf("%s%d", g, i))
				}
				plan.Groups = append(plan.Groups, pg)
			}
			var p schemas.Plan
			decodeOrSkip(t, plan, &p)
			steps.AddPlan(p, t0)
			pairs := schemas.PairGroup{Schema: schemas.Version, Run: "r", Step: step, GroupID: "a"}
			for _, g := range plan.Groups {
				pred := schemas.Prediction{Schema: schemas.Version, Run: "r", Step: step, GroupID: g.GroupID}
				exec := schemas.Execution{Schema: schemas.Version, Run: "r", Step: step, GroupID: g.GroupID}
				for _, id := range g.TrajIDs {
					v, truth := next(), next()
					pred.Items = append(pred.Items, schemas.PredItem{TrajID: id, Score: &v, Status: schemas.PredOK})
					exec.Items = append(exec.Items, schemas.ExecItem{TrajID: id, Score: &truth, Status: schemas.ExecScored})
					pairs.Pairs = append(pairs.Pairs, schemas.PairItem{TrajID: id, Predicted: v, True: truth})
				}
				var pr schemas.Prediction
				if decodeOrSkip(t, pred, &pr) {
					steps.AddPrediction(pr)
				}
				if !g.Anchor {
					continue
				}
				var ex schemas.Execution
				if decodeOrSkip(t, exec, &ex) {
					steps.AddExecution(ex)
				}
				b, err := json.Marshal(pairs)
				if err != nil {
					continue
				}
				c, err := cal.Absorb(b)
				if errors.Is(err, schemas.ErrInvalid) {
					continue // dead-lettered by the stage
				}
				if err != nil {
					t.Fatalf("step %d: absorb: %v", step, err)
				}
				var cd schemas.Calibration
				if !decodeOrSkip(t, *c, &cd) {
					t.Fatalf("step %d: the calibration of a pair group calibrate accepted is refused: %+v", step, *c)
				}
				if err := steps.AddCalibration(cd); err != nil {
					t.Fatalf("step %d: %v", step, err)
				}
			}
			for _, n := range steps.Ready(t0.Add(2 * time.Hour)) {
				u := steps.Fuse(n, t0)
				steps.Close(n)
				m, err := schemas.NewMessage("u", u)
				if err != nil {
					t.Fatalf("step %d: the update cannot be sent: %v", n, err)
				}
				var back schemas.Update
				if err := schemas.Decode(m.Payload, "r", &back); err != nil {
					t.Fatalf("step %d: the archive refuses the update: %v", n, err)
				}
				if !(u.Rho >= 1 && u.Rho <= 4) {
					t.Fatalf("step %d: rho %v", n, u.Rho)
				}
				for _, it := range u.Items {
					if !finiteAll(it.Advantage, it.Weight, it.FusedAdvantage) {
						t.Fatalf("step %d: %+v", n, it)
					}
				}
			}
		}
	})
}

// decodeOrSkip sends v through JSON and schemas.Decode into dst, as a stage
// reads it: false when the wire cannot carry it or Decode refuses it (then
// as invalid, to be dead-lettered).
func decodeOrSkip(t *testing.T, v any, dst schemas.Internal) bool {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		return false // a NaN or infinity: JSON cannot carry it
	}
	err = schemas.Decode(b, "r", dst)
	if err != nil && !errors.Is(err, schemas.ErrInvalid) {
		t.Fatalf("decode: %v is not ErrInvalid", err)
	}
	return err == nil
}

func floatBytes(vs ...float64) []byte {
	b := make([]byte, 1, 1+8*len(vs))
	for _, v := range vs {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(v))
	}
	return b
}

// floats reads data after its first byte as float64s, 8 bytes each.
func floats(data []byte) []float64 {
	var out []float64
	for i := 1; i+8 <= len(data); i += 8 {
		out = append(out, math.Float64frombits(binary.LittleEndian.Uint64(data[i:])))
	}
	return out
}

func finiteAll(vs ...float64) bool {
	for _, v := range vs {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return false
		}
	}
	return true
}
