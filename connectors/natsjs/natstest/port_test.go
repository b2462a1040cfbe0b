package natstest

import "testing"

// TestFreePortNeverRepeats: ports handed out before they are bound must
// differ (2000 draws from 12000 ports repeat one almost surely if drawn
// independently).
func TestFreePortNeverRepeats(t *testing.T) {
	seen := map[int]bool{}
	for range 2000 {
		p := FreePort(t)
		if seen[p] {
			t.Fatalf("port %d handed out twice", p)
		}
		seen[p] = true
	}
}
