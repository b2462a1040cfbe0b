// Package offlinetest reads back, for tests, the files the offline
// commands write (the plots of replay, audit and wm-eval).
package offlinetest

import (
	"image"
	"image/png"
	"os"
	"testing"
)

// DecodePNG reads the PNG at path, failing t if there is none.
func DecodePNG(t testing.TB, path string) image.Image {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("%s is no PNG: %v", path, err)
	}
	return img
}
