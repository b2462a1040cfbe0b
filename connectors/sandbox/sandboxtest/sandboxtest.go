// Package sandboxtest makes the example task (examples/tasks/housing)
// for tests of any package: its data generated, as a user would.
package sandboxtest

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// housing is examples/tasks/housing, found from this file's place in the
// repository, whichever package's test asks.
func housing() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..", "examples", "tasks", "housing")
}

// Housing generates the example task into dir (made if missing): its
// task.json, and the public data, private answers and leaderboard its
// generate.py writes. It returns the paths of the task's candidate
// solutions in the repository. Without python3 the test is skipped.
func Housing(t testing.TB, dir string) (solutions []string) {
	t.Helper()
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("python3 not installed")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	src := housing()
	for _, f := range []string{"generate.py", "task.json"} {
		b, err := os.ReadFile(filepath.Join(src, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.Command("python3", filepath.Join(dir, "generate.py")).CombinedOutput(); err != nil {
		t.Fatalf("generate the example task: %v\n%s", err, out)
	}
	solutions, _ = filepath.Glob(filepath.Join(src, "solutions", "*.py"))
	if len(solutions) == 0 {
		t.Fatalf("no candidate solutions in %s", filepath.Join(src, "solutions"))
	}
	return solutions
}
