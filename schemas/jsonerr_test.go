package schemas

import (
	stdjson "encoding/json"
	"strings"
	"testing"
)

// A message with a value of the wrong kind is refused saying where and
// what was wanted, as its author wrote it, not the Go type it was to be
// decoded into (the whole of an anonymous struct's, for a trajectory that
// is not an object).
func TestAValueOfTheWrongKindIsSaidInJSONsWords(t *testing.T) {
	ok := `{"schema":1,"run":"r","step":3,"group_id":"g","traj_id":"t","group_size":2,"task_id":"x","prompt":"p","response":"r","policy_version":1}`
	for payload, want := range map[string]string{
		`1`:                                    "malformed JSON: want an object, got a number",
		`["a"]`:                                "malformed JSON: want an object, got an array",
		strings.Replace(ok, `3`, `"3"`, 1):     "malformed JSON: field step: want an integer, got a string",
		strings.Replace(ok, `2,`, `2.5,`, 1):   "malformed JSON: field group_size: want an integer, got a number 2.5",
		strings.Replace(ok, `"p"`, `["p"]`, 1): "malformed JSON: field prompt: want a string, got an array",
		`{"schema":1,`:                         "malformed JSON: unexpected end of JSON input",
	} {
		_, err := DecodeTrajectory([]byte(payload))
		if err == nil || !strings.HasSuffix(err.Error(), want) || strings.Contains(err.Error(), "Go ") {
			t.Errorf("%s: %v; want it to end %q", payload, err, want)
		}
	}
	if _, err := SplitTrajectories([]byte(`{"step":1}`)); err == nil || !strings.HasSuffix(err.Error(), "malformed JSON: want an array of trajectories, got an object") {
		t.Errorf("a trajs message that is an object: %v", err)
	}
	var trajs RawTrajectories // as the gateway reads a request's body
	if err := ReadableJSON(stdjson.Unmarshal([]byte(`"x"`), &trajs)); err == nil || err.Error() != "want an array of trajectories, got a string" {
		t.Errorf("a body that is a string: %v", err)
	}
	// encoding/json's errors, as the gateway's request bodies give them.
	var body struct {
		Query  []string `json:"query"`
		Groups *int     `json:"groups"`
	}
	for payload, want := range map[string]string{
		`{"query": 1}`:      "field query: want an array of strings, got a number",
		`{"query": [1]}`:    "field query: want a string, got a number",
		`{"groups": {}}`:    "field groups: want an integer, got an object",
		`[]`:                "want an object, got an array",
		`{"query": ["a"],}`: "invalid character '}' looking for beginning of object key string",
	} {
		err := ReadableJSON(stdjson.Unmarshal([]byte(payload), &body))
		if err == nil || err.Error() != want {
			t.Errorf("%s: %v; want %q", payload, err, want)
		}
	}
}
