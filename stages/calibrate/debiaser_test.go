package calibrate

import (
	"encoding/json"
	"errors"
	"math"
	"math/rand/v2"
	"testing"
)

func mustDebiaser(t *testing.T, cfg DebiaserConfig) *Debiaser {
	t.Helper()
	d, err := NewDebiaser(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// refitPushes pushes n spread-out pairs and returns the 1-based push numbers
// at which the map was refitted.
func refitPushes(t *testing.T, d *Debiaser, n int) []int {
	t.Helper()
	r := rand.New(rand.NewPCG(7, 7))
	var at []int
	for i := 1; i <= n; i++ {
		x := r.Float64()
		refit, err := d.Push(Pair{x, x * x})
		if err != nil {
			t.Fatal(err)
		}
		if refit {
			at = append(at, i)
		}
	}
	return at
}

func TestDebiaserReferenceCadence(t *testing.T) {
	tests := []struct {
		minPairs, every int
		want            []int
	}{
		{200, 64, []int{200, 264, 328, 392}},
		{10, 64, []int{64, 128, 192, 256, 320, 384}},
		{100, 100, []int{100, 200, 300, 400}},
		{0, 0, []int{200, 264, 328, 392}}, // zero: the defaults
	}
	for _, tt := range tests {
		cfg := DefaultDebiaserConfig()
		cfg.MinPairs, cfg.RefitEvery = tt.minPairs, tt.every
		if cfg.FirstFit() != tt.want[0] {
			t.Errorf("min %d every %d: FirstFit says %d, the first refit is at push %d", tt.minPairs, tt.every, cfg.FirstFit(), tt.want[0])
		}
		d := mustDebiaser(t, cfg)
		got := refitPushes(t, d, 400)
		if len(got) != len(tt.want) {
			t.Fatalf("min %d every %d: refits at %v, want %v", tt.minPairs, tt.every, got, tt.want)
		}
		for i := range got {
			if got[i] != tt.want[i] {
				t.Fatalf("min %d every %d: refits at %v, want %v", tt.minPairs, tt.every, got, tt.want)
			}
		}
		if d.Version() != int64(len(tt.want)) {
			t.Fatalf("version %d after %d refits", d.Version(), len(tt.want))
		}
	}
}

func TestDebiaserFailedFitRetriedNextPush(t *testing.T) {
	cfg := DefaultDebiaserConfig()
	cfg.MinPairs, cfg.RefitEvery, cfg.BeforeFit = 5, 5, BeforeFitIdentity // the reference
	d := mustDebiaser(t, cfg)
	// All in one bin: no fit possible, the identity stays.
	for i := 0; i < 8; i++ {
		refit, _ := d.Push(Pair{0.51 + float64(i)*0.001, 0.2})
		if refit {
			t.Fatalf("push %d: fitted with a single populated bin", i+1)
		}
	}
	if d.Version() != 0 || d.Predict(0.9) != 0.9 {
		t.Fatalf("identity expected before a fit: version %d, Predict(0.9)=%v", d.Version(), d.Predict(0.9))
	}
	// The next push with a second bin fits at once (the counter kept running).
	refit, _ := d.Push(Pair{0.05, 0.1})
	if !refit || d.Version() != 1 {
		t.Fatalf("push 9: refit %v, version %d; want a fit on the first possible push", refit, d.Version())
	}
}

func TestBinEdgesMatchNumpyLinspace(t *testing.T) {
	e := binEdges(10)
	if e[3] != 0.30000000000000004 || e[6] != 0.6000000000000001 || e[7] != 0.7000000000000001 {
		t.Fatalf("edges %v differ from numpy's linspace(0, 1, 11)", e)
	}
	for _, tc := range []struct {
		x    float64
		want int
	}{{0.3, 2}, {0.30000000000000004, 3}, {0.6, 5}, {0.7, 6}, {0, 0}, {-3, 0}, {0.999, 9}, {1, 9}, {7, 9}, {0.1, 1}} {
		if got := binOf(e, tc.x); got != tc.want {
			t.Errorf("bin of %v = %d, want %d", tc.x, got, tc.want)
		}
	}
}

func TestDebiaserBinnedFitUsesBinMeans(t *testing.T) {
	cfg := DefaultDebiaserConfig()
	cfg.MinPairs, cfg.RefitEvery = 4, 4
	d := mustDebiaser(t, cfg)
	// Bin 2 holds 0.3 (not bin 3: the edge is 0.30000000000000004) and 0.25;
	// bin 8 holds 0.8 and 0.86. Values outside [0, 1] are not clipped.
	for _, p := range []Pair{{0.3, 0.4}, {0.25, 0.2}, {0.8, 0.9}, {0.86, 1.3}} {
		if _, err := d.Push(p); err != nil {
			t.Fatal(err)
		}
	}
	x, y := d.Map().Thresholds()
	want := [][2]float64{{0.275, 0.3}, {0.83, 1.1}}
	if len(x) != 2 || math.Abs(x[0]-want[0][0]) > 1e-12 || math.Abs(y[0]-want[0][1]) > 1e-12 ||
		math.Abs(x[1]-want[1][0]) > 1e-12 || math.Abs(y[1]-want[1][1]) > 1e-12 {
		t.Fatalf("breakpoints (%v, %v), want %v", x, y, want)
	}
	// np.interp: flat outside, linear inside.
	if math.Abs(d.Predict(0)-0.3) > 1e-12 || math.Abs(d.Predict(1)-1.1) > 1e-12 {
		t.Fatalf("not flat outside: %v %v", d.Predict(0), d.Predict(1))
	}
	if got := d.Predict(0.5525); math.Abs(got-0.7) > 1e-12 {
		t.Fatalf("midpoint %v, want 0.7", got)
	}
}

// A world model with a monotone bias and noise: calibration must shrink the
// error against the truth as pairs accumulate, end well below the raw error,
// and (unbinned) approach the best any monotone map can do, estimated by an
// isotonic fit on 200k pairs.
func TestDebiaserRemovesMonotoneBias(t *testing.T) {
	g := func(s float64) float64 { return 0.3 + 0.5*s*s*s } // compressed, over-confident low end
	const noise = 0.02
	r := rand.New(rand.NewPCG(11, 0))
	heldS := make([]float64, 4000)
	heldR := make([]float64, 4000)
	raw := 0.0
	for i := range heldS {
		heldS[i] = r.Float64()
		heldR[i] = g(heldS[i]) + r.NormFloat64()*noise
		raw += (heldR[i] - heldS[i]) * (heldR[i] - heldS[i])
	}
	raw /= float64(len(heldS))
	mse := func(predict func(float64) float64) float64 {
		e := 0.0
		for i := range heldS {
			v := predict(heldR[i]) - heldS[i]
			e += v * v
		}
		return e / float64(len(heldS))
	}
	ox, oy := make([]float64, 200000), make([]float64, 200000)
	for i := range ox {
		oy[i] = r.Float64()
		ox[i] = g(oy[i]) + r.NormFloat64()*noise
	}
	oracle, err := FitIsotonic(ox, oy, nil)
	if err != nil {
		t.Fatal(err)
	}
	floor := mse(oracle.Predict)

	for _, bins := range []int{0, 10} {
		d := mustDebiaser(t, DebiaserConfig{MinPairs: 20, RefitEvery: 10, BufferSize: 5000, Bins: bins})
		var errs []float64
		for _, upto := range []int{20, 200, 5000} {
			for d.Pushed() < int64(upto) {
				s := r.Float64()
				if _, err := d.Push(Pair{g(s) + r.NormFloat64()*noise, s}); err != nil {
					t.Fatal(err)
				}
			}
			errs = append(errs, mse(d.Predict))
		}
		t.Logf("bins=%d: raw MSE %.5f, best monotone %.5f, calibrated after 20/200/5000 pairs: %.5f %.5f %.5f",
			bins, raw, floor, errs[0], errs[1], errs[2])
		if !(errs[2] < errs[0] && errs[2] <= errs[1]*1.1) {
			t.Errorf("bins=%d: calibrated error does not shrink with pairs: %v", bins, errs)
		}
		if errs[2] > raw/3 {
			t.Errorf("bins=%d: final calibrated MSE %v not well below raw %v", bins, errs[2], raw)
		}
		if bins == 0 && errs[2] > floor*1.1 {
			t.Errorf("unbinned: final calibrated MSE %v not within 10%% of the best monotone map's %v", errs[2], floor)
		}
	}
}

func TestDebiaserFIFOAndDecayForgetOldBias(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  DebiaserConfig
	}{
		{"fifo", DebiaserConfig{MinPairs: 50, RefitEvery: 10, BufferSize: 100}},
		{"decay", DebiaserConfig{MinPairs: 50, RefitEvery: 10, BufferSize: 5000, HalfLife: 20}},
	} {
		d := mustDebiaser(t, tc.cfg)
		r := rand.New(rand.NewPCG(1, 1))
		for i := 0; i < 300; i++ { // old policy: the truth is 0.8 x
			x := r.Float64()
			d.Push(Pair{x, 0.8 * x})
		}
		for i := 0; i < 200; i++ { // drifted: the truth is 0.2 x
			x := r.Float64()
			d.Push(Pair{x, 0.2 * x})
		}
		if got := d.Predict(0.9); math.Abs(got-0.18) > 0.05 {
			t.Errorf("%s: Predict(0.9) = %v; the drifted truth is 0.18, the stale one 0.72", tc.name, got)
		}
	}
	// Without decay and with a large buffer, the stale pairs still weigh in.
	d := mustDebiaser(t, DebiaserConfig{MinPairs: 50, RefitEvery: 10, BufferSize: 5000})
	r := rand.New(rand.NewPCG(1, 1))
	for i := 0; i < 500; i++ {
		x := r.Float64()
		y := 0.8 * x
		if i >= 300 {
			y = 0.2 * x
		}
		d.Push(Pair{x, y})
	}
	if got := d.Predict(0.9); got < 0.3 {
		t.Errorf("without decay Predict(0.9) = %v; expected the stale bias to remain", got)
	}
}

func TestDebiaserSnapshotRestoreExact(t *testing.T) {
	lo, hi := 0.0, 1.0
	for _, cfg := range []DebiaserConfig{
		DefaultDebiaserConfig(),
		{MinPairs: 30, RefitEvery: 7, BufferSize: 90, HalfLife: 25, Lo: &lo, Hi: &hi},
	} {
		a := mustDebiaser(t, cfg)
		r := rand.New(rand.NewPCG(9, 9))
		next := func() Pair { x := r.Float64(); return Pair{x, math.Sqrt(x) + r.NormFloat64()*0.1} }
		for i := 0; i < 777; i++ {
			a.Push(next())
		}
		raw, err := json.Marshal(a.Snapshot())
		if err != nil {
			t.Fatal(err)
		}
		var s DebiaserState
		if err := json.Unmarshal(raw, &s); err != nil {
			t.Fatal(err)
		}
		b, err := RestoreDebiaser(s)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 500; i++ {
			p := next()
			ra, _ := a.Push(p)
			rb, _ := b.Push(p)
			if ra != rb || a.Version() != b.Version() {
				t.Fatalf("push %d after restore: refit %v/%v, version %d/%d", i, ra, rb, a.Version(), b.Version())
			}
			for q := -0.1; q < 1.1; q += 0.05 {
				if a.Predict(q) != b.Predict(q) {
					t.Fatalf("push %d after restore: Predict(%v) %v != %v", i, q, a.Predict(q), b.Predict(q))
				}
			}
		}
	}
}

func TestDebiaserRejectsBadInput(t *testing.T) {
	for _, cfg := range []DebiaserConfig{
		{MinPairs: -1}, {RefitEvery: -2}, {BufferSize: 1}, {MinPairs: 300, BufferSize: 100}, {Bins: 1}, {HalfLife: -1},
		{Lo: ptr(1), Hi: ptr(0)}, {Lo: ptr(math.Inf(-1))}, {BeforeFit: "median"},
	} {
		if _, err := NewDebiaser(cfg); !errors.Is(err, ErrConfig) {
			t.Errorf("config %+v: got %v, want ErrConfig", cfg, err)
		}
	}
	d := mustDebiaser(t, DefaultDebiaserConfig())
	if _, err := d.Push(Pair{math.NaN(), 1}); !errors.Is(err, ErrNonFinite) {
		t.Fatalf("NaN pair: %v", err)
	}
	if d.Pushed() != 0 {
		t.Fatal("a rejected pair was counted")
	}
	if _, err := RestoreDebiaser(DebiaserState{Config: DebiaserConfig{BufferSize: 2, MinPairs: 1}, Pairs: make([]Pair, 3), Pushed: 3}); !errors.Is(err, ErrConfig) {
		t.Fatalf("oversized snapshot: %v", err)
	}
}

func ptr(v float64) *float64 { return &v }

// Before its first fit the debiaser maps every score to the mean true
// score buffered so far under BeforeFitMean, and passes scores through
// under the reference's identity; from the first fit both use the fit.
func TestDebiaserBeforeFit(t *testing.T) {
	pairs := []Pair{{0.9, 0.1}, {0.2, 0.8}, {0.5, 0.3}, {0.1, 0.6}}
	for _, mode := range []string{"", BeforeFitIdentity, BeforeFitMean} {
		cfg := DebiaserConfig{MinPairs: 4, RefitEvery: 1, BufferSize: 8, BeforeFit: mode}
		d := mustDebiaser(t, cfg)
		if got := d.Predict(0.7); got != 0.7 || d.Map() != nil {
			t.Errorf("%q: with no pairs 0.7 maps to %v (map %v), want itself", mode, got, d.Map())
		}
		sum := 0.0
		for i, p := range pairs[:3] {
			if refit, err := d.Push(p); err != nil || refit {
				t.Fatalf("%q: push %d reports a refit (%v, %v) before min_pairs", mode, i, refit, err)
			}
			sum += p.True
			want := 0.7
			if mode == BeforeFitMean {
				want = sum / float64(i+1)
			}
			if got := d.Predict(0.7); math.Abs(got-want) > 1e-15 || d.Version() != 0 {
				t.Errorf("%q after %d pairs: 0.7 maps to %v, want %v (version %d)", mode, i+1, got, want, d.Version())
			}
			if mode == BeforeFitMean && d.Predict(0.05) != d.Predict(0.95) {
				t.Errorf("%q: the map before the fit is not flat", mode)
			}
		}
		if mode == BeforeFitMean {
			// The flat map survives a restart, and travels as the map in force.
			s, err := RestoreDebiaser(d.Snapshot())
			if err != nil {
				t.Fatal(err)
			}
			if got, want := s.Predict(0.3), d.Predict(0.3); got != want || s.Map() == nil {
				t.Errorf("restored: 0.3 maps to %v, want %v (map %v)", got, want, s.Map())
			}
		}
		if refit, err := d.Push(pairs[3]); err != nil || !refit || d.Version() != 1 {
			t.Fatalf("%q: the 4th pair did not fit a map (%v, %v)", mode, refit, err)
		}
		// Anti-correlated pairs pool into one level: the fitted map is flat
		// at their mean whatever the mode.
		if got := d.Predict(0.7); math.Abs(got-0.45) > 1e-12 {
			t.Errorf("%q fitted: 0.7 maps to %v, want the pooled mean 0.45", mode, got)
		}
	}
}
