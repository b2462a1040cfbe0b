package pipeline

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"

	"github.com/wmrl/wmrl/schemas"
)

// FailedInARow is how many executions in a row may fail (scored 0 as
// crashed, timed out or invalid) before the run says so.
const FailedInARow = 32

// executions watches what the execute stage's executions come to. It
// counts and times them, and says when FailedInARow in a row fail: failing
// alike, they are more often the sandbox's setup (a package the solutions
// import missing from --exec-python, a limit too tight) than the policy,
// and their zeros train the calibration and the anchors' advantages all
// the same. Sandbox errors are no scores and neither count nor break a
// run of failures.
type executions struct {
	metrics *Metrics
	notef   func(string, ...any)

	mu       sync.Mutex
	failed   int
	byStatus map[string]int
}

func (e *executions) executed(it schemas.ExecItem) {
	e.metrics.Executions.WithLabelValues(it.Status).Inc()
	e.metrics.ExecutionSeconds.Observe(it.Seconds)
	if it.Status == schemas.ExecSandboxError {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if it.Status == schemas.ExecScored {
		if e.failed >= FailedInARow {
			e.notef("execute: an execution scored again, after %d in a row that failed", e.failed)
		}
		e.failed, e.byStatus = 0, nil
		return
	}
	if e.byStatus == nil {
		e.byStatus = map[string]int{}
	}
	e.failed++
	e.byStatus[it.Status]++
	if e.failed == FailedInARow {
		e.notef("execute: none of the last %d executions scored (%s); the newest: %.300s. Failing alike, they are more likely the sandbox's setup "+
			"than the policy: a package the solutions import missing from the Python that runs them (--exec-python), or limits too tight "+
			"(--exec-timeout, --exec-memory-mb); each scores 0", e.failed, countsBy(e.byStatus, " "), it.Detail)
	}
}

// countsBy lists counts by key, the keys in order: "crashed 3, timed_out 1"
// with sep " ".
func countsBy(counts map[string]int, sep string) string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(counts)) {
		out = append(out, fmt.Sprintf("%s%s%d", k, sep, counts[k]))
	}
	return strings.Join(out, ", ")
}
