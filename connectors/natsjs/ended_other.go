//go:build !linux

package natsjs

// pidSpace is "" off Linux: a lease lapses TTL after its holder's last
// renewal, whether or not the holder still runs.
func pidSpace() string { return "" }

// Ended is false off Linux: whether the holder runs cannot be told.
func (h Holder) Ended() bool { return false }
