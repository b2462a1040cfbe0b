package main

import (
	"bytes"
	"os"
	"strings"
	"testing"
)

func TestProgressWritesWholeLinesOffTerminal(t *testing.T) {
	var buf bytes.Buffer
	bar := newProgressBar(&buf)
	if bar.terminal {
		t.Fatal("a bytes.Buffer taken for a terminal")
	}
	for _, phase := range []string{"training", "sweep"} {
		show := bar.set(phase)
		for i := 0; i <= 1000; i++ {
			show(i, 1000)
		}
	}
	bar.done()
	out := buf.String()
	if strings.Contains(out, "\r") {
		t.Fatalf("carriage return in a log: %q", out)
	}
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	// 0%, 10%, ..., 100% for each phase; more only if 30 s passed between calls.
	if len(lines) != 22 {
		t.Fatalf("%d lines, want 22 (a line per tenth of each phase):\n%s", len(lines), out)
	}
	for i, want := range []string{"training   0% 0/1000", "training 100% 1000/1000", "sweep   0% 0/1000", "sweep  50% 500/1000", "sweep 100% 1000/1000"} {
		if !strings.Contains(out, want+" ") {
			t.Errorf("check %d: no line %q in:\n%s", i, want, out)
		}
	}
	if strings.HasSuffix(out, "\n\n") {
		t.Errorf("done added an empty line to a log:\n%s", out)
	}
}

func TestProgressRedrawsOneLineOnTerminal(t *testing.T) {
	var buf bytes.Buffer
	bar := newProgressBar(&buf)
	bar.terminal = true // what isTerminal says of a tty
	show := bar.set("reading")
	for i := 0; i <= 1000; i++ {
		show(i, 1000)
	}
	bar.done()
	out := buf.String()
	if strings.Count(out, "\n") != 1 || !strings.HasSuffix(out, "\n") {
		t.Fatalf("want one line ended by done, got %q", out)
	}
	// Redraws are at most one per 100 ms, and the last one is always drawn.
	if n := strings.Count(out, "\r"); n < 2 || n > 900 {
		t.Errorf("%d redraws for 1001 calls", n)
	}
	last := out[strings.LastIndex(out, "\r"):]
	if !strings.Contains(last, "100%  1000/1000") || !strings.Contains(last, strings.Repeat("#", 30)) {
		t.Errorf("last redraw %q is not the full bar", last)
	}
}

func TestIsTerminal(t *testing.T) {
	f, err := os.CreateTemp(t.TempDir(), "log")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	for _, w := range []*os.File{f, null} {
		if isTerminal(w) {
			t.Errorf("%s taken for a terminal", w.Name())
		}
	}
}
