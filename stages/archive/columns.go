package archive

import (
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/parquet-go/parquet-go"
)

// The archive is read column by column: parquet-go's row reader rebuilds
// each row through reflection, at about 0.5M rows/s here, while decoding a
// column's pages into a row group's rows runs several times faster.

// column decodes one leaf column into rows; back supplies the row group's
// storage for optional floats (one allocation per column, not per value).
type column struct {
	name string
	set  func(rows []Row, i int, v parquet.Value, c *colState)
}

type colState struct {
	floats []float64
	ints   []int64
	strs   map[string]string // interned values of a low-cardinality column
	texts  []string          // the row group's storage for optional strings
}

func (c *colState) float(i int, v parquet.Value) *float64 {
	if v.IsNull() {
		return nil
	}
	c.floats[i] = v.Double()
	return &c.floats[i]
}

func (c *colState) int(i int, v parquet.Value) *int64 {
	if v.IsNull() {
		return nil
	}
	c.ints[i] = v.Int64()
	return &c.ints[i]
}

// text is an optional string column's value for row i (nil when null),
// interned for a column of few values.
func (c *colState) text(i int, v parquet.Value, intern bool) *string {
	switch {
	case v.IsNull():
		return nil
	case intern:
		c.texts[i] = c.intern(v)
	default:
		c.texts[i] = string(v.ByteArray())
	}
	return &c.texts[i]
}

func (c *colState) intern(v parquet.Value) string {
	b := v.ByteArray()
	if s, ok := c.strs[string(b)]; ok {
		return s
	}
	s := string(b)
	c.strs[s] = s
	return s
}

var columns = []column{
	{"step", func(r []Row, i int, v parquet.Value, _ *colState) { r[i].Step = v.Int64() }},
	{"group_id", func(r []Row, i int, v parquet.Value, _ *colState) { r[i].GroupID = string(v.ByteArray()) }},
	{"traj_id", func(r []Row, i int, v parquet.Value, _ *colState) { r[i].TrajID = string(v.ByteArray()) }},
	{"task_id", func(r []Row, i int, v parquet.Value, c *colState) { r[i].TaskID = c.intern(v) }},
	{"policy_version", func(r []Row, i int, v parquet.Value, _ *colState) { r[i].PolicyVersion = v.Int64() }},
	{"is_anchor", func(r []Row, i int, v parquet.Value, _ *colState) { r[i].IsAnchor = v.Boolean() }},
	{"predicted", func(r []Row, i int, v parquet.Value, c *colState) { r[i].Predicted = c.float(i, v) }},
	{"true_score", func(r []Row, i int, v parquet.Value, c *colState) { r[i].TrueScore = c.float(i, v) }},
	{"calibrated", func(r []Row, i int, v parquet.Value, c *colState) { r[i].Calibrated = c.float(i, v) }},
	{"calibration_version", func(r []Row, i int, v parquet.Value, _ *colState) { r[i].CalibrationVersion = v.Int64() }},
	{"reward", func(r []Row, i int, v parquet.Value, c *colState) { r[i].Reward = c.float(i, v) }},
	{"advantage", func(r []Row, i int, v parquet.Value, _ *colState) { r[i].Advantage = v.Double() }},
	{"weight", func(r []Row, i int, v parquet.Value, _ *colState) { r[i].Weight = v.Double() }},
	{"fused_advantage", func(r []Row, i int, v parquet.Value, _ *colState) { r[i].FusedAdvantage = v.Double() }},
	{"rho", func(r []Row, i int, v parquet.Value, _ *colState) { r[i].Rho = v.Double() }},
	{"source", func(r []Row, i int, v parquet.Value, c *colState) { r[i].Source = c.intern(v) }},
	{"wm_status", func(r []Row, i int, v parquet.Value, c *colState) { r[i].WMStatus = c.intern(v) }},
	{"exec_status", func(r []Row, i int, v parquet.Value, c *colState) { r[i].ExecStatus = c.text(i, v, true) }},
	{"exec_seconds", func(r []Row, i int, v parquet.Value, c *colState) { r[i].ExecSeconds = c.float(i, v) }},
	{"ts", func(r []Row, i int, v parquet.Value, _ *colState) { r[i].TS = time.UnixMicro(v.Int64()).UTC() }},
	{"calibration_seq", func(r []Row, i int, v parquet.Value, _ *colState) { r[i].CalibrationSeq = v.Int64() }},
	{"absorbed_seq", func(r []Row, i int, v parquet.Value, _ *colState) { r[i].AbsorbedSeq = v.Int64() }},
	{"d", func(r []Row, i int, v parquet.Value, _ *colState) { r[i].D = v.Double() }},
	{"exec_detail", func(r []Row, i int, v parquet.Value, c *colState) { r[i].ExecDetail = c.text(i, v, false) }},
	{"wm_verdict", func(r []Row, i int, v parquet.Value, c *colState) { r[i].WMVerdict = c.text(i, v, true) }},
	{"wm_rationale", func(r []Row, i int, v parquet.Value, c *colState) { r[i].WMRationale = c.text(i, v, false) }},
	{"prompt", func(r []Row, i int, v parquet.Value, c *colState) { r[i].Prompt = c.text(i, v, false) }},
	{"response", func(r []Row, i int, v parquet.Value, c *colState) { r[i].Response = c.text(i, v, false) }},
	{"response_bytes", func(r []Row, i int, v parquet.Value, c *colState) { r[i].ResponseBytes = c.int(i, v) }},
	{"exec_copy_of", func(r []Row, i int, v parquet.Value, c *colState) { r[i].ExecCopyOf = c.text(i, v, false) }},
	{"exec_copy_step", func(r []Row, i int, v parquet.Value, c *colState) { r[i].ExecCopyStep = c.int(i, v) }},
	{"exec_copy_group", func(r []Row, i int, v parquet.Value, c *colState) { r[i].ExecCopyGroup = c.text(i, v, false) }},
	{"wm_model", func(r []Row, i int, v parquet.Value, c *colState) { r[i].WMModel = c.text(i, v, true) }},
}

// codeColumns hold the anchors' trajectories: kilobytes a row where the
// other columns hold bytes, and nothing replay or the audit computes on,
// so Read leaves them out and Scan (a merge) keeps them.
var codeColumns = map[string]bool{"prompt": true, "response": true}

// laterColumns were added to Row after archives were first written: a file
// without one reads it as null (its zero value), and a merge (Compact)
// rewrites such a file with the column.
var laterColumns = map[string]bool{"exec_detail": true, "wm_verdict": true, "wm_rationale": true, "prompt": true, "response": true, "response_bytes": true, "exec_copy_of": true,
	"exec_copy_step": true, "exec_copy_group": true, "wm_model": true}

// missingColumns lists the later columns schema lacks.
func missingColumns(schema *parquet.Schema) []string {
	var missing []string
	for _, col := range columns {
		if _, ok := schema.Lookup(col.name); !ok && laterColumns[col.name] {
			missing = append(missing, col.name)
		}
	}
	return missing
}

// readRowGroup decodes a row group into rows, which must hold exactly its
// rows (they may be kept); the columns skip names are left at their zero
// values.
func readRowGroup(pf *parquet.File, rg parquet.RowGroup, vals []parquet.Value, rows []Row, skip func(column string) bool) error {
	n := int(rg.NumRows())
	if len(rows) != n {
		return fmt.Errorf("row group of %d rows decoded into %d", n, len(rows))
	}
	chunks := rg.ColumnChunks()
	for _, col := range columns {
		if skip(col.name) {
			continue
		}
		leaf, ok := pf.Schema().Lookup(col.name)
		if !ok && !laterColumns[col.name] {
			return fmt.Errorf("no column %q", col.name)
		}
		st := &colState{}
		switch col.name {
		case "predicted", "true_score", "calibrated", "reward", "exec_seconds":
			st.floats = make([]float64, n)
		case "response_bytes", "exec_copy_step":
			st.ints = make([]int64, n)
		case "exec_status", "wm_verdict", "wm_model":
			st.texts = make([]string, n)
			st.strs = map[string]string{}
		case "exec_detail", "wm_rationale", "prompt", "response", "exec_copy_of", "exec_copy_group":
			st.texts = make([]string, n)
		default:
			st.strs = map[string]string{}
		}
		if !ok { // a file from before the column: null throughout
			for i := range rows {
				col.set(rows, i, parquet.NullValue(), st)
			}
			continue
		}
		pages := chunks[leaf.ColumnIndex].Pages()
		i := 0
		for {
			p, err := pages.ReadPage()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				pages.Close()
				return fmt.Errorf("column %s: %w", col.name, err)
			}
			r := p.Values()
			for {
				k, err := r.ReadValues(vals)
				for _, v := range vals[:k] {
					if i >= n {
						pages.Close()
						return fmt.Errorf("column %s has more values than the row group's %d rows", col.name, n)
					}
					col.set(rows, i, v, st)
					i++
				}
				if errors.Is(err, io.EOF) {
					break
				}
				if err != nil {
					pages.Close()
					return fmt.Errorf("column %s: %w", col.name, err)
				}
			}
			parquet.Release(p)
		}
		pages.Close()
		if i != n {
			return fmt.Errorf("column %s has %d values for %d rows", col.name, i, n)
		}
	}
	return nil
}
