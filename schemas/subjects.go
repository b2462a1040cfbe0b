package schemas

import (
	"fmt"
	"regexp"
	"strings"
)

// Version is the "schema" number every message carries.
const Version = 1

// DefaultPrefix is the first token of every subject.
const DefaultPrefix = "wmrl"

// Kind is the last token of a subject: what the messages on it are.
type Kind string

// Public kinds: trainers and external stages depend on these names.
const (
	KindTraj   Kind = "traj"   // in: one Trajectory
	KindTrajs  Kind = "trajs"  // in: a JSON array of Trajectories (a group, or more)
	KindStep   Kind = "step"   // in: a StepClose watermark
	KindUpdate Kind = "update" // out: one Update per step, retained
	KindDLQ    Kind = "dlq"    // dead letters
)

// Internal kinds, under the same prefix. Each message carries a whole group.
const (
	KindGroup       Kind = "group"       // route -> predict: a complete Group
	KindExec        Kind = "exec"        // route -> execute: an anchor Group
	KindPlan        Kind = "plan"        // route -> pair, fuse: a step's Plan
	KindPred        Kind = "pred"        // predict -> pair, fuse: a Prediction
	KindExecution   Kind = "execution"   // execute -> pair, fuse: an Execution
	KindPairs       Kind = "pairs"       // pair -> calibrate: a PairGroup
	KindCalibration Kind = "calibration" // calibrate -> fuse: a Calibration
)

// Kinds lists every kind, public first.
var Kinds = []Kind{KindTraj, KindTrajs, KindStep, KindUpdate, KindDLQ, KindGroup, KindExec, KindPlan, KindPred, KindExecution, KindPairs, KindCalibration}

var tokenRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// ValidToken reports whether s can be a subject token (a prefix or run name):
// letters, digits, '_' and '-', at most 64.
func ValidToken(s string) bool { return tokenRE.MatchString(s) }

// Subject is "<prefix>.<run>.<kind>".
func Subject(prefix, run string, kind Kind) string {
	return prefix + "." + run + "." + string(kind)
}

// ParseSubject splits a subject into prefix, run and kind.
func ParseSubject(subject string) (prefix, run string, kind Kind, err error) {
	parts := strings.Split(subject, ".")
	if len(parts) != 3 {
		return "", "", "", fmt.Errorf("schemas: subject %q: want <prefix>.<run>.<kind>", subject)
	}
	return parts[0], parts[1], Kind(parts[2]), nil
}
