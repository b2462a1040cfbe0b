package natsjs

import (
	"fmt"
	"strings"

	"github.com/nats-io/nats.go"
)

// Health says whether nc can carry messages now: nil while it is
// connected, else what it is doing instead ("reconnecting", "closed") and
// its last error. It is what a process's /healthz answers from.
func Health(nc *nats.Conn) error {
	st := nc.Status()
	if st == nats.CONNECTED {
		return nil
	}
	what := strings.ToLower(strings.ReplaceAll(st.String(), "_", " "))
	if err := nc.LastError(); err != nil {
		return fmt.Errorf("the NATS connection is %s (its last error: %v)", what, err)
	}
	return fmt.Errorf("the NATS connection is %s", what)
}
