package main

import (
	"encoding/json"
	"io"
	"time"

	"github.com/wmrl/wmrl/pipeline"
	"github.com/wmrl/wmrl/stages/fuse"
)

// statusDoc is `wmrl status --json`: what the text shows, for a script
// (a job scheduler's health check, a trainer's pre-flight) to read. Times
// are RFC 3339 in UTC, ages in seconds at "at"; an object is null when
// the run has none yet.
type statusDoc struct {
	Run          string    `json:"run"`
	Stream       string    `json:"stream"`
	At           time.Time `json:"at"` // when the status was read
	MessagesKept uint64    `json:"messages_kept"`
	// OtherRuns: with no message of the run kept, the runs the stream
	// holds (a --run mistyped).
	OtherRuns        []string `json:"other_runs,omitempty"`
	RetentionSeconds float64  `json:"retention_seconds,omitzero"`
	Store            storeDoc `json:"store"`
	Received         *stepDoc `json:"received"`
	// NewestTrajectory: the step of the newest trajectory; past Received's,
	// it waits for its watermark.
	NewestTrajectory *stepDoc       `json:"newest_trajectory"`
	Fused            *fusedDoc      `json:"fused"`
	NextStep         *int64         `json:"next_step"` // where a trainer (resumed) numbers its steps on
	Unfused          []unfusedDoc   `json:"unfused"`
	Calibration      *calibDoc      `json:"calibration"`
	DeadLetters      deadLettersDoc `json:"dead_letters"`
	Executions       executionsDoc  `json:"executions"`
	// AnchorGroups: what became of the anchor groups of the steps fused
	// in unfused's window: late (past --anchor-deadline) or failed.
	AnchorGroups anchorGroupsDoc `json:"anchor_groups"`
	Consumers    []consumerDoc   `json:"consumers"`
	// Runners: which process runs each one-per-run stage (holder null:
	// none), as its lease says.
	Runners []runnerDoc `json:"runners"`
}

type runnerDoc struct {
	Stage  string     `json:"stage"`
	Holder *holderDoc `json:"holder"`
}

type holderDoc struct {
	Host      string    `json:"host"`
	PID       int       `json:"pid"`
	Since     time.Time `json:"since"`
	RenewedAt time.Time `json:"renewed_at"`
	// AgeSeconds: since the last renewal (every 5 s while it runs).
	AgeSeconds float64 `json:"age_seconds"`
	// NoLongerRuns: the holder was of this machine and its pid is gone.
	NoLongerRuns bool `json:"no_longer_runs,omitempty"`
	// Silent: its process answered no request (killed, or cut off from
	// the server for now).
	Silent bool `json:"silent,omitempty"`
}

type storeDoc struct {
	StreamBytes  uint64 `json:"stream_bytes"`
	AccountBytes uint64 `json:"account_bytes"`
	LimitBytes   *int64 `json:"limit_bytes"` // null: not known
}

type stepDoc struct {
	Step       int64     `json:"step"`
	At         time.Time `json:"at"`
	AgeSeconds float64   `json:"age_seconds"`
}

type fusedDoc struct {
	stepDoc
	Rho                float64 `json:"rho"`
	D                  float64 `json:"d"`
	CalibrationVersion int64   `json:"calibration_version"`
	Groups             int     `json:"groups"`
	Anchors            int     `json:"anchors"`
	// WMModels: the world models that scored the step (more than one
	// when two did; "" for one its predictions did not name).
	WMModels []string `json:"wm_models"`
	// AdvantageNorm: how the step's advantages were formed, "std" (GRPO)
	// or "center" (Dr. GRPO), for a trainer's check before it trains.
	AdvantageNorm string `json:"advantage_norm"`
}

type unfusedDoc struct {
	Step      int64     `json:"step"`
	PlannedAt time.Time `json:"planned_at"`
	// HeldBack: below the newest fused step, so waiting for an anchor
	// group within its deadline or for a prediction, which has none.
	HeldBack bool `json:"held_back"`
}

type calibDoc struct {
	stepDoc       // the step of the newest anchor group absorbed
	Version int64 `json:"version"`
	Groups  int64 `json:"anchor_groups"`
}

type deadLettersDoc struct {
	Count  uint64         `json:"count"`
	Newest *deadLetterDoc `json:"newest"`
}

type deadLetterDoc struct {
	Kind       string    `json:"kind"` // "given_up" (a service down) or "rejected" (bad input)
	Stage      string    `json:"stage"`
	Subject    string    `json:"subject"`
	Reason     string    `json:"reason"`
	At         time.Time `json:"at"`
	AgeSeconds float64   `json:"age_seconds"`
}

type executionsDoc struct {
	WindowSeconds float64        `json:"window_seconds"`
	Since         time.Time      `json:"since,omitzero"`
	Capped        bool           `json:"capped"` // more groups than read: Since is later than the window
	Groups        int            `json:"anchor_groups"`
	ByStatus      map[string]int `json:"by_status"`
	Shared        int            `json:"shared"` // took a copy's outcome (--exec-copies-once), not in by_status
	ByCause       map[string]int `json:"by_cause"`
	NewestFailure *failureDoc    `json:"newest_failure"`
	// Seconds: the executions' times, copies and sandbox errors left out;
	// GroupSlowest: each anchor group's slowest execution (null: none).
	Seconds      *quantilesDoc `json:"seconds"`
	GroupSlowest *quantilesDoc `json:"group_slowest_seconds"`
}

type anchorGroupsDoc struct {
	WindowSeconds float64   `json:"window_seconds"`
	Since         time.Time `json:"since,omitzero"`
	Capped        bool      `json:"capped"` // more steps than read: Since is later than the window
	Steps         int       `json:"steps"`
	Groups        int       `json:"groups"`
	Late          int       `json:"late"`
	Failed        int       `json:"failed"`
}

type quantilesDoc struct {
	Median float64 `json:"median"`
	P99    float64 `json:"p99"`
	Max    float64 `json:"max"`
}

// quantilesOf is q as a document, null when there were none.
func quantilesOf(q pipeline.TimeQuantiles) *quantilesDoc {
	if q == (pipeline.TimeQuantiles{}) {
		return nil
	}
	return &quantilesDoc{Median: q.Median, P99: q.P99, Max: q.Max}
}

type failureDoc struct {
	Status string    `json:"status"`
	Detail string    `json:"detail"`
	At     time.Time `json:"at"`
}

type consumerDoc struct {
	Name         string     `json:"name"`
	Subject      string     `json:"subject"`
	Backlog      uint64     `json:"backlog"`
	InFlight     int        `json:"in_flight"`
	Redelivered  int        `json:"redelivered"`
	PullsWaiting int        `json:"pulls_waiting"`
	LastDelivery *time.Time `json:"last_delivery"`
	// Unread: a backlog and no pull request waiting; nothing reads it.
	Unread bool `json:"unread"`
}

func writeStatusJSON(w io.Writer, st *pipeline.Status, run string, now time.Time) error {
	now = now.UTC()
	age := func(t time.Time) float64 { return now.Sub(t).Seconds() }
	step := func(n int64, at time.Time) stepDoc { return stepDoc{Step: n, At: at.UTC(), AgeSeconds: age(at)} }
	d := statusDoc{
		Run: run, Stream: st.Stream, At: now, RetentionSeconds: st.MaxAge.Seconds(), OtherRuns: st.OtherRuns,
		Store:       storeDoc{StreamBytes: st.Bytes, AccountBytes: st.StoreUsed},
		Unfused:     []unfusedDoc{},
		DeadLetters: deadLettersDoc{Count: st.DeadLetters},
		Consumers:   []consumerDoc{},
	}
	for _, n := range st.Subjects {
		d.MessagesKept += n
	}
	if st.StoreLimit > 0 {
		d.Store.LimitBytes = &st.StoreLimit
	}
	if s := st.LastStep; s != nil {
		r := step(s.Step, st.LastStepAt)
		d.Received = &r
	}
	if n := st.LastTrajStep; n != nil {
		r := step(*n, st.LastTrajAt)
		d.NewestTrajectory = &r
	}
	if u := st.LastUpdate; u != nil {
		d.Fused = &fusedDoc{stepDoc: step(u.Step, st.LastUpdateAt), Rho: u.Rho, D: u.D, CalibrationVersion: u.CalibrationVersion, Groups: u.Groups, Anchors: u.Anchors,
			WMModels: append([]string{}, u.Models()...), AdvantageNorm: string(fuse.Normalization(u.AdvantageNorm).Effective())}
	}
	if next, ok := nextStep(st); ok {
		d.NextStep = &next
	}
	for _, u := range st.Unfused {
		d.Unfused = append(d.Unfused, unfusedDoc{Step: u.Step, PlannedAt: u.Planned.UTC(), HeldBack: st.LastUpdate != nil && u.Step < st.LastUpdate.Step})
	}
	if c := st.LastCalibration; c != nil {
		d.Calibration = &calibDoc{stepDoc: step(c.Step, st.LastCalibAt), Version: c.Version, Groups: c.Seq}
	}
	if dl := st.LastDeadLetter; dl != nil {
		kind := "rejected"
		if pipeline.GivenUp(*dl) {
			kind = "given_up"
		}
		d.DeadLetters.Newest = &deadLetterDoc{Kind: kind, Stage: dl.Stage, Subject: dl.Subject, Reason: dl.Reason, At: st.LastDeadLetterAt.UTC(), AgeSeconds: age(st.LastDeadLetterAt)}
	}
	es := st.Executions
	d.Executions = executionsDoc{WindowSeconds: pipeline.ExecutionsWindow.Seconds(), Capped: es.Capped, Groups: es.Groups,
		ByStatus: nonNil(es.ByStatus), Shared: es.Shared, ByCause: nonNil(es.ByCause),
		Seconds: quantilesOf(es.Seconds), GroupSlowest: quantilesOf(es.Slowest)}
	if !es.Since.IsZero() {
		d.Executions.Since = es.Since.UTC()
	}
	if f := es.NewestFailure; f.Status != "" {
		d.Executions.NewestFailure = &failureDoc{Status: f.Status, Detail: f.Detail, At: es.NewestFailureAt.UTC()}
	}
	as := st.Anchors
	d.AnchorGroups = anchorGroupsDoc{WindowSeconds: pipeline.UnfusedWindow.Seconds(), Capped: as.Capped, Steps: as.Steps,
		Groups: as.Groups, Late: as.Late, Failed: as.Failed}
	if !as.Since.IsZero() {
		d.AnchorGroups.Since = as.Since.UTC()
	}
	for _, c := range st.Consumers {
		cd := consumerDoc{Name: c.Name, Subject: c.Subject, Backlog: c.Backlog, InFlight: c.InFlight, Redelivered: c.Redelivered,
			PullsWaiting: c.Waiting, Unread: c.Backlog > 0 && c.Waiting == 0}
		if c.LastDelivery != nil {
			t := c.LastDelivery.UTC()
			cd.LastDelivery = &t
		}
		d.Consumers = append(d.Consumers, cd)
	}
	d.Runners = []runnerDoc{}
	for _, r := range st.Runners {
		rd := runnerDoc{Stage: r.Stage}
		if h := r.Holder; h != nil {
			rd.Holder = &holderDoc{Host: h.Host, PID: h.PID, Since: h.Since.UTC(), RenewedAt: r.Renewed.UTC(), AgeSeconds: age(r.Renewed), NoLongerRuns: r.Ended, Silent: r.Silent}
		}
		d.Runners = append(d.Runners, rd)
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(d)
}

func nonNil(m map[string]int) map[string]int {
	if m == nil {
		return map[string]int{}
	}
	return m
}
