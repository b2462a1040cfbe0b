package schemas

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

// A trajectory's meta reaches every subject after the trainer's as the
// trainer wrote it. Decoded into Go values, as it was, an integer past 2^53
// came out rounded: 12345678901234567890 as 12345678901234567000.
func TestMetaPassesThroughAsItCame(t *testing.T) {
	const meta = `{"sample_id":12345678901234567890,"seed":9007199254740993,"lr":0.1,"z":{"b":[1,2.50,-0e0]},"a":"é \u2028 \u003c"}`
	traj := `{"schema":1,"run":"r","step":3,"group_id":"g","traj_id":"t","group_size":1,"task_id":"x","prompt":"p","response":"print(1)","policy_version":7,"meta":` + meta + `}`
	tr, err := DecodeTrajectory([]byte(traj))
	if err != nil {
		t.Fatal(err)
	}
	m, err := NewTrajMessage(tr)
	if err != nil {
		t.Fatal(err)
	}
	g, err := NewMessage("", Group{Schema: Version, Run: "r", Step: 3, GroupID: "g", Trajectories: []Trajectory{tr}})
	if err != nil {
		t.Fatal(err)
	}
	for _, out := range [][]byte{m.Payload, g.Payload} {
		if !bytes.Contains(out, []byte(`"meta":`+meta)) {
			t.Errorf("meta changed on its way through:\n got %s\nwant it to hold \"meta\":%s", out, meta)
		}
	}
	again, err := DecodeTrajectory(m.Payload)
	if err != nil || !bytes.Equal(again.Meta, tr.Meta) {
		t.Errorf("read again: %s, %v; want %s", again.Meta, err, tr.Meta)
	}
	var id json.Number
	if ok, err := again.Meta.Get("sample_id", &id); !ok || err != nil || id != "12345678901234567890" {
		t.Errorf("Get(sample_id) = %v, %v, %v", id, ok, err)
	}
	var lr float64
	if ok, err := again.Meta.Get("lr", &lr); !ok || err != nil || lr != 0.1 {
		t.Errorf("Get(lr) = %v, %v, %v", lr, ok, err)
	}
	if ok, err := again.Meta.Get("absent", &lr); ok || err != nil {
		t.Errorf("Get(absent) = %v, %v", ok, err)
	}
	if ok, err := again.Meta.Get("a", &lr); !ok || err == nil || !strings.Contains(err.Error(), "meta a") {
		t.Errorf("Get(a) into a number = %v, %v; want an error naming the field", ok, err)
	}
}

// No meta, or null, is left out of what a stage sends (the JSON Schema has
// meta an object); an empty object stays one.
func TestAbsentMetaIsLeftOut(t *testing.T) {
	base := `{"schema":1,"run":"r","step":3,"group_id":"g","traj_id":"t","group_size":1,"task_id":"x","prompt":"p","response":"x","policy_version":7`
	for in, want := range map[string]string{
		base + `}`:                "",
		base + `,"meta":null}`:    "",
		base + `,"meta": {} }`:    `"meta":{}`,
		base + `,"meta":{"a":1}}`: `"meta":{"a":1}`,
	} {
		tr, err := DecodeTrajectory([]byte(in))
		if err != nil {
			t.Fatal(err)
		}
		m, err := NewTrajMessage(tr)
		if err != nil {
			t.Fatal(err)
		}
		if has := strings.Contains(string(m.Payload), `"meta"`); has != (want != "") || !strings.Contains(string(m.Payload), want) {
			t.Errorf("%s\nsent as %s; want %q", in, m.Payload, want)
		}
	}
}

// Bytes that are not UTF-8 in a meta string are replaced, as anywhere else
// in a message, so that no stage sends them on; the numbers stay exact.
func TestMetaWithBadUTF8IsMendedNotRefused(t *testing.T) {
	in := "{\"schema\":1,\"run\":\"r\",\"step\":3,\"group_id\":\"g\",\"traj_id\":\"t\",\"group_size\":1,\"task_id\":\"x\",\"prompt\":\"p\",\"response\":\"x\",\"policy_version\":7,\"meta\":{\"note\":\"bad \xff\",\"id\":12345678901234567890}}"
	tr, err := DecodeTrajectory([]byte(in))
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"id":12345678901234567890,"note":"bad ` + "\ufffd" + `"}`; string(tr.Meta) != want {
		t.Errorf("meta %s, want %s", tr.Meta, want)
	}
}

// Get reads a field as encoding/json would: of a name given twice, the
// last; a meta that is not an object is an error, not a missing field.
func TestMetaGetReadsAsEncodingJSON(t *testing.T) {
	for _, tc := range []struct {
		meta  string
		found bool
		want  float64
		err   string
	}{
		{`{"k":1,"k":2}`, true, 2, ""},
		{`{"a":{"k":5},"b":[{"k":6}],"k":7}`, true, 7, ""},
		{`{"a":{"k":5}}`, false, 0, ""},
		{`{"k":"x"}`, true, 0, "meta k"},
		{`[1]`, false, 0, "meta is an array, want an object"},
		{`{"k":`, false, 0, "meta: "},
		{`null`, false, 0, "meta is null, want an object"},
	} {
		var got float64
		found, err := Meta(tc.meta).Get("k", &got)
		if found != tc.found || got != tc.want || (err == nil) != (tc.err == "") || err != nil && !strings.Contains(err.Error(), tc.err) {
			t.Errorf("Get(k) of %s = %v, %v, %v; want %v, %v, an error naming %q", tc.meta, got, found, err, tc.want, tc.found, tc.err)
		}
	}
}
