//go:build !unix

package natstest

// reserve claims nothing where there are no file locks: ports are handed
// out once per process only.
func reserve(int) bool { return true }
