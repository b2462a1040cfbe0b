package fuse

import (
	"cmp"
	"math"
	"slices"

	"gonum.org/v1/gonum/stat"
)

// Spearman is the rank correlation of x and y (average ranks for ties); NaN
// when either side is constant or there are fewer than 2 points.
func Spearman(x, y []float64) float64 {
	if len(x) < 2 {
		return math.NaN()
	}
	rx, ry := ranks(x), ranks(y)
	if stat.Variance(rx, nil) == 0 || stat.Variance(ry, nil) == 0 {
		return math.NaN()
	}
	return stat.Correlation(rx, ry, nil)
}

// AUC is the probability that x of a random positive exceeds x of a random
// negative, ties counting half (the Mann-Whitney form of ROC AUC); NaN when
// either class is empty.
func AUC(x []float64, positive []bool) float64 {
	var rankSum, pos float64
	for i, r := range ranks(x) {
		if positive[i] {
			rankSum += r
			pos++
		}
	}
	neg := float64(len(x)) - pos
	if pos == 0 || neg == 0 {
		return math.NaN()
	}
	return (rankSum - pos*(pos+1)/2) / (pos * neg)
}

func ranks(x []float64) []float64 {
	idx := make([]int, len(x))
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(a, b int) int { return cmp.Compare(x[a], x[b]) })
	r := make([]float64, len(x))
	for i := 0; i < len(idx); {
		j := i
		for j+1 < len(idx) && x[idx[j+1]] == x[idx[i]] {
			j++
		}
		avg := float64(i+j)/2 + 1
		for k := i; k <= j; k++ {
			r[idx[k]] = avg
		}
		i = j + 1
	}
	return r
}

// Kendall is Kendall's tau-b of x and y, in O(n log n) (Knight's
// algorithm: sort by x then y, count discordant pairs by merge sort on y);
// NaN when either side is constant.
func Kendall(x, y []float64) float64 {
	n := len(x)
	if n < 2 {
		return math.NaN()
	}
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(a, b int) int { return cmp.Or(cmp.Compare(x[a], x[b]), cmp.Compare(y[a], y[b])) })
	ys := make([]float64, n)
	for i, k := range idx {
		ys[i] = y[k]
	}
	pairs := int64(n) * int64(n-1) / 2
	// Ties in x, and joint ties in (x, y).
	var tx, txy int64
	for i := 0; i < n; {
		j := i
		for j+1 < n && x[idx[j+1]] == x[idx[i]] {
			j++
		}
		m := int64(j - i + 1)
		tx += m * (m - 1) / 2
		for a := i; a <= j; {
			b := a
			for b+1 <= j && ys[b+1] == ys[a] {
				b++
			}
			l := int64(b - a + 1)
			txy += l * (l - 1) / 2
			a = b + 1
		}
		i = j + 1
	}
	swaps := mergeCount(ys, make([]float64, n))
	// ys is now sorted: ties in y.
	var ty int64
	for i := 0; i < n; {
		j := i
		for j+1 < n && ys[j+1] == ys[i] {
			j++
		}
		m := int64(j - i + 1)
		ty += m * (m - 1) / 2
		i = j + 1
	}
	if tx == pairs || ty == pairs {
		return math.NaN()
	}
	concordMinusDiscord := pairs - tx - ty + txy - 2*swaps
	return float64(concordMinusDiscord) / math.Sqrt(float64(pairs-tx)*float64(pairs-ty))
}

// mergeCount sorts a and returns the number of inversions (pairs i < j
// with a[i] > a[j]).
func mergeCount(a, tmp []float64) int64 {
	n := len(a)
	if n < 2 {
		return 0
	}
	mid := n / 2
	inv := mergeCount(a[:mid], tmp[:mid]) + mergeCount(a[mid:], tmp[mid:])
	i, j, k := 0, mid, 0
	for i < mid && j < n {
		if a[j] < a[i] {
			tmp[k] = a[j]
			inv += int64(mid - i)
			j++
		} else {
			tmp[k] = a[i]
			i++
		}
		k++
	}
	k += copy(tmp[k:], a[i:mid])
	copy(tmp[k:], a[j:])
	copy(a, tmp[:n])
	return inv
}
