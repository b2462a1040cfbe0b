package main

import (
	"strings"
	"testing"

	"github.com/wmrl/wmrl/connectors/sim/rl"
)

func TestPickMethods(t *testing.T) {
	names := func(ms []rl.Method) string {
		var out []string
		for _, m := range ms {
			out = append(out, m.Name)
		}
		return strings.Join(out, ",")
	}
	// grpo and wmrl always run, in the order of rl.Methods, once each.
	ms, err := pickMethods("wmrl-ratio, denoise,denoise")
	if err != nil {
		t.Fatal(err)
	}
	if got := names(ms); got != "grpo,denoise,wmrl,wmrl-ratio" {
		t.Errorf("--methods wmrl-ratio,denoise,denoise runs %s", got)
	}
	if ms, _ := pickMethods("all"); len(ms) != len(rl.Methods) {
		t.Errorf("--methods all runs %d methods, want %d", len(ms), len(rl.Methods))
	}
	if _, err := pickMethods("wmrl,grop"); err == nil || !strings.Contains(err.Error(), `"grop"`) || !strings.Contains(err.Error(), "grpo") {
		t.Errorf("a misspelt method gives %v; want the name and the list", err)
	}
}
