package offline

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/wmrl/wmrl/stages/archive"
)

// StepRange is the steps From to To, both included: an audit of the
// newest day of a run of a week, or of the steps since a change of prompt.
type StepRange struct {
	From int64 `json:"from"`
	// To is the last step (nil: the newest the archive holds).
	To *int64 `json:"to,omitempty"`
}

// ParseStepRange reads "A-B", "A-" (A and after), "-B" (up to B) or "A"
// (that step alone).
func ParseStepRange(s string) (StepRange, error) {
	bad := func(why string) (StepRange, error) {
		return StepRange{}, fmt.Errorf("steps %q: %s; want FROM-TO, FROM-, -TO or one step (FROM-TO includes both)", s, why)
	}
	from, to, isRange := strings.Cut(strings.TrimSpace(s), "-")
	var r StepRange
	if from != "" {
		n, err := strconv.ParseInt(from, 10, 64)
		if err != nil || n < 0 {
			return bad("the first step is not a step number")
		}
		r.From = n
	}
	if !isRange {
		to = from
	}
	if to != "" {
		n, err := strconv.ParseInt(to, 10, 64)
		if err != nil || n < 0 {
			return bad("the last step is not a step number")
		}
		r.To = &n
	}
	switch {
	case from == "" && to == "":
		return bad("no step")
	case r.To != nil && *r.To < r.From:
		return bad("the last step is before the first")
	}
	return r, nil
}

// Has reports whether step is in r.
func (r StepRange) Has(step int64) bool { return step >= r.From && (r.To == nil || step <= *r.To) }

// String names the steps: "steps 5000 and after", "steps 0 to 2000",
// "step 7".
func (r StepRange) String() string {
	switch {
	case r.To == nil:
		return fmt.Sprintf("steps %d and after", r.From)
	case *r.To == r.From:
		return fmt.Sprintf("step %d", r.From)
	}
	return fmt.Sprintf("steps %d to %d", r.From, *r.To)
}

// rowsIn is src's rows of the steps in r alone. held, once src has been
// read, says which steps src held, in r or not (ok false: none).
func rowsIn(src Rows, r StepRange) (in Rows, held func() (first, last int64, ok bool)) {
	first, last, seen := int64(0), int64(0), false
	in = rowsWhere(src, "step", func(row archive.Row) bool {
		if !seen || row.Step < first {
			first = row.Step
		}
		if !seen || row.Step > last {
			last = row.Step
		}
		seen = true
		return r.Has(row.Step)
	})
	return in, func() (int64, int64, bool) { return first, last, seen }
}

// rowsWhere is src's rows that keep takes, reading column too when src is
// asked for some columns alone. keep sees every row src gives, and may
// note what it saw.
func rowsWhere(src Rows, column string, keep func(archive.Row) bool) Rows {
	return func(columns []string, fn func([]archive.Row) error) error {
		if len(columns) > 0 && !slices.Contains(columns, column) {
			columns = append(slices.Clone(columns), column)
		}
		return src(columns, func(rows []archive.Row) error {
			var kept []archive.Row // fn may keep it (a replay keeps its steps' rows)
			for _, row := range rows {
				if keep(row) {
					kept = append(kept, row)
				}
			}
			switch len(kept) {
			case 0:
				return nil
			case len(rows):
				return fn(rows)
			}
			return fn(kept)
		})
	}
}

// LastSteps is the steps fused in the span d up to the newest update src
// holds: from the first step whose update came within d of the newest
// one, to the newest step (a late anchor's row, stamped when its group
// was calibrated, does not count). It reads src's steps, times and
// sources alone.
func LastSteps(src Rows, d time.Duration) (StepRange, error) {
	type stamp struct {
		step int64
		at   time.Time
	}
	var updates []stamp // the first row of each batch's run of one step: an update's rows share its time
	err := src([]string{"step", "ts", "source"}, func(rows []archive.Row) error {
		for i, r := range rows {
			if r.Source == archive.SourceLateAnchor || i > 0 && rows[i-1].Step == r.Step && rows[i-1].Source != archive.SourceLateAnchor {
				continue
			}
			updates = append(updates, stamp{r.Step, r.TS})
		}
		return nil
	})
	if err != nil {
		return StepRange{}, err
	}
	if len(updates) == 0 {
		return StepRange{}, errors.New("no step fused")
	}
	newest := slices.MaxFunc(updates, func(a, b stamp) int { return a.at.Compare(b.at) }).at
	from := int64(math.MaxInt64)
	for _, u := range updates {
		if !u.at.Before(newest.Add(-d)) {
			from = min(from, u.step)
		}
	}
	return StepRange{From: from}, nil
}
