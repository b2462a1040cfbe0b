package pipeline

import (
	"regexp"
	"strings"
	"sync"

	"github.com/wmrl/wmrl/stages/predict"
)

// UngradedInARow is how many trajectories in a row the world model may
// leave ungraded before the run says so.
const UngradedInARow = 64

// replies watches what the world model's answers come to, and says what
// the step lines' "wm ungraded" count cannot: why. A server that refuses a
// kind of request (an unknown --wm-model, a key it does not take, a prompt
// over the model's context) is said the first time, with its answer; and
// UngradedInARow trajectories in a row ungraded, once, with their causes:
// ungraded alike, they are the setup's more often than the solutions'.
// Their steps train on the anchors meanwhile; nothing is scored 0.
type replies struct {
	notef func(string, ...any)

	mu       sync.Mutex
	ungraded int
	byCause  map[string]int
	refused  map[string]bool // the refusals said
}

func (r *replies) predicted(scores []predict.Score) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range scores {
		if s.Graded {
			if r.ungraded >= UngradedInARow {
				r.notef("world model: graded a trajectory again, after %d in a row it did not", r.ungraded)
			}
			r.ungraded, r.byCause = 0, nil
			continue
		}
		cause := ReplyCause(s.Reason)
		if strings.HasPrefix(cause, refusedPrefix) && !r.refused[cause] {
			if r.refused == nil {
				r.refused = map[string]bool{}
			}
			r.refused[cause] = true
			r.notef("%.400s; such trajectories are ungraded (\"wm ungraded\" in the step lines, null from the reward endpoints), never scored 0", s.Reason)
		}
		if r.byCause == nil {
			r.byCause = map[string]int{}
		}
		r.ungraded++
		r.byCause[cause]++
		if r.ungraded == UngradedInARow {
			r.notef("world model: graded none of the last %d trajectories (%s); the newest: %.300s. Ungraded alike, they are more "+
				"likely the setup than the solutions: the model's name (--wm-model), its key (WMRL_WM_API_KEY), a reply cut short "+
				"(--wm-max-tokens) or a prompt it does not answer in the JSON asked for (--wm-template); their steps train on the anchors",
				r.ungraded, countsBy(r.byCause, ": "), s.Reason)
		}
	}
}

// refusedPrefix begins the reason of a trajectory whose request the world
// model's server refused (openai's permanent errors).
const refusedPrefix = "world model refused the request"

var replyNumbers = regexp.MustCompile(`[0-9]+(\.[0-9]+)?`)

// ReplyCause is the kind of an ungraded trajectory's reason, to count them
// by: its first two parts ("world model refused the request: HTTP 404",
// "no usable reply: reply JSON"), numbers as N but an HTTP status.
func ReplyCause(reason string) string {
	parts := strings.SplitN(reason, ": ", 3)
	cause := strings.Join(parts[:min(2, len(parts))], ": ")
	if strings.HasPrefix(cause, refusedPrefix) {
		return cause
	}
	return replyNumbers.ReplaceAllString(cause, "N")
}
