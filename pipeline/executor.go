package pipeline

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/wmrl/wmrl/connectors/sandbox"
	"github.com/wmrl/wmrl/connectors/sim"
	"github.com/wmrl/wmrl/stages/execute"
)

// This file builds the process's executor and says what each execution
// may take.

// buildExecutor builds the configured executor: the simulated one, or
// real execution of the task, or of the tasks (by each trajectory's
// task_id), and says what each execution may take.
func (p *Pipeline) buildExecutor(ctx context.Context) (execute.Executor, error) {
	cfg := &p.cfg
	switch {
	case cfg.ExecutorImpl != nil:
		return cfg.ExecutorImpl, nil
	case cfg.executor() == "sim":
		return &sim.Executor{Latency: cfg.ExecLatency, Noise: 0.02}, nil
	}
	tasks, err := sandbox.LoadTasks(cfg.TaskDir)
	if err != nil {
		return nil, err
	}
	// As each executor will resolve them, for the note.
	limits := map[*sandbox.Task]sandbox.Limits{}
	for _, t := range tasks {
		limits[t] = cfg.execLimits(t).For(t)
	}
	if cfg.executor() == "sandbox-fusion" {
		exes := map[string]execute.Executor{}
		for _, t := range tasks {
			exes[t.Name] = &sandbox.Fusion{URL: cfg.SandboxURL, Task: t, Limits: cfg.execLimits(t)}
		}
		p.noteLimits("sandbox-fusion", tasks, limits, func(l sandbox.Limits) string {
			return fmt.Sprintf("run_timeout %v, memory_limit_MB %d (enforced by the server)", l.Timeout, max(l.MemoryBytes>>20, -1))
		})
		return oneOrByTask(tasks, exes), nil
	}
	// The store and the archive hold every trajectory's code with its
	// score, and the tasks' private/ their answers: out of the code's view.
	hide := []string{cfg.DataDir, cfg.ArchiveRoot()}
	for _, t := range tasks {
		hide = append(hide, filepath.Join(t.Dir, "private"))
	}
	exe := &sandbox.Subprocess{Task: tasks[0], Limits: cfg.execLimits(tasks[0]), Env: cfg.ExecEnv, Hide: hide,
		Waiting: func(what string, d int) { p.metrics.ExecutionsWaiting.WithLabelValues(what).Add(float64(d)) }}
	user := "as nobody"
	if os.Geteuid() != 0 {
		user = "as this process's user"
	}
	if cfg.ExecUIDs != "" {
		if os.Geteuid() != 0 {
			return nil, errors.New("--exec-uids: running executions as other users needs wmrl to run as root")
		}
		exe.UIDs, _ = uidRange(cfg.ExecUIDs) // checked by Validate
		accounts, err := sandbox.Accounts(exe.UIDs)
		if err != nil {
			return nil, fmt.Errorf("--exec-uids: %w", err)
		}
		if len(accounts) > 0 {
			ids := slices.Sorted(maps.Keys(accounts))
			var names []string
			for _, id := range ids[:min(len(ids), 5)] {
				names = append(names, fmt.Sprintf("%d (%s)", id, accounts[id]))
			}
			if len(ids) > 5 {
				names = append(names, fmt.Sprintf("and %d more", len(ids)-5))
			}
			return nil, fmt.Errorf("--exec-uids %s: takes the ids of accounts in /etc/passwd: %s. Every process of an execution's user is killed when it ends: give ids no account uses", cfg.ExecUIDs, strings.Join(names, ", "))
		}
		user = fmt.Sprintf("each as a user of its own (uids %s)", cfg.ExecUIDs)
		if len(exe.UIDs) < cfg.ExecSlots {
			user += fmt.Sprintf(", %d at once: fewer than the %d --exec-slots", len(exe.UIDs), cfg.ExecSlots)
		}
	}
	var unused []string
	exe.GPUs, unused, _ = cfg.gpuSets() // checked by Validate
	gpus := ""
	switch n := sandbox.MachineGPUs(); {
	case len(exe.GPUs) > 0:
		sets := make([]string, len(exe.GPUs))
		for i, set := range exe.GPUs {
			sets[i] = strings.Join(set, ",")
		}
		gpus = fmt.Sprintf(", GPUs %s (a set each)", strings.Join(sets, " | "))
		if len(unused) > 0 {
			gpus += fmt.Sprintf(", GPUs %s unused (fewer than --exec-gpus-each)", strings.Join(unused, ","))
		}
		if len(exe.GPUs) < cfg.ExecSlots {
			gpus += fmt.Sprintf(", %d at once: fewer than the %d --exec-slots", len(exe.GPUs), cfg.ExecSlots)
		}
	case n > 0:
		gpus = fmt.Sprintf(", every execution at once sees all %d GPUs (--exec-gpus shares them out)", n)
	}
	user += gpus
	if cfg.ExecPython != "" {
		python, err := exec.LookPath(cfg.ExecPython)
		if err != nil {
			return nil, fmt.Errorf("--exec-python: %w", err)
		}
		exe.Command = []string{python, "solution.py"}
	}
	// A wmrl killed with executions under way left their directories.
	switch n, size, err := sandbox.RemoveLeftovers(); {
	case err != nil:
		p.notef("execute: removing the work directories a stopped wmrl left in %s: %v", sandbox.WorkParent(), err)
	case n > 0:
		dirs := fmt.Sprintf("%d work directories", n)
		if n == 1 {
			dirs = "1 work directory"
		}
		p.notef("execute: removed %s (%.1f MiB) that a killed wmrl left in %s", dirs, float64(size)/(1<<20), sandbox.WorkParent())
	}
	python, err := exe.Check(ctx)
	if err != nil {
		return nil, fmt.Errorf("--executor subprocess: %w (--exec-python names another)", err)
	}
	exes := map[string]execute.Executor{}
	for _, t := range tasks {
		e := exe.ForTask(t) // the users and GPUs shared out among every task's executions
		e.Limits = cfg.execLimits(t)
		exes[t.Name] = e
	}
	p.noteLimits("subprocess ("+python+")", tasks, limits, func(l sandbox.Limits) string {
		return user + ", " + sandbox.Isolation() + "; " + l.String()
	})
	// Another run on this machine given the same users or GPUs: this
	// one's executions wait for each while that one's execution holds it.
	users, gpuIDs, err := exe.HeldElsewhere()
	if err != nil {
		return nil, fmt.Errorf("--executor subprocess: %w", err)
	}
	var held []string
	if len(users) > 0 {
		held = append(held, fmt.Sprintf("%d of the %d users of --exec-uids", len(users), len(exe.UIDs)))
	}
	if len(gpuIDs) > 0 {
		held = append(held, "GPUs "+strings.Join(gpuIDs, ","))
	}
	if len(held) > 0 {
		p.notef("execute: another wmrl process on this machine has an execution on %s now: this run's executions wait for them while it does (wmrl_executions_waiting)", strings.Join(held, " and "))
	}
	return oneOrByTask(tasks, exes), nil
}

// oneOrByTask is the executor of a single task, which executes every
// trajectory as a solution of it, whatever its task_id; of several, the
// one that picks each trajectory's by its task_id.
func oneOrByTask(tasks []*sandbox.Task, exes map[string]execute.Executor) execute.Executor {
	if len(tasks) == 1 {
		return exes[tasks[0].Name]
	}
	return sandbox.ByTask{Executors: exes}
}

// noteLimits says what each real execution may take (say puts a task's
// limits in words), per task where tasks differ, and, when that is longer
// than a step waits for its anchors, what becomes of slower ones.
func (p *Pipeline) noteLimits(executor string, tasks []*sandbox.Task, limits map[*sandbox.Task]sandbox.Limits, say func(sandbox.Limits) string) {
	var timeout time.Duration
	each := say(limits[tasks[0]])
	for _, t := range tasks {
		timeout = max(timeout, limits[t].Timeout)
		if say(limits[t]) != say(limits[tasks[0]]) {
			var per []string
			for _, t := range tasks {
				per = append(per, t.Name+": "+say(limits[t]))
			}
			each = strings.Join(per, "; ")
			break
		}
	}
	more := ""
	if p.cfg.runs(StageFuse) && timeout > p.cfg.AnchorDeadline {
		more = fmt.Sprintf("; a step waits %v for its anchors (--anchor-deadline): slower ones are fused on the world model (late anchors)", p.cfg.AnchorDeadline)
	}
	if p.cfg.ExecCopiesOnce {
		more += "; a solution runs once in the run, its copies in any anchor group taking its outcome (--exec-copies-once)"
	}
	if len(tasks) > 1 {
		more += "; each trajectory on the task its task_id names"
	}
	p.notef("execute: %s on %s, each execution: %s%s", executor, sandbox.TaskNames(tasks), each, more)
}

// execLimits are a real execution's limits on task as flags set them (the
// task's fill in the rest: sandbox.Limits.For). With GPUs shared out, the
// address space is unlimited unless the flag or the task says otherwise:
// CUDA's driver reserves far more of it than it uses, and a solution
// given a GPU under the default 1 GiB could not start CUDA at all.
func (c *Config) execLimits(task *sandbox.Task) sandbox.Limits {
	l := sandbox.Limits{Timeout: c.ExecTimeout, MemoryBytes: int64(c.ExecMemoryMB) << 20, CPUSeconds: c.ExecCPUSeconds,
		Processes: cmp.Or(c.ExecProcesses, sandbox.DefaultProcesses(c.ExecSlots)), DiskBytes: int64(c.ExecDiskMB) << 20,
		SubmissionBytes: int64(c.ExecSubmissionMB) << 20}
	if c.ExecGPUs != "" && l.MemoryBytes == 0 && (task == nil || task.MemoryMB == 0) {
		l.MemoryBytes = -1
	}
	return l
}

// gpuSets is ExecGPUs in sets of ExecGPUsEach, in the order given, and
// the GPUs left over, fewer than a set, which are not used.
func (c *Config) gpuSets() (sets [][]string, unused []string, err error) {
	each := cmp.Or(c.ExecGPUsEach, 1)
	if c.ExecGPUs == "" {
		if c.ExecGPUsEach != 0 {
			return nil, nil, fmt.Errorf("--exec-gpus-each %d: without --exec-gpus, there are no GPUs to share out", c.ExecGPUsEach)
		}
		return nil, nil, nil
	}
	var gpus []string
	for g := range strings.SplitSeq(c.ExecGPUs, ",") {
		g = strings.TrimSpace(g)
		switch {
		case g == "" || strings.ContainsAny(g, " \t\n="):
			return nil, nil, fmt.Errorf("--exec-gpus %q: want GPUs as nvidia-smi lists them, indexes or UUIDs, separated by commas (0,1,2,3)", c.ExecGPUs)
		case slices.Contains(gpus, g):
			return nil, nil, fmt.Errorf("--exec-gpus %q: GPU %s is given twice", c.ExecGPUs, g)
		}
		gpus = append(gpus, g)
	}
	if each < 1 || each > len(gpus) {
		return nil, nil, fmt.Errorf("--exec-gpus-each %d: want 1 to the %d GPUs of --exec-gpus", each, len(gpus))
	}
	for len(gpus) >= each {
		sets, gpus = append(sets, gpus[:each:each]), gpus[each:]
	}
	return sets, gpus, nil
}
