package route

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"
)

func ids(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("g%03d", i)
	}
	return out
}

func TestCountFollowsReference(t *testing.T) {
	tests := []struct {
		cfg                  SchedulerConfig
		n, inFlight          int
		wantWant, wantChosen int
	}{
		{SchedulerConfig{Fraction: 0.1}, 25, 0, 2, 2},                               // 2.5 rounds half to even: 2
		{SchedulerConfig{Fraction: 0.1}, 35, 0, 4, 4},                               // 3.5 -> 4
		{SchedulerConfig{Fraction: 0.1}, 4, 0, 0, 0},                                // 0.4 -> 0: nothing drawn
		{SchedulerConfig{Fraction: 0.1, MinPerStep: 1}, 4, 0, 1, 1},                 // the minimum
		{SchedulerConfig{Fraction: 0, MinPerStep: 9}, 4, 0, 4, 4},                   // at most n
		{SchedulerConfig{Fraction: 0.5, MaxInFlight: 5}, 20, 3, 10, 2},              // cap - in flight
		{SchedulerConfig{Fraction: 0.5, MinPerStep: 3, MaxInFlight: 5}, 4, 7, 3, 0}, // the cap beats the minimum
		{SchedulerConfig{Fraction: 0.25}, 8, 0, 2, 2},                               // the released cluster configs
	}
	for _, tt := range tests {
		s, err := NewScheduler(tt.cfg)
		if err != nil {
			t.Fatal(err)
		}
		want, chosen := s.Count("run", 3, tt.n, tt.inFlight)
		if want != tt.wantWant || chosen != tt.wantChosen {
			t.Errorf("%+v n=%d inFlight=%d: got (%d, %d), want (%d, %d)", tt.cfg, tt.n, tt.inFlight, want, chosen, tt.wantWant, tt.wantChosen)
		}
	}
}

func TestSelectReproducibleAndOrderFree(t *testing.T) {
	s, _ := NewScheduler(SchedulerConfig{Fraction: 0.25, Seed: 7})
	groups := ids(40)
	a := s.Select("run", 3, groups, 0)
	rev := slices.Clone(groups)
	slices.Reverse(rev)
	b := s.Select("run", 3, rev, 0)
	if !slices.Equal(a.Anchors(), b.Anchors()) || len(a.Anchors()) != 10 {
		t.Fatalf("same step, shuffled input: %v vs %v", a.Anchors(), b.Anchors())
	}
	if c := s.Select("run", 4, groups, 0); slices.Equal(a.Anchors(), c.Anchors()) {
		t.Fatal("two steps drew the same anchors")
	}
	other, _ := NewScheduler(SchedulerConfig{Fraction: 0.25, Seed: 8})
	if c := other.Select("run", 3, groups, 0); slices.Equal(a.Anchors(), c.Anchors()) {
		t.Fatal("two seeds drew the same anchors")
	}
}

func TestSelectUniform(t *testing.T) {
	s, _ := NewScheduler(SchedulerConfig{Fraction: 0.25, Seed: 1})
	groups := ids(8)
	hits := map[string]int{}
	const steps = 8000
	for step := int64(0); step < steps; step++ {
		for _, id := range s.Select("r", step, groups, 0).Anchors() {
			hits[id]++
		}
	}
	for _, id := range groups {
		p := float64(hits[id]) / steps // expected 0.25, sd ~0.005
		if math.Abs(p-0.25) > 0.025 {
			t.Errorf("%s chosen in %.3f of steps, want 0.25", id, p)
		}
	}
}

func TestSelectExplainsEveryGroup(t *testing.T) {
	s, _ := NewScheduler(SchedulerConfig{Fraction: 0.5, MaxInFlight: 4, Seed: 2})
	sel := s.Select("r", 1, ids(10), 1)
	count := map[string]int{}
	for _, d := range sel.Decisions {
		count[d.Reason]++
		if d.Anchor != (d.Reason == ReasonDrawn) {
			t.Fatalf("decision %+v contradicts itself", d)
		}
	}
	if count[ReasonDrawn] != 3 || count[ReasonCapped] != 2 || count[ReasonNotDrawn] != 5 {
		t.Fatalf("reasons %v; want 3 drawn, 2 capped, 5 not drawn", count)
	}
}

func TestSchedulerConfigErrors(t *testing.T) {
	for _, cfg := range []SchedulerConfig{{Fraction: -0.1}, {Fraction: 1.5}, {Fraction: math.NaN()}, {MinPerStep: -1}, {MaxInFlight: -1}, {Rounding: "up"}} {
		if _, err := NewScheduler(cfg); !errors.Is(err, ErrConfig) {
			t.Errorf("%+v: got %v", cfg, err)
		}
	}
}

// Spread rounding executes the fraction over any window of steps to within
// one group, each step's count one of the two whole numbers around f*n.
func TestSpreadExecutesTheFractionOverEveryWindow(t *testing.T) {
	for _, tc := range []struct {
		f float64
		n int
	}{{0.1, 16}, {0.1, 8}, {0.07, 20}, {0.5, 3}, {0.3, 7}, {0.25, 8}, {0.1, 20}} {
		s, err := NewScheduler(SchedulerConfig{Fraction: tc.f, Rounding: RoundSpread, Seed: 5})
		if err != nil {
			t.Fatal(err)
		}
		a := tc.f * float64(tc.n)
		const steps = 2000
		counts := make([]int, steps)
		for k := range counts {
			want, chosen := s.Count("run", int64(k), tc.n, 0)
			if want != chosen || float64(want) < math.Floor(a) || float64(want) > math.Ceil(a) {
				t.Fatalf("f %v of %d groups, step %d: want %d chosen %d; want floor or ceil of %v", tc.f, tc.n, k, want, chosen, a)
			}
			counts[k] = want
		}
		for _, l := range []int{1, 7, 10, 64, steps} {
			for i := 0; i+l <= steps; i++ {
				sum := 0
				for _, c := range counts[i : i+l] {
					sum += c
				}
				if math.Abs(float64(sum)-a*float64(l)) >= 1 {
					t.Fatalf("f %v of %d groups: steps %d-%d execute %d groups; want %v within one", tc.f, tc.n, i, i+l-1, sum, a*float64(l))
				}
			}
		}
	}
}

// The spread count depends on the seed, run, step and n only; runs and
// seeds get their own phase; the minimum and the cap apply as to even.
func TestSpreadIsReproducibleAndKeepsMinimumAndCap(t *testing.T) {
	mk := func(cfg SchedulerConfig) *Scheduler {
		cfg.Fraction, cfg.Rounding = 0.1, RoundSpread
		s, err := NewScheduler(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	seq := func(s *Scheduler, run string) string {
		var b []byte
		for k := int64(100); k < 140; k++ {
			want, _ := s.Count(run, k, 23, 0) // 2.3 a step: ten phases tell apart
			b = append(b, byte('0'+want))
		}
		return string(b)
	}
	a := mk(SchedulerConfig{Seed: 1})
	if x, y := seq(a, "r1"), seq(mk(SchedulerConfig{Seed: 1}), "r1"); x != y {
		t.Fatalf("the same seed and run gave %s and %s", x, y)
	}
	phases := map[string]bool{}
	for _, run := range []string{"r1", "r2", "r3", "r4", "r5", "r6"} {
		phases[seq(a, run)] = true
	}
	phases[seq(mk(SchedulerConfig{Seed: 2}), "r1")] = true
	if len(phases) < 4 {
		t.Fatalf("7 runs and seeds gave %d distinct sequences; the phase does not follow them", len(phases))
	}
	if sel := a.Select("r1", 7, ids(16), 0); sel.Want != len(sel.Anchors()) {
		t.Fatalf("select drew %d anchors, its count says %d", len(sel.Anchors()), sel.Want)
	}
	for k := int64(0); k < 50; k++ {
		if want, _ := mk(SchedulerConfig{MinPerStep: 1}).Count("r", k, 4, 0); want != 1 {
			t.Fatalf("0.1 of 4 groups with a minimum of 1: step %d wants %d", k, want)
		}
		if want, chosen := mk(SchedulerConfig{MaxInFlight: 3}).Count("r", k, 16, 2); chosen > 1 || chosen > want {
			t.Fatalf("cap 3 with 2 in flight: step %d chose %d of %d", k, chosen, want)
		}
	}
	even, _ := NewScheduler(SchedulerConfig{Fraction: 0.1, Rounding: RoundEven})
	dflt, _ := NewScheduler(SchedulerConfig{Fraction: 0.1})
	for k := int64(0); k < 20; k++ {
		w1, _ := even.Count("r", k, 16, 0)
		w2, _ := dflt.Count("r", k, 16, 0)
		if w1 != 2 || w2 != 2 {
			t.Fatalf("even rounding of 1.6 gave %d and %d at step %d; want 2 every step", w1, w2, k)
		}
	}
}

func TestKeepMakesExactlyTheSentGroupsAnchors(t *testing.T) {
	s, err := NewScheduler(SchedulerConfig{Fraction: 0.5, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	ids := []string{"a", "b", "c", "d", "e", "f"}
	sel := s.Select("r", 9, ids, 0)
	drawn := sel.Anchors()
	notDrawn := slices.DeleteFunc(slices.Clone(ids), func(id string) bool { return slices.Contains(drawn, id) })
	kept := sel.Keep([]string{drawn[0], notDrawn[0]})
	if kept.Chosen != 2 || kept.Want != sel.Want || fmt.Sprint(kept.Anchors()) != fmt.Sprint(sortedOf(drawn[0], notDrawn[0])) {
		t.Fatalf("kept %v (chosen %d want %d), want exactly %s and %s", kept.Anchors(), kept.Chosen, kept.Want, drawn[0], notDrawn[0])
	}
	for _, d := range kept.Decisions {
		want := map[string]string{drawn[0]: ReasonDrawn, notDrawn[0]: ReasonResent}[d.GroupID]
		if want == "" {
			want = ReasonNotDrawn
			if slices.Contains(drawn, d.GroupID) {
				want = ReasonCapped
			}
		}
		if d.Reason != want {
			t.Errorf("%s: reason %q, want %q", d.GroupID, d.Reason, want)
		}
	}
	if fmt.Sprint(sel.Anchors()) != fmt.Sprint(drawn) {
		t.Error("Keep changed the selection it was called on")
	}
}

func sortedOf(ids ...string) []string { slices.Sort(ids); return ids }
