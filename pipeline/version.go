package pipeline

import (
	"runtime"
	"runtime/debug"
)

// Build is which build of wmrl runs, as the binary records it
// (debug.ReadBuildInfo): the module's version ("(devel)" when built from
// a checkout), the commit with its time and whether the tree had changes
// not committed, and the Go release. A binary built without version
// control stamping (go run, GOFLAGS=-buildvcs=false, a build outside a
// checkout) records no commit.
type Build struct {
	Version, Revision, Time string
	Modified                bool
	Go                      string
}

// ReadBuild is this binary's Build.
func ReadBuild() Build {
	b := Build{Version: "(unknown)", Go: runtime.Version()}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return b
	}
	b.Version = bi.Main.Version
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			b.Revision = s.Value
		case "vcs.time":
			b.Time = s.Value
		case "vcs.modified":
			b.Modified = s.Value == "true"
		}
	}
	return b
}

// String is b for people: "(devel), commit 9492b48c1a2b of
// 2026-12-07T18:10:00Z, with changes not committed, go1.26.8".
func (b Build) String() string {
	s := b.Version
	switch {
	case b.Revision == "":
		s += ", no commit recorded (go run, -buildvcs=false or a build outside a checkout: make build records it)"
	default:
		s += ", commit " + b.Revision[:min(12, len(b.Revision))]
		if b.Time != "" {
			s += " of " + b.Time
		}
		if b.Modified {
			s += ", with changes not committed"
		}
	}
	return s + ", " + b.Go
}
