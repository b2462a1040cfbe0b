package openai

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
)

// Verdict is the world model's prediction for one trajectory.
type Verdict struct {
	Status    string   `json:"status"`
	Score     float64  `json:"-"`
	RawScore  *float64 `json:"score"`
	Rationale string   `json:"rationale"`
}

var statuses = map[string]bool{"scored": true, "crashed": true, "invalid_submission": true, "timed_out": true}

// ParseVerdict reads a reply, tolerating code fences and prose around the
// JSON object. A predicted failure (crashed, invalid_submission, timed_out)
// without a score scores 0, as a failure does when executed; a "scored"
// verdict must carry a score in [0, 1]. Anything else is an error saying
// what was wrong: the caller reports the trajectory ungraded.
func ParseVerdict(reply string) (Verdict, error) {
	obj, err := firstObject(reply)
	if err != nil {
		return Verdict{}, err
	}
	var v Verdict
	if err := json.Unmarshal([]byte(obj), &v); err != nil {
		return Verdict{}, fmt.Errorf("reply JSON: %v", err)
	}
	v.Status = strings.ToLower(strings.TrimSpace(v.Status))
	switch {
	case !statuses[v.Status]:
		return Verdict{}, fmt.Errorf("reply status %q is not one of scored, crashed, invalid_submission, timed_out", v.Status)
	case v.RawScore == nil && v.Status == "scored":
		return Verdict{}, errors.New(`reply says "scored" but gives no score`)
	case v.RawScore == nil:
		v.Score = 0
	case math.IsNaN(*v.RawScore) || *v.RawScore < 0 || *v.RawScore > 1:
		return Verdict{}, fmt.Errorf("reply score %v is outside [0, 1]", *v.RawScore)
	default:
		v.Score = *v.RawScore
	}
	return v, nil
}

// firstObject finds the first balanced {...} in s that parses as JSON,
// skipping braces inside strings.
func firstObject(s string) (string, error) {
	for start := strings.IndexByte(s, '{'); start >= 0; {
		depth, inString, escaped := 0, false, false
		for i := start; i < len(s); i++ {
			c := s[i]
			switch {
			case escaped:
				escaped = false
			case inString && c == '\\':
				escaped = true
			case c == '"':
				inString = !inString
			case inString:
			case c == '{':
				depth++
			case c == '}':
				depth--
				if depth == 0 {
					if cand := s[start : i+1]; json.Valid([]byte(cand)) {
						return cand, nil
					}
					i = len(s) // not JSON: try the next '{'
				}
			}
		}
		next := strings.IndexByte(s[start+1:], '{')
		if next < 0 {
			break
		}
		start += 1 + next
	}
	return "", fmt.Errorf("no JSON object in the reply: %q", snippet([]byte(s)))
}
