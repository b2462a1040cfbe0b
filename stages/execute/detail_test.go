package execute

import (
	"context"
	"strings"
	"testing"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/stagetest"
)

func TestLastLinesClipsEachLine(t *testing.T) {
	out := "epoch 1\n" + strings.Repeat("x", 5000) + "\nTraceback (most recent call last):\nValueError: bad\n"
	got := LastLines(out, 3, 100)
	parts := strings.Split(got, " | ")
	if len(parts) != 3 || len(parts[0]) > 100 || parts[2] != "ValueError: bad" || parts[1] != "Traceback (most recent call last):" {
		t.Fatalf("LastLines = %q", got)
	}
	// Python 3.11's markers under the failing expression are left out.
	tb := "  File \"/w/solution.py\", line 5, in <genexpr>\n    print(sum(float(r[\"area\"]) for r in rows))\n" +
		"                    ~^^^^^^^^\n              ^^^^^^^\nKeyError: 'area'\n"
	if got, want := LastLines(tb, 3, 300), "  File \"/w/solution.py\", line 5, in <genexpr> |     print(sum(float(r[\"area\"]) for r in rows)) | KeyError: 'area'"; got != want {
		t.Fatalf("LastLines of a traceback with markers = %q, want %q", got, want)
	}
}

// bigDetail fails every trajectory with a detail of n bytes.
type bigDetail int

func (n bigDetail) Execute(context.Context, schemas.Trajectory) (Result, error) {
	return Result{Status: schemas.ExecInvalid, Detail: "grader: " + strings.Repeat("y", int(n)) + " (the cause)"}, nil
}

// Whatever an executor says, what the stage publishes is bounded: a
// message over NATS's max payload would never be published.
func TestDetailsArePublishedClipped(t *testing.T) {
	pub := &stagetest.Recorder{}
	h := NewHandler("r", "execution", pub, bigDetail(4<<20), 2)
	if err := h.Handle(stagetest.Message(t, context.Background(), anchorGroup("a", "b"))); err != nil {
		t.Fatal(err)
	}
	var e schemas.Execution
	pub.Decode(t, 0, &e)
	for _, it := range e.Items {
		if len(it.Detail) > MaxDetail || !strings.HasPrefix(it.Detail, "grader: y") || !strings.HasSuffix(it.Detail, "y (the cause)") {
			t.Fatalf("detail of %d bytes: %.80q … %q", len(it.Detail), it.Detail, it.Detail[max(0, len(it.Detail)-40):])
		}
	}
}

func TestCauseIsWhatWentWrongWithoutItsNumbers(t *testing.T) {
	for _, c := range []struct{ detail, want string }{
		{"exit code 1: Traceback (most recent call last): | File \"/w/solution.py\", line 4, in <module> | import lightgbm | ModuleNotFoundError: No module named 'lightgbm'",
			"ModuleNotFoundError: No module named 'lightgbm'"},
		{"exit code 1: ValueError: Found input variables with inconsistent numbers of samples: [100, 250]",
			"ValueError: Found input variables with inconsistent numbers of samples: [N, N]"},
		{"exit code 1: x | MemoryError (its address space is limited to 1024 MiB) (" + NoteNotIsolated + ")",
			"MemoryError (its address space is limited to N MiB)"},
		{"exit code 2: ", "exit code N"},
		{"killed by signal 11 (segmentation fault): Fatal Python error | more", "killed by signal N (segmentation fault)"},
		{"killed after 1m0s, its wall-clock limit", "killed after N, its wall-clock limit"},
		{"killed after 61 s of CPU time, its limit (30.512s of wall clock)", "killed after N s of CPU time, its limit (N of wall clock)"},
		{"no submission.csv written (" + NoteLeftover + "unlinkat /w/x: permission denied)", "no submission.csv written"},
		{"(" + NoteNotIsolated + ")", "(no detail)"},
		{"", "(no detail)"},
		{"ModuleNotFoundError: No module named 'sklearn2'", "ModuleNotFoundError: No module named 'sklearn2'"},
		// The sandbox's work directory has a random name: one cause for every execution.
		{"exit code 1: x | FileNotFoundError: [Errno 2] No such file or directory: '/tmp/wmrl-execs/wmrl-exec-5f0c3e9a1b7d4e2f8a6c0b9d3e1f7a24/out/x.csv'",
			"FileNotFoundError: [Errno N] No such file or directory: '/tmp/wmrl-execs/wmrl-exec-N/out/x.csv'"},
	} {
		if got := Cause(c.detail); got != c.want {
			t.Errorf("Cause(%q)\n = %q\nwant %q", c.detail, got, c.want)
		}
	}
}
