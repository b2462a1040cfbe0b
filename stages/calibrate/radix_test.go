package calibrate

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestSortPointsMatchesComparisonSort(t *testing.T) {
	r := rand.New(rand.NewPCG(12, 12))
	gens := map[string]func() float64{
		"uniform":  r.Float64,
		"signed":   func() float64 { return r.NormFloat64() * 1e3 },
		"ties":     func() float64 { return math.Round(r.Float64()*20) / 20 },
		"zeros":    func() float64 { return []float64{0, math.Copysign(0, -1), 1, -1}[r.IntN(4)] },
		"extremes": func() float64 { return []float64{math.MaxFloat64, -math.MaxFloat64, 5e-324, -5e-324}[r.IntN(4)] },
	}
	for name, gen := range gens {
		for _, n := range []int{0, 1, 255, 256, 1000, 20000} {
			pts := make([]point, n)
			for i := range pts {
				pts[i] = point{x: gen(), y: float64(r.IntN(5)), w: float64(i)}
			}
			want := slices.Clone(pts)
			slices.SortStableFunc(want, comparePoints)
			sortPoints(pts)
			for i := range pts {
				if comparePoints(pts[i], want[i]) != 0 {
					t.Fatalf("%s n=%d: position %d holds %+v, want %+v", name, n, i, pts[i], want[i])
				}
			}
		}
	}
}
