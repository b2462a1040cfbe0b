package schemas

import (
	"bytes"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// MsgIDKey is the metadata key whose value JetStream uses to drop a second
// publish of the same message (the Nats-Msg-Id header).
const MsgIDKey = "Nats-Msg-Id"

// Headers of an update message that count its step's anchor groups: those
// used (executed and calibrated in time, with two scores or more), those
// late (past --anchor-deadline) and those failed (executed with fewer
// than two scores), in decimal. A reader of many updates (wmrl status)
// reads these instead of the updates, which hold every trajectory of
// their steps. Updates stored before these were added, or by a stage in
// fuse's place that does not set them, lack them.
const (
	HeaderAnchors       = "Wmrl-Anchors"
	HeaderLateAnchors   = "Wmrl-Late-Anchors"
	HeaderFailedAnchors = "Wmrl-Failed-Anchors"
)

// SetAnchorCounts sets m's anchor-group headers from u.
func SetAnchorCounts(m *message.Message, u Update) {
	m.Metadata.Set(HeaderAnchors, strconv.Itoa(u.Anchors))
	m.Metadata.Set(HeaderLateAnchors, strconv.Itoa(len(u.LateAnchors)))
	m.Metadata.Set(HeaderFailedAnchors, strconv.Itoa(len(u.FailedAnchors)))
}

// NewMessage encodes v as a watermill message whose de-duplication ID is id:
// derive id from the input that produced v, so a redelivered input never
// yields a second copy downstream.
func NewMessage(id string, v any) (*message.Message, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("schemas: encode %T: %w", v, err)
	}
	m := message.NewMessage(watermill.NewUUID(), b)
	if id != "" {
		m.Metadata.Set(MsgIDKey, id)
	}
	return m, nil
}

// StepOfMsgID reads the step of a de-duplication ID
// "<run>/<kind>/<step>[/<rest>]", as the stages make them for plans,
// updates and the rest of a step's outputs.
func StepOfMsgID(id string) (int64, bool) {
	step, _, ok := SplitMsgID(id)
	return step, ok
}

// SplitMsgID reads the step of such an ID and what follows it (a group's
// ID; "" when nothing does).
func SplitMsgID(id string) (step int64, rest string, ok bool) {
	parts := strings.SplitN(id, "/", 4)
	if len(parts) < 3 {
		return 0, "", false
	}
	n, err := strconv.ParseInt(parts[2], 10, 64)
	if err != nil {
		return 0, "", false
	}
	if len(parts) == 4 {
		rest = parts[3]
	}
	return n, rest, true
}

// Again is m's payload as a new message whose de-duplication ID is id: the
// same value sent on a second subject, encoded once (the payload is
// shared, and neither message may change it).
func Again(m *message.Message, id string) *message.Message {
	c := message.NewMessage(watermill.NewUUID(), m.Payload)
	c.Metadata.Set(MsgIDKey, id)
	return c
}

// NewTrajMessage encodes t as a message whose de-duplication ID is
// TrajMsgID.
func NewTrajMessage(t Trajectory) (*message.Message, error) {
	m, err := NewMessage("", t)
	if err != nil {
		return nil, err
	}
	m.Metadata.Set(MsgIDKey, TrajMsgID(t, m.Payload))
	return m, nil
}

// TrajMsgID is the de-duplication ID of trajectory t encoded as payload:
// its run, step, group and id, and a digest of the payload, so that a
// trajectory sent again (a retried request) is stored once.
//   - The step is in it so that a trainer that names its trajectories
//     alike every step ("g0-t0") does not have the later steps' dropped as
//     copies of the first's.
//   - The group, so that a trajectory id two groups of a step share
//     reaches route, which refuses the second saying why, rather than
//     being dropped by the server as a copy without a word.
//   - The digest, so that another trajectory under an id of its step (a
//     trainer resumed from a checkpoint that sends its new rollouts as a
//     step it had sent to) reaches route too, which refuses it saying why.
//     Dropped as a copy, the step's update would carry the first
//     trajectory's advantage under the id of the second.
//
// The digest is the payload's CRC-32C: 26 GB/s here, against 0.9 for a
// 64-bit FNV-1a (20 µs of a 20 kB solution), and a clash matters only
// when an id comes again with other content.
func TrajMsgID(t Trajectory, payload []byte) string {
	return fmt.Sprintf("%s/traj/%d/%s/%s/%08x", t.Run, t.Step, t.GroupID, t.TrajID, crc32.Checksum(payload, castagnoli))
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// NewTrajsMessage encodes ts, at least one, as one message of the trajs
// kind (a JSON array), whose de-duplication ID is TrajsMsgID.
func NewTrajsMessage(ts []Trajectory) (*message.Message, error) {
	if len(ts) == 0 {
		return nil, fmt.Errorf("schemas: encode trajectories: none")
	}
	m, err := NewMessage("", ts)
	if err != nil {
		return nil, err
	}
	m.Metadata.Set(MsgIDKey, TrajsMsgID(ts, m.Payload))
	return m, nil
}

// JoinTrajs is the trajs message of ts, at least one, each already
// encoded alone in payloads (NewTrajMessage's): their JSON joined into an
// array, the bytes NewTrajsMessage would encode, without encoding them
// again.
func JoinTrajs(ts []Trajectory, payloads [][]byte) *message.Message {
	b := append([]byte{'['}, bytes.Join(payloads, []byte{','})...)
	m := message.NewMessage(watermill.NewUUID(), append(b, ']'))
	m.Metadata.Set(MsgIDKey, TrajsMsgID(ts, m.Payload))
	return m
}

// ByGroup splits ts into its runs of trajectories of one group, in order:
// for a trainer's rollouts, listed group by group, a trajs message each.
func ByGroup(ts []Trajectory) [][]Trajectory {
	var out [][]Trajectory
	for len(ts) > 0 {
		n := 1
		for n < len(ts) && ts[n].GroupID == ts[0].GroupID {
			n++
		}
		out, ts = append(out, ts[:n]), ts[n:]
	}
	return out
}

// TrajsMsgID is the de-duplication ID of trajectories ts encoded as
// payload: the run, step, group and id of the first, how many there are,
// and a digest of the payload, so that a message sent again (a retried
// publish) is stored once. As for TrajMsgID, the digest tells content apart
// only among messages that begin with the same trajectory.
func TrajsMsgID(ts []Trajectory, payload []byte) string {
	t := ts[0]
	return fmt.Sprintf("%s/trajs/%d/%s/%s/%d/%08x", t.Run, t.Step, t.GroupID, t.TrajID, len(ts), crc32.Checksum(payload, castagnoli))
}
