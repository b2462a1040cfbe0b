// Package stepset keeps the steps a stage is done with: a set that stays
// a few ranges however long a run goes on.
package stepset

import (
	"iter"
	"slices"
)

// Set is a set of steps kept as sorted, disjoint, non-adjacent
// ranges. A run's published steps are nearly consecutive (a step fused
// out of order leaves a hole until it is), so a run of days is a few
// ranges, not an entry a step. The zero value is empty.
type Set struct {
	r []stepRange
}

type stepRange struct{ lo, hi int64 } // both included

// find is the index of the first range whose hi >= n.
func (s *Set) find(n int64) int {
	i, _ := slices.BinarySearchFunc(s.r, n, func(r stepRange, n int64) int {
		switch {
		case r.hi < n:
			return -1
		case r.hi > n:
			return 1
		}
		return 0
	})
	return i
}

// Has reports whether n is in the set.
func (s *Set) Has(n int64) bool {
	i := s.find(n)
	return i < len(s.r) && s.r[i].lo <= n
}

// Add puts n in the set.
func (s *Set) Add(n int64) {
	i := s.find(n)
	if i < len(s.r) && s.r[i].lo <= n {
		return
	}
	joinsBefore := i > 0 && s.r[i-1].hi == n-1
	joinsAfter := i < len(s.r) && s.r[i].lo == n+1
	switch {
	case joinsBefore && joinsAfter:
		s.r[i-1].hi = s.r[i].hi
		s.r = slices.Delete(s.r, i, i+1)
	case joinsBefore:
		s.r[i-1].hi = n
	case joinsAfter:
		s.r[i].lo = n
	default:
		s.r = slices.Insert(s.r, i, stepRange{n, n})
	}
}

// Len is the number of steps in the set.
func (s *Set) Len() int64 {
	var n int64
	for _, r := range s.r {
		n += r.hi - r.lo + 1
	}
	return n
}

// All yields the steps in order.
func (s *Set) All() iter.Seq[int64] {
	return func(yield func(int64) bool) {
		for _, r := range s.r {
			for n := r.lo; n <= r.hi; n++ {
				if !yield(n) {
					return
				}
			}
		}
	}
}

// Ranges is the number of ranges the set is kept as.
func (s *Set) Ranges() int { return len(s.r) }
