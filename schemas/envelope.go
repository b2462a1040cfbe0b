package schemas

import (
	"encoding/json"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// MsgIDKey is the metadata key whose value JetStream uses to drop a second
// publish of the same message (the Nats-Msg-Id header).
const MsgIDKey = "Nats-Msg-Id"

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

// Again is m's payload as a new message whose de-duplication ID is id: the
// same value sent on a second subject, encoded once (the payload is
// shared, and neither message may change it).
func Again(m *message.Message, id string) *message.Message {
	c := message.NewMessage(watermill.NewUUID(), m.Payload)
	c.Metadata.Set(MsgIDKey, id)
	return c
}

// TrajMsgID is a trajectory's de-duplication ID: its run, step, group and
// id, so that a trajectory sent again (a retried request) is stored once,
// while a trainer that names its trajectories alike every step ("g0-t0")
// does not have the later steps' dropped as copies of the first's. The
// group is in it so that a trajectory id two groups of a step share
// reaches route, which refuses the second saying why, rather than being
// dropped by the server as a copy without a word.
func TrajMsgID(t Trajectory) string {
	return fmt.Sprintf("%s/traj/%d/%s/%s", t.Run, t.Step, t.GroupID, t.TrajID)
}
