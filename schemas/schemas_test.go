package schemas

import (
	"bytes"
	stdjson "encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the JSON Schema files")

// The JSON Schema files are generated from the Go types; this keeps them in
// step (go test ./schemas -update rewrites them).
func TestJSONSchemaFilesUpToDate(t *testing.T) {
	for _, d := range Messages {
		want, err := JSONSchema(d)
		if err != nil {
			t.Fatal(err)
		}
		path := string(d.Kind) + ".schema.json"
		if *update {
			if err := os.WriteFile(path, want, 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		got, err := os.ReadFile(path)
		if err != nil {
			t.Fatalf("%s: %v (run go test ./schemas -update)", path, err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s is stale: run go test ./schemas -update", path)
		}
	}
}

func TestDecodeTrajectoryNamesWhatIsWrong(t *testing.T) {
	ok := `{"schema":1,"run":"r","step":3,"group_id":"g","traj_id":"t","group_size":4,"task_id":"x","prompt":"","response":"print(1)","policy_version":7,"meta":{"k":1}}`
	tr, err := DecodeTrajectory([]byte(ok))
	var k float64
	if found, merr := tr.Meta.Get("k", &k); err != nil || tr.Step != 3 || tr.GroupSize != 4 || !found || merr != nil || k != 1 {
		t.Fatalf("valid trajectory: %+v %v", tr, err)
	}
	for _, tc := range []struct{ payload, want string }{
		{`{"schema":1,`, "malformed JSON"},
		{strings.Replace(ok, `"schema":1`, `"schema":3`, 1), "schema 3"},
		{`{"schema":1,"run":"r"}`, "missing field(s): step, group_id, traj_id, group_size, task_id, prompt, response, policy_version"},
		{strings.Replace(ok, `"group_size":4`, `"group_size":0`, 1), "group_size 0"},
		{strings.Replace(ok, `"step":3`, `"step":-1`, 1), "step -1"},
		{strings.Replace(ok, `"run":"r"`, `"run":"a.b"`, 1), `run "a.b"`},
		{strings.Replace(ok, `"step":3`, `"step":"3"`, 1), "malformed JSON"},
		{strings.Replace(ok, `{"k":1}`, `[1]`, 1), "meta is an array, want an object"},
		{strings.Replace(ok, `{"k":1}`, `"k"`, 1), "meta is a string, want an object"},
		{strings.Replace(ok, `{"k":1}`, `{"k":}`, 1), "malformed JSON"},
	} {
		_, err := DecodeTrajectory([]byte(tc.payload))
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v, want an ErrInvalid naming %q", tc.payload, err, tc.want)
		}
	}
	if _, err := DecodeStepClose([]byte(`{"schema":1,"run":"r","step":1}`)); err == nil || !strings.Contains(err.Error(), "groups") {
		t.Errorf("step without groups: %v", err)
	}
	var p Prediction
	if err := Decode([]byte(`{"schema":1,"run":"other"}`), "r", &p); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), `unknown run "other"`) {
		t.Errorf("internal message of another run: %v", err)
	}
}

// The pipeline decodes with encoding/json/v2's implementation of
// encoding/json's semantics: a trainer's message that encoding/json took
// must still be taken, and as the same values, whatever the JSON looks like.
func TestDecodingTakesWhatEncodingJSONTook(t *testing.T) {
	base := `"run":"r","step":3,"group_id":"g","traj_id":"t","group_size":4,"task_id":"x","prompt":"p","policy_version":7`
	for _, payload := range []string{
		`{"schema":1,` + base + `,"response":"print(1)","meta":{"k":1,"n":null,"l":[1,"a",{"b":true}]}}`,
		`{"SCHEMA":1,` + base + `,"Response":"print(1)"}`,             // names in another case
		`{"schema":1,` + base + `,"response":"a","response":"b"}`,     // a duplicate name: the last wins
		`{"schema":1,` + base + `,"response":"\ud800 \u00e9 \u2028"}`, // a lone surrogate
		"{\"schema\":1," + base + ",\"response\":\"bad \xff\xfe utf-8\"}",
		`{"schema":1,` + base + `,"response":"x","meta":null,"extra":{"deep":[[[]]]}}`,
		`{"schema":1,` + base + `,"response":"x","step":null}`, // null leaves a field unset
		`{"schema":1,` + base + `,"response":"x","policy_version":1e2}`,
		`{"schema":1,` + base + `,"response":"x","step":9223372036854775808}`,
		`{"schema":1,` + base + `,"response":"x"} trailing`,
		` {"schema":1,` + base + `,"response":"x"}` + "\n",
	} {
		got, gotErr := DecodeTrajectory([]byte(payload))
		ours := unmarshal
		unmarshal = stdjson.Unmarshal
		want, wantErr := DecodeTrajectory([]byte(payload))
		unmarshal = ours
		if (gotErr == nil) != (wantErr == nil) || !reflect.DeepEqual(got, want) {
			t.Errorf("%q:\n got %+v, %v\nwant %+v, %v (encoding/json)", payload, got, gotErr, want, wantErr)
		}
	}
}

// A trajectory's de-duplication ID is the same for the same content (a
// retried request is stored once) and differs for other content under the
// same id (which route then refuses, rather than the server dropping it).
func TestNewTrajMessageNamesTheContent(t *testing.T) {
	tr := Trajectory{Schema: Version, Run: "r", Step: 3, GroupID: "g0", TrajID: "g0-t1", GroupSize: 2, TaskID: "x", Prompt: "p", Response: "print(1)"}
	a, err := NewTrajMessage(tr)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := NewTrajMessage(tr)
	tr.Response = "print(2)"
	c, _ := NewTrajMessage(tr)
	ida, idb, idc := a.Metadata.Get(MsgIDKey), b.Metadata.Get(MsgIDKey), c.Metadata.Get(MsgIDKey)
	if ida != idb || ida == idc || !strings.HasPrefix(ida, "r/traj/3/g0/g0-t1/") || len(ida) != len("r/traj/3/g0/g0-t1/")+8 {
		t.Errorf("IDs %q, %q (the same content), %q (another solution)", ida, idb, idc)
	}
}

// A trajs message is named by its first trajectory, how many it holds and
// its content: sent again alike it is stored once; a group with another
// solution, or with one more, is another message. Split gives its items
// back, each a trajectory's JSON; ByGroup cuts rollouts into groups.
func TestATrajsMessageNamesItsContentAndSplits(t *testing.T) {
	var ts []Trajectory
	for g := range 2 {
		for i := range 3 {
			ts = append(ts, Trajectory{Schema: Version, Run: "r", Step: 3, GroupID: fmt.Sprintf("g%d", g), TrajID: fmt.Sprintf("g%d-t%d", g, i),
				GroupSize: 3, TaskID: "x", Prompt: "p", Response: fmt.Sprintf("print(%d)", i)})
		}
	}
	groups := ByGroup(ts)
	if len(groups) != 2 || len(groups[0]) != 3 || groups[1][0].TrajID != "g1-t0" || len(ByGroup(nil)) != 0 {
		t.Fatalf("ByGroup: %v", groups)
	}
	a, err := NewTrajsMessage(groups[0])
	if err != nil {
		t.Fatal(err)
	}
	b, _ := NewTrajsMessage(slices.Clone(groups[0]))
	other := slices.Clone(groups[0])
	other[2].Response = "print(9)"
	c, _ := NewTrajsMessage(other)
	d, _ := NewTrajsMessage(groups[0][:2])
	ida, idb, idc, idd := a.Metadata.Get(MsgIDKey), b.Metadata.Get(MsgIDKey), c.Metadata.Get(MsgIDKey), d.Metadata.Get(MsgIDKey)
	if ida != idb || ida == idc || ida == idd || !strings.HasPrefix(ida, "r/trajs/3/g0/g0-t0/3/") || !strings.HasPrefix(idd, "r/trajs/3/g0/g0-t0/2/") {
		t.Errorf("IDs %q, %q (the same content), %q (another solution), %q (one fewer)", ida, idb, idc, idd)
	}
	var payloads [][]byte
	for _, tr := range groups[0] {
		m, _ := NewTrajMessage(tr)
		payloads = append(payloads, m.Payload)
	}
	if j := JoinTrajs(groups[0], payloads); !bytes.Equal(j.Payload, a.Payload) || j.Metadata.Get(MsgIDKey) != ida {
		t.Errorf("joined trajs message %s (%s), want %s (%s) as encoded whole", j.Payload, j.Metadata.Get(MsgIDKey), a.Payload, ida)
	}
	if _, err := NewTrajsMessage(nil); err == nil {
		t.Error("a trajs message of no trajectories encoded")
	}
	items, err := SplitTrajectories(a.Payload)
	if err != nil || len(items) != 3 {
		t.Fatalf("split: %d items, %v", len(items), err)
	}
	for i, item := range items {
		if got, err := DecodeTrajectory(item); err != nil || !reflect.DeepEqual(got, groups[0][i]) {
			t.Errorf("item %d: %+v, %v; want %+v", i, got, err, groups[0][i])
		}
	}
	for payload, want := range map[string]string{`[]`: "no trajectories", `{"step": 1}`: "want an array", `[{}`: "malformed JSON"} {
		if _, err := SplitTrajectories([]byte(payload)); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), want) {
			t.Errorf("split %s: %v, want it invalid saying %q", payload, err, want)
		}
	}
}

// NewestStep reads the step of anyone's trajectory input: a trajs
// message's newest, and none from what names no step.
func TestNewestStepReadsEitherKind(t *testing.T) {
	for _, tc := range []struct {
		kind Kind
		data string
		step int64
		ok   bool
	}{
		{KindTraj, `{"step": 3, "run": "r"}`, 3, true},
		{KindTrajs, `[{"step": 2}, {"step": 9}, {"run": "r"}, {"step": 4}]`, 9, true},
		{KindTrajs, `[{"run": "r"}]`, 0, false},
		{KindTrajs, `{"step": 3}`, 0, false},
		{KindTraj, `[{"step": 3}]`, 0, false},
		{KindTraj, `{"step": 3`, 0, false},
		{KindTraj, `{"step": -1}`, 0, false},
	} {
		if step, ok := NewestStep(tc.kind, []byte(tc.data)); step != tc.step || ok != tc.ok {
			t.Errorf("%s %s: step %d, %v; want %d, %v", tc.kind, tc.data, step, ok, tc.step, tc.ok)
		}
	}
}
