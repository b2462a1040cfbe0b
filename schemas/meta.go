package schemas

import (
	"bytes"
	"encoding/json"
	"fmt"
	"unicode/utf8"

	"github.com/go-json-experiment/json/jsontext"
)

// Meta is a trajectory's meta object as its trainer sent it: raw JSON,
// passed on by every stage as it came. Decoded into Go values, as it
// was until this type, its integers past 2^53 (a 64-bit sample id, a
// hash) came out rounded on every subject after the trainer's
// (12345678901234567890 as 12345678901234567000), and every hop decoded
// and encoded the whole object again. A stage that needs a field reads
// it with Get. Empty (absent or null on the wire) it is left out.
type Meta []byte

// NewMeta encodes fields as a Meta (nil for none).
func NewMeta(fields map[string]any) (Meta, error) {
	if len(fields) == 0 {
		return nil, nil
	}
	b, err := json.Marshal(fields)
	if err != nil {
		return nil, fmt.Errorf("schemas: meta: %w", err)
	}
	return b, nil
}

// MarshalJSON writes m as it came; empty, as null.
func (m Meta) MarshalJSON() ([]byte, error) {
	if len(m) == 0 {
		return []byte("null"), nil
	}
	return m, nil
}

// UnmarshalJSON keeps a copy of b, which must be an object or null. A
// string with bytes that are not UTF-8 has them replaced, as decoding
// a string anywhere else in a message does, so that no stage sends on
// what a reader in another language would refuse.
func (m *Meta) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	switch {
	case len(b) == 0 || string(b) == "null":
		*m = nil
		return nil
	case b[0] != '{':
		return fmt.Errorf("meta is %s, want an object", jsonKind(b[0]))
	case !utf8.Valid(b):
		var v map[string]any
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.UseNumber()
		if err := dec.Decode(&v); err != nil {
			return fmt.Errorf("meta: %w", err)
		}
		out, err := json.Marshal(v)
		if err != nil {
			return fmt.Errorf("meta: %w", err)
		}
		*m = out
		return nil
	}
	// Escaped as encoding/json escapes every string it writes (<, >, &,
	// U+2028, U+2029), so that the meta is the same bytes on every subject
	// after the first.
	var out bytes.Buffer
	out.Grow(len(b))
	json.HTMLEscape(&out, b)
	*m = out.Bytes()
	return nil
}

// Get decodes the field key of m into v (encoding/json's rules; of a
// name given twice, the last), reporting whether m has it. It reads past
// the other fields without decoding them: the simulator asks for a field
// of every trajectory.
func (m Meta) Get(key string, v any) (bool, error) {
	if len(m) == 0 {
		return false, nil
	}
	dec := jsontext.NewDecoder(bytes.NewReader(m), jsontext.AllowDuplicateNames(true), jsontext.AllowInvalidUTF8(true))
	tok, err := dec.ReadToken()
	if err != nil {
		return false, fmt.Errorf("meta: %w", err)
	}
	if tok.Kind() != '{' {
		return false, fmt.Errorf("meta is %s, want an object", jsonKind(byte(tok.Kind())))
	}
	var raw jsontext.Value
	for dec.PeekKind() == '"' {
		name, err := dec.ReadToken()
		if err != nil {
			return false, fmt.Errorf("meta: %w", err)
		}
		if name.String() != key {
			err = dec.SkipValue()
		} else if raw, err = dec.ReadValue(); err == nil {
			raw = bytes.Clone(raw) // valid only until the next read
		}
		if err != nil {
			return false, fmt.Errorf("meta: %w", err)
		}
	}
	if raw == nil {
		return false, nil
	}
	if err := json.Unmarshal(raw, v); err != nil {
		return true, fmt.Errorf("meta %s: %w", key, err)
	}
	return true, nil
}

func jsonKind(first byte) string {
	switch first {
	case '[':
		return "an array"
	case '"':
		return "a string"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	default:
		return "a number"
	}
}
