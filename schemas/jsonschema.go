package schemas

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"time"
)

// Documented pairs a message kind with its Go type and a description, for
// the JSON Schema files in this folder.
type Documented struct {
	Kind  Kind
	Type  any
	Title string
	Doc   string
}

// Messages lists every message on the wire, in Kinds order.
var Messages = []Documented{
	{KindTraj, Trajectory{}, "Trajectory", "One candidate solution, published by the trainer on <prefix>.<run>.traj."},
	{KindTrajs, []Trajectory{}, "Trajectories", "Several candidate solutions in one message (a group, or a whole step), published by the trainer on <prefix>.<run>.trajs: a JSON array of Trajectory objects (traj.schema.json), each taken as if sent alone on <prefix>.<run>.traj. A trainer that has a group's rollouts at once sends fewer messages this way, which is what bounds the pipeline's rate."},
	{KindStep, StepClose{}, "StepClose", "A step's watermark on <prefix>.<run>.step: the step has `groups` groups and no more trajectories will come for it."},
	{KindUpdate, Update{}, "Update", "A step's fused advantages on <prefix>.<run>.update, one per step, retained in JetStream."},
	{KindDLQ, DeadLetter{}, "DeadLetter", "A message no stage could use, with the reason, on <prefix>.<run>.dlq."},
	{KindGroup, Group{}, "Group", "Internal: a complete rollout group, route -> predict (and, for anchors, route -> execute on <prefix>.<run>.exec)."},
	{KindExec, Group{}, "Group (anchor)", "Internal: an anchor group to execute, route -> execute."},
	{KindPlan, Plan{}, "Plan", "Internal: a step's groups and anchor choice, route -> fuse. Stored after every group of the step."},
	{KindPred, Prediction{}, "Prediction", "Internal: the world model's scores for a group, predict -> pair, fuse."},
	{KindExecution, Execution{}, "Execution", "Internal: the real outcome of an anchor group, execute -> pair, fuse."},
	{KindPairs, PairGroup{}, "PairGroup", "Internal: an anchor group's (predicted, true) pairs, pair -> calibrate."},
	{KindCalibration, Calibration{}, "Calibration", "Internal: the debiaser's map after absorbing one anchor group, calibrate -> fuse, in absorption order."},
}

// JSONSchema returns the draft 2020-12 JSON Schema of d's type, indented.
func JSONSchema(d Documented) ([]byte, error) {
	s := schemaOf(reflect.TypeOf(d.Type))
	if s["type"] == "array" {
		s["minItems"] = 1 // a message of several holds one at least
	}
	s["$schema"] = "https://json-schema.org/draft/2020-12/schema"
	s["$id"] = "wmrl/" + string(d.Kind) + ".schema.json"
	s["title"] = d.Title
	s["description"] = d.Doc
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	err := enc.Encode(s)
	return buf.Bytes(), err
}

var (
	timeType = reflect.TypeOf(time.Time{})
	metaType = reflect.TypeOf(Meta{})
)

func schemaOf(t reflect.Type) map[string]any {
	nullable := false
	if t.Kind() == reflect.Pointer {
		nullable, t = true, t.Elem()
	}
	var s map[string]any
	switch {
	case t == timeType:
		s = map[string]any{"type": "string", "format": "date-time"}
	case t == metaType:
		s = map[string]any{"type": "object"}
	case t.Kind() == reflect.String:
		s = map[string]any{"type": "string"}
	case t.Kind() == reflect.Bool:
		s = map[string]any{"type": "boolean"}
	case t.Kind() >= reflect.Int && t.Kind() <= reflect.Uint64:
		s = map[string]any{"type": "integer"}
	case t.Kind() == reflect.Float64:
		s = map[string]any{"type": "number"}
	case t.Kind() == reflect.Slice:
		s = map[string]any{"type": "array", "items": schemaOf(t.Elem())}
	case t.Kind() == reflect.Map:
		s = map[string]any{"type": "object"}
	case t.Kind() == reflect.Struct:
		props := map[string]any{}
		var required []string
		for i := range t.NumField() {
			f := t.Field(i)
			name, opts, _ := strings.Cut(f.Tag.Get("json"), ",")
			if name == "" || name == "-" {
				continue
			}
			props[name] = schemaOf(f.Type)
			if name == "schema" {
				props[name] = map[string]any{"const": Version}
			}
			if !strings.Contains(opts, "omitempty") && f.Type.Kind() != reflect.Map {
				required = append(required, name)
			}
		}
		s = map[string]any{"type": "object", "properties": props, "required": required}
	default:
		panic("schemas: no JSON Schema for " + t.String())
	}
	if nullable {
		s["type"] = []any{s["type"], "null"}
	}
	return s
}
