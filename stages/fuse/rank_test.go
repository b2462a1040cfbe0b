package fuse

import (
	"math"
	"math/rand/v2"
	"testing"
)

// kendallNaive is tau-b by its definition, over every pair.
func kendallNaive(x, y []float64) float64 {
	var c, d, tx, ty float64
	for i := range x {
		for j := i + 1; j < len(x); j++ {
			sx, sy := math.Copysign(1, x[i]-x[j]), math.Copysign(1, y[i]-y[j])
			switch {
			case x[i] == x[j] && y[i] == y[j]:
			case x[i] == x[j]:
				tx++
			case y[i] == y[j]:
				ty++
			case sx == sy:
				c++
			default:
				d++
			}
		}
	}
	return (c - d) / math.Sqrt((c+d+tx)*(c+d+ty))
}

func TestKendallMatchesTheDefinition(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for trial := range 200 {
		n := 2 + rng.IntN(60)
		x, y := make([]float64, n), make([]float64, n)
		for i := range x {
			// Few distinct values: plenty of ties on both sides.
			x[i] = float64(rng.IntN(1 + trial%7))
			y[i] = x[i]*float64(trial%3-1) + float64(rng.IntN(4))
		}
		got, want := Kendall(x, y), kendallNaive(x, y)
		if math.IsNaN(want) != math.IsNaN(got) || !math.IsNaN(want) && math.Abs(got-want) > 1e-12 {
			t.Fatalf("trial %d: Kendall = %v, by definition %v (x %v y %v)", trial, got, want, x, y)
		}
	}
}

func TestSpearman(t *testing.T) {
	x := []float64{1, 2, 3, 4, 5}
	if s := Spearman(x, []float64{10, 20, 30, 40, 1000}); math.Abs(s-1) > 1e-12 {
		t.Fatalf("monotone: %v", s)
	}
	if s := Spearman(x, []float64{5, 4, 3, 2, 1}); math.Abs(s+1) > 1e-12 {
		t.Fatalf("reversed: %v", s)
	}
	// scipy.stats.spearmanr([1,2,2,3],[1,3,2,4]) = 0.9486832980505138
	if s := Spearman([]float64{1, 2, 2, 3}, []float64{1, 3, 2, 4}); math.Abs(s-0.9486832980505138) > 1e-12 {
		t.Fatalf("ties: %v", s)
	}
	if !math.IsNaN(Spearman(x, []float64{1, 1, 1, 1, 1})) {
		t.Fatal("constant side must give NaN")
	}
}

// TestAUCMatchesTheDefinition: AUC against counting every (positive,
// negative) pair, ties half, on random scores with many ties.
func TestAUCMatchesTheDefinition(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for trial := range 50 {
		n := 2 + r.IntN(40)
		x, pos := make([]float64, n), make([]bool, n)
		for i := range x {
			x[i], pos[i] = float64(r.IntN(6)), r.IntN(3) == 0
		}
		var wins, pairs float64
		for i := range x {
			for j := range x {
				if pos[i] && !pos[j] {
					pairs++
					switch {
					case x[i] > x[j]:
						wins++
					case x[i] == x[j]:
						wins += 0.5
					}
				}
			}
		}
		got := AUC(x, pos)
		if pairs == 0 {
			if !math.IsNaN(got) {
				t.Fatalf("trial %d: one class only, AUC %v; want NaN", trial, got)
			}
			continue
		}
		if math.Abs(got-wins/pairs) > 1e-12 {
			t.Fatalf("trial %d: AUC %v, counted %v", trial, got, wins/pairs)
		}
	}
}
