package execute

import (
	"regexp"
	"slices"
	"strings"

	"github.com/wmrl/wmrl/schemas"
)

// MaxDetail bounds an execution's detail as it travels (the execution
// message, the outcome store, the step's update, the archive): what ended
// it, in a line or two. A solution's stderr is anyone's size, and one
// line of it can be megabytes (a printed array); NATS refuses messages
// over its max payload (1 MB by default).
const MaxDetail = 2000

// LastLines joins the last n lines of out with " | ", each
// clipped to lineBytes (see schemas.Clip): the end of a solution's stderr, where a
// traceback says what failed. Python's markers under the failing
// expression (lines of ^ and ~ alone) say nothing without their columns,
// and are left out.
func LastLines(out string, n, lineBytes int) string {
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	lines = slices.DeleteFunc(lines, func(l string) bool {
		l = strings.TrimSpace(l)
		return l != "" && strings.Trim(l, "^~") == ""
	})
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	for i, l := range lines {
		lines[i] = schemas.Clip(l, lineBytes)
	}
	return strings.Join(lines, " | ")
}

// Notes an executor appends to a detail, in parentheses, about where the
// code ran rather than how it ended (Cause leaves them out).
const (
	NoteNotIsolated = "not isolated: no permission for network and PID namespaces"
	NoteLeftover    = "its work directory is left behind: "
)

// numbers matches a number, or a Go duration, standing alone: the sizes,
// counts and times that differ between two failures of the same kind.
var numbers = regexp.MustCompile(`\b(?:\d+(?:\.\d+)?(?:ns|µs|ms|s|m|h)?)+\b`)

// randomIDs matches a long hexadecimal token standing alone: the random
// name of an execution's work directory (the subprocess sandbox's has 32
// hex digits), which differs between two failures of the same kind.
var randomIDs = regexp.MustCompile(`\b[0-9a-f]{16,}\b`)

// Cause is what a detail says went wrong, as a key to count failures by:
// the last line of a crash's stderr (a Python exception: "ModuleNotFoundError:
// No module named 'lightgbm'"), the signal that killed it, the limit that
// ended it, or what the grader refused; with numbers and random IDs as N,
// so that one kind of failure with other sizes or paths counts once.
func Cause(detail string) string {
	d := " " + strings.TrimSpace(detail) // a note may be all there is
	for {
		trimmed := strings.TrimSuffix(d, " ("+NoteNotIsolated+")")
		if i := strings.LastIndex(trimmed, " ("+NoteLeftover); i >= 0 && strings.HasSuffix(trimmed, ")") {
			trimmed = trimmed[:i]
		}
		if trimmed == d {
			break
		}
		d = trimmed
	}
	d = strings.TrimSpace(d)
	switch rest, signal := strings.CutPrefix(d, "killed by signal "); {
	case signal:
		if i := strings.Index(rest, "): "); i >= 0 {
			d = d[:len("killed by signal ")+i+1]
		}
	case strings.Contains(d, " | "):
		d = d[strings.LastIndex(d, " | ")+3:]
	case strings.HasPrefix(d, "exit code "):
		if _, msg, ok := strings.Cut(d, ": "); ok && strings.TrimSpace(msg) != "" {
			d = msg
		}
	}
	d = strings.TrimSuffix(strings.TrimSpace(d), ":")
	if d == "" {
		return "(no detail)"
	}
	return numbers.ReplaceAllString(randomIDs.ReplaceAllString(d, "N"), "N")
}
