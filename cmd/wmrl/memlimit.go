package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/KimMachineGun/automemlimit/memlimit"
)

// memoryLimitShare is the share of its cgroup's memory limit a long-running
// command gives the Go runtime as its soft limit (GOMEMLIMIT): the rest is
// room for what the runtime does not count (stacks of cgo, the kernel's
// page cache charged to the cgroup).
const memoryLimitShare = 0.9

// followMemoryLimit sets the Go runtime's soft memory limit to
// memoryLimitShare of what the process's cgroup allows (a container's
// memory limit), and follows it if it changes, until ctx ends. Without it
// the runtime lets the heap reach twice what is live before collecting,
// which a run holding the embedded server's de-duplication IDs can carry
// past a container's limit, to be killed. GOMEMLIMIT set, or
// AUTOMEMLIMIT=off, leave it alone (AUTOMEMLIMIT=0.8 sets another share).
// It says what it set on out, unless quiet; without a limit it does nothing.
func followMemoryLimit(ctx context.Context, out io.Writer, quiet bool) {
	if os.Getenv("GOMEMLIMIT") != "" || os.Getenv("AUTOMEMLIMIT") == "off" {
		return
	}
	allowed, err := memlimit.FromCgroup()
	if err != nil {
		return // no cgroup, or no limit in it: the runtime's defaults
	}
	set, err := memlimit.Set(memlimit.WithProvider(memlimit.FromCgroup), memlimit.WithRatio(memoryLimitShare),
		memlimit.WithRefreshInterval(ctx, time.Minute))
	if quiet {
		return
	}
	if err != nil {
		fmt.Fprintf(out, "memory: the cgroup allows %s, and setting the Go runtime's soft limit below it failed: %v\n", mib(int64(allowed)), err)
		return
	}
	fmt.Fprintf(out, "memory: the cgroup allows %s; the Go runtime collects garbage harder rather than grow its heap past %s "+
		"(GOMEMLIMIT, %.0f%% of it; set GOMEMLIMIT, or AUTOMEMLIMIT to another share or off, to choose)\n",
		mib(int64(allowed)), mib(set), 100*float64(set)/float64(allowed)) // AUTOMEMLIMIT may have set another share
}

func mib(n int64) string { return fmt.Sprintf("%.0f MiB", float64(n)/(1<<20)) }
