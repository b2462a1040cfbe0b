package schemas

import (
	"cmp"
	"slices"
	"time"
)

// Trajectory is one candidate solution (public, in: <prefix>.<run>.traj).
type Trajectory struct {
	Schema        int    `json:"schema"`
	Run           string `json:"run"`
	Step          int64  `json:"step"`
	GroupID       string `json:"group_id"`
	TrajID        string `json:"traj_id"`
	GroupSize     int    `json:"group_size"`
	TaskID        string `json:"task_id"`
	Prompt        string `json:"prompt"`
	Response      string `json:"response"`
	PolicyVersion int64  `json:"policy_version"`
	Meta          Meta   `json:"meta,omitempty"`
}

// StepClose is a step's watermark (public, in: <prefix>.<run>.step): the
// step has Groups groups and no more trajectories will come for it.
type StepClose struct {
	Schema int    `json:"schema"`
	Run    string `json:"run"`
	Step   int64  `json:"step"`
	Groups int    `json:"groups"`
}

// Update is a step's fused result (public, out: <prefix>.<run>.update), one
// per step, retained so a trainer that was down catches up.
type Update struct {
	Schema int    `json:"schema"`
	Run    string `json:"run"`
	Step   int64  `json:"step"`
	// Rho is the anchor weight used; D the tracked world-model disagreement.
	Rho float64 `json:"rho"`
	D   float64 `json:"d"`
	// CalibrationVersion is the isotonic map version used for world-model
	// groups: 0 before the first fit (the map before_fit says: flat at the
	// anchors' mean true score by default, or the identity), and 0 when
	// the run does not debias.
	CalibrationVersion int64 `json:"calibration_version"`
	// Groups and Anchors count the groups that contribute to the gradient.
	Groups  int `json:"groups"`
	Anchors int `json:"anchors"`
	// Items: every trajectory of the step, in group order.
	Items []UpdateItem `json:"items"`
	// Skipped: groups that do not contribute, and why.
	Skipped []SkippedGroup `json:"skipped"`
	// LateAnchors: anchor groups whose execution missed the deadline; they
	// used world-model rewards here, and their pairs still feed calibration.
	LateAnchors []string `json:"late_anchors"`
	// FailedAnchors: anchor groups executed in time whose execution scored
	// fewer than two trajectories (sandbox errors, an executor given up
	// on): they used world-model rewards here, as late ones do.
	FailedAnchors []string `json:"failed_anchors,omitempty"`
	// PairsTotal: anchor pairs the calibration had absorbed;
	// CalibrationSeq: anchor groups it had absorbed (the calibration
	// message's seq), which pins the map and rho used, for replays.
	PairsTotal     int64 `json:"pairs_total"`
	CalibrationSeq int64 `json:"calibration_seq"`
	// ClosedAt: when the step's last input arrived (its plan was made);
	// PublishedAt: when this update was made.
	ClosedAt    time.Time `json:"closed_at"`
	PublishedAt time.Time `json:"published_at"`
	// WMModel: the world model that scored the step (its predictions'
	// model), when every group of it was scored by the same one; empty
	// otherwise, when each item names its own (UpdateItem.WMModel).
	WMModel string `json:"wm_model,omitempty"`
	// AdvantageNorm says how the items' advantages were formed within
	// their groups: "center" (r - mean, Dr. GRPO) when the run was told
	// so; absent, "std" ((r - mean) / (std + 1e-4), GRPO). A trainer that
	// uses the fused advantages in place of its own checks that it is
	// the one it would use.
	AdvantageNorm string `json:"advantage_norm,omitempty"`
}

// ItemModel is the world model that scored it, an item of u: u's, or the
// item's own in a step scored by more than one; none for an item whose
// group was not sent to be scored.
func (u *Update) ItemModel(it *UpdateItem) string {
	if it.WMStatus == PredNotSent {
		return ""
	}
	return cmp.Or(u.WMModel, it.WMModel)
}

// Models names the world models that scored u's items, each once, in
// item order ("" for a prediction that named none; an item never sent to
// be scored is left out).
func (u *Update) Models() []string {
	if u.WMModel != "" {
		return []string{u.WMModel}
	}
	var names []string
	for i := range u.Items {
		if m := u.ItemModel(&u.Items[i]); u.Items[i].WMStatus != PredNotSent && !slices.Contains(names, m) {
			names = append(names, m)
		}
	}
	return names
}

// UpdateItem is one trajectory's share of the step's gradient.
type UpdateItem struct {
	TrajID  string `json:"traj_id"`
	GroupID string `json:"group_id"`
	// Source: "anchor" (real execution) or "world_model".
	Source string `json:"source"`
	// Reward: the true score for anchors, the calibrated world-model score
	// otherwise; null when ungraded (dropped, never scored as 0).
	Reward *float64 `json:"reward"`
	// Advantage: the group-relative advantage A_i; Weight: w_i (rho for
	// anchors, 1 otherwise, 0 when not contributing).
	Advantage float64 `json:"advantage"`
	Weight    float64 `json:"weight"`
	// FusedAdvantage = A_i * w_i * m / (rho*|A| + |W|): use it in place of
	// the GRPO advantage.
	FusedAdvantage float64 `json:"fused_advantage"`

	// The record behind the numbers, for logs and the archive.
	TaskID        string `json:"task_id"`
	PolicyVersion int64  `json:"policy_version"`
	// Predicted: the raw world-model score (null when ungraded), WMStatus
	// its status.
	Predicted *float64 `json:"predicted"`
	WMStatus  string   `json:"wm_status"`
	// Calibrated: the world-model score under the calibration: for
	// world-model items the map the step used (the identity when debiasing
	// is off); for anchors, the out-of-sample value (the map before their
	// group's pairs were absorbed). Null when not known.
	Calibrated *float64 `json:"calibrated"`
	// TrueScore, ExecStatus, ExecSeconds: the execution of an anchor
	// executed in time (null and empty otherwise); ExecDetail what ended
	// it, when the executor said (the end of a failure's stderr).
	TrueScore   *float64 `json:"true_score"`
	ExecStatus  string   `json:"exec_status"`
	ExecSeconds *float64 `json:"exec_seconds"`
	ExecDetail  string   `json:"exec_detail,omitempty"`
	// ExecCopyOf: the trajectory whose execution this anchor's shares
	// (schemas.ExecItem.CopyOf); empty when it ran its own. ExecCopyStep
	// and ExecCopyGroup: its step and group, when not this item's group.
	ExecCopyOf    string `json:"exec_copy_of,omitempty"`
	ExecCopyStep  *int64 `json:"exec_copy_step,omitempty"`
	ExecCopyGroup string `json:"exec_copy_group,omitempty"`
	// WMVerdict: the status the world model predicted, and WMRationale
	// its reason, when it says them; on anchor groups' items only, where
	// there is a truth to set them against (a sentence on every item would
	// add a third to the update).
	WMVerdict   string `json:"wm_verdict,omitempty"`
	WMRationale string `json:"wm_rationale,omitempty"`
	// AbsorbedSeq: for an anchor, the calibration seq at which its group's
	// pairs were absorbed (0 for others).
	AbsorbedSeq int64 `json:"absorbed_seq"`
	// WMModel: the world model that scored this trajectory, set only in a
	// step whose groups were scored by more than one (Update.WMModel
	// empty: two predict processes with different models, a restart
	// onto another one); empty there when not known.
	WMModel string `json:"wm_model,omitempty"`
}

// SkippedGroup is a group that does not contribute.
type SkippedGroup struct {
	GroupID string `json:"group_id"`
	Reason  string `json:"reason"`
}

// DeadLetter is a message no stage could use (<prefix>.<run>.dlq).
type DeadLetter struct {
	Schema  int       `json:"schema"`
	Subject string    `json:"subject"`
	Stage   string    `json:"stage"`
	Reason  string    `json:"reason"`
	Payload string    `json:"payload"`
	Time    time.Time `json:"time"`
	// Seq is the message's sequence in the run's stream, where the whole
	// of it stays for the stream's retention (0: not known).
	Seq uint64 `json:"seq,omitempty"`
	// PayloadBytes, when set, is the size of the whole payload, of which
	// Payload holds only the start: the dead letter with all of it would
	// have been over the server's max_payload (a message near the limit,
	// whose JSON escaping grows in a string). The whole is at Seq.
	PayloadBytes int `json:"payload_bytes,omitempty"`
}

// Group is a complete rollout group (internal: group, exec).
type Group struct {
	Schema       int          `json:"schema"`
	Run          string       `json:"run"`
	Step         int64        `json:"step"`
	GroupID      string       `json:"group_id"`
	TaskID       string       `json:"task_id"`
	Anchor       bool         `json:"anchor"`
	Trajectories []Trajectory `json:"trajectories"`
}

// Plan is a step's composition and anchor choice (internal: plan).
type Plan struct {
	Schema    int            `json:"schema"`
	Run       string         `json:"run"`
	Step      int64          `json:"step"`
	Groups    []PlanGroup    `json:"groups"`
	Anchors   int            `json:"anchors"`
	ClosedAt  time.Time      `json:"closed_at"`
	Decisions []PlanDecision `json:"decisions"`
}

// PlanGroup lists one group's trajectories as received.
type PlanGroup struct {
	GroupID string   `json:"group_id"`
	Anchor  bool     `json:"anchor"`
	TrajIDs []string `json:"traj_ids"`
	// Want is the declared group size; fewer TrajIDs mean the step closed
	// on its timeout with the group incomplete.
	Want int `json:"want"`
	// TaskID and PolicyVersions (parallel to TrajIDs) carry the
	// trajectories' task and policy version to the update.
	TaskID         string  `json:"task_id"`
	PolicyVersions []int64 `json:"policy_versions"`
	// Dropped, when set, says why the group was not sent on to be scored
	// (its message was over the server's max_payload): the step does not
	// wait for it, and its update has its trajectories ungraded (wm_status
	// not_sent) and the group skipped with this reason.
	Dropped string `json:"dropped,omitempty"`
}

// PlanDecision says why a group was or was not made an anchor.
type PlanDecision struct {
	GroupID string `json:"group_id"`
	Anchor  bool   `json:"anchor"`
	Reason  string `json:"reason"`
}

// Statuses of a world-model prediction.
const (
	PredOK       = "ok"
	PredUngraded = "ungraded"
	// PredNotSent: the trajectory's group was never sent to the world
	// model (PlanGroup.Dropped); in update items only.
	PredNotSent = "not_sent"
)

// Prediction is the world model's scores for a group (internal: pred).
type Prediction struct {
	Schema  int        `json:"schema"`
	Run     string     `json:"run"`
	Step    int64      `json:"step"`
	GroupID string     `json:"group_id"`
	Anchor  bool       `json:"anchor"`
	Model   string     `json:"model"`
	Items   []PredItem `json:"items"`
}

// PredItem is one trajectory's prediction.
type PredItem struct {
	TrajID string   `json:"traj_id"`
	Score  *float64 `json:"score"` // null when ungraded
	Status string   `json:"status"`
	Reason string   `json:"reason,omitempty"`
	// Spread: standard deviation over the world model's samples.
	Spread float64 `json:"spread,omitempty"`
	// Verdict: the execution status the world model predicted, and
	// Rationale its reason, when it gives them.
	Verdict   string `json:"verdict,omitempty"`
	Rationale string `json:"rationale,omitempty"`
	// ResponseChars: the response's length, for shaping stages.
	ResponseChars int `json:"response_chars"`
}

// Statuses of an execution.
const (
	ExecScored       = "scored"
	ExecInvalid      = "invalid_submission" // scored 0 by the grader
	ExecCrashed      = "crashed"            // scored 0
	ExecTimedOut     = "timed_out"          // scored 0
	ExecSandboxError = "sandbox_error"      // not a score: ungraded
)

// ExecStatuses lists the statuses of an execution, scores first.
var ExecStatuses = []string{ExecScored, ExecInvalid, ExecCrashed, ExecTimedOut, ExecSandboxError}

// Execution is the real outcome of an anchor group (internal: execution).
type Execution struct {
	Schema  int        `json:"schema"`
	Run     string     `json:"run"`
	Step    int64      `json:"step"`
	GroupID string     `json:"group_id"`
	Items   []ExecItem `json:"items"`
}

// ExecItem is one trajectory's execution.
type ExecItem struct {
	TrajID  string   `json:"traj_id"`
	Score   *float64 `json:"score"` // null for a sandbox error
	Status  string   `json:"status"`
	Seconds float64  `json:"seconds"`
	Detail  string   `json:"detail,omitempty"`
	// CopyOf names the trajectory whose execution this one shares: the
	// same task, prompt and response, run once (execute's
	// --exec-copies-once). Its Seconds are 0: it took no sandbox time.
	// CopyStep and CopyGroup say where that trajectory was, when not in
	// this group: another anchor group of the run, executed first (of any
	// step: steps in flight execute at once). Trajectory ids are a
	// step's, and may repeat in another.
	CopyOf    string `json:"copy_of,omitempty"`
	CopyStep  *int64 `json:"copy_step,omitempty"`
	CopyGroup string `json:"copy_group,omitempty"`
}

// PairGroup is an anchor group's (prediction, truth) pairs (internal:
// pairs), in trajectory order, graded on both sides only.
type PairGroup struct {
	Schema  int        `json:"schema"`
	Run     string     `json:"run"`
	Step    int64      `json:"step"`
	GroupID string     `json:"group_id"`
	Pairs   []PairItem `json:"pairs"`
}

// PairItem is one anchor pair.
type PairItem struct {
	TrajID    string  `json:"traj_id"`
	Predicted float64 `json:"predicted"`
	True      float64 `json:"true"`
}

// Calibration is the debiaser's state after absorbing one anchor group
// (internal: calibration), published in the order the groups were absorbed.
type Calibration struct {
	Schema int    `json:"schema"`
	Run    string `json:"run"`
	// Seq counts anchor groups absorbed; Version counts map refits.
	Seq     int64 `json:"seq"`
	Version int64 `json:"version"`
	// Step and GroupID name the group just absorbed.
	Step    int64  `json:"step"`
	GroupID string `json:"group_id"`
	// Map is the isotonic map now in force. Before the first fit (Version
	// 0) it is the flat map at the buffered pairs' mean true score (one
	// threshold: every score maps to it), or null, the identity, when the
	// debiaser runs with before_fit "identity" as the reference does.
	Map *Thresholds `json:"map"`
	// Pairs are the group's pairs with their calibrated predictions under
	// the map before (out-of-sample) and after (in-sample) they were added,
	// for the denoiser.
	Pairs      []CalibratedPair `json:"pairs"`
	PairsTotal int64            `json:"pairs_total"`
}

// CalibratedPair is one anchor pair as the denoiser needs it.
type CalibratedPair struct {
	TrajID    string  `json:"traj_id"`
	Predicted float64 `json:"predicted"`
	True      float64 `json:"true"`
	Before    float64 `json:"before"`
	After     float64 `json:"after"`
}

// Thresholds are an isotonic map's breakpoints.
type Thresholds struct {
	X []float64 `json:"x"`
	Y []float64 `json:"y"`
}
