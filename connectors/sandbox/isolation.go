package sandbox

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// checkHidden refuses a directory to hide that holds what the code needs
// to start: its interpreter, or the shell that starts it.
func (s *Subprocess) checkHidden() error {
	if !namespaceTools().privateTmp {
		return nil // nothing is hidden
	}
	interpreter := "python3"
	if len(s.Command) > 0 {
		interpreter = s.Command[0]
	}
	hidden, shared := s.hidden(), sharedDirs()
	for _, name := range []string{interpreter, "/bin/sh"} {
		path, ok := s.lookPath(name)
		if !ok {
			continue // the code's shell says so
		}
		paths := []string{path}
		if real, err := filepath.EvalSymlinks(path); err == nil {
			paths = append(paths, real)
		}
		for _, p := range paths {
			p, _ = filepath.Abs(p)
			for _, h := range hidden {
				if within(p, h) {
					return fmt.Errorf("sandbox: %s is in %s, which the code must not see (the task's answers, wmrl's data): put one or the other elsewhere", p, h)
				}
			}
			for _, d := range shared {
				if within(p, d) {
					return fmt.Errorf("sandbox: %s is in %s, which every user may write, so each execution gets an empty one of its own: put it elsewhere", p, d)
				}
			}
		}
	}
	return nil
}

// within reports whether path is dir or in it.
func within(path, dir string) bool {
	return path == dir || strings.HasPrefix(path, strings.TrimSuffix(dir, "/")+"/")
}

// unshareFlags puts the code in PID, network, mount and IPC namespaces of
// its own, with a /proc of its PID namespace. The mount namespace's mounts
// are private (unshare's default propagation): none of them reaches the
// host. The IPC namespace holds the System V shared memory, semaphores and
// message queues the code makes, which outlive their process: on the
// host's, what code killed at its limit left stayed for as long as the
// machine ran, and the next execution found it by its key. The namespace
// goes, with all of them, when the code's last process ends.
var unshareFlags = []string{"--pid", "--net", "--mount", "--ipc", "--fork", "--kill-child", "--mount-proc", "--"}

// privateTmpScript runs as root in the new mount namespace, before the
// drop to the code's user: the work directory ($1) becomes the code's
// /tmp and /var/tmp, /dev/shm a tmpfs of its own (of $3 bytes, when set),
// and the directory the work directories are made in ($2) an empty,
// read-only one. Code that writes a fixed path such as /tmp/model.pt
// (solutions often do) then writes into its own directory, where two
// executions at once cannot overwrite each other's file, and it is
// removed with that directory: a run of days leaves nothing in the
// host's /tmp or /dev/shm, where nothing would clean it. It cannot reach
// another execution's directory even knowing its path, as the same user.
// The $4 paths after those are what the code needs of the host's /tmp
// and /var/tmp (keptInTmp: an interpreter there): each is bound into the
// work directory under its name there first, and comes along with it.
// The work directory may itself be under /tmp: it is bound there first,
// and its old path is gone from view with the parent. The count and the
// directories after those are what the code must not see (hidden): each
// that exists becomes an empty, read-only one too. The count and the
// directories after those are the host's other directories every user
// may write (sharedDirs): each becomes an empty one of the code's own, of
// 16 MiB. Why a mount fails
// is said on fd 3, as the code's shell says why the code did not start.
// The mounts are private to the namespace (unshare's default): none of
// them reaches the host, where the work directory is then removed.
// privateTmpArgs is its command line.
const privateTmpScript = `w=$1 parent=$2 shm=$3 n=$4; shift 4
m() { what=$1; shift; out=$(mount "$@" 2>&1) || { echo "its own $what could not be mounted: ${out%%
*}" >&3; exit 1; }; }
while [ "$n" -gt 0 ]; do
  k=$1 n=$((n - 1)); shift
  at=$w/${k##*/}
  { if [ -d "$k" ]; then mkdir "$at"; else : >"$at"; fi; } 2>/dev/null || { echo "its own /tmp cannot show $k: its work directory has a ${at##*/}" >&3; exit 1; }
  m "view of $k" --bind "$k" "$at"
done
n=$1; shift
m /tmp --rbind "$w" /tmp
[ ! -d /var/tmp ] || m /var/tmp --rbind /tmp /var/tmp
[ ! -d /dev/shm ] || m /dev/shm -t tmpfs -o "nosuid,nodev,mode=1777${shm:+,size=$shm}" wmrl-shm /dev/shm
[ ! -d "$parent" ] || m "view of $parent" -t tmpfs -o ro,mode=0755,size=4k wmrl-hidden "$parent"
while [ "$n" -gt 0 ]; do
  h=$1 n=$((n - 1)); shift
  [ ! -d "$h" ] || m "view of $h" -t tmpfs -o ro,mode=0755,size=4k wmrl-hidden "$h"
done
n=$1; shift
while [ "$n" -gt 0 ]; do
  d=$1 n=$((n - 1)); shift
  [ ! -d "$d" ] || m "$d" -t tmpfs -o "nosuid,nodev,mode=1777,size=16m" wmrl-shared "$d"
done
cd /tmp && exec "$@"`

// privateTmpArgs runs privateTmpScript, and then the command that follows
// them, with work as the code's /tmp, parent hidden, a /dev/shm of shm
// bytes ("": tmpfs's default), keep in view and hide out of it.
func privateTmpArgs(work, parent, shm string, keep, hide, shared []string) []string {
	args := []string{"/bin/sh", "-c", privateTmpScript, "wmrl-private-tmp", work, parent, shm, strconv.Itoa(len(keep))}
	args = append(append(args, keep...), strconv.Itoa(len(hide)))
	args = append(append(args, hide...), strconv.Itoa(len(shared)))
	return append(args, shared...)
}

// sharedDirs are the host's directories, beside /tmp, /var/tmp and
// /dev/shm, that every user may write: /run/lock, /var/crash and the
// like, looked for among the entries of the places they are made in.
// Code wrote there past its disk limit, which counts only its own
// directory, and what it left stayed for the next execution to find.
func sharedDirs() []string {
	var dirs []string
	for _, parent := range []string{"/", "/run", "/var", "/var/lib", "/var/cache", "/dev", "/srv", "/opt", "/home", "/mnt", "/media"} {
		entries, _ := os.ReadDir(parent)
		for _, e := range entries {
			path := filepath.Join(parent, e.Name())
			if !e.IsDir() || slices.Contains([]string{"/tmp", "/var/tmp", "/dev/shm", "/proc", "/sys"}, path) {
				continue // a symlink is not a directory here: where it leads is looked at, or not, as itself
			}
			if fi, err := e.Info(); err == nil && fi.Mode().Perm()&0o002 != 0 {
				dirs = append(dirs, path)
			}
		}
	}
	return dirs
}

// hidden is what the code must not see, as absolute paths: the task's
// private/ (its answers) and Hide.
func (s *Subprocess) hidden() []string {
	dirs := slices.Clone(s.Hide)
	if s.Task != nil && s.Task.Dir != "" {
		dirs = append(dirs, filepath.Join(s.Task.Dir, "private"))
	}
	var abs []string
	for _, d := range dirs {
		if a, err := filepath.Abs(d); err == nil && !slices.Contains(abs, a) {
			abs = append(abs, a)
		}
	}
	return abs
}

// keptInTmp is what of the host's /tmp and /var/tmp the code needs in its
// own: the top directory there that holds its interpreter (Command's
// first word, and where a symlink there points), such as a virtualenv
// made in /tmp. The code sees it at the same path.
func (s *Subprocess) keptInTmp() []string {
	if len(s.Command) == 0 || !filepath.IsAbs(s.Command[0]) {
		return nil
	}
	paths := []string{filepath.Clean(s.Command[0])}
	if real, err := filepath.EvalSymlinks(paths[0]); err == nil {
		paths = append(paths, real)
	}
	var keep []string
	for _, p := range paths {
		for _, root := range []string{"/tmp/", "/var/tmp/"} {
			if rest, ok := strings.CutPrefix(p, root); ok {
				top, _, _ := strings.Cut(rest, "/")
				if k := root + top; !slices.ContainsFunc(keep, func(have string) bool { return filepath.Base(have) == top }) {
					keep = append(keep, k)
				}
			}
		}
	}
	return keep
}

// namespaceTools finds util-linux's unshare and setpriv, and tries them
// once: as root, and otherwise in a user namespace of their own, where the
// kernel (or container) allows that. It tries the private /tmp as well
// (mount, in the new mount namespace), and without it when that fails.
func namespaceTools() *nsSupport {
	nsTools.once.Do(func() {
		unshare, err1 := exec.LookPath("unshare")
		setpriv, err2 := exec.LookPath("setpriv")
		if err1 != nil || err2 != nil {
			return
		}
		ns := &nsTools
		ns.unshare, ns.setpriv, ns.userNS = unshare, setpriv, os.Geteuid() != 0
		// util-linux 2.33 (2018) and later; RHEL 8's 2.32 has no --pdeathsig.
		help, _ := exec.Command(setpriv, "--help").Output()
		ns.pdeathsig = bytes.Contains(help, []byte("--pdeathsig"))
		try := func(argv ...string) bool {
			argv = append(append(append(ns.flags(), argv...), ns.drop(65534)...), "/bin/sh", "-c", "exit 0")
			return exec.Command(unshare, argv...).Run() == nil
		}
		if dir, err := os.MkdirTemp("", "wmrl-ns-probe-"); err == nil {
			ns.privateTmp = try(privateTmpArgs(dir, filepath.Join(dir, "parent"), "1048576", nil, nil, nil)...)
			os.Remove(dir)
		}
		ns.ok = ns.privateTmp || try()
	})
	return &nsTools
}

// nsSupport is what namespaceTools found.
type nsSupport struct {
	once             sync.Once
	unshare, setpriv string
	ok               bool // namespaces, through unshare and setpriv
	privateTmp       bool // and the code's own /tmp, /var/tmp and /dev/shm
	// userNS: wmrl is not root, and the namespaces are those of a user
	// namespace of their own, where the code runs as its root, which is
	// wmrl's user outside, with no capabilities: it cannot undo the
	// mounts that hide the host's /tmp.
	userNS bool
	// pdeathsig: setpriv can set the parent-death signal after it changes
	// the user (drop).
	pdeathsig bool
}

// flags are unshare's flags for an execution's namespaces.
func (ns *nsSupport) flags() []string {
	if ns.userNS {
		return append([]string{"--user", "--map-root-user"}, unshareFlags...)
	}
	return slices.Clone(unshareFlags)
}

// drop is setpriv's command line that runs the code as uid (as root), or
// as the user namespace's root without capabilities (not root), with
// no_new_privs either way: no setuid program gives privileges back.
//
// With --pdeathsig the namespace's init (setpriv's process) is killed
// with unshare, and the namespace with it: unshare's --kill-child sets
// that signal, but the kernel clears it when the process changes its user,
// as it does here as root, and the code would then outlive a killed wmrl.
func (ns *nsSupport) drop(uid uint32) []string {
	argv := []string{ns.setpriv}
	if ns.pdeathsig {
		argv = append(argv, "--pdeathsig", "SIGKILL")
	}
	if ns.userNS {
		return append(argv, "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--")
	}
	u := strconv.FormatUint(uint64(uid), 10)
	return append(argv, "--reuid", u, "--regid", u, "--clear-groups", "--no-new-privs", "--")
}

var nsTools nsSupport

// Isolation says how executions are kept apart on this machine, for a
// run's log.
func Isolation() string {
	ns := namespaceTools()
	where := "in namespaces of its own"
	if ns.userNS {
		where = "in namespaces of its own, in a user namespace (as its root, which is this user outside, without capabilities)"
	}
	outlives := ""
	if ns.ok && !ns.userNS && !ns.pdeathsig {
		outlives = "; an execution outlives a killed wmrl, up to its CPU-time limit (this setpriv has no --pdeathsig)"
	}
	switch {
	case ns.privateTmp:
		return where + ": no network, its own processes and /proc, its own System V IPC, its directory as /tmp and /var/tmp, its own /dev/shm and other directories every user may write, the task's answers and wmrl's data out of view" + outlives
	case ns.ok:
		return where + ": no network, its own processes and /proc, its own System V IPC; the host's /tmp and /dev/shm, and the task's answers and wmrl's data where permissions let it (mount refused)" + outlives
	case os.Geteuid() == 0:
		return "in network, PID and IPC namespaces where the kernel allows them (no util-linux unshare and setpriv): the host's /proc, /tmp and /dev/shm"
	}
	return "not isolated (not root, and no user namespaces through util-linux unshare and setpriv here): network reachable, the host's /tmp and /dev/shm; code outlives a killed wmrl, up to its CPU-time limit"
}
