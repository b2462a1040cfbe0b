package fuse

import (
	"encoding/json"
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/wmrl/wmrl/stages/calibrate"
)

func mustDenoiser(t *testing.T, cfg DenoiserConfig) *Denoiser {
	t.Helper()
	d, err := NewDenoiser(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// correlatedGroup draws s ~ N(0,1) and d with within-group correlation r.
func correlatedGroup(rng *rand.Rand, n int, r float64) (d, s []float64) {
	d, s = make([]float64, n), make([]float64, n)
	for i := range s {
		s[i] = rng.NormFloat64()
		d[i] = r*s[i] + math.Sqrt(1-r*r)*rng.NormFloat64()
	}
	return d, s
}

func TestAdvantageEstimatorTracksCorrelation(t *testing.T) {
	for _, tc := range []struct {
		r, want float64
	}{
		{1, 1},     // perfect world model
		{0.9, 1.2}, // 1 + 2(1 - r)
		{0.5, 2},   //
		{0, 3},     // independent
		{-0.8, 4},  // anti-correlated: 1 + 3.6 = 4.6, clipped
	} {
		d := mustDenoiser(t, DenoiserConfig{Estimator: EstimatorAdvantage})
		rng := rand.New(rand.NewPCG(1, uint64(tc.r*100+100)))
		sum, n := 0.0, 0
		for g := 0; g < 3000; g++ {
			cal, truth := correlatedGroup(rng, 16, tc.r)
			rho, _ := d.Observe(cal, truth)
			if g >= 1000 {
				sum += rho
				n++
			}
		}
		got := sum / float64(n)
		if math.Abs(got-tc.want) > 0.1*tc.want {
			t.Errorf("r=%v: mean rho %v, want %v within 10%%", tc.r, got, tc.want)
		}
	}
}

// A flat calibration map (the isotonic fit of an anti-correlated world
// model, or the map before its first fit) gives every anchor group the same
// calibrated score. The advantage estimator reads that as a world model
// without information, as it reads an independent one: rho 1 + 2 = 3, not
// the 1 + mean(A_s^2) = 2 of the all-zero advantages.
func TestAdvantageEstimatorReadsAFlatMapAsNoInformation(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 5))
	flat := mustDenoiser(t, DenoiserConfig{Estimator: EstimatorAdvantage})
	independent := mustDenoiser(t, DenoiserConfig{Estimator: EstimatorAdvantage})
	for g := 0; g < 2000; g++ {
		noise, s := correlatedGroup(rng, 8, 0)
		cal := make([]float64, len(s))
		for i := range cal {
			cal[i] = 0.4 + 1e-6*noise[i] // within 1e-9 of variance: flat
		}
		flat.Observe(cal, s)
		independent.Observe(noise, s)
	}
	if got := flat.Rho(); math.Abs(got-3) > 1e-9 {
		t.Errorf("flat map: rho %v, want exactly 3 (gap 2 per group)", got)
	}
	if got, want := flat.Rho(), independent.Rho(); got < want-0.2 {
		t.Errorf("flat map: rho %v is below an independent world model's %v", got, want)
	}
}

func TestRatioEstimatorReadsVarianceRatio(t *testing.T) {
	for _, nsr := range []float64{0.25, 1, 2} { // noise / signal variance
		d := mustDenoiser(t, DenoiserConfig{Estimator: EstimatorRatio, RhoMax: 10})
		rng := rand.New(rand.NewPCG(2, uint64(nsr*100)))
		sum, n := 0.0, 0
		for g := 0; g < 3000; g++ {
			s, cal := make([]float64, 8), make([]float64, 8)
			for i := range s {
				s[i] = rng.NormFloat64()
				cal[i] = s[i] + math.Sqrt(nsr)*rng.NormFloat64() // d = s + noise, uncalibrated
			}
			rho, _ := d.Observe(cal, s)
			if g >= 1000 {
				sum += rho
				n++
			}
		}
		if got, want := sum/float64(n), 1+nsr; math.Abs(got-want) > 0.1*want {
			t.Errorf("noise/signal %v: mean rho %v, want %v within 10%%", nsr, got, want)
		}
	}
}

// A group whose true scores barely exceed the variance threshold gives an
// enormous D. The reference lets it swamp the EWMA; the ratio estimator
// (ratio of averages) and the advantage gap (bounded) do not.
func TestNearDegenerateGroupCannotSwamp(t *testing.T) {
	cal, truth := []float64{0.45, 0.55}, []float64{0.5, 0.50007} // D = 2e6
	ref := mustDenoiser(t, DenoiserConfig{Estimator: EstimatorReference, Warmup: 1})
	ref.Observe(cal, truth)
	if ref.Signal() < 1e6 {
		t.Fatalf("reference D = %v; WMRL.md documents ~2e6 for this group", ref.Signal())
	}
	rng := rand.New(rand.NewPCG(3, 3))
	for _, est := range []Estimator{EstimatorRatio, EstimatorAdvantage} {
		d := mustDenoiser(t, DenoiserConfig{Estimator: est, Warmup: 1})
		for g := 0; g < 200; g++ {
			c, s := correlatedGroup(rng, 8, 0.9)
			d.Observe(c, s)
		}
		before := d.Signal()
		d.Observe(cal, truth)
		if after := d.Signal(); after > before+0.5 {
			t.Errorf("%s: one near-degenerate group moved the signal from %v to %v", est, before, after)
		}
	}
}

func TestReferenceEstimatorBehaviour(t *testing.T) {
	cfg := DenoiserConfig{Estimator: EstimatorReference, Warmup: 4}
	d := mustDenoiser(t, cfg)
	alpha := 1 - math.Pow(0.5, 1.0/64)
	groupD := func(cal, s []float64) float64 {
		ms, vs := meanVar(s)
		md, _ := meanVar(cal)
		num := 0.0
		for i := range s {
			e := (cal[i] - md) - (s[i] - ms)
			num += e * e
		}
		return num / float64(len(s)) / vs
	}
	// Skipped: variance below 1e-9 is not counted.
	if _, counted := d.Observe([]float64{0.1, 0.9}, []float64{0.5, 0.5}); counted || d.Count() != 0 {
		t.Fatal("a group with constant truth was counted")
	}
	rng := rand.New(rand.NewPCG(4, 4))
	ewma := 0.0
	for g := 1; g <= 10; g++ {
		cal, s := correlatedGroup(rng, 8, 0.7)
		D := groupD(cal, s)
		if g == 1 {
			ewma = D // starts at the first D, no blend with 0
		} else {
			ewma = alpha*D + (1-alpha)*ewma
		}
		rho, counted := d.Observe(cal, s)
		if !counted || math.Abs(d.Signal()-ewma) > 1e-12 {
			t.Fatalf("group %d: EWMA %v, want %v", g, d.Signal(), ewma)
		}
		switch {
		case g < 4 && rho != 1:
			t.Fatalf("group %d: rho %v before warm-up, want exactly 1", g, rho)
		case g == 4 && math.Abs(rho-2) > 1e-12:
			t.Fatalf("warm-up group: rho %v, want the target 2 at once", rho)
		case g > 4:
			c := 1 / d.Snapshot().C
			want := min(4, max(1, 1+ewma/c))
			if math.Abs(rho-want) > 1e-12 {
				t.Fatalf("group %d: rho %v, want %v", g, rho, want)
			}
		}
	}
}

// A perfect world model through warm-up (D = 0) defers fixing c until the
// EWMA exceeds 1e-12; then the first tiny D fixes a huge c, saturating the
// weight: the reference's documented weak spot.
func TestReferenceDeferredCalibration(t *testing.T) {
	d := mustDenoiser(t, DenoiserConfig{Estimator: EstimatorReference, Warmup: 3})
	s := []float64{0.1, 0.4, 0.9}
	for g := 0; g < 5; g++ {
		if rho, _ := d.Observe(s, s); rho != 1 {
			t.Fatalf("perfect group %d: rho %v, want 1 (c deferred)", g, rho)
		}
	}
	if d.Snapshot().CFixed {
		t.Fatal("c fixed with a zero EWMA")
	}
	rho, _ := d.Observe([]float64{0.1, 0.4, 0.9001}, s)
	if math.Abs(rho-2) > 1e-9 || !d.Snapshot().CFixed {
		t.Fatalf("first non-zero D: rho %v, want the target 2 and c fixed", rho)
	}
	rho, _ = d.Observe([]float64{0.9, 0.4, 0.1}, s)
	if rho != 4 {
		t.Fatalf("after a huge c, a bad group: rho %v, want saturation at 4", rho)
	}
}

func TestOffEstimatorKeepsRhoOne(t *testing.T) {
	d := mustDenoiser(t, DenoiserConfig{Estimator: EstimatorOff, Warmup: 1})
	rng := rand.New(rand.NewPCG(5, 5))
	for g := 0; g < 100; g++ {
		c, s := correlatedGroup(rng, 8, -0.5)
		if rho, _ := d.Observe(c, s); rho != 1 {
			t.Fatalf("rho %v with denoising off", rho)
		}
	}
	if d.Signal() < 1 {
		t.Fatalf("the signal is still tracked for audits, got %v", d.Signal())
	}
}

func TestDenoiserConfigErrors(t *testing.T) {
	for _, cfg := range []DenoiserConfig{
		{Estimator: "magic"}, {HalfLife: -1}, {Warmup: -1}, {Target: 0.5}, {RhoMin: 2, RhoMax: 1}, {MinVar: -1},
	} {
		if _, err := NewDenoiser(cfg); !errors.Is(err, ErrConfig) {
			t.Errorf("%+v: got %v, want ErrConfig", cfg, err)
		}
	}
}

// The reference scores an anchor group in-sample (map refitted after its own
// pairs), the others out-of-sample (map from before).
func TestCorrectorSampleOrder(t *testing.T) {
	for _, est := range []Estimator{EstimatorReference, EstimatorAdvantage} {
		cfg := DefaultCorrectorConfig()
		cfg.Debiaser = calibrate.DebiaserConfig{MinPairs: 8, RefitEvery: 8, BufferSize: 100}
		cfg.Denoiser = DenoiserConfig{Estimator: est, Warmup: 1}
		c, err := NewCorrector(cfg)
		if err != nil {
			t.Fatal(err)
		}
		pred := []float64{0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8}
		truth := []float64{0.8, 0.1, 0.7, 0.2, 0.6, 0.3, 0.5, 0.4}
		res, err := c.ObserveAnchorGroup(pred, truth)
		if err != nil || res.Refits != 1 {
			t.Fatalf("%s: %+v %v; want one refit", est, res, err)
		}
		// Out-of-sample, the map was the identity when the group was scored.
		// In-sample, it was the fitted map (here nearly flat).
		ref := mustDenoiser(t, cfg.Denoiser)
		scored := pred
		if est == EstimatorReference {
			scored = c.Debiaser().Map().PredictBatch(nil, pred)
		}
		want, _ := ref.Observe(scored, truth)
		if res.Rho != want || c.Denoiser().Signal() != ref.Signal() {
			t.Fatalf("%s: signal %v, want %v", est, c.Denoiser().Signal(), ref.Signal())
		}
	}
}

func TestCorrectorSnapshotRoundTrip(t *testing.T) {
	c, _ := NewCorrector(DefaultCorrectorConfig())
	rng := rand.New(rand.NewPCG(6, 6))
	feed := func(c *Corrector, n int, rng *rand.Rand) {
		for g := 0; g < n; g++ {
			d, s := correlatedGroup(rng, 8, 0.6)
			if _, err := c.ObserveAnchorGroup(d, s); err != nil {
				t.Fatal(err)
			}
		}
	}
	feed(c, 100, rng)
	raw, err := json.Marshal(c.Snapshot())
	if err != nil {
		t.Fatal(err)
	}
	var st CorrectorState
	if err := json.Unmarshal(raw, &st); err != nil {
		t.Fatal(err)
	}
	b, err := RestoreCorrector(st)
	if err != nil {
		t.Fatal(err)
	}
	feed(c, 50, rand.New(rand.NewPCG(7, 7)))
	feed(b, 50, rand.New(rand.NewPCG(7, 7)))
	if c.Rho() != b.Rho() || c.Debiaser().Version() != b.Debiaser().Version() || c.Calibrate(0.37) != b.Calibrate(0.37) {
		t.Fatalf("diverged after restore: rho %v/%v version %d/%d", c.Rho(), b.Rho(), c.Debiaser().Version(), b.Debiaser().Version())
	}
}
