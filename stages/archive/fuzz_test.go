package archive

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// FuzzReadADamagedFile: an archive file whose bytes changed on disk is
// read whole, or refused with an error naming it; never a panic, which
// ended the process reading it (an audit, a replay, the archive stage at
// its start, again at every restart). The seed is a file the writer made;
// the fuzzer changes its bytes. Run it longer with make fuzz.
func FuzzReadADamagedFile(f *testing.F) {
	dir := f.TempDir()
	w, err := OpenWriter(WriterConfig{Dir: dir, Run: "r", MaxRows: 1 << 20, MaxAge: time.Hour})
	if err != nil {
		f.Fatal(err)
	}
	for step := range int64(3) {
		rows, _ := FromUpdate(testUpdate(step))
		if _, err := w.Add(UpdateKey(step), rows, nil); err != nil {
			f.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		f.Fatal(err)
	}
	files, err := Files(dir, "r")
	if err != nil || len(files) != 1 {
		f.Fatalf("files %v: %v", files, err)
	}
	good, err := os.ReadFile(files[0])
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	f.Add(good[:len(good)/2])
	f.Fuzz(func(t *testing.T, b []byte) {
		path := filepath.Join(t.TempDir(), "part-000000000000.parquet")
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
		for what, read := range map[string]func() error{
			"Read":         func() error { _, err := Read([]string{path}, nil); return err },
			"Scan":         func() error { return Scan([]string{path}, func([]Row) error { return nil }) },
			"ReadSettings": func() error { _, err := ReadSettings(path); return err },
			"readMeta":     func() error { _, _, _, err := readMeta(path); return err },
		} {
			if err := read(); err != nil && !strings.Contains(err.Error(), "part-000000000000.parquet") {
				t.Fatalf("%s: %v does not name the file", what, err)
			}
		}
	})
}

// One-byte changes all over a file the writer made: each read gives the
// rows or an error naming the file, and those past what the parquet reader
// survives (the page index's offsets pointing past its end, say) are
// ErrDamaged, saying what to do. Before, the reader's panic ended the
// process; and a footer whose row group held more rows than the file
// sent the read out of bounds (change 880, once the rows had two more
// columns).
func TestADamagedFileIsRefusedNotCrashedOn(t *testing.T) {
	dir := t.TempDir()
	w, err := OpenWriter(WriterConfig{Dir: dir, Run: "r", MaxRows: 1 << 20, MaxAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	rows, _ := FromUpdate(testUpdate(0))
	w.Add(UpdateKey(0), rows, nil)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	files, _ := Files(dir, "r")
	good, _ := os.ReadFile(files[0])
	path := filepath.Join(t.TempDir(), "part-000000000000.parquet")
	refused, damagedOnes := 0, 0
	for i := range 1500 {
		b := append([]byte(nil), good...)
		b[(i*7919)%len(b)] ^= byte(1 + i%255)
		os.WriteFile(path, b, 0o644)
		_, err := Read([]string{path}, nil)
		switch {
		case err == nil:
		case !strings.Contains(err.Error(), "part-000000000000.parquet"):
			t.Fatalf("change %d: %v does not name the file", i, err)
		case errors.Is(err, ErrDamaged) && !strings.Contains(err.Error(), "part-000000000000.parquet: damaged: ") ||
			errors.Is(err, ErrDamaged) && !strings.Contains(err.Error(), "move it out of"):
			t.Fatalf("change %d: %v", i, err)
		case errors.Is(err, ErrDamaged):
			damagedOnes++
			fallthrough
		default:
			refused++
		}
	}
	t.Logf("of 1500 one-byte changes, %d refused, %d of them as damaged", refused, damagedOnes)
}
