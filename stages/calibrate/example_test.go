package calibrate_test

import (
	"fmt"
	"math"

	"github.com/wmrl/wmrl/stages/calibrate"
)

func ExampleFitIsotonic() {
	x := []float64{1, 2, 3, 4, 5}
	y := []float64{1, 3, 2, 4, 3.5}
	m, err := calibrate.FitIsotonic(x, y, nil, calibrate.WithBounds(0, math.Inf(1)))
	if err != nil {
		panic(err)
	}
	fmt.Println(m.PredictBatch(nil, x))
	fmt.Println(m.Predict(2.25), m.Predict(100))
	// Output:
	// [1 2.5 2.5 3.75 3.75]
	// 2.5 3.75
}

func ExampleDebiaser() {
	d, _ := calibrate.NewDebiaser(calibrate.DebiaserConfig{MinPairs: 4, RefitEvery: 4, BufferSize: 100})
	// The world model over-scores: it says 0.8 when the truth is 0.4.
	for _, p := range []calibrate.Pair{{0.2, 0.1}, {0.4, 0.2}, {0.6, 0.3}, {0.8, 0.4}} {
		d.Push(p)
	}
	fmt.Printf("version %d, 0.7 -> %.2f\n", d.Version(), d.Predict(0.7))
	// Output: version 1, 0.7 -> 0.35
}
