package fuse

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

func TestAdvantages(t *testing.T) {
	a, ok := Advantages(nil, []float64{1, 2, 3, 4}, nil, Standardize)
	sd := math.Sqrt(1.25)
	if !ok || math.Abs(a[0]-(-1.5/(sd+AdvantageEps))) > 1e-15 || math.Abs(a[3]-(1.5/(sd+AdvantageEps))) > 1e-15 {
		t.Fatalf("standardized: %v", a)
	}
	a, ok = Advantages(nil, []float64{1, 2, 3, 4}, nil, CenterOnly)
	if !ok || a[0] != -1.5 || a[3] != 1.5 {
		t.Fatalf("centred: %v", a)
	}
	// The ungraded item is dropped from the statistics, not scored as 0.
	a, ok = Advantages(nil, []float64{1, 0, 3}, []bool{true, false, true}, CenterOnly)
	if !ok || a[0] != -1 || a[1] != 0 || a[2] != 1 {
		t.Fatalf("with an ungraded item: %v", a)
	}
	if _, ok := Advantages(nil, []float64{1, 2}, []bool{true, false}, Standardize); ok {
		t.Fatal("one graded item gave a usable group")
	}
}

func TestFuseSkipsAndCounts(t *testing.T) {
	groups := []Group{
		{ID: "a", Anchor: true, Items: []Item{{"a1", 0.2, true}, {"a2", 0.8, true}}},
		{ID: "b", Anchor: true, Items: []Item{{"b1", 0.5, true}, {"b2", 0, false}}}, // skipped
		{ID: "c", Items: []Item{{"c1", 0.1, true}, {"c2", 0.3, true}, {"c3", 0, false}}},
		{ID: "d", Items: []Item{{"d1", 0.4, true}, {"d2", 0.9, true}}},
	}
	const rho = 3.0
	res := Fuse(groups, rho, Standardize)
	if res.Groups != 3 || res.Anchors != 1 || len(res.Skipped) != 1 || res.Skipped[0].GroupID != "b" {
		t.Fatalf("groups %d anchors %d skipped %v", res.Groups, res.Anchors, res.Skipped)
	}
	if len(res.Items) != 9 {
		t.Fatalf("%d items, want every input item", len(res.Items))
	}
	scale := 3 / (rho*1 + 2)
	for _, it := range res.Items {
		switch {
		case it.GroupID == "b" || !it.Graded:
			if it.FusedAdvantage != 0 || it.Weight != 0 {
				t.Errorf("%s does not contribute but has fused %v weight %v", it.TrajID, it.FusedAdvantage, it.Weight)
			}
		case it.Source == SourceAnchor:
			if it.Weight != rho || math.Abs(it.FusedAdvantage-it.Advantage*rho*scale) > 1e-15 {
				t.Errorf("anchor %s: %+v", it.TrajID, it)
			}
		default:
			if it.Weight != 1 || math.Abs(it.FusedAdvantage-it.Advantage*scale) > 1e-15 {
				t.Errorf("world-model %s: %+v", it.TrajID, it)
			}
		}
	}
	if res := Fuse(groups[1:2], rho, Standardize); res.Groups != 0 || res.Items[0].FusedAdvantage != 0 {
		t.Fatalf("a step with only a skipped group: %+v", res)
	}
}

// The fused advantages carry the WMRL gradient exactly: for any vectors x_i
// standing in for grad log pi, the step mean of fused_i * x_i equals
// (rho*g_E + g_WM) / (rho*|A| + |W|) built from group means.
func TestFusionIdentity(t *testing.T) {
	r := rand.New(rand.NewPCG(42, 1))
	for trial := 0; trial < 100; trial++ {
		const G, dim = 8, 5
		m := 2 + r.IntN(30)
		rho := 1 + 3*r.Float64()
		groups := make([]Group, m)
		x := map[string][]float64{}
		for gi := range groups {
			g := Group{ID: fmt.Sprint(gi), Anchor: r.Float64() < 0.3}
			for i := 0; i < G; i++ {
				id := fmt.Sprintf("%d/%d", gi, i)
				g.Items = append(g.Items, Item{TrajID: id, Reward: r.Float64(), Graded: true})
				v := make([]float64, dim)
				for k := range v {
					v[k] = r.NormFloat64()
				}
				x[id] = v
			}
			groups[gi] = g
		}
		res := Fuse(groups, rho, Standardize)

		got := make([]float64, dim)
		for _, it := range res.Items {
			for k := range got {
				got[k] += it.FusedAdvantage * x[it.TrajID][k] / float64(len(res.Items))
			}
		}
		gE, gWM := make([]float64, dim), make([]float64, dim)
		nA, nW := 0.0, 0.0
		for _, g := range groups {
			rewards := make([]float64, G)
			for i, it := range g.Items {
				rewards[i] = it.Reward
			}
			a, _ := Advantages(nil, rewards, nil, Standardize)
			dst := gWM
			if g.Anchor {
				dst, nA = gE, nA+1
			} else {
				nW++
			}
			for i, it := range g.Items {
				for k := range dst {
					dst[k] += a[i] * x[it.TrajID][k] / G
				}
			}
		}
		for k := range got {
			want := (rho*gE[k] + gWM[k]) / (rho*nA + nW)
			if math.Abs(got[k]-want) > 1e-12 {
				t.Fatalf("trial %d dim %d: step mean %v, fused gradient %v", trial, k, got[k], want)
			}
		}
	}
}
