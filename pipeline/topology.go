package pipeline

import (
	"fmt"
	"os"
	"slices"
	"strings"

	"gopkg.in/yaml.v3"

	"github.com/wmrl/wmrl/schemas"
)

// Stage names.
const (
	StageRoute     = "route"
	StagePredict   = "predict"
	StageExecute   = "execute"
	StagePair      = "pair"
	StageCalibrate = "calibrate"
	StageFuse      = "fuse"
	StageArchive   = "archive"
)

// AllStages in data-flow order.
var AllStages = []string{StageRoute, StagePredict, StageExecute, StagePair, StageCalibrate, StageFuse, StageArchive}

// Ports: which kinds each stage reads and writes.
var (
	stageIn = map[string][]schemas.Kind{
		StageRoute:     {schemas.KindTraj, schemas.KindTrajs, schemas.KindStep},
		StagePredict:   {schemas.KindGroup},
		StageExecute:   {schemas.KindExec},
		StagePair:      {schemas.KindPred, schemas.KindExecution},
		StageCalibrate: {schemas.KindPairs},
		StageFuse:      {schemas.KindPlan, schemas.KindPred, schemas.KindExecution, schemas.KindCalibration},
		StageArchive:   {schemas.KindUpdate, schemas.KindCalibration, schemas.KindExec},
	}
	stageOut = map[string][]schemas.Kind{
		StageRoute:     {schemas.KindGroup, schemas.KindExec, schemas.KindPlan},
		StagePredict:   {schemas.KindPred},
		StageExecute:   {schemas.KindExecution},
		StagePair:      {schemas.KindPairs},
		StageCalibrate: {schemas.KindCalibration},
		StageFuse:      {schemas.KindUpdate},
		StageArchive:   {},
	}
)

// Topology says which subject each stage reads and writes for each kind.
// By default a stage's port for kind K is <prefix>.<run>.K; a topology file
// re-points ports so that an extra stage (any process, any language) can
// sit between two: e.g. predict writes pred_raw, a shaping stage reads it
// and writes pred.
type Topology struct {
	prefix, run string
	ports       map[string]string // "stage/in/kind" or "stage/out/kind" -> subject
}

// topologyFile is the YAML form:
//
//	stages:
//	  predict:
//	    out: {pred: "{prefix}.{run}.pred_raw"}
//
// Subjects may use {prefix} and {run}; they must stay under the prefix.
type topologyFile struct {
	Stages map[string]struct {
		In  map[string]string `yaml:"in"`
		Out map[string]string `yaml:"out"`
	} `yaml:"stages"`
}

// DefaultTopology wires every stage to the standard subjects.
func DefaultTopology(prefix, run string) *Topology {
	return &Topology{prefix: prefix, run: run, ports: map[string]string{}}
}

// LoadTopology reads a YAML topology file over the default one.
func LoadTopology(path, prefix, run string) (*Topology, error) {
	t := DefaultTopology(prefix, run)
	if path == "" {
		return t, nil
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("topology: %w", err)
	}
	var f topologyFile
	dec := yaml.NewDecoder(strings.NewReader(string(raw)))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil {
		return nil, fmt.Errorf("topology %s: %w", path, err)
	}
	for stage, ports := range f.Stages {
		if stageIn[stage] == nil {
			return nil, fmt.Errorf("topology %s: unknown stage %q (stages: %s)", path, stage, strings.Join(AllStages, ", "))
		}
		for dir, m := range map[string]map[string]string{"in": ports.In, "out": ports.Out} {
			allowed := stageIn[stage]
			if dir == "out" {
				allowed = stageOut[stage]
			}
			for kind, subject := range m {
				if !slices.Contains(allowed, schemas.Kind(kind)) {
					return nil, fmt.Errorf("topology %s: stage %s has no %s port %q (it has %v)", path, stage, dir, kind, allowed)
				}
				s := strings.NewReplacer("{prefix}", prefix, "{run}", run).Replace(subject)
				if !strings.HasPrefix(s, prefix+".") || strings.ContainsAny(s, "*> ") {
					return nil, fmt.Errorf("topology %s: %s %s %s: subject %q must be a literal subject under %q", path, stage, dir, kind, s, prefix+".")
				}
				t.ports[stage+"/"+dir+"/"+kind] = s
			}
		}
	}
	// A trainer sends trajectories alone (traj) or several a message
	// (trajs; the gateway does, a group a message): a stage put before
	// route on one of the two would be passed by the other, without a word.
	one, several := t.ports["route/in/"+string(schemas.KindTraj)], t.ports["route/in/"+string(schemas.KindTrajs)]
	if (one == "") != (several == "") {
		set, unset, to := schemas.KindTraj, schemas.KindTrajs, one
		if one == "" {
			set, unset, to = schemas.KindTrajs, schemas.KindTraj, several
		}
		return nil, fmt.Errorf("topology %s: route's %s input is re-pointed (to %q) and its %s input is not: trajectories sent on %s would reach route "+
			"without passing the stage that writes %q (a trainer may send both; the gateway sends a group's trajectories as one %s message); "+
			"re-point route's %s input too, to a subject that stage writes what it reads on %s to",
			path, set, to, unset, schemas.Subject(prefix, run, unset), to, schemas.KindTrajs, unset, schemas.Subject(prefix, run, unset))
	}
	return t, nil
}

// In is the subject stage reads kind from.
func (t *Topology) In(stage string, kind schemas.Kind) string {
	return t.port(stage, "in", kind)
}

// InOr is the subject stage reads kind from when the topology sets it,
// else like's.
func (t *Topology) InOr(stage, like string, kind schemas.Kind) string {
	if s, ok := t.ports[stage+"/in/"+string(kind)]; ok {
		return s
	}
	return t.In(like, kind)
}

// Out is the subject stage writes kind to.
func (t *Topology) Out(stage string, kind schemas.Kind) string {
	return t.port(stage, "out", kind)
}

func (t *Topology) port(stage, dir string, kind schemas.Kind) string {
	if s, ok := t.ports[stage+"/"+dir+"/"+string(kind)]; ok {
		return s
	}
	return schemas.Subject(t.prefix, t.run, kind)
}

// Subject is the standard subject of a kind.
func (t *Topology) Subject(kind schemas.Kind) string { return schemas.Subject(t.prefix, t.run, kind) }
