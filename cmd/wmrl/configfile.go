package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/spf13/pflag"
	"gopkg.in/yaml.v3"
)

// configFlag names the YAML file of settings a command reads before it
// runs: a mapping of the command's flags, named without their dashes, to
// their values. A flag given on the command line wins over the file, so a
// job's settings live in one file that every restart reads alike, and a
// one-off change goes on the command line.
const configFlag = "config"

// applyConfigFile sets the flags of fs (command's) that path names and the
// command line did not. Errors name the file, the line and the setting.
func applyConfigFile(fs *pflag.FlagSet, command, path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("--%s: %w", configFlag, err)
	}
	var doc yaml.Node
	if err := yaml.NewDecoder(bytes.NewReader(b)).Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil // an empty file sets nothing
		}
		return fmt.Errorf("--%s %s: %w", configFlag, path, err)
	}
	root := &doc
	if root.Kind == yaml.DocumentNode && len(root.Content) == 1 {
		root = root.Content[0]
	}
	if root.Kind != yaml.MappingNode {
		return fmt.Errorf("--%s %s:%d: want a mapping of settings (name: value), got a %s", configFlag, path, root.Line, kindName(root.Kind))
	}
	seen := map[string]int{}
	for i := 0; i+1 < len(root.Content); i += 2 {
		k, v := root.Content[i], root.Content[i+1]
		at := fmt.Sprintf("--%s %s:%d", configFlag, path, k.Line)
		name := strings.ReplaceAll(k.Value, "_", "-") // anchor_fraction as in a Python config
		if line, again := seen[name]; again {
			return fmt.Errorf("%s: %q is set already on line %d", at, k.Value, line)
		}
		seen[name] = k.Line
		f := fs.Lookup(name)
		if f == nil || name == configFlag || name == "help" {
			return fmt.Errorf("%s: %s has no setting %q%s", at, command, k.Value, suggest(fs, name))
		}
		if f.Changed {
			continue // the command line wins
		}
		values, err := valuesOf(v, f)
		if err != nil {
			return fmt.Errorf("%s: %s: %w", at, k.Value, err)
		}
		for _, s := range values {
			if err := fs.Set(name, s); err != nil {
				return fmt.Errorf("%s: %s: %w", at, k.Value, err)
			}
		}
	}
	return nil
}

// valuesOf is what v sets f to: a scalar as it is written, or for a flag
// that is given once per value (exec-env) or takes a list, a sequence.
func valuesOf(v *yaml.Node, f *pflag.Flag) ([]string, error) {
	list := strings.HasSuffix(f.Value.Type(), "Slice") || strings.HasSuffix(f.Value.Type(), "Array")
	switch {
	case v.Kind == yaml.ScalarNode && v.Tag == "!!null":
		return nil, errors.New("no value: give one, or leave the setting out for the default")
	case v.Kind == yaml.ScalarNode:
		return []string{v.Value}, nil
	case v.Kind == yaml.SequenceNode && list:
		var out []string
		for _, e := range v.Content {
			if e.Kind != yaml.ScalarNode {
				return nil, fmt.Errorf("line %d: want a list of values, got a %s in it", e.Line, kindName(e.Kind))
			}
			out = append(out, e.Value)
		}
		return out, nil
	case v.Kind == yaml.SequenceNode:
		return nil, errors.New("takes one value, not a list")
	}
	return nil, fmt.Errorf("want a value, got a %s", kindName(v.Kind))
}

func kindName(k yaml.Kind) string {
	switch k {
	case yaml.MappingNode:
		return "mapping"
	case yaml.SequenceNode:
		return "list"
	case yaml.ScalarNode:
		return "value"
	case yaml.AliasNode:
		return "alias"
	}
	return "document"
}

// suggest names the command's flag closest to name, if one is close.
func suggest(fs *pflag.FlagSet, name string) string {
	best, dist := "", 4
	fs.VisitAll(func(f *pflag.Flag) {
		if d := editDistance(name, f.Name); d < dist && f.Name != configFlag {
			best, dist = f.Name, d
		}
	})
	if best == "" {
		return ""
	}
	return fmt.Sprintf(" (did you mean %q?)", best)
}

// editDistance is Levenshtein's distance between a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			sub := prev[j-1]
			if a[i-1] != b[j-1] {
				sub++
			}
			cur[j] = slices.Min([]int{prev[j] + 1, cur[j-1] + 1, sub})
		}
		prev = cur
	}
	return prev[len(b)]
}
