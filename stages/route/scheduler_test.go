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
		want, chosen := s.Count(tt.n, tt.inFlight)
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
	for _, cfg := range []SchedulerConfig{{Fraction: -0.1}, {Fraction: 1.5}, {Fraction: math.NaN()}, {MinPerStep: -1}, {MaxInFlight: -1}} {
		if _, err := NewScheduler(cfg); !errors.Is(err, ErrConfig) {
			t.Errorf("%+v: got %v", cfg, err)
		}
	}
}
