package calibrate

import (
	"encoding/json"
	"errors"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

type sklearnCase struct {
	Name          string    `json:"name"`
	X             []float64 `json:"x"`
	Y             []float64 `json:"y"`
	W             []float64 `json:"w"`
	YMin          *float64  `json:"y_min"`
	YMax          *float64  `json:"y_max"`
	Query         []float64 `json:"query"`
	ExpectedFit   []float64 `json:"expected_fit"`
	ExpectedQuery []float64 `json:"expected_query"`
	XMin          float64   `json:"X_min"`
	XMax          float64   `json:"X_max"`
	XThresholds   []float64 `json:"X_thresholds"`
	YThresholds   []float64 `json:"y_thresholds"`
}

func close9(a, b float64) bool {
	d := math.Abs(a - b)
	return d <= 1e-9 || d <= 1e-9*math.Max(math.Abs(a), math.Abs(b))
}

func TestFitIsotonicMatchesSklearn(t *testing.T) {
	files, err := filepath.Glob("testdata/isotonic-sklearn/*.json")
	if err != nil || len(files) == 0 {
		t.Fatalf("no sklearn cases found: %v", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			raw, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			var c sklearnCase
			if err := json.Unmarshal(raw, &c); err != nil {
				t.Fatal(err)
			}
			lo, hi := math.Inf(-1), math.Inf(1)
			if c.YMin != nil {
				lo = *c.YMin
			}
			if c.YMax != nil {
				hi = *c.YMax
			}
			m, err := FitIsotonic(c.X, c.Y, c.W, WithBounds(lo, hi))
			if err != nil {
				t.Fatal(err)
			}
			tx, ty := m.Thresholds()
			if len(tx) != len(c.XThresholds) {
				t.Fatalf("thresholds: got %d, want %d\n got x=%v\nwant x=%v", len(tx), len(c.XThresholds), tx, c.XThresholds)
			}
			for i := range tx {
				if !close9(tx[i], c.XThresholds[i]) || !close9(ty[i], c.YThresholds[i]) {
					t.Errorf("threshold %d: got (%v, %v), want (%v, %v)", i, tx[i], ty[i], c.XThresholds[i], c.YThresholds[i])
				}
			}
			if dlo, dhi := m.Domain(); !close9(dlo, c.XMin) || !close9(dhi, c.XMax) {
				t.Errorf("domain: got [%v, %v], want [%v, %v]", dlo, dhi, c.XMin, c.XMax)
			}
			fit := m.PredictBatch(nil, c.X)
			for i := range fit {
				if !close9(fit[i], c.ExpectedFit[i]) {
					t.Errorf("fit[%d] (x=%v): got %v, want %v", i, c.X[i], fit[i], c.ExpectedFit[i])
				}
			}
			for i, q := range c.Query {
				if got := m.Predict(q); !close9(got, c.ExpectedQuery[i]) {
					t.Errorf("query[%d] (x=%v): got %v, want %v", i, q, got, c.ExpectedQuery[i])
				}
			}
		})
	}
}

func TestFitIsotonicErrors(t *testing.T) {
	nan, inf := math.NaN(), math.Inf(1)
	tests := []struct {
		name    string
		x, y, w []float64
		opts    []IsotonicOption
		wantErr error
	}{
		{"empty", nil, nil, nil, nil, ErrEmpty},
		{"y shorter", []float64{1, 2}, []float64{1}, nil, nil, ErrLength},
		{"w shorter", []float64{1, 2}, []float64{1, 2}, []float64{1}, nil, ErrLength},
		{"NaN x", []float64{1, nan}, []float64{1, 2}, nil, nil, ErrNonFinite},
		{"Inf y", []float64{1, 2}, []float64{inf, 2}, nil, nil, ErrNonFinite},
		{"NaN w", []float64{1, 2}, []float64{1, 2}, []float64{1, nan}, nil, ErrNonFinite},
		{"negative w", []float64{1, 2}, []float64{1, 2}, []float64{1, -1}, nil, ErrNegativeWeight},
		{"all-zero w", []float64{1, 2}, []float64{1, 2}, []float64{0, 0}, nil, ErrZeroWeight},
		{"lo above hi", []float64{1, 2}, []float64{1, 2}, nil, []IsotonicOption{WithBounds(1, 0)}, ErrBounds},
		{"NaN bound", []float64{1, 2}, []float64{1, 2}, nil, []IsotonicOption{WithBounds(nan, 0)}, ErrBounds},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := FitIsotonic(tt.x, tt.y, tt.w, tt.opts...)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("got %v, want %v", err, tt.wantErr)
			}
		})
	}
}

func randomData(r *rand.Rand, n int) (x, y, w []float64) {
	x, y, w = make([]float64, n), make([]float64, n), make([]float64, n)
	for i := range x {
		x[i] = math.Round(r.Float64()*50) / 50 // ties on purpose
		y[i] = x[i] + r.NormFloat64()*0.3
		w[i] = r.Float64() * 2
	}
	return
}

func TestIsotonicProperties(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for trial := 0; trial < 200; trial++ {
		n := 1 + r.IntN(300)
		x, y, w := randomData(r, n)
		m, err := FitIsotonic(x, y, w)
		if err != nil {
			t.Fatal(err)
		}
		// Monotone everywhere, including between and beyond thresholds.
		prev := math.Inf(-1)
		for q := -0.5; q <= 1.5; q += 0.001 {
			v := m.Predict(q)
			if v < prev-1e-12 {
				t.Fatalf("trial %d: not monotone at %v: %v < %v", trial, q, v, prev)
			}
			prev = v
		}
		// Each block's value is the weighted mean of its points: group points
		// by fitted value, the weighted mean of y in the group equals it.
		fit := m.PredictBatch(nil, x)
		sums := map[float64][2]float64{}
		for i := range x {
			s := sums[fit[i]]
			sums[fit[i]] = [2]float64{s[0] + w[i]*y[i], s[1] + w[i]}
		}
		for v, s := range sums {
			if s[1] > 0 && math.Abs(s[0]/s[1]-v) > 1e-9 {
				t.Fatalf("trial %d: block value %v but weighted mean of its points %v", trial, v, s[0]/s[1])
			}
		}
		// Bounds are respected.
		b, err := FitIsotonic(x, y, w, WithBounds(0.2, 0.7))
		if err != nil {
			t.Fatal(err)
		}
		for q := -0.5; q <= 1.5; q += 0.01 {
			if v := b.Predict(q); v < 0.2 || v > 0.7 {
				t.Fatalf("trial %d: bounded prediction %v outside [0.2, 0.7]", trial, v)
			}
		}
	}
}

func TestIsotonicAlreadyMonotoneIsReturned(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	x := make([]float64, 100)
	y := make([]float64, 100)
	acc := 0.0
	for i := range x {
		x[i] = float64(i) + r.Float64()*0.5
		acc += r.Float64()
		y[i] = acc
	}
	r.Shuffle(len(x), func(i, j int) { x[i], x[j] = x[j], x[i]; y[i], y[j] = y[j], y[i] })
	m, err := FitIsotonic(x, y, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range x {
		if got := m.Predict(x[i]); math.Abs(got-y[i]) > 1e-12 {
			t.Fatalf("point %d: got %v, want %v", i, got, y[i])
		}
	}
}

func TestIsotonicJSONRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	x, y, w := randomData(r, 500)
	m, err := FitIsotonic(x, y, w)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	var back Isotonic
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	mx, my := m.Thresholds()
	bx, by := back.Thresholds()
	if !slices.Equal(mx, bx) || !slices.Equal(my, by) {
		t.Fatal("thresholds changed in a JSON round trip")
	}
	if err := json.Unmarshal([]byte(`{"x":[1,0],"y":[0,1]}`), &back); !errors.Is(err, ErrThresholds) {
		t.Fatalf("decreasing x accepted: %v", err)
	}
}

// naiveInterp is numpy.interp by linear scan: the definition the bucket
// index must reproduce exactly.
func naiveInterp(xs, ys []float64, x float64) float64 {
	n := len(xs)
	if n == 1 || x <= xs[0] {
		return ys[0]
	}
	if x >= xs[n-1] {
		return ys[n-1]
	}
	j := 0
	for j < n-2 && xs[j+1] <= x {
		j++
	}
	return (ys[j+1]-ys[j])/(xs[j+1]-xs[j])*(x-xs[j]) + ys[j]
}

func TestPredictIndexMatchesLinearScan(t *testing.T) {
	r := rand.New(rand.NewPCG(8, 8))
	layouts := map[string]func(i, n int) float64{
		"uniform":   func(i, n int) float64 { return float64(i) / float64(n) },
		"clustered": func(i, n int) float64 { return math.Exp(float64(i) / float64(n) * 40) }, // 1 .. e^40
		"tiny":      func(i, n int) float64 { return 1 + float64(i)*1e-13 },
		"huge":      func(i, n int) float64 { return -1e300 + float64(i)*1e298 },
	}
	for name, at := range layouts {
		for _, n := range []int{2, 3, 17, 1000} {
			xs, ys := make([]float64, n), make([]float64, n)
			for i := range xs {
				xs[i] = at(i, n)
				ys[i] = float64(i) + r.Float64()
			}
			m, err := NewIsotonic(xs, ys)
			if err != nil {
				t.Fatalf("%s n=%d: %v", name, n, err)
			}
			queries := append([]float64{}, xs...) // exactly on thresholds
			for k := 0; k < 5000; k++ {
				a, b := xs[r.IntN(n)], xs[r.IntN(n)]
				queries = append(queries, a+(b-a)*r.Float64(), math.Nextafter(a, math.Inf(1)), math.Nextafter(a, math.Inf(-1)))
			}
			for _, q := range queries {
				if got, want := m.Predict(q), naiveInterp(xs, ys, q); got != want {
					t.Fatalf("%s n=%d: Predict(%v) = %v, linear scan gives %v", name, n, q, got, want)
				}
			}
		}
	}
}
