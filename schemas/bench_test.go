package schemas

import (
	stdjson "encoding/json"
	"fmt"
	"testing"
	"time"
)

// benchTrajectory is a trajectory as the simulated source sends it.
func benchTrajectory(b *testing.B) []byte {
	t := Trajectory{
		Schema: Version, Run: "default", Step: 12, GroupID: "s12-g0003", TrajID: "s12-g0003-t5",
		GroupSize: 8, TaskID: "task-07", Prompt: "Sort a list of integers in place, stably.",
		Response: "def solve(xs):\n    xs.sort()\n    return xs\n", PolicyVersion: 12,
		Meta: Meta(`{"quality":0.4123}`),
	}
	data, err := stdjson.Marshal(t)
	if err != nil {
		b.Fatal(err)
	}
	return data
}

// benchUpdate is a step update of 1,024 trajectories.
func benchUpdate(b *testing.B) []byte {
	u := Update{Schema: Version, Run: "default", Step: 3, Rho: 1.7, D: 0.8, Groups: 128, Anchors: 13}
	for i := range 1024 {
		r := float64(i%97) / 97
		u.Items = append(u.Items, UpdateItem{
			TrajID: fmt.Sprintf("s3-g%04d-t%d", i/8, i%8), GroupID: fmt.Sprintf("s3-g%04d", i/8),
			Source: "world_model", Reward: &r, Advantage: r - 0.5, Weight: 1, FusedAdvantage: r - 0.49,
		})
	}
	data, err := stdjson.Marshal(u)
	if err != nil {
		b.Fatal(err)
	}
	return data
}

// benchDecode times decode on data, then the same decode with the
// standard library's encoding/json in the same run, and reports the ratio.
func benchDecode(b *testing.B, data []byte, decode func([]byte) error) {
	timeIt := func(n int) time.Duration {
		start := time.Now()
		for range n {
			if err := decode(data); err != nil {
				b.Fatal(err)
			}
		}
		return time.Since(start)
	}
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		if err := decode(data); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	n := max(b.N, 100)
	ours := timeIt(n)
	defer func(u func([]byte, any) error) { unmarshal = u }(unmarshal)
	unmarshal = stdjson.Unmarshal
	b.ReportMetric(float64(timeIt(n))/float64(ours), "x_encoding_json")
}

// BenchmarkDecodeTrajectory: decoding and checking one trajectory, the
// message route receives once per trajectory.
func BenchmarkDecodeTrajectory(b *testing.B) {
	benchDecode(b, benchTrajectory(b), func(d []byte) error {
		_, err := DecodeTrajectory(d)
		return err
	})
}

// BenchmarkDecodeUpdate: decoding a step update of 1,024 trajectories, as
// the archive does.
func BenchmarkDecodeUpdate(b *testing.B) {
	benchDecode(b, benchUpdate(b), func(d []byte) error {
		var u Update
		return Decode(d, "default", &u)
	})
}

// BenchmarkMetaGet: one field of a trajectory's meta, as the simulator
// reads the quality of every trajectory it scores.
func BenchmarkMetaGet(b *testing.B) {
	m := Meta(`{"step":12,"group":3,"note":{"a":[1,2,3]},"sim_quality":0.4123}`)
	for b.Loop() {
		var q float64
		if ok, err := m.Get("sim_quality", &q); !ok || err != nil || q != 0.4123 {
			b.Fatal(ok, err, q)
		}
	}
}
