package schemas

import (
	"bytes"
	"errors"
	"testing"
)

// FuzzDecode: whatever bytes come on a subject, decoding gives either a
// message that keeps the contract (its fields checked, and it encodes
// again: nothing that cannot be sent on is taken) or ErrInvalid, which is
// dead-lettered with its reason; never a panic, which would take the
// stage's process down and, redelivered, every restart of it. Run it
// longer with make fuzz.
func FuzzDecode(f *testing.F) {
	for _, seed := range []string{
		`{"schema":1,"run":"r","step":3,"group_id":"g","traj_id":"t","group_size":4,"task_id":"x","prompt":"","response":"print(1)","policy_version":7,"meta":{"k":[1,{"a":null}]}}`,
		`{"schema":1,"run":"r","step":3,"groups":16}`,
		`{"schema":1,"run":"r","step":2,"group_id":"g","items":[{"traj_id":"t0","score":0.5,"status":"ok","spread":0.1},{"traj_id":"t1","score":null,"status":"ungraded"}]}`,
		`{"schema":1,"run":"r","step":2,"group_id":"g","items":[{"traj_id":"t0","score":1,"status":"scored","seconds":12.5,"copy_of":"t1"}]}`,
		`{"schema":1,"run":"r","step":2,"group_id":"g","pairs":[{"traj_id":"t0","predicted":0.4,"true":0.9}]}`,
		`{"schema":1,"run":"r","seq":4,"version":1,"step":2,"group_id":"g","map":{"x":[0.1,0.9],"y":[0.2,0.8]},"pairs":[{"traj_id":"t0","predicted":0.4,"true":0.9,"before":0.3,"after":0.5}],"pairs_total":8}`,
		`{"schema":1,"run":"r","step":2,"rho":2,"d":1,"items":[{"traj_id":"t0","group_id":"g","source":"anchor","reward":0.5,"advantage":1,"weight":2,"fused_advantage":1.8,"predicted":0.4,"true_score":0.5,"exec_seconds":3}],"skipped":[],"late_anchors":[],"closed_at":"2026-12-04T07:00:00Z","published_at":"2026-12-04T07:00:01Z"}`,
		`{"schema":1,"run":"r","step":2,"groups":[{"group_id":"g","anchor":true,"traj_ids":["t0"],"dropped":"too large"}]}`,
		`{"schema":1,"run":"r","step":2,"group_id":"g","anchor":true,"trajectories":[{"schema":1,"run":"r","step":2,"group_id":"g","traj_id":"t0","group_size":1,"task_id":"x","prompt":"p","response":"r","policy_version":0}]}`,
		`{"schema":1,"run":"r","step":2,"items":[{"score":1e300}]}`, `{"schema":2}`, `[`, `null`, `{"items":[null]}`,
		"{\"schema\":1,\"run\":\"r\",\"step\":3,\"group_id\":\"g\",\"traj_id\":\"t\",\"group_size\":4,\"task_id\":\"x\",\"prompt\":\"\",\"response\":\"\",\"policy_version\":7,\"meta\":{\"id\":12345678901234567890,\"x\":1e400,\"s\":\"\xff\",\"k\":1,\"k\":2}}",
		`{"schema":1,"run":"r","step":3,"group_id":"g","traj_id":"t","group_size":4,"task_id":"x","prompt":"","response":"","policy_version":7,"meta":[1]}`,
		"{\"schema\":1,\"run\":\"r\",\"step\":3,\"group_id\":\"g\",\"traj_id\":\"t\",\"group_size\":4,\"task_id\":\"x\",\"prompt\":\"\",\"response\":\"\",\"policy_version\":7,\"meta\":{\"h\":\"<a> & \u2028\"}}",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if tr, err := DecodeTrajectory(data); err == nil {
			if tr.Step < 0 || tr.GroupSize < 1 || !ValidToken(tr.Run) || tr.GroupID == "" || tr.TrajID == "" || tr.TaskID == "" {
				t.Fatalf("took a trajectory that breaks the contract: %+v", tr)
			}
			mustEncode(t, tr)
			// Its meta goes on as it came: an object, the same again
			// once sent and read back.
			if len(tr.Meta) > 0 && tr.Meta[0] != '{' {
				t.Fatalf("took meta %s, which is not an object", tr.Meta)
			}
			m, _ := NewTrajMessage(tr)
			if again, err := DecodeTrajectory(m.Payload); err != nil || !bytes.Equal(again.Meta, tr.Meta) {
				t.Fatalf("meta %s came back as %s (%v)", tr.Meta, again.Meta, err)
			}
		} else if !errors.Is(err, ErrInvalid) {
			t.Fatalf("trajectory: %v is not ErrInvalid", err)
		}
		if sc, err := DecodeStepClose(data); err == nil {
			if sc.Step < 0 || sc.Groups < 0 {
				t.Fatalf("took a watermark that breaks the contract: %+v", sc)
			}
			mustEncode(t, sc)
		} else if !errors.Is(err, ErrInvalid) {
			t.Fatalf("watermark: %v is not ErrInvalid", err)
		}
		for _, v := range []Internal{&Group{}, &Plan{}, &Prediction{}, &Execution{}, &PairGroup{}, &Calibration{}, &Update{}} {
			err := Decode(data, "r", v)
			if err != nil {
				if !errors.Is(err, ErrInvalid) {
					t.Fatalf("%T: %v is not ErrInvalid", v, err)
				}
				continue
			}
			if c, ok := v.(validator); ok && c.validate() != nil {
				t.Fatalf("%T taken out of range: %v", v, c.validate())
			}
			mustEncode(t, v)
		}
	})
}

func mustEncode(t *testing.T, v any) {
	t.Helper()
	if _, err := NewMessage("id", v); err != nil {
		t.Fatalf("took %T that cannot be sent on: %v", v, err)
	}
}
