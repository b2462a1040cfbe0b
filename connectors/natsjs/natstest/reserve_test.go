//go:build unix

package natstest

import (
	"bufio"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"testing"
)

// A port another test process of the run claimed is not handed out while
// that process lives, and is once it has ended. The other process is this
// test binary again, claiming the port named in its environment.
func TestAPortAnotherProcessClaimedIsNotHandedOut(t *testing.T) {
	if p := os.Getenv("NATSTEST_CLAIM"); p != "" {
		port, _ := strconv.Atoi(p)
		if !reserve(port) {
			os.Stdout.WriteString("refused\n")
			os.Exit(1)
		}
		os.Stdout.WriteString("claimed\n")
		bufio.NewReader(os.Stdin).ReadString('\n') // until the test closes stdin
		os.Exit(0)
	}
	// A port no process claims yet: the other one tries the next when one
	// is (by another package's tests running at once).
	var cmd *exec.Cmd
	var stdin io.WriteCloser
	port := 0
	for try := 0; port == 0; try++ {
		if try == 100 {
			t.Fatal("no port the other process could claim in 100 tries")
		}
		handedMu.Lock()
		p := 20000 + rand.IntN(12000)
		free := !handed[p]
		handed[p] = true // not handed out here after the test
		handedMu.Unlock()
		if !free {
			continue
		}
		cmd = exec.Command(os.Args[0], "-test.run=^TestAPortAnotherProcessClaimedIsNotHandedOut$")
		cmd.Env = append(os.Environ(), "NATSTEST_CLAIM="+strconv.Itoa(p))
		var err error
		if stdin, err = cmd.StdinPipe(); err != nil {
			t.Fatal(err)
		}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		line, _ := bufio.NewReader(stdout).ReadString('\n')
		if line == "claimed\n" {
			port = p
			break
		}
		stdin.Close()
		cmd.Wait()
	}
	if reserve(port) {
		t.Errorf("port %d claimed by another living process was claimed here too", port)
	}
	stdin.Close()
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	if !reserve(port) {
		t.Errorf("port %d not claimed here once the process that held it ended", port)
	}
}
