package fuse_test

import (
	"fmt"

	"github.com/wmrl/wmrl/stages/fuse"
)

func ExampleFuse() {
	groups := []fuse.Group{
		{ID: "anchor", Anchor: true, Items: []fuse.Item{{"a0", 0.2, true}, {"a1", 0.6, true}}},
		{ID: "wm", Items: []fuse.Item{{"w0", 0.3, true}, {"w1", 0.5, true}, {"w2", 0, false}}},
	}
	res := fuse.Fuse(groups, 3, fuse.CenterOnly) // rho = 3
	for _, it := range res.Items {
		fmt.Printf("%s %-11s advantage %+.2f weight %.0f fused %+.2f\n", it.TrajID, it.Source, it.Advantage, it.Weight, it.FusedAdvantage)
	}
	// Output:
	// a0 anchor      advantage -0.20 weight 3 fused -0.30
	// a1 anchor      advantage +0.20 weight 3 fused +0.30
	// w0 world_model advantage -0.10 weight 1 fused -0.05
	// w1 world_model advantage +0.10 weight 1 fused +0.05
	// w2 world_model advantage +0.00 weight 0 fused +0.00
}

// A world model that ranks a group right but for one swapped pair, and one
// that gives two solutions the same score: rank correlations are what
// GRPO's within-group advantages care about, whatever the scale.
func ExampleSpearman() {
	truth := []float64{0.10, 0.40, 0.35, 0.90}
	swapped := []float64{0.52, 0.55, 0.58, 0.70} // compressed, 0.40 and 0.35 in the wrong order
	tied := []float64{0.2, 0.5, 0.5, 0.8}
	fmt.Printf("swapped: Spearman %.2f, Kendall %.2f\n", fuse.Spearman(swapped, truth), fuse.Kendall(swapped, truth))
	fmt.Printf("tied:    Spearman %.2f, Kendall %.2f\n", fuse.Spearman(tied, truth), fuse.Kendall(tied, truth))
	fmt.Printf("constant: %v\n", fuse.Spearman([]float64{0.5, 0.5, 0.5, 0.5}, truth))
	// Output:
	// swapped: Spearman 0.80, Kendall 0.67
	// tied:    Spearman 0.95, Kendall 0.91
	// constant: NaN
}
