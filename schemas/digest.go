package schemas

import (
	"crypto/sha256"
	"encoding/binary"
	"io"
)

// Digest names content in 32 bytes: what a long run keeps of solutions
// (the gateway's memory of rewards, execute's outcomes by solution) is
// their digests, not their text. Each part is prefixed with its length, so
// that no two different lists of parts run together alike.
func Digest(parts ...string) [sha256.Size]byte {
	h := sha256.New()
	var n [8]byte
	for _, p := range parts {
		binary.LittleEndian.PutUint64(n[:], uint64(len(p)))
		h.Write(n[:])
		io.WriteString(h, p)
	}
	var d [sha256.Size]byte
	h.Sum(d[:0])
	return d
}
