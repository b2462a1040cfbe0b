package sim

import (
	"fmt"
	"math"
	"strconv"

	"github.com/wmrl/wmrl/schemas"
)

// Policy generates rollouts: each step, Groups groups of GroupSize
// trajectories, each group answering one of Tasks tasks. A trajectory's
// quality depends on its task's difficulty, its sampled style and the
// policy's skill, which grows slowly with the step, as training would make
// it. Deterministic in (Seed, step).
type Policy struct {
	Run       string
	Seed      uint64
	Tasks     int
	Groups    int
	GroupSize int
	// ResponseBytes pads responses to about this size (default 200).
	ResponseBytes int
}

// Step returns step n's trajectories and watermark.
func (p *Policy) Step(n int64) ([]schemas.Trajectory, schemas.StepClose) {
	seed := strconv.FormatUint(p.Seed, 10)
	step := strconv.FormatInt(n, 10)
	pad := p.ResponseBytes
	if pad == 0 {
		pad = 200
	}
	skill := 1 - math.Exp(-float64(n)/500)
	trajs := make([]schemas.Trajectory, 0, p.Groups*p.GroupSize)
	for g := 0; g < p.Groups; g++ {
		r := rng(seed, step, strconv.Itoa(g), "group")
		task := r.IntN(p.Tasks)
		difficulty := rng(seed, strconv.Itoa(task), "task").Float64()
		gid := fmt.Sprintf("s%d-g%d", n, g)
		for i := 0; i < p.GroupSize; i++ {
			style := r.IntN(8)
			q := clip01(0.55 - 0.4*difficulty + 0.3*skill + 0.08*float64(style-4)/4 + 0.1*r.NormFloat64())
			body := fmt.Sprintf("# task %d style %d\nprint(%d)\n", task, style, r.IntN(1_000_000))
			for len(body) < pad {
				body += "# padding to a realistic solution size\n"
			}
			trajs = append(trajs, schemas.Trajectory{
				Schema: schemas.Version, Run: p.Run, Step: n, GroupID: gid,
				TrajID: fmt.Sprintf("%s-t%d", gid, i), GroupSize: p.GroupSize,
				TaskID: fmt.Sprintf("task-%d", task), Prompt: fmt.Sprintf("Solve task %d.", task),
				Response: body, PolicyVersion: n, Meta: qualityMeta(q),
			})
		}
	}
	return trajs, schemas.StepClose{Schema: schemas.Version, Run: p.Run, Step: n, Groups: p.Groups}
}
