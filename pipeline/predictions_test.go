package pipeline

import "testing"

// The reasons of ungraded trajectories count by kind: a server's refusal
// by its HTTP status, an unreadable reply by what was wrong with it,
// whatever the numbers in it.
func TestReplyCause(t *testing.T) {
	for reason, want := range map[string]string{
		`world model refused the request: HTTP 404: {"message":"The model x does not exist."}`: "world model refused the request: HTTP 404",
		`world model refused the request: HTTP 400: maximum context length is 8192 tokens`:     "world model refused the request: HTTP 400",
		`no usable reply: reply score 1.7 is outside [0, 1]`:                                   "no usable reply: reply score N is outside [N, N]",
		`no usable reply: no JSON object in the reply: "I think it runs"`:                      "no usable reply: no JSON object in the reply",
		`prompt template: template: prompt:1: map has no entry for key "Foo"`:                  "prompt template: template",
		`unreadable`: "unreadable",
	} {
		if got := ReplyCause(reason); got != want {
			t.Errorf("ReplyCause(%q) = %q, want %q", reason, got, want)
		}
	}
}
