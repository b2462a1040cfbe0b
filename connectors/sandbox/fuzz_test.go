package sandbox

import (
	"errors"
	"strings"
	"testing"
)

// FuzzGrade: a submission is whatever the agent's code wrote. It grades to
// a leaderboard position in (0, 1] or is refused as ErrInvalidSubmission
// (an invalid_submission, scored 0, saying why); never a panic, which
// would take down the execute stage with the group of every trajectory
// in it. Run it longer with make fuzz.
func FuzzGrade(f *testing.F) {
	task := housing(f)
	var good strings.Builder
	good.WriteString("id,price\n")
	for id := range task.answers {
		good.WriteString(id + ",200000\n")
	}
	for _, seed := range []string{good.String(), "id,price\n1000,1\n", "id,price\n1000,NaN\n", "id,price\n1000,1e400\n",
		"\"id\",\"price\"\n\"1000\",\"1\"\"\n", "price,id\n", "", "\xff\xfe", "id\n1000\n", "id,price,id\n1000,1,1000\n"} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, sub []byte) {
		score, err := task.Grade(sub)
		switch {
		case err != nil && !errors.Is(err, ErrInvalidSubmission):
			t.Fatalf("%v is not ErrInvalidSubmission", err)
		case err == nil && !(score > 0 && score <= 1):
			t.Fatalf("graded %v", score)
		}
	})
}
