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
