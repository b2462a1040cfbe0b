package archive

import (
	"encoding/json"
	"fmt"

	"github.com/parquet-go/parquet-go"

	"github.com/wmrl/wmrl/stages/calibrate"
	"github.com/wmrl/wmrl/stages/fuse"
)

const metaSettings = "wmrl.settings"

// Settings are the correction settings of the pipeline that wrote an
// archive, kept in every file's footer so that a replay can reproduce it.
// The archive stage records its own process's settings: run it with the
// same flags as the calibrate and fuse stages.
type Settings struct {
	Debias         bool                     `json:"debias"`
	Debiaser       calibrate.DebiaserConfig `json:"debiaser"`
	Denoiser       fuse.DenoiserConfig      `json:"denoiser"`
	AnchorFraction float64                  `json:"anchor_fraction"`
	AnchorMin      int                      `json:"anchor_min"`
	AnchorRounding string                   `json:"anchor_rounding,omitempty"`
	// AnchorDeadline is --anchor-deadline in seconds, which the audit sets
	// the executions' times against (0 in archives from before it was
	// kept).
	AnchorDeadline float64 `json:"anchor_deadline_seconds,omitempty"`
}

// ReadSettings returns the settings recorded in a file.
func ReadSettings(path string) (Settings, error) {
	var s Settings
	f, pf, err := openParquet(path, parquet.SkipPageIndex(true))
	if err != nil {
		return s, err
	}
	defer f.Close()
	v, ok := pf.Lookup(metaSettings)
	if !ok {
		return s, fmt.Errorf("archive: %s records no settings", path)
	}
	if err := json.Unmarshal([]byte(v), &s); err != nil {
		return s, fmt.Errorf("archive: %s: settings: %w", path, err)
	}
	return s, nil
}
