package archive

import (
	"encoding/json"
	"fmt"
	"slices"

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
	// AdvantageNorm is how the rows' advantages were formed within their
	// groups: empty for fuse.Standardize (GRPO, and every archive from
	// before it was kept), so that files of a run that did not change it
	// keep equal settings across an upgrade; fuse.CenterOnly otherwise.
	AdvantageNorm fuse.Normalization `json:"advantage_norm,omitempty"`
	// Build is the wmrl build whose archive stage wrote the file, as
	// wmrl --version says it: the archive stage's own process's, as with
	// the settings above (empty in files from before it was kept).
	// Compaction merges only files of equal settings, so a file's rows
	// are all of one build: a replay on another build that does not
	// reproduce the archive can name the build that wrote it.
	Build string `json:"wmrl_build,omitempty"`
}

// ReadSettings returns the settings recorded in a file.
func ReadSettings(path string) (Settings, error) {
	f, pf, err := openParquet(path, parquet.SkipPageIndex(true))
	if err != nil {
		return Settings{}, err
	}
	defer f.Close()
	return settingsOf(path, pf)
}

func settingsOf(path string, pf *parquet.File) (Settings, error) {
	var s Settings
	v, ok := pf.Lookup(metaSettings)
	if !ok {
		return s, fmt.Errorf("archive: %s records no settings", path)
	}
	if err := json.Unmarshal([]byte(v), &s); err != nil {
		return s, fmt.Errorf("archive: %s: settings: %w", path, err)
	}
	return s, nil
}

// Description is what a run's files say of it in their footers.
type Description struct {
	Rows     int64
	Settings Settings // the newest file's (the last of files)
	// Builds are the builds that wrote the files (Settings.Build), each
	// once, in the order of the files that first record them; "" stands
	// for files from before the build was kept.
	Builds []string
}

// Describe reads the footers of files, in order, once each.
func Describe(files []string) (Description, error) {
	var d Description
	for _, path := range files {
		f, pf, err := openParquet(path, parquet.SkipPageIndex(true))
		if err != nil {
			return d, err
		}
		s, err := settingsOf(path, pf)
		rows := pf.NumRows()
		f.Close()
		if err != nil {
			return d, err
		}
		d.Rows += rows
		d.Settings = s
		if !slices.Contains(d.Builds, s.Build) {
			d.Builds = append(d.Builds, s.Build)
		}
	}
	return d, nil
}
