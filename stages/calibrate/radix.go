package calibrate

import (
	"cmp"
	"math"
	"slices"
)

// sortPoints orders points by x, then y (numpy's lexsort((y, x))), as the
// comparison sort would, in O(n): a stable least-significant-digit radix
// sort on x's bits, then a small comparison sort inside each run of equal x.
// Below a few hundred points the comparison sort is faster and is used.
func sortPoints(pts []point) {
	if len(pts) < 256 {
		slices.SortFunc(pts, comparePoints)
		return
	}
	keys := make([]uint64, len(pts))
	for i, p := range pts {
		keys[i] = floatKey(p.x)
	}
	tmpKeys := make([]uint64, len(pts))
	tmpPts := make([]point, len(pts))
	var count [256]int
	for shift := uint(0); shift < 64; shift += 8 {
		clear(count[:])
		for _, k := range keys {
			count[byte(k>>shift)]++
		}
		if count[byte(keys[0]>>shift)] == len(keys) {
			continue // every key shares this byte: nothing to move
		}
		sum := 0
		for b, c := range count {
			count[b] = sum
			sum += c
		}
		for i, k := range keys {
			b := byte(k >> shift)
			tmpKeys[count[b]] = k
			tmpPts[count[b]] = pts[i]
			count[b]++
		}
		keys, tmpKeys = tmpKeys, keys
		copy(pts, tmpPts)
	}
	for i := 0; i < len(pts); {
		j := i + 1
		for j < len(pts) && keys[j] == keys[i] {
			j++
		}
		if j-i > 1 {
			slices.SortFunc(pts[i:j], comparePoints)
		}
		i = j
	}
}

func comparePoints(a, b point) int {
	if c := cmp.Compare(a.x, b.x); c != 0 {
		return c
	}
	return cmp.Compare(a.y, b.y)
}

// floatKey maps a finite float64 to a uint64 of the same order (-0 and +0
// are equal, as they compare).
func floatKey(f float64) uint64 {
	if f == 0 {
		f = 0 // fold -0 into +0
	}
	u := math.Float64bits(f)
	if u>>63 == 1 {
		return ^u
	}
	return u | 1<<63
}
