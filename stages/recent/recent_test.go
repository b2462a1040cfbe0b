package recent

import (
	"math/rand/v2"
	"testing"
)

// A Map keeps the newest keys first put, whatever was put again since,
// against a plain map and list that forget the same way.
func TestAMapKeepsTheNewestKeysFirstPut(t *testing.T) {
	for _, keep := range []int{-1, 0, 1, 3, 50} {
		r := New[int, int](keep)
		want := map[int]int{}
		var order []int
		rng := rand.New(rand.NewPCG(uint64(keep+2), 7))
		for i := range 2000 {
			k, v := rng.IntN(80), i
			if _, ok := want[k]; !ok {
				order = append(order, k)
			}
			want[k] = v
			for len(order) > max(keep, 0) {
				delete(want, order[0])
				order = order[1:]
			}
			r.Put(k, v)
			if r.Len() != len(want) {
				t.Fatalf("keep %d, after %d puts: %d kept, want %d", keep, i+1, r.Len(), len(want))
			}
			for k := range 80 {
				got, ok := r.Get(k)
				if w, wok := want[k]; ok != wok || got != w || r.Has(k) != wok {
					t.Fatalf("keep %d, after %d puts: key %d is %d (kept %v), want %d (kept %v)", keep, i+1, k, got, ok, w, wok)
				}
			}
		}
	}
}

// A key put again keeps its place: it is forgotten when the keys put
// before it first are.
func TestAKeyPutAgainKeepsItsPlace(t *testing.T) {
	r := New[string, int](2)
	r.Put("a", 1)
	r.Put("b", 2)
	r.Put("a", 3) // not newer than b
	if v, _ := r.Get("a"); v != 3 {
		t.Fatalf("a is %d, want 3", v)
	}
	r.Put("c", 4)
	if r.Has("a") || !r.Has("b") || !r.Has("c") {
		t.Fatalf("after c: a %v, b %v, c %v; want a forgotten, b and c kept", r.Has("a"), r.Has("b"), r.Has("c"))
	}
}
