package gateway

import (
	"fmt"
	"net/http"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
)

// This file takes a trainer's trajectories and its steps' watermarks.

// postTrajectories validates every trajectory first and publishes only if
// all are valid: a bad request changes nothing.
func (g *Gateway) postTrajectories(w http.ResponseWriter, r *http.Request) {
	var raw schemas.RawTrajectories
	if !readBody(w, r, &raw) {
		return
	}
	if len(raw) == 0 {
		fail(w, http.StatusBadRequest, "no trajectories: want a non-empty JSON array")
		return
	}
	msgs, trajs := make([]*message.Message, len(raw)), make([]schemas.Trajectory, len(raw))
	groupOf, idOf := map[trajKey]string{}, map[trajKey]string{}
	for i, b := range raw {
		t, err := schemas.DecodeTrajectory(b)
		if err == nil {
			err = schemas.CheckRun(t.Run, g.cfg.Run)
		}
		if err != nil {
			fail(w, http.StatusBadRequest, "trajectory %d: %v", i, err)
			return
		}
		if other, ok := groupOf[trajKey{t.Step, t.TrajID}]; ok && other != t.GroupID {
			fail(w, http.StatusBadRequest, "trajectory %d: %v", i, schemas.TrajIDTaken(t.TrajID, t.GroupID, other, t.Step))
			return
		}
		groupOf[trajKey{t.Step, t.TrajID}] = t.GroupID
		if g.planned.has(t.Step) {
			// Route would dead-letter it, and the step's update is (or will
			// be) of the trajectories it planned, not of these.
			next, _ := g.next(r.Context()) // without the stream's answer, past the newest planned or fused
			fail(w, http.StatusConflict, "trajectory %d: step %d was planned already, from the trajectories that came before its close; "+
				"a trainer resumed from a checkpoint numbers its steps on from the run's next, %d (GET /v1/runs/%s/steps), or starts a new --run",
				i, t.Step, next, g.cfg.Run)
			return
		}
		if g.planned.unsure(t.Step) {
			unavailable(w, "trajectory %d: the gateway started a moment ago and is still reading which steps were planned before: "+
				"step %d may be among them; send the request again", i, t.Step)
			return
		}
		m, err := schemas.NewTrajMessage(t)
		if err != nil {
			fail(w, http.StatusInternalServerError, "trajectory %d: %v", i, err)
			return
		}
		id := m.Metadata.Get(schemas.MsgIDKey)
		if prev, ok := idOf[trajKey{t.Step, t.TrajID}]; ok && prev != id {
			fail(w, http.StatusBadRequest, "trajectory %d: %s of step %d is in the request twice, with other content", i, t.TrajID, t.Step)
			return
		}
		idOf[trajKey{t.Step, t.TrajID}] = id
		// Route would dead-letter either, and the step's update would give
		// the first one's advantage under this one's id.
		switch before, ok := g.sent.of(t.Step, t.TrajID); {
		case ok && before.group != t.GroupID:
			fail(w, http.StatusBadRequest, "trajectory %d: %v", i, schemas.TrajIDTaken(t.TrajID, t.GroupID, before.group, t.Step))
			return
		case ok && before.id != id:
			next, _ := g.next(r.Context())
			fail(w, http.StatusConflict, "trajectory %d: %s of group %s of step %d was sent before with other content; "+
				"a trainer resumed from a checkpoint numbers its steps on from the run's next, %d (GET /v1/runs/%s/steps), or starts a new --run",
				i, t.TrajID, t.GroupID, t.Step, next, g.cfg.Run)
			return
		}
		if size := natsjs.WireSize(m); g.cfg.MaxPayload > 0 && size > g.cfg.MaxPayload {
			fail(w, http.StatusRequestEntityTooLarge, "trajectory %d (%s) is %d bytes of JSON and headers, and the NATS server takes messages of at most %d bytes (its max_payload): "+
				"raise it (--nats-max-payload-mb for the embedded server, up to 64), or send shorter prompts and solutions", i, t.TrajID, size, g.cfg.MaxPayload)
			return
		}
		msgs[i], trajs[i] = m, t
	}
	alone, batched := g.byGroup(trajs, msgs)
	for _, out := range []struct {
		subject string
		msgs    []*message.Message
	}{{g.cfg.Subjects.Traj, alone}, {g.cfg.Subjects.Trajs, batched}} {
		if len(out.msgs) == 0 {
			continue
		}
		if err := g.pub.Publish(out.subject, out.msgs...); err != nil {
			notStored(w, "trajectories", err)
			return
		}
	}
	g.sent.add(trajs, msgs, g.planned)
	writeJSON(w, http.StatusAccepted, map[string]int{"accepted": len(msgs)})
}

// byGroup is what a request's trajectories (trajs, each encoded alone in
// msgs) are stored as: those of one group in one trajs message, in the
// order the group first comes in the request, as a trainer that sends a
// group at once would (route then handles one message where it handled G,
// and the count of messages is what bounds the pipeline's rate); a
// trajectory without others of its group in the request, alone. A group
// whose message would be over the server's max_payload goes one by one,
// as does everything without a trajs subject. A request sent again alike
// is stored as the same messages, under the same IDs: the server stores
// it once.
func (g *Gateway) byGroup(trajs []schemas.Trajectory, msgs []*message.Message) (alone, batched []*message.Message) {
	if g.cfg.Subjects.Trajs == "" {
		return msgs, nil
	}
	type key struct {
		step  int64
		group string
	}
	var order []key
	of := map[key][]int{}
	for i, t := range trajs {
		k := key{t.Step, t.GroupID}
		if of[k] == nil {
			order = append(order, k)
		}
		of[k] = append(of[k], i)
	}
	for _, k := range order {
		idx := of[k]
		if len(idx) == 1 {
			alone = append(alone, msgs[idx[0]])
			continue
		}
		group, payloads := make([]schemas.Trajectory, len(idx)), make([][]byte, len(idx))
		for j, i := range idx {
			group[j], payloads[j] = trajs[i], msgs[i].Payload
		}
		m := schemas.JoinTrajs(group, payloads)
		if g.cfg.MaxPayload > 0 && natsjs.WireSize(m) > g.cfg.MaxPayload {
			for _, i := range idx {
				alone = append(alone, msgs[i])
			}
			continue
		}
		batched = append(batched, m)
	}
	return alone, batched
}

// sent is what this gateway stored of the steps route has not planned:
// by step and trajectory id, the trajectory's group and de-duplication ID
// (run, step, group, id and a digest of its content). A trajectory sent
// again alike is stored once. Under the same id with other content (a
// trainer resumed from a checkpoint that sends its new rollouts as the
// step it crashed in) or in another group, route refuses it, and the
// update would carry the first one's advantage under its id: refused here
// at once, the trainer hears of it. What another gateway, or this one
// before a restart, stored only route refuses (dead-lettered, saying why).
type sent struct {
	mu  sync.Mutex
	ids map[int64]map[string]sentAs
}

type sentAs struct{ group, id string }

// of is how trajectory id of step was stored, if it was.
func (s *sent) of(step int64, id string) (sentAs, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	as, ok := s.ids[step][id]
	return as, ok
}

// add notes trajs, stored as msgs, and forgets the steps route has
// planned since.
func (s *sent) add(trajs []schemas.Trajectory, msgs []*message.Message, planned *planned) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for step := range s.ids {
		if planned.has(step) {
			delete(s.ids, step)
		}
	}
	for i, t := range trajs {
		if planned.has(t.Step) {
			continue
		}
		if s.ids[t.Step] == nil {
			s.ids[t.Step] = map[string]sentAs{}
		}
		s.ids[t.Step][t.TrajID] = sentAs{t.GroupID, msgs[i].Metadata.Get(schemas.MsgIDKey)}
	}
}

func (g *Gateway) closeStep(w http.ResponseWriter, r *http.Request) {
	step, ok := stepParam(w, r)
	if !ok {
		return
	}
	var body struct {
		Groups *int `json:"groups"`
	}
	if !readBody(w, r, &body) {
		return
	}
	if body.Groups == nil || *body.Groups < 0 {
		fail(w, http.StatusBadRequest, `body must be {"groups": n} with n >= 0`)
		return
	}
	sc := schemas.StepClose{Schema: schemas.Version, Run: g.cfg.Run, Step: step, Groups: *body.Groups}
	m, _ := schemas.NewMessage(fmt.Sprintf("%s/step/%d", g.cfg.Run, step), sc)
	if err := g.pub.Publish(g.cfg.Subjects.Step, m); err != nil {
		notStored(w, "watermark", err)
		return
	}
	writeJSON(w, http.StatusAccepted, sc)
}
