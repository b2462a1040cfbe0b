//go:build !linux

package natsjs

// pidSpace is "" off Linux: a lease lapses TTL after its holder's last
// renewal, whether or not the holder still runs.
func pidSpace() string { return "" }

func (h Holder) ended() bool { return false }
