package main

import (
	"strings"
	"testing"
	"time"

	"github.com/wmrl/wmrl/connectors/natsjs"
)

// A process that ends as it starts (a wrong flag, a missing binary) is
// started again as a supervisor would, but the fifth time in a row ends
// the rehearsal with the end of its log, instead of restarting it twice a
// second for the rest of the run.
func TestAProcessThatEndsAsItStartsEndsTheRehearsal(t *testing.T) {
	c := &cast{dir: t.TempDir()}
	c.add("stage", []string{"sh", "-c", "echo 'flag provided but not defined: -replicas'; exit 2"})
	if err := c.startAll(); err != nil {
		t.Fatal(err)
	}
	var err error
	for restarts := 0; err == nil; restarts++ {
		if restarts > quickTries {
			t.Fatalf("restarted %d times, want the rehearsal ended after %d exits in a row", restarts, quickTries)
		}
		<-c.procs["stage"].done
		err = c.restartExited()
	}
	for _, want := range []string{"stage ended by itself within 3s of its start 5 times in a row (exit status 2)", "flag provided but not defined: -replicas"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the rehearsal ended with %q, not naming %q", err, want)
		}
	}
}

// An exit after the process ran a while starts the count again.
func TestAProcessThatRanAWhileIsStartedAgain(t *testing.T) {
	c := &cast{dir: t.TempDir()}
	c.add("stage", []string{"true"})
	if err := c.startAll(); err != nil {
		t.Fatal(err)
	}
	p := c.procs["stage"]
	p.quick = quickTries - 1
	<-p.done
	p.started = time.Now().Add(-2 * quickExit) // as if it ran that long
	if err := c.restartExited(); err != nil {
		t.Fatalf("an exit after %v ended the rehearsal: %v", 2*quickExit, err)
	}
	if p.quick != 0 {
		t.Errorf("%d quick exits counted after one that ran %v", p.quick, 2*quickExit)
	}
	<-p.done
}

// A second rehearsal on a directory in use refuses to start, naming it.
func TestASecondRehearsalOnTheSameDirRefuses(t *testing.T) {
	dir := t.TempDir()
	unlock, err := lockDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lockDir(dir); err == nil || !strings.Contains(err.Error(), "another rehearsal uses it") {
		t.Fatalf("a second lock of %s: %v", dir, err)
	}
	unlock()
	again, err := lockDir(dir)
	if err != nil {
		t.Fatalf("after the first let go: %v", err)
	}
	again()
}

// A rehearsal refuses to start on a disk with less room than it keeps,
// naming the directory and what it needs: one that fills the disk fails
// for that alone.
func TestARehearsalWantsRoomOnItsDisk(t *testing.T) {
	dir := t.TempDir()
	err := roomFor(dir, 100_000*time.Hour) // 3 PB
	if err == nil || !strings.Contains(err.Error(), "the disk of "+dir+" has") || !strings.Contains(err.Error(), "give --dir on another disk") {
		t.Errorf("a rehearsal of 100000 hours: %v; want it refused for want of room, naming %s", err, dir)
	}
	free, _, err := natsjs.DiskRoom(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := roomFor(dir, time.Minute); (err == nil) != (free >= 2*roomPerMinute) {
		t.Errorf("a rehearsal of a minute with %d bytes free: %v; want it refused below %d only", free, err, 2*roomPerMinute)
	}
}
