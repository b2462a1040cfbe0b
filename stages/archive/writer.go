package archive

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/parquet-go/parquet-go"
)

// Metadata keys of an archive file.
const (
	metaKeys = "wmrl.keys" // JSON list of the inputs whose rows the file holds
	metaLate = "wmrl.late" // JSON list of the late anchor groups its updates named
)

// WriterConfig configures a Writer.
type WriterConfig struct {
	// Dir is the archive root; files go under Dir/run=<Run>/.
	Dir string
	Run string
	// A file is closed (and its inputs acknowledged) once it holds MaxRows
	// rows (default 1,000,000) or has been open MaxAge (default 10s).
	MaxRows int
	MaxAge  time.Duration
	// RowGroupRows bounds a row group (default 65,536).
	RowGroupRows int64
	// Settings are recorded in every file.
	Settings Settings
}

// Writer appends rows to rolling zstd Parquet files. A file is written
// under a hidden temporary name and renamed to its final, sortable name
// (part-<n>.parquet) only once closed and synced, so a reader never sees a
// partial file. Add returns a Commit that completes when the rows are
// durable; the caller acknowledges its input only then. Every file records
// the keys of the inputs it holds, and a key already archived is never
// written again, so redelivery after a crash duplicates nothing. Safe for
// concurrent use.
type Writer struct {
	cfg WriterConfig
	dir string

	mu      sync.Mutex
	next    int64
	cur     *file
	durable keySet               // keys in closed files
	late    map[string]LateGroup // late groups named by updates, by LateKey
	stop    chan struct{}
	stopped chan struct{}
	closed  bool
	owner   *os.File // the run's writer lock, held until Close
}

// Commit completes when its rows' file is closed, synced and visible.
type Commit struct {
	done chan struct{}
	err  error
}

// Done is closed when the commit completes.
func (c *Commit) Done() <-chan struct{} { return c.done }

// Err is the commit's outcome, once Done.
func (c *Commit) Err() error { return c.err }

var committed = func() *Commit { c := &Commit{done: make(chan struct{})}; close(c.done); return c }()

type file struct {
	f      *os.File
	w      *parquet.GenericWriter[Row]
	tmp    string
	final  string
	rows   int
	opened time.Time
	keys   []string
	has    map[string]bool
	late   []LateGroup
	commit *Commit
}

// OpenWriter opens the run's archive directory, removes temporary files a
// crash left behind, and reads the keys of every closed file.
func OpenWriter(cfg WriterConfig) (*Writer, error) {
	if cfg.Dir == "" || cfg.Run == "" {
		return nil, errors.New("archive: writer needs a directory and a run")
	}
	if cfg.MaxRows <= 0 {
		cfg.MaxRows = 1_000_000
	}
	if cfg.MaxAge <= 0 {
		cfg.MaxAge = 10 * time.Second
	}
	if cfg.RowGroupRows <= 0 {
		cfg.RowGroupRows = 65536
	}
	w := &Writer{cfg: cfg, dir: RunDir(cfg.Dir, cfg.Run), late: map[string]LateGroup{},
		stop: make(chan struct{}), stopped: make(chan struct{})}
	if err := os.MkdirAll(w.dir, 0o755); err != nil {
		return nil, fmt.Errorf("archive: %w", err)
	}
	var err error
	if w.owner, err = lockWriter(w.dir); err != nil {
		return nil, err
	}
	opened := false
	defer func() {
		if !opened {
			w.owner.Close()
		}
	}()
	release, err := ReadLock(cfg.Dir, cfg.Run) // no merge under way while the keys are read
	if err != nil {
		return nil, err
	}
	defer release()
	ents, err := os.ReadDir(w.dir)
	if err != nil {
		return nil, fmt.Errorf("archive: %w", err)
	}
	for _, e := range ents {
		name := e.Name()
		if strings.HasPrefix(name, ".part-") && strings.HasSuffix(name, ".tmp") {
			if err := os.Remove(filepath.Join(w.dir, name)); err != nil {
				return nil, fmt.Errorf("archive: remove partial file: %w", err)
			}
			continue
		}
		n, ok := partNumber(name)
		if !ok {
			continue
		}
		keys, late, mergedTo, err := readMeta(filepath.Join(w.dir, name))
		if err != nil {
			return nil, err
		}
		w.next = max(w.next, n+1, mergedTo+1)
		for _, k := range keys {
			w.durable.add(k)
		}
		for _, g := range late {
			w.late[LateKey(g.Step, g.GroupID)] = g
		}
	}
	go w.roll(min(max(w.cfg.MaxAge/4, 10*time.Millisecond), 50*time.Millisecond)) // read here: SetMaxAge may race the goroutine's start
	opened = true
	return w, nil
}

// lockWriter makes sure a run has one writer. A second one would number
// its files from the same directory listing, and its archive stage would
// wait for good for updates the first one archived (a late anchor group
// is archived by whichever stage has its step's update); the README's
// "one archive stage per run" is enforced here, naming the holder.
func lockWriter(dir string) (*os.File, error) {
	path := filepath.Join(dir, ".writer.lock")
	f, err := flockAt(path, os.O_RDWR, syscall.LOCK_EX|syscall.LOCK_NB)
	if errors.Is(err, syscall.EWOULDBLOCK) {
		holder, _ := os.ReadFile(path)
		return nil, fmt.Errorf("archive: %s is written by another archive stage (process %s): run one archive stage per run", dir, strings.TrimSpace(string(holder)))
	}
	if err != nil {
		return nil, fmt.Errorf("archive: lock %s: %w", dir, err)
	}
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return f, nil
}

// RunDir is where a run's files live.
func RunDir(root, run string) string { return filepath.Join(root, "run="+run) }

func partName(n int64) string { return fmt.Sprintf("part-%012d.parquet", n) }

func partNumber(name string) (int64, bool) {
	s, ok := strings.CutPrefix(name, "part-")
	if !ok {
		return 0, false
	}
	s, ok = strings.CutSuffix(s, ".parquet")
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseInt(s, 10, 64)
	return n, err == nil
}

// readMeta reads what a file's footer records: the inputs it holds, the
// late groups its updates named, and for a merged file its last input's
// number (else 0).
func readMeta(path string) (keys []string, late []LateGroup, mergedTo int64, err error) {
	f, pf, err := openParquet(path, parquet.SkipPageIndex(true))
	if err != nil {
		return nil, nil, 0, err
	}
	defer f.Close()
	if v, ok := pf.Lookup(metaKeys); ok {
		if err := json.Unmarshal([]byte(v), &keys); err != nil {
			return nil, nil, 0, fmt.Errorf("archive: %s: keys: %w", path, err)
		}
	}
	if v, ok := pf.Lookup(metaLate); ok {
		if err := json.Unmarshal([]byte(v), &late); err != nil {
			return nil, nil, 0, fmt.Errorf("archive: %s: late groups: %w", path, err)
		}
	}
	if v, ok := pf.Lookup(metaMergedTo); ok {
		if mergedTo, err = strconv.ParseInt(v, 10, 64); err != nil {
			return nil, nil, 0, fmt.Errorf("archive: %s: merged_to: %w", path, err)
		}
	}
	return keys, late, mergedTo, nil
}

// Has reports whether key's rows are archived or being archived, and the
// commit to wait for (nil when not).
func (w *Writer) Has(key string) *Commit {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.has(key)
}

func (w *Writer) has(key string) *Commit {
	if w.durable.has(key) {
		return committed
	}
	if w.cur != nil && w.cur.has[key] {
		return w.cur.commit
	}
	return nil
}

// Archived lists the steps whose updates are in closed files.
func (w *Writer) Archived() []int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Collect(w.durable.updates.All())
}

// PendingLate lists the late anchor groups named by archived updates
// whose pairs are not archived yet, by step and group.
func (w *Writer) PendingLate() []LateGroup {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []LateGroup
	for k, g := range w.late {
		if w.has(k) == nil {
			out = append(out, g)
		}
	}
	slices.SortFunc(out, func(a, b LateGroup) int {
		return cmp.Or(cmp.Compare(a.Step, b.Step), strings.Compare(a.GroupID, b.GroupID))
	})
	return out
}

// Late returns the late anchor group an archived (or being archived)
// update named (ok false: none named it), with the commit of the step's
// update (nil: not added yet). Both are read at once: a group not named
// by an update that is added is one that was in time.
func (w *Writer) Late(step int64, group string) (g LateGroup, update *Commit, ok bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	g, ok = w.late[LateKey(step, group)]
	return g, w.has(UpdateKey(step)), ok
}

// Add archives rows under key (with the late groups an update named) and
// returns the commit to wait for. A key already held returns that commit
// and writes nothing.
func (w *Writer) Add(key string, rows []Row, late []LateGroup) (*Commit, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, errors.New("archive: writer closed")
	}
	if c := w.has(key); c != nil {
		return c, nil
	}
	if w.cur == nil {
		if err := w.open(); err != nil {
			return nil, err
		}
	}
	cur := w.cur
	if _, err := cur.w.Write(rows); err != nil {
		w.abort(err)
		return nil, fmt.Errorf("archive: write %s: %w", key, err)
	}
	cur.rows += len(rows)
	cur.keys = append(cur.keys, key)
	cur.has[key] = true
	for _, g := range late {
		cur.late = append(cur.late, g)
		w.late[LateKey(g.Step, g.GroupID)] = g
	}
	c := cur.commit
	if cur.rows >= w.cfg.MaxRows {
		w.finish()
	}
	return c, nil
}

func (w *Writer) open() error {
	n := w.next
	w.next++
	tmp := filepath.Join(w.dir, "."+partName(n)+".tmp")
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return fmt.Errorf("archive: %w", err)
	}
	settings, err := json.Marshal(w.cfg.Settings)
	if err != nil {
		return fmt.Errorf("archive: settings: %w", err)
	}
	pw := parquet.NewGenericWriter[Row](f, parquet.Compression(&parquet.Zstd), parquet.KeyValueMetadata(metaSettings, string(settings)),
		parquet.MaxRowsPerRowGroup(w.cfg.RowGroupRows), parquet.CreatedBy("wmrl", "1", ""))
	w.cur = &file{f: f, w: pw, tmp: tmp, final: filepath.Join(w.dir, partName(n)), opened: time.Now(),
		has: map[string]bool{}, commit: &Commit{done: make(chan struct{})}}
	return nil
}

// finish closes the current file, makes it visible and completes its
// commit. On failure the file is discarded and its waiters get the error
// (their inputs are redelivered and written again).
func (w *Writer) finish() {
	cur := w.cur
	w.cur = nil
	if cur == nil {
		return
	}
	err := cur.close()
	if err == nil {
		for _, k := range cur.keys {
			w.durable.add(k)
		}
	} else {
		_ = os.Remove(cur.tmp)
		for _, g := range cur.late {
			delete(w.late, LateKey(g.Step, g.GroupID))
		}
	}
	cur.commit.err = err
	close(cur.commit.done)
}

func (f *file) close() error {
	keys, _ := json.Marshal(f.keys)
	f.w.SetKeyValueMetadata(metaKeys, string(keys))
	if len(f.late) > 0 {
		late, _ := json.Marshal(f.late)
		f.w.SetKeyValueMetadata(metaLate, string(late))
	}
	if err := commitFile(f.w, f.f, f.final); err != nil {
		return fmt.Errorf("archive: close %s: %w", f.final, err)
	}
	return nil
}

// commitFile makes a file written under a temporary name visible, complete,
// under its final name: the Parquet writer's footer, fsync, close, rename
// and fsync of the directory, so that a crash leaves either no file or the
// whole one. The caller removes the temporary file on error.
func commitFile(pw io.Closer, f *os.File, final string) error {
	err := pw.Close()
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), final)
	}
	if err == nil {
		err = syncDir(filepath.Dir(final))
	}
	return err
}

func (w *Writer) abort(err error) {
	cur := w.cur
	w.cur = nil
	_ = cur.f.Close()
	_ = os.Remove(cur.tmp)
	for _, g := range cur.late {
		delete(w.late, LateKey(g.Step, g.GroupID))
	}
	cur.commit.err = fmt.Errorf("archive: file discarded: %w", err)
	close(cur.commit.done)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// roll closes the current file once it is MaxAge old, looking every tick.
func (w *Writer) roll(tick time.Duration) {
	defer close(w.stopped)
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
			w.mu.Lock()
			if w.cur != nil && time.Since(w.cur.opened) >= w.cfg.MaxAge {
				w.finish()
			}
			w.mu.Unlock()
		}
	}
}

// SetMaxAge changes how long a file stays open (a run about to end
// shortens it so that its last rows are durable soon).
func (w *Writer) SetMaxAge(d time.Duration) {
	w.mu.Lock()
	w.cfg.MaxAge = d
	w.mu.Unlock()
}

// Flush closes the current file now.
func (w *Writer) Flush() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	c := committed
	if w.cur != nil {
		c = w.cur.commit
		w.finish()
	}
	return c.err
}

// Close closes the current file and stops rolling.
func (w *Writer) Close() error {
	err := w.Flush()
	w.mu.Lock()
	already := w.closed
	w.closed = true
	w.mu.Unlock()
	if !already {
		close(w.stop)
		<-w.stopped
		w.owner.Close()
	}
	return err
}

// Files lists the run's closed files in order.
func Files(root, run string) ([]string, error) {
	dir := RunDir(root, run)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("archive: %w", err)
	}
	var out []string
	for _, e := range ents {
		if _, ok := partNumber(e.Name()); ok {
			out = append(out, filepath.Join(dir, e.Name()))
		}
	}
	slices.Sort(out)
	return out, nil
}
