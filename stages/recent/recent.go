// Package recent keeps the newest entries of a map: what a stage saw
// lately (planned steps, executions, real scores, world-model answers),
// bounded however long a run goes on.
package recent

// Map keeps its newest keys, in the order each was first put, up to a
// bound, forgetting the oldest past it. Not safe for concurrent use: its
// owner holds its own lock.
type Map[K comparable, V any] struct {
	m     map[K]V
	order []K // keys in the order they were first put; order[0] the oldest
	keep  int
}

// New returns a Map that keeps the newest keep keys (none if keep <= 0).
func New[K comparable, V any](keep int) *Map[K, V] {
	return &Map[K, V]{m: map[K]V{}, keep: keep}
}

// Put sets k's value. A key new to the map is its newest, and the
// oldest past the bound is forgotten (k itself if the bound keeps none);
// a key already in it keeps its place.
func (r *Map[K, V]) Put(k K, v V) {
	if _, ok := r.m[k]; ok {
		r.m[k] = v
		return
	}
	r.m[k] = v
	r.order = append(r.order, k)
	for len(r.order) > max(r.keep, 0) {
		var zero K
		delete(r.m, r.order[0])
		r.order[0] = zero // the array outlives the slice until append moves it
		r.order = r.order[1:]
	}
}

// Get returns k's value, and whether k is kept.
func (r *Map[K, V]) Get(k K) (V, bool) {
	v, ok := r.m[k]
	return v, ok
}

// Has reports whether k is kept.
func (r *Map[K, V]) Has(k K) bool {
	_, ok := r.m[k]
	return ok
}

// Len is how many keys are kept.
func (r *Map[K, V]) Len() int { return len(r.m) }
