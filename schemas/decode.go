package schemas

import (
	"errors"
	"fmt"
	"strings"

	// encoding/json's semantics on encoding/json/v2's implementation, which
	// decodes the pipeline's messages 1.2-1.7x faster (BenchmarkDecode*). It
	// is what Go 1.27's encoding/json is built on; this import goes then.
	json "github.com/go-json-experiment/json/v1"
)

// ErrInvalid marks a message that can never be used, however often it is
// redelivered: it goes to the dead-letter subject with the reason.
var ErrInvalid = errors.New("invalid message")

// ErrUnusable marks a valid message a stage can no longer use, such as one
// side of a join whose other side never came: like an invalid one, it goes
// to the dead-letter subject at once, with the reason, rather than being
// held or redelivered forever.
var ErrUnusable = errors.New("unusable message")

// ErrOutage marks a failure that is not the message's (a full or missing
// disk under the archive): the message is retried, with backoff, for as
// long as the outage lasts and never dead-lettered, so that nothing is lost
// once it is over.
var ErrOutage = errors.New("outage")

// ErrDown marks a valid message a stage gave up on without trying, because
// what it needs has been failing for a while (a world model whose calls
// keep failing): it goes to the dead-letter subject at once, counted with
// the messages given up after their retries, so that its step goes on
// without it instead of waiting out every retry.
var ErrDown = errors.New("down")

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
}

// missing collects the names of absent required fields.
type missing []string

func (m *missing) need(name string, present bool) {
	if !present {
		*m = append(*m, name)
	}
}

func (m missing) err() error {
	if len(m) == 0 {
		return nil
	}
	return invalid("missing field(s): %s", strings.Join(m, ", "))
}

// unmarshal decodes every message; a benchmark swaps in encoding/json's.
var unmarshal = json.Unmarshal

func decodeJSON(data []byte, v any) error {
	if err := unmarshal(data, v); err != nil {
		return invalid("malformed JSON: %v", ReadableJSON(err))
	}
	return nil
}

func checkSchema(schema *int) error {
	if schema == nil {
		return nil // reported as missing
	}
	if *schema != Version {
		return invalid("schema %d, this pipeline speaks schema %d", *schema, Version)
	}
	return nil
}

// CheckRun rejects a message whose run is not the pipeline's.
func CheckRun(got, want string) error {
	if got != want {
		return invalid("unknown run %q (this pipeline serves run %q)", got, want)
	}
	return nil
}

// SplitTrajectories parses a message of the trajs kind into its items, each
// a trajectory's JSON for DecodeTrajectory: the message must be a JSON
// array of at least one object. The items are not checked here, so that a
// bad one can be refused alone.
func SplitTrajectories(data []byte) (RawTrajectories, error) {
	var items RawTrajectories
	if err := unmarshal(data, &items); err != nil {
		return nil, invalid("malformed JSON: %v", ReadableJSON(err))
	}
	if len(items) == 0 {
		return nil, invalid("no trajectories: want a non-empty JSON array")
	}
	return items, nil
}

// NewestStep is the step of a message of the traj kind, or the newest step
// among the trajectories of a trajs message; false if it names none (a
// malformed message, which route dead-letters, says nothing of the step).
// It reads the step alone, of anyone's input.
func NewestStep(kind Kind, data []byte) (int64, bool) {
	type stepOf struct {
		Step *int64 `json:"step"`
	}
	var items []stepOf
	if kind == KindTrajs {
		if unmarshal(data, &items) != nil {
			return 0, false
		}
	} else {
		var one stepOf
		if unmarshal(data, &one) != nil {
			return 0, false
		}
		items = []stepOf{one}
	}
	newest := int64(-1)
	for _, it := range items {
		if it.Step != nil {
			newest = max(newest, *it.Step)
		}
	}
	if newest < 0 {
		return 0, false
	}
	return newest, true
}

// DecodeTrajectory parses and validates a Trajectory, naming every missing
// or invalid field.
func DecodeTrajectory(data []byte) (Trajectory, error) {
	var r struct {
		Schema        *int    `json:"schema"`
		Run           *string `json:"run"`
		Step          *int64  `json:"step"`
		GroupID       *string `json:"group_id"`
		TrajID        *string `json:"traj_id"`
		GroupSize     *int    `json:"group_size"`
		TaskID        *string `json:"task_id"`
		Prompt        *string `json:"prompt"`
		Response      *string `json:"response"`
		PolicyVersion *int64  `json:"policy_version"`
		Meta          Meta    `json:"meta"`
	}
	if err := decodeJSON(data, &r); err != nil {
		return Trajectory{}, err
	}
	var m missing
	m.need("schema", r.Schema != nil)
	m.need("run", r.Run != nil && *r.Run != "")
	m.need("step", r.Step != nil)
	m.need("group_id", r.GroupID != nil && *r.GroupID != "")
	m.need("traj_id", r.TrajID != nil && *r.TrajID != "")
	m.need("group_size", r.GroupSize != nil)
	m.need("task_id", r.TaskID != nil && *r.TaskID != "")
	m.need("prompt", r.Prompt != nil)
	m.need("response", r.Response != nil)
	m.need("policy_version", r.PolicyVersion != nil)
	if err := errors.Join(checkSchema(r.Schema), m.err()); err != nil {
		return Trajectory{}, err
	}
	t := Trajectory{
		Schema: *r.Schema, Run: *r.Run, Step: *r.Step, GroupID: *r.GroupID, TrajID: *r.TrajID,
		GroupSize: *r.GroupSize, TaskID: *r.TaskID, Prompt: *r.Prompt, Response: *r.Response,
		PolicyVersion: *r.PolicyVersion, Meta: r.Meta,
	}
	switch {
	case !ValidToken(t.Run):
		return t, invalid("run %q: want letters, digits, '_' or '-'", t.Run)
	case t.Step < 0:
		return t, invalid("step %d < 0", t.Step)
	case t.GroupSize < 1:
		return t, invalid("group_size %d < 1", t.GroupSize)
	}
	return t, nil
}

// TrajIDTaken is the error for trajectory id of group that group other of
// the step has already: trajectory ids are a step's, since its update
// tells its items apart by them.
func TrajIDTaken(id, group, other string, step int64) error {
	return invalid("trajectory id %q of group %s is taken by group %s of step %d: trajectory ids must be unique within a step, "+
		"since a step's update tells its items apart by them (name them \"<group>-<i>\", say)", id, group, other, step)
}

// TrajIDReused is the error for a trajectory whose id, in its group and
// step, came before with other content: the first one stays.
func TrajIDReused(t Trajectory) error {
	return invalid("trajectory %q of group %s of step %d came before with another prompt, solution or field; the first one stays, since "+
		"a trajectory id names one trajectory of its step and the step's update gives the advantage by it "+
		"(a trainer resumed from a checkpoint numbers its steps on from past every step it sent to: wmrl status says where)", t.TrajID, t.GroupID, t.Step)
}

// DecodeStepClose parses and validates a StepClose.
func DecodeStepClose(data []byte) (StepClose, error) {
	var r struct {
		Schema *int    `json:"schema"`
		Run    *string `json:"run"`
		Step   *int64  `json:"step"`
		Groups *int    `json:"groups"`
	}
	if err := decodeJSON(data, &r); err != nil {
		return StepClose{}, err
	}
	var m missing
	m.need("schema", r.Schema != nil)
	m.need("run", r.Run != nil && *r.Run != "")
	m.need("step", r.Step != nil)
	m.need("groups", r.Groups != nil)
	if err := errors.Join(checkSchema(r.Schema), m.err()); err != nil {
		return StepClose{}, err
	}
	s := StepClose{Schema: *r.Schema, Run: *r.Run, Step: *r.Step, Groups: *r.Groups}
	switch {
	case s.Step < 0:
		return s, invalid("step %d < 0", s.Step)
	case s.Groups < 0:
		return s, invalid("groups %d < 0", s.Groups)
	}
	return s, nil
}

// Internal is implemented by every internal message type (and Update).
type Internal interface {
	head() (schema int, run string)
}

func (m *Group) head() (int, string)       { return m.Schema, m.Run }
func (m *Plan) head() (int, string)        { return m.Schema, m.Run }
func (m *Prediction) head() (int, string)  { return m.Schema, m.Run }
func (m *Execution) head() (int, string)   { return m.Schema, m.Run }
func (m *PairGroup) head() (int, string)   { return m.Schema, m.Run }
func (m *Calibration) head() (int, string) { return m.Schema, m.Run }
func (m *Update) head() (int, string)      { return m.Schema, m.Run }

// Decode parses an internal message into v and checks its schema number,
// its run, and that its scores are in range (MaxScore).
func Decode(data []byte, run string, v Internal) error {
	if err := decodeJSON(data, v); err != nil {
		return err
	}
	schema, got := v.head()
	if schema != Version {
		return invalid("schema %d, this pipeline speaks schema %d", schema, Version)
	}
	if err := CheckRun(got, run); err != nil {
		return err
	}
	if c, ok := v.(validator); ok {
		return c.validate()
	}
	return nil
}
