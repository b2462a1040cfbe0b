package gateway

import (
	"context"
	"errors"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/wmrl/wmrl/schemas"
)

// This file answers what a trainer asks of the run: a step's update,
// where the run is, and the calibration in force.

func (g *Gateway) getUpdate(w http.ResponseWriter, r *http.Request) {
	step, ok := stepParam(w, r)
	if !ok {
		return
	}
	wait := time.Duration(0)
	if s := r.URL.Query().Get("wait"); s != "" {
		secs, err := strconv.ParseFloat(s, 64)
		if err != nil || secs < 0 || math.IsNaN(secs) {
			fail(w, http.StatusBadRequest, "wait %q: want seconds >= 0", s)
			return
		}
		wait = min(time.Duration(secs*float64(time.Second)), g.cfg.MaxWait)
	}
	data, seq, arrived := g.updates.get(step, wait > 0)
	if arrived != nil {
		defer g.updates.forget(step, arrived)
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-arrived:
			data, seq, _ = g.updates.get(step, false)
		case <-t.C:
		case <-r.Context().Done():
			return
		case <-g.closing.Done():
			// The process stops: its server lets requests in flight end
			// before it closes, and a long poll would hold it up.
			unavailable(w, "the gateway is stopping: ask again for step %d's update (another gateway of the run, or this one once it is back)", step)
			return
		}
	}
	if data == nil && seq > 0 {
		st, err := g.js.Stream(r.Context(), g.cfg.Stream)
		var m *jetstream.RawStreamMsg
		if err == nil {
			m, err = st.GetMsg(r.Context(), seq)
		}
		if err != nil {
			unavailable(w, "read update of step %d: %v", step, err)
			return
		}
		data = m.Data
	}
	if data == nil && g.updates.indexing() {
		// It may be among those stored before the start, not all read yet.
		unavailable(w, "the gateway started a moment ago and is still reading which steps were fused before: ask again for step %d's update", step)
		return
	}
	if data == nil {
		if last, ok := g.updates.newest(); ok && last.Step > step {
			// A step behind a fused one waits for an anchor group within
			// its deadline, or for a prediction, which has none.
			fail(w, http.StatusNotFound, "step %d has no update yet (waited %v), while step %d's is out: it is held back, waiting for an anchor group's execution "+
				"(up to --anchor-deadline) or for a group's prediction, which has no deadline; wmrl status shows it, and if a stage between predict and fuse "+
				"gave the prediction up, wmrl dlq --resend sends it back", step, wait, last.Step)
			return
		}
		fail(w, http.StatusNotFound, "step %d has no update yet (waited %v)", step, wait)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(data)
}

// StepsView is GET .../steps: where the run is, for a trainer that starts
// or resumes.
type StepsView struct {
	Run     string `json:"run"`
	Planned *int64 `json:"planned"` // the newest step planned (closed); null before any
	Fused   *int64 `json:"fused"`   // the newest step fused; null before any
	Next    int64  `json:"next"`    // the first step number no trajectory has used: past the newest planned, fused or sent to
}

func (g *Gateway) getSteps(w http.ResponseWriter, r *http.Request) {
	next, err := g.next(r.Context())
	if err != nil {
		unavailable(w, "read the newest trajectory: %v", err)
		return
	}
	v := StepsView{Run: g.cfg.Run, Next: next}
	if n, ok := g.planned.newest(); ok {
		v.Planned = &n
	}
	if u, ok := g.updates.newest(); ok {
		step := u.Step
		v.Fused = &step
	}
	writeJSON(w, http.StatusOK, v)
}

// newestSent is one past the step of the newest trajectory stored, alone
// or in a trajs message (0: none, or it names no step). A trainer that
// crashed during a step, after sending some of its trajectories, resumes
// past it: that step is not planned yet, and the same ids in it with other
// rollouts are refused.
func (g *Gateway) newestSent(ctx context.Context) (int64, error) {
	if g.js == nil {
		return 0, nil
	}
	stream, err := g.js.Stream(ctx, g.cfg.Stream)
	if err != nil {
		return 0, err
	}
	var next int64
	for kind, subject := range map[schemas.Kind]string{schemas.KindTraj: g.cfg.Subjects.Traj, schemas.KindTrajs: g.cfg.Subjects.Trajs} {
		if subject == "" {
			continue
		}
		m, err := stream.GetLastMsgForSubject(ctx, subject)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return 0, err
		}
		if step, ok := schemas.NewestStep(kind, m.Data); ok {
			next = max(next, step+1)
		}
	}
	return next, nil
}

// next is the first step number no trajectory has used: past the newest
// step planned, fused or sent a trajectory (0 before any). Without the
// stream's answer, it is past the newest planned or fused, with the error.
func (g *Gateway) next(ctx context.Context) (int64, error) {
	next, err := g.newestSent(ctx)
	if n, ok := g.planned.newest(); ok {
		next = max(next, n+1)
	}
	if u, ok := g.updates.newest(); ok {
		next = max(next, u.Step+1)
	}
	return next, err
}

// CalibrationView is GET .../calibration.
type CalibrationView struct {
	Run        string              `json:"run"`
	Version    int64               `json:"version"`
	Map        *schemas.Thresholds `json:"map"` // null: identity
	PairsTotal int64               `json:"pairs_total"`
	Rho        float64             `json:"rho"`
	D          float64             `json:"d"`
	Step       *int64              `json:"step"` // the newest update's step; null before any
}

func (g *Gateway) getCalibration(w http.ResponseWriter, _ *http.Request) {
	v := CalibrationView{Run: g.cfg.Run, Rho: 1}
	if st := g.cal.Load(); st != nil {
		v.Version, v.Map, v.PairsTotal = st.c.Version, st.c.Map, st.c.PairsTotal
	}
	if u, ok := g.updates.newest(); ok {
		step := u.Step
		v.Rho, v.D, v.Step = u.Rho, u.D, &step
	}
	writeJSON(w, http.StatusOK, v)
}
