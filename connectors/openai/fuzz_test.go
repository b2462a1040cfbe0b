package openai

import (
	"math"
	"testing"
)

// FuzzParseVerdict: a world model's reply is a language model's text,
// anything at all. It is read as a verdict with a status the pipeline
// knows and a score in [0, 1], or refused with an error (the trajectory
// ungraded, saying why); never a panic, never a score out of range. Run
// it longer with make fuzz.
func FuzzParseVerdict(f *testing.F) {
	for _, seed := range []string{
		`{"status": "scored", "score": 0.7, "rationale": "fits the data"}`,
		"Here is my verdict:\n```json\n{\"status\":\"crashed\",\"rationale\":\"imports a missing module\"}\n```",
		`{"status":"scored","score":1e400}`, `{"status":"scored","score":-0}`, `{"a":"}{"} {"status":"timed_out"}`,
		`{"status":"SCORED ","score":"0.5"}`, `{{{{`, `"}"{`, `{"status":"scored","score":null,"x":{"y":[1,2,{}]}}`,
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, reply string) {
		v, err := ParseVerdict(reply)
		if err != nil {
			return
		}
		if !statuses[v.Status] || math.IsNaN(v.Score) || v.Score < 0 || v.Score > 1 {
			t.Fatalf("took %+v from %q", v, reply)
		}
		if v.Status != "scored" && v.RawScore == nil && v.Score != 0 {
			t.Fatalf("a predicted failure without a score scored %v", v.Score)
		}
	})
}
