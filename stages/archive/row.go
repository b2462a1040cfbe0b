// Package archive keeps every reward record as Parquet for offline replays
// and audits of the world model's bias: one row per trajectory of every
// step update, and one per trajectory of an anchor group whose execution
// came too late for its step, once the group's calibration comes.
package archive

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/stepset"
)

// Sources of a row: the two of an update item, and a late anchor: the
// execution of an anchor trajectory whose group was absorbed by the
// calibration after its step was fused on world-model rewards.
const (
	SourceAnchor     = "anchor"
	SourceWorldModel = "world_model"
	SourceLateAnchor = "late_anchor"
)

// ExecLate is the exec_status of the world-model row of an anchor whose
// execution missed its step's deadline; its execution comes later as a
// row of source late_anchor.
const ExecLate = "late"

// Row is one archived record. The column names are public: DuckDB, pandas
// and the audit read them.
//
// The run is the archive's hive partition, <archive>/run=<run>/, and not a
// column of the files, as Spark and pyarrow's write_to_dataset lay out
// partitions: pandas (pyarrow) and DuckDB read it from the path as the
// column run, and pyarrow refuses a dataset whose files also hold it.
// Our readers fill Run from the path.
type Row struct {
	Run           string `parquet:"-"`
	Step          int64  `parquet:"step"`
	GroupID       string `parquet:"group_id"`
	TrajID        string `parquet:"traj_id"`
	TaskID        string `parquet:"task_id,dict"`
	PolicyVersion int64  `parquet:"policy_version"`
	IsAnchor      bool   `parquet:"is_anchor"`
	// Predicted is null when the world model could not grade it; TrueScore
	// null unless executed and graded.
	Predicted  *float64 `parquet:"predicted,optional"`
	TrueScore  *float64 `parquet:"true_score,optional"`
	Calibrated *float64 `parquet:"calibrated,optional"`
	// CalibrationVersion: the map version the step used (0: before the
	// first fit, or not debiased; see schemas.Update).
	CalibrationVersion int64 `parquet:"calibration_version"`
	// Reward is null when ungraded (and on late_anchor rows, which did not
	// enter any gradient).
	Reward         *float64 `parquet:"reward,optional"`
	Advantage      float64  `parquet:"advantage"`
	Weight         float64  `parquet:"weight"`
	FusedAdvantage float64  `parquet:"fused_advantage"`
	Rho            float64  `parquet:"rho"`
	Source         string   `parquet:"source,dict"`
	WMStatus       string   `parquet:"wm_status,dict"`
	ExecStatus     *string  `parquet:"exec_status,optional,dict"`
	ExecSeconds    *float64 `parquet:"exec_seconds,optional"`
	// TS is when the update was made (its published_at), or, on a
	// late_anchor row, when the group's calibration was stored (in
	// archives written before that was known, when the archive wrote it).
	TS time.Time `parquet:"ts,timestamp(microsecond:utc)"`

	// For replays: the calibration seq the step was fused at, and for an
	// anchor the seq at which its group's pairs were absorbed (0: not).
	CalibrationSeq int64 `parquet:"calibration_seq"`
	AbsorbedSeq    int64 `parquet:"absorbed_seq"`
	// D is the tracked world-model disagreement when the step was fused.
	D float64 `parquet:"d"`

	// ExecDetail is what ended an execution, as the executor said (the end
	// of a failure's stderr, the limit that killed it), or null. Added
	// after the first archives: files without the column read it as null
	// (see laterColumns).
	ExecDetail *string `parquet:"exec_detail,optional"`
	// WMVerdict is the execution status the world model predicted, and
	// WMRationale its reason, on anchor groups' rows when it gave them;
	// null otherwise (the simulated world model gives neither). Added
	// after the first archives (see laterColumns).
	WMVerdict   *string `parquet:"wm_verdict,optional,dict"`
	WMRationale *string `parquet:"wm_rationale,optional"`
	// Prompt and Response are the trajectory as the policy wrote it and
	// the world model and the executor saw it, on anchor groups' rows
	// (null on the others, and when the archive stage runs without
	// them): with true_score they are what an offline evaluation of
	// another world model, or its training, needs, kept past the stream's
	// retention. Read (replay, audit) leaves them out; Scan and DuckDB or
	// pandas read them. Added after the first archives (see laterColumns).
	Prompt   *string `parquet:"prompt,optional"`
	Response *string `parquet:"response,optional"`
	// ResponseBytes is the response's length, beside it: Read leaves the
	// code out but reads this, for the audit's bias by solution length.
	ResponseBytes *int64 `parquet:"response_bytes,optional"`
	// ExecCopyOf names the trajectory whose execution this anchor's
	// shares (the same task, prompt and response, run once, under
	// --exec-copies-once; its exec_seconds are 0), null when it ran its
	// own. Added after the first archives (see laterColumns).
	ExecCopyOf *string `parquet:"exec_copy_of,optional"`
	// ExecCopyStep and ExecCopyGroup say where that trajectory was when
	// not in this row's group: another anchor group of the run, executed
	// first, whose outcome --exec-copies-once reused (null otherwise).
	// Added after the first archives (see laterColumns).
	ExecCopyStep  *int64  `parquet:"exec_copy_step,optional"`
	ExecCopyGroup *string `parquet:"exec_copy_group,optional"`
	// WMModel is the world model whose prediction the row holds (its
	// name: --wm-model, or "sim"), null when the trajectory was not sent
	// to be scored or its prediction named none. Added after the first
	// archives (see laterColumns): older files read it as null.
	WMModel *string `parquet:"wm_model,optional,dict"`
}

// Detached is r with what its optional fields point to copied: a row
// that Read or Scan decoded points into its row group's columns, and one
// row kept holds them all (about 150 bytes for each row of its row group),
// where a reader that keeps a few rows of many (wm-eval's executed anchors)
// wants only those.
func (r Row) Detached() Row {
	for _, p := range []**float64{&r.Predicted, &r.TrueScore, &r.Calibrated, &r.Reward, &r.ExecSeconds} {
		*p = Detach(*p)
	}
	for _, p := range []**string{&r.ExecStatus, &r.ExecDetail, &r.WMVerdict, &r.WMRationale, &r.Prompt, &r.Response, &r.ExecCopyOf, &r.ExecCopyGroup, &r.WMModel} {
		*p = Detach(*p)
	}
	r.ResponseBytes, r.ExecCopyStep = Detach(r.ResponseBytes), Detach(r.ExecCopyStep)
	return r
}

// Detach is a copy of what p points to (nil for nil): one field of a
// decoded row, kept without its row group's column.
func Detach[T any](p *T) *T {
	if p == nil {
		return nil
	}
	v := *p
	return &v
}

// UpdateKey and LateKey name what a file holds, so that a redelivered
// input is never archived twice.
func UpdateKey(step int64) string { return "update/" + strconv.FormatInt(step, 10) }

// updateStep is the step an UpdateKey names.
func updateStep(key string) (int64, bool) {
	digits, ok := strings.CutPrefix(key, "update/")
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseInt(digits, 10, 64)
	return n, err == nil && strconv.FormatInt(n, 10) == digits
}

// keySet is the set of input keys in closed files: the updates' as the
// steps they name, a few ranges for a run of days, and the others (late
// anchor groups', few) by name.
type keySet struct {
	updates stepset.Set
	other   map[string]bool
}

func (k *keySet) add(key string) {
	if n, ok := updateStep(key); ok {
		k.updates.Add(n)
		return
	}
	if k.other == nil {
		k.other = map[string]bool{}
	}
	k.other[key] = true
}

func (k *keySet) has(key string) bool {
	if n, ok := updateStep(key); ok {
		return k.updates.Has(n)
	}
	return k.other[key]
}

// LateKey names a late anchor group's pairs.
func LateKey(step int64, group string) string { return fmt.Sprintf("late/%d/%s", step, group) }

// LateGroup is what a late anchor group's rows take from its step's update.
type LateGroup struct {
	Step          int64            `json:"step"`
	GroupID       string           `json:"group_id"`
	TaskID        string           `json:"task_id"`
	PolicyVersion map[string]int64 `json:"policy_version"`
	// Ungraded lists, in the update's order, the group's trajectories the
	// world model gave no score: no pair comes for them, so their rows
	// come from their executions' outcomes alone. Absent from the files
	// of archives from before it was kept.
	Ungraded []UngradedTraj `json:"ungraded,omitempty"`
	// WMModel is the world model that scored the group (Row.WMModel);
	// absent from the files of archives from before it was kept.
	WMModel string `json:"wm_model,omitempty"`
}

// UngradedTraj is a late anchor trajectory without a world-model score.
type UngradedTraj struct {
	TrajID   string `json:"traj_id"`
	WMStatus string `json:"wm_status"`
}

// FromUpdate turns an update into its rows, in item order, and lists its
// late anchor groups.
func FromUpdate(u schemas.Update) ([]Row, []LateGroup) {
	late := map[string]*LateGroup{}
	var lates []LateGroup
	for _, g := range u.LateAnchors {
		late[g] = &LateGroup{Step: u.Step, GroupID: g, PolicyVersion: map[string]int64{}}
	}
	failed := map[string]bool{}
	for _, g := range u.FailedAnchors {
		failed[g] = true
	}
	rows := make([]Row, len(u.Items))
	for i, it := range u.Items {
		lg := late[it.GroupID]
		r := Row{
			Run: u.Run, Step: u.Step, GroupID: it.GroupID, TrajID: it.TrajID, TaskID: it.TaskID,
			PolicyVersion: it.PolicyVersion, IsAnchor: it.Source == SourceAnchor || lg != nil || failed[it.GroupID],
			Predicted: it.Predicted, TrueScore: it.TrueScore, Calibrated: it.Calibrated,
			CalibrationVersion: u.CalibrationVersion, Reward: it.Reward, Advantage: it.Advantage,
			Weight: it.Weight, FusedAdvantage: it.FusedAdvantage, Rho: u.Rho, Source: it.Source,
			WMStatus: it.WMStatus, ExecSeconds: it.ExecSeconds, TS: u.PublishedAt.UTC(),
			CalibrationSeq: u.CalibrationSeq, AbsorbedSeq: it.AbsorbedSeq, D: u.D,
		}
		r.ExecStatus, r.ExecDetail, r.ExecCopyOf = nonEmpty(it.ExecStatus), nonEmpty(it.ExecDetail), nonEmpty(it.ExecCopyOf)
		r.ExecCopyStep, r.ExecCopyGroup = it.ExecCopyStep, nonEmpty(it.ExecCopyGroup)
		r.WMVerdict, r.WMRationale = nonEmpty(it.WMVerdict), nonEmpty(it.WMRationale)
		r.WMModel = nonEmpty(u.ItemModel(&u.Items[i]))
		if lg != nil {
			s := ExecLate
			r.ExecStatus = &s
			lg.TaskID, lg.WMModel = it.TaskID, u.ItemModel(&u.Items[i])
			lg.PolicyVersion[it.TrajID] = it.PolicyVersion
			if it.Predicted == nil {
				lg.Ungraded = append(lg.Ungraded, UngradedTraj{TrajID: it.TrajID, WMStatus: it.WMStatus})
			}
		}
		rows[i] = r
	}
	for _, g := range u.LateAnchors {
		lates = append(lates, *late[g])
	}
	return rows, lates
}

// nonEmpty is s as an optional column: null when empty.
func nonEmpty(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// FromLate turns a late anchor group's calibration into its rows, with
// no reward: one per pair, with the out-of-sample calibrated prediction,
// then one per other trajectory of the group (those the world model did
// not grade, and those whose execution gave no score: no pair comes for
// either) with an outcome. Their execution's status, seconds, detail and
// copy come from outcomes (by trajectory ID; a calibration carries only
// the scores): a pair takes a scored one only, and without it has a null
// exec_status, as nothing says how its execution ended (a score of 0 is
// also what a crash or a timeout gets); another trajectory without one
// has no row. The other trajectories' rows have null predicted and
// calibrated (a graded one's prediction is on its world-model row).
func FromLate(c schemas.Calibration, g LateGroup, outcomes map[string]schemas.ExecItem, now time.Time) []Row {
	rows := make([]Row, 0, len(c.Pairs)+len(g.Ungraded))
	row := func(traj, wmStatus string, it schemas.ExecItem, ok bool) Row {
		r := Row{
			Run: c.Run, Step: c.Step, GroupID: c.GroupID, TrajID: traj, TaskID: g.TaskID,
			PolicyVersion: g.PolicyVersion[traj], IsAnchor: true, CalibrationVersion: c.Version,
			Source: SourceLateAnchor, WMStatus: wmStatus, TS: now.UTC(),
			CalibrationSeq: c.Seq, AbsorbedSeq: c.Seq, WMModel: nonEmpty(g.WMModel),
		}
		if ok {
			seconds := it.Seconds
			r.TrueScore, r.ExecStatus, r.ExecSeconds, r.ExecDetail = it.Score, nonEmpty(it.Status), &seconds, nonEmpty(it.Detail)
			r.ExecCopyOf, r.ExecCopyStep, r.ExecCopyGroup = nonEmpty(it.CopyOf), it.CopyStep, nonEmpty(it.CopyGroup)
		}
		return r
	}
	for _, p := range c.Pairs {
		it, ok := outcomes[p.TrajID]
		r := row(p.TrajID, schemas.PredOK, it, ok && it.Score != nil)
		pred, truth, before := p.Predicted, p.True, p.Before
		r.Predicted, r.TrueScore, r.Calibrated = &pred, &truth, &before // the score the calibration absorbed
		rows = append(rows, r)
	}
	for _, o := range g.others(c) {
		if it, ok := outcomes[o.TrajID]; ok {
			rows = append(rows, row(o.TrajID, o.WMStatus, it, true))
		}
	}
	return rows
}

// others lists g's trajectories that have no pair in c: those the world
// model did not grade, in the update's order, then the graded ones (whose
// executions gave no score) by ID.
func (g LateGroup) others(c schemas.Calibration) []UngradedTraj {
	paired := make(map[string]bool, len(c.Pairs))
	for _, p := range c.Pairs {
		paired[p.TrajID] = true
	}
	out := make([]UngradedTraj, 0, max(0, len(g.PolicyVersion)-len(c.Pairs)))
	listed := make(map[string]bool, len(g.Ungraded))
	for _, u := range g.Ungraded {
		listed[u.TrajID] = true
		if !paired[u.TrajID] {
			out = append(out, u)
		}
	}
	ungraded := len(out)
	for traj := range g.PolicyVersion {
		if !paired[traj] && !listed[traj] {
			out = append(out, UngradedTraj{TrajID: traj, WMStatus: schemas.PredOK})
		}
	}
	slices.SortFunc(out[ungraded:], func(a, b UngradedTraj) int { return strings.Compare(a.TrajID, b.TrajID) })
	return out
}
