package pipeline

import (
	"fmt"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/wmrl/wmrl/schemas"
)

func TestARunOfFailedExecutionsIsSaidOnce(t *testing.T) {
	var said []string
	e := &executions{metrics: NewMetrics(), notef: func(f string, a ...any) { said = append(said, fmt.Sprintf(f, a...)) }}
	run := func(n int, status string) {
		for range n {
			e.executed(schemas.ExecItem{Status: status, Detail: "exit code 1: boom", Seconds: 2})
		}
	}
	run(FailedInARow-1, schemas.ExecCrashed)
	run(1, schemas.ExecScored) // one score breaks the run
	run(FailedInARow-2, schemas.ExecCrashed)
	run(5, schemas.ExecSandboxError) // no score: neither counts nor breaks it
	if len(said) != 0 {
		t.Fatalf("said %q before %d failures in a row", said, FailedInARow)
	}
	run(1, schemas.ExecTimedOut)
	run(1, schemas.ExecInvalid)
	run(40, schemas.ExecCrashed)
	if len(said) != 1 || !strings.Contains(said[0], fmt.Sprintf("none of the last %d executions scored (crashed %d, invalid_submission 1, timed_out 1); the newest: exit code 1: boom",
		FailedInARow, FailedInARow-2)) {
		t.Fatalf("said %q; want it once, with the counts", said)
	}
	run(1, schemas.ExecScored)
	if len(said) != 2 || said[1] != fmt.Sprintf("execute: an execution scored again, after %d in a row that failed", FailedInARow+40) {
		t.Fatalf("said %q; want the recovery", said)
	}
	m := e.metrics
	if got := testutil.ToFloat64(m.Executions.WithLabelValues(schemas.ExecCrashed)); got != 2*FailedInARow-3+40 {
		t.Errorf("crashed counted %v", got)
	}
	if got := testutil.CollectAndCount(m.ExecutionSeconds); got != 1 {
		t.Errorf("%d execution_seconds series", got)
	}
}
