package sandbox

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strconv"

	"github.com/wmrl/wmrl/stages/fuse"
)

// ErrInvalidSubmission marks a submission the grader cannot score.
var ErrInvalidSubmission = errors.New("invalid submission")

// Task is a prediction task on disk:
//
//	task.json             name, metric, id_column, target, submission,
//	                      and optionally time_limit_seconds, memory_mb
//	public/               data the code sees (copied read-only)
//	private/answers.csv   id, target, board (public | private)
//	leaderboard.csv       public_score, private_score of reference entries
type Task struct {
	Dir         string `json:"-"`
	Name        string `json:"name"`
	Description string `json:"description"`
	// Metric: accuracy, f1 (positive class "1"), auc (binary target, the
	// submission a probability of 1) or rmse.
	Metric     string `json:"metric"`
	IDColumn   string `json:"id_column"`
	Target     string `json:"target"`
	Submission string `json:"submission"`
	// TimeLimitSeconds and MemoryMB are what one execution of a solution
	// may take: wall-clock seconds and address space (MiB; -1: no limit,
	// as CUDA needs). 0 leaves them to the executor (60 s and 1024 MiB
	// unless the run says otherwise): a task whose solutions train a model
	// for minutes says so here.
	TimeLimitSeconds float64 `json:"time_limit_seconds"`
	MemoryMB         int     `json:"memory_mb"`

	answers     map[string]answer
	leaderboard [2][]float64 // public, private
}

type answer struct {
	value   string
	private bool
}

// LoadTask reads a task directory: its task.json (ReadTaskJSON), and the
// private answers and leaderboard its grading needs.
func LoadTask(dir string) (*Task, error) {
	t, err := ReadTaskJSON(dir)
	if err != nil {
		return nil, err
	}
	rows, err := readCSV(filepath.Join(dir, "private", "answers.csv"))
	if err != nil {
		return nil, fmt.Errorf("task %s: answers (generate the task first): %w", dir, err)
	}
	t.answers = map[string]answer{}
	for _, r := range rows {
		t.answers[r["id"]] = answer{value: r["target"], private: r["board"] == "private"}
	}
	lb, err := readCSV(filepath.Join(dir, "leaderboard.csv"))
	if err != nil {
		return nil, fmt.Errorf("task %s: leaderboard: %w", dir, err)
	}
	for _, r := range lb {
		for b, col := range []string{"public_score", "private_score"} {
			v, err := strconv.ParseFloat(r[col], 64)
			if err != nil {
				return nil, fmt.Errorf("task %s: leaderboard %s %q: %w", dir, col, r[col], err)
			}
			t.leaderboard[b] = append(t.leaderboard[b], v)
		}
	}
	if len(t.answers) == 0 || len(t.leaderboard[0]) == 0 {
		return nil, fmt.Errorf("task %s: no answers or no leaderboard", dir)
	}
	return t, nil
}

// ReadTaskJSON reads a task's task.json alone: what a process that does
// not grade (the world model's, told the limits) needs, without the
// private answers. The task it returns cannot grade.
func ReadTaskJSON(dir string) (*Task, error) {
	raw, err := os.ReadFile(filepath.Join(dir, "task.json"))
	if err != nil {
		return nil, fmt.Errorf("task %s: %w", dir, err)
	}
	t := &Task{Dir: dir}
	if err := json.Unmarshal(raw, t); err != nil {
		return nil, fmt.Errorf("task %s: task.json: %w", dir, err)
	}
	if _, ok := higherIsBetter[t.Metric]; !ok {
		return nil, fmt.Errorf("task %s: metric %q: want accuracy, f1, auc or rmse", dir, t.Metric)
	}
	if t.Submission == "" {
		t.Submission = "submission.csv"
	}
	if t.TimeLimitSeconds < 0 || t.MemoryMB < -1 {
		return nil, fmt.Errorf("task %s: time_limit_seconds %v and memory_mb %d: want >= 0 (0: the executor's defaults; memory_mb -1: no limit)", dir, t.TimeLimitSeconds, t.MemoryMB)
	}
	return t, nil
}

// PublicDir holds the data the code sees.
func (t *Task) PublicDir() string { return filepath.Join(t.Dir, "public") }

// walkPublic calls fn for everything under PublicDir, directories before
// what they hold, with its path and its slash-separated path relative to
// PublicDir (an image task keeps its images in directories).
func (t *Task) walkPublic(fn func(path, rel string, dir bool) error) error {
	root := t.PublicDir()
	return filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if path == root {
			return nil
		}
		rel, err := filepath.Rel(root, path)
		if err != nil {
			return err
		}
		return fn(path, filepath.ToSlash(rel), d.IsDir())
	})
}

func readCSV(path string) ([]map[string]string, error) {
	f, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return parseCSV(f)
}

func parseCSV(b []byte) ([]map[string]string, error) {
	recs, err := csv.NewReader(bytes.NewReader(b)).ReadAll()
	if err != nil {
		return nil, err
	}
	if len(recs) == 0 {
		return nil, errors.New("empty file")
	}
	var out []map[string]string
	for _, r := range recs[1:] {
		m := map[string]string{}
		for i, h := range recs[0] {
			if i < len(r) {
				m[h] = r[i]
			}
		}
		out = append(out, m)
	}
	return out, nil
}

var higherIsBetter = map[string]bool{"accuracy": true, "f1": true, "auc": true, "rmse": false}

// Grade validates a submission and returns its reward: the leaderboard
// position reward (total - position + 1) / total, averaged over the public
// and private boards, as in WMRL.md.
func (t *Task) Grade(sub []byte) (float64, error) {
	scores, err := t.Score(sub)
	if err != nil {
		return 0, err
	}
	reward := 0.0
	for b := range 2 {
		better := 0
		for _, ref := range t.leaderboard[b] {
			if (higherIsBetter[t.Metric] && ref > scores[b]) || (!higherIsBetter[t.Metric] && ref < scores[b]) {
				better++
			}
		}
		total := float64(len(t.leaderboard[b]) + 1)
		reward += (total - float64(better+1) + 1) / total / 2
	}
	return reward, nil
}

// Score computes the metric on the public and private boards.
func (t *Task) Score(sub []byte) ([2]float64, error) {
	rows, err := parseCSV(sub)
	if err != nil {
		return [2]float64{}, fmt.Errorf("%w: not a CSV file: %v", ErrInvalidSubmission, err)
	}
	seen := map[string]bool{}
	var pred, truth [2][]string
	for i, r := range rows {
		id, ok := r[t.IDColumn]
		v, ok2 := r[t.Target]
		if !ok || !ok2 {
			return [2]float64{}, fmt.Errorf("%w: columns %q and %q are required", ErrInvalidSubmission, t.IDColumn, t.Target)
		}
		a, known := t.answers[id]
		switch {
		case !known:
			return [2]float64{}, fmt.Errorf("%w: row %d: unknown %s %q", ErrInvalidSubmission, i+1, t.IDColumn, id)
		case seen[id]:
			return [2]float64{}, fmt.Errorf("%w: row %d: %s %q twice", ErrInvalidSubmission, i+1, t.IDColumn, id)
		}
		seen[id] = true
		b := 0
		if a.private {
			b = 1
		}
		pred[b], truth[b] = append(pred[b], v), append(truth[b], a.value)
	}
	if len(seen) != len(t.answers) {
		return [2]float64{}, fmt.Errorf("%w: %d of %d rows", ErrInvalidSubmission, len(seen), len(t.answers))
	}
	var out [2]float64
	for b := range 2 {
		s, err := metric(t.Metric, pred[b], truth[b])
		if err != nil {
			return [2]float64{}, fmt.Errorf("%w: %v", ErrInvalidSubmission, err)
		}
		out[b] = s
	}
	return out, nil
}

func floats(xs []string) ([]float64, error) {
	out := make([]float64, len(xs))
	for i, x := range xs {
		v, err := strconv.ParseFloat(x, 64)
		if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
			return nil, fmt.Errorf("value %q is not a finite number", x)
		}
		out[i] = v
	}
	return out, nil
}

func metric(name string, pred, truth []string) (float64, error) {
	switch name {
	case "accuracy":
		ok := 0
		for i := range pred {
			if pred[i] == truth[i] {
				ok++
			}
		}
		return float64(ok) / float64(len(pred)), nil
	case "f1":
		var tp, fp, fn float64
		for i := range pred {
			switch {
			case pred[i] == "1" && truth[i] == "1":
				tp++
			case pred[i] == "1":
				fp++
			case truth[i] == "1":
				fn++
			}
		}
		if tp == 0 {
			return 0, nil
		}
		return 2 * tp / (2*tp + fp + fn), nil
	case "rmse":
		p, err := floats(pred)
		if err != nil {
			return 0, err
		}
		y, err := floats(truth)
		if err != nil {
			return 0, err
		}
		ss := 0.0
		for i := range p {
			ss += (p[i] - y[i]) * (p[i] - y[i])
		}
		return math.Sqrt(ss / float64(len(p))), nil
	case "auc":
		p, err := floats(pred)
		if err != nil {
			return 0, err
		}
		return auc(p, truth), nil
	}
	return 0, fmt.Errorf("unknown metric %q", name)
}

// auc is ROC AUC of the scores p for truth "1" against the rest; 0.5 when
// truth has one class only.
func auc(p []float64, truth []string) float64 {
	positive := make([]bool, len(truth))
	for i, t := range truth {
		positive[i] = t == "1"
	}
	if a := fuse.AUC(p, positive); !math.IsNaN(a) {
		return a
	}
	return 0.5
}
