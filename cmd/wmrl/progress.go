package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"golang.org/x/term"
)

// progressBar shows how far a long command is, on stderr. On a terminal it
// redraws one line at most every 100 ms. Anywhere else (a log file, a
// Kubernetes pod's log, CI) it writes a whole line each time another tenth
// of the work is done, or after 30 s without one, so logs stay readable.
type progressBar struct {
	w        io.Writer
	terminal bool
	start    time.Time
	last     time.Time // last line or redraw
	drawn    bool      // a terminal line is open and needs its newline
}

func newProgressBar(w io.Writer) *progressBar {
	return &progressBar{w: w, terminal: isTerminal(w), start: time.Now()}
}

// isTerminal reports whether w is a terminal (not a file, a pipe or
// /dev/null, which is a character device too).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// set returns the callback for one phase of the work, labelled label.
func (b *progressBar) set(label string) func(done, total int) {
	written := -1 // the highest tenth written, on non-terminals
	return func(done, total int) {
		if total <= 0 {
			return
		}
		done = min(max(done, 0), total)
		now := time.Now()
		if b.terminal {
			if now.Sub(b.last) < 100*time.Millisecond && done < total {
				return
			}
			b.last, b.drawn = now, true
			const width = 30
			n := width * done / total
			fmt.Fprintf(b.w, "\r%-8s [%s%s] %3d%% %5d/%d  %s ", label, strings.Repeat("#", n), strings.Repeat(".", width-n),
				100*done/total, done, total, b.elapsed(now))
			return
		}
		tenth := 10 * done / total
		if tenth <= written && now.Sub(b.last) < 30*time.Second {
			return
		}
		written, b.last = tenth, now
		fmt.Fprintf(b.w, "%s %3d%% %d/%d %s\n", label, 100*done/total, done, total, b.elapsed(now))
	}
}

func (b *progressBar) elapsed(now time.Time) time.Duration {
	return now.Sub(b.start).Round(time.Second)
}

// done ends the terminal line; on other writers every line is already whole.
func (b *progressBar) done() {
	if b.drawn {
		fmt.Fprintln(b.w)
		b.drawn = false
	}
}
