package pipeline

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"

	"github.com/wmrl/wmrl/connectors/natsjs"
	"github.com/wmrl/wmrl/schemas"
	"github.com/wmrl/wmrl/stages/archive"
)

// A run of a fixed number of steps ends once the archive holds every
// step and the pairs of its late anchor groups, which come after their
// steps. A late group whose messages were dead-lettered on the way to
// the archive (pair gave up on an execution that never came, calibrate
// or an outside stage rejected its pairs, a bug) sends no pairs until
// the letter is resent, and the run waited for them in silence, for
// good. lettered follows the dlq subject and names those groups, so that
// the run ends, saying which pairs are in the dead letters.

// lettered is, by archive.LateKey, why the pairs of an anchor group are
// held up: the stage and reason of the dead letter.
type lettered struct {
	mu  sync.Mutex
	why map[string]string
}

// noPairsFor says whether dl holds up the pairs of the anchor group its
// message names, and which group: route's letters (trajectories) and
// predict's hold up a step, not its pairs, and execute, giving up on a
// group, still sends it on ungraded.
func noPairsFor(dl schemas.DeadLetter) (step int64, group string, ok bool) {
	switch dl.Stage {
	case StageRoute, StagePredict, StageExecute:
		return 0, "", false
	}
	var of struct {
		Step    *int64 `json:"step"`
		GroupID string `json:"group_id"`
	}
	// A payload cut to fit the server is not JSON: its group is unknown.
	if json.Unmarshal([]byte(dl.Payload), &of) != nil || of.Step == nil || of.GroupID == "" {
		return 0, "", false
	}
	return *of.Step, of.GroupID, true
}

// followLetters reads the run's dead letters, from the first retained,
// into p.lettered until ctx ends, checking at each whether the run is
// complete.
func (p *Pipeline) followLetters(ctx context.Context) error {
	r, err := p.reader(ctx, StageArchive, p.dl.subject, 0)
	if err != nil {
		return err
	}
	defer r.Close()
	if err := r.Follow(ctx, func(rec natsjs.Record) {
		var dl schemas.DeadLetter
		if json.Unmarshal(rec.Data, &dl) != nil {
			return
		}
		if step, group, ok := noPairsFor(dl); ok {
			p.lettered.mu.Lock()
			if p.lettered.why == nil {
				p.lettered.why = map[string]string{}
			}
			p.lettered.why[archive.LateKey(step, group)] = dl.Stage + "'s: " + dl.Reason
			p.lettered.mu.Unlock()
			p.finishIfComplete()
		}
	}); err != nil {
		return fmt.Errorf("archive: follow the dead letters: %w", err)
	}
	return nil
}

// lateWaits splits the late anchor groups whose pairs the archive has
// not written into those still to come and those a dead letter holds up,
// with the letters' stages and reasons.
func (p *Pipeline) lateWaits() (coming, held []archive.LateGroup, why []string) {
	pending := p.archiveWriter.PendingLate()
	p.lettered.mu.Lock()
	defer p.lettered.mu.Unlock()
	for _, g := range pending {
		reason, ok := p.lettered.why[archive.LateKey(g.Step, g.GroupID)]
		if !ok {
			coming = append(coming, g)
			continue
		}
		held, why = append(held, g), append(why, reason)
	}
	return coming, held, why
}
