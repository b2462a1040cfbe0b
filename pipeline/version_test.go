package pipeline

import "testing"

// A build says its commit, shortened, with its time and whether the tree
// had changes; one that records no commit says why and how to get one.
func TestABuildSaysWhichCommitItIs(t *testing.T) {
	for _, tc := range []struct {
		b    Build
		want string
	}{
		{Build{Version: "(devel)", Revision: "9492b48c1a2b3c4d5e6f", Time: "2026-12-07T18:10:00Z", Go: "go1.26.8"},
			"(devel), commit 9492b48c1a2b of 2026-12-07T18:10:00Z, go1.26.8"},
		{Build{Version: "v0.3.0", Revision: "abc", Modified: true, Go: "go1.26.8"}, "v0.3.0, commit abc, with changes not committed, go1.26.8"},
		{Build{Version: "(devel)", Go: "go1.26.8"},
			"(devel), no commit recorded (go run, -buildvcs=false or a build outside a checkout: make build records it), go1.26.8"},
	} {
		if got := tc.b.String(); got != tc.want {
			t.Errorf("%+v: %q, want %q", tc.b, got, tc.want)
		}
	}
}
