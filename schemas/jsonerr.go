package schemas

import (
	stdjson "encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"

	json "github.com/go-json-experiment/json/v1"
)

// ReadableJSON is a JSON decoding error as the author of the message reads
// it: a value of the wrong kind says where it is and what was wanted
// ("field query: want an array of strings, got a number"), not the Go type
// it was to be decoded into. Other errors are returned as they are.
func ReadableJSON(err error) error {
	var where, got string
	var want reflect.Type
	var v1 *json.UnmarshalTypeError     // the messages' decoder
	var std *stdjson.UnmarshalTypeError // encoding/json's
	switch {
	case errors.As(err, &v1) && v1.Type != nil:
		where, got, want = v1.Field, v1.Value, v1.Type
	case errors.As(err, &std) && std.Type != nil:
		where, got, want = std.Field, std.Value, std.Type
	default:
		return err
	}
	if where == "" {
		return fmt.Errorf("want %s, got %s", writtenAs(want), article(got))
	}
	return fmt.Errorf("field %s: want %s, got %s", where, writtenAs(want), article(got))
}

// RawTrajectories is a JSON array of trajectories, each kept as it was
// written so that a bad one is refused alone. Either decoder takes it, and
// ReadableJSON names it: "want an array of trajectories, got an object".
type RawTrajectories []json.RawMessage

// writtenAs says in JSON's words how a value of Go type t is written: "an
// object", "an array of strings".
func writtenAs(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch {
	case t == reflect.TypeFor[RawTrajectories]():
		return "an array of trajectories"
	case t.Kind() == reflect.Slice && !isRaw(t):
		return "an array of " + pluralOf(t.Elem())
	case t.Kind() == reflect.Struct || t.Kind() == reflect.Map:
		return "an object"
	}
	return article(strings.TrimSuffix(pluralOf(t), "s"))
}

// pluralOf names values of Go type t in JSON's words, plural.
func pluralOf(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Slice, reflect.Array:
		if isRaw(t) {
			return "JSON values"
		}
		return "arrays"
	case reflect.Struct, reflect.Map:
		return "objects"
	case reflect.String:
		return "strings"
	case reflect.Bool:
		return "booleans"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "integers"
	case reflect.Float32, reflect.Float64:
		return "numbers"
	}
	return "JSON values"
}

// article puts "a" or "an" before a noun.
func article(noun string) string {
	if noun != "" && strings.ContainsRune("aeiou", rune(noun[0])) {
		return "an " + noun
	}
	return "a " + noun
}

// isRaw says whether t holds any JSON value as it was written.
func isRaw(t reflect.Type) bool {
	return t == reflect.TypeFor[json.RawMessage]() || t == reflect.TypeFor[stdjson.RawMessage]()
}
