package offline

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/wmrl/wmrl/stages/archive"
)

// rowsOf is src's rows of the world model named model (its predictions'
// model; "" for rows that name none), and the names of the world models
// of every row src gave so far.
func rowsOf(src Rows, model string) (of Rows, seen func() []string) {
	names := map[string]bool{}
	of = rowsWhere(src, "wm_model", func(row archive.Row) bool {
		name := modelOf(row)
		names[name] = true
		return name == model
	})
	return of, func() []string { return slices.Sorted(maps.Keys(names)) }
}

// modelOf is the name of the world model that scored r, "" if it names
// none.
func modelOf(r archive.Row) string {
	if r.WMModel == nil {
		return ""
	}
	return *r.WMModel
}

// modelNames lists names for a message, quoted, "" as what it stands for.
func modelNames(names []string) string {
	out := make([]string, len(names))
	for i, n := range names {
		out[i] = fmt.Sprintf("%q", n)
		if n == "" {
			out[i] = "none named (rows from before wm_model was kept)"
		}
	}
	return strings.Join(out, ", ")
}
