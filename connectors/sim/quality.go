// Package sim provides simulated connectors for tests and demos: a world
// model with a configurable monotone bias and noise, an executor with
// configurable latency, and a rollout policy. They score any trajectory,
// including ones from outside, deterministically from its content.
package sim

import (
	"hash/fnv"
	"math"
	"math/rand/v2"
	"strconv"

	"github.com/wmrl/wmrl/schemas"
)

// QualityKey is the meta field the simulated policy sets: the trajectory's
// latent true quality in [0, 1].
const QualityKey = "sim_quality"

// Quality is a trajectory's latent true quality: meta[QualityKey] when the
// simulated policy wrote it, otherwise a uniform value derived from the task
// and response, so outside trajectories are scored deterministically.
func Quality(t schemas.Trajectory) float64 {
	var v float64
	if ok, err := t.Meta.Get(QualityKey, &v); ok && err == nil && v >= 0 && v <= 1 {
		return v
	}
	return rng(t.TaskID, t.Response, "quality").Float64()
}

// qualityMeta is the meta the simulated policy writes: q exactly, as the
// shortest decimal that reads back as q.
func qualityMeta(q float64) schemas.Meta {
	return schemas.Meta(`{"` + QualityKey + `":` + strconv.FormatFloat(q, 'g', -1, 64) + `}`)
}

// rng is a generator seeded by the content of its parts.
func rng(parts ...string) *rand.Rand {
	h := fnv.New64a()
	for _, p := range parts {
		h.Write([]byte(p))
		h.Write([]byte{0})
	}
	s := h.Sum64()
	return rand.New(rand.NewPCG(s, s^0x9e3779b97f4a7c15))
}

func clip01(x float64) float64 { return math.Min(1, math.Max(0, x)) }
