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
