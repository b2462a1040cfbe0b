package natsjs

import (
	"fmt"
	"strings"
	"syscall"

	"github.com/nats-io/nats-server/v2/server"
)

// DiskRoom is the free room of the disk under dir, to a process that is
// not root, and the disk's size, in bytes.
func DiskRoom(dir string) (free, size int64, err error) {
	var fs syscall.Statfs_t
	if err := syscall.Statfs(dir, &fs); err != nil {
		return 0, 0, fmt.Errorf("natsjs: room on the disk of %s: %w", dir, err)
	}
	return int64(fs.Bavail) * fs.Bsize, int64(fs.Blocks) * fs.Bsize, nil
}

// StoreLimit is the most file storage the server's JetStream takes: the
// bound it was started with, or, without one, what FollowDisk set last.
func (s *Server) StoreLimit() int64 {
	if s.follows {
		return s.followed.Load()
	}
	return s.ns.JetStreamConfig().MaxStore
}

// FollowDisk sets the store's limit of a server started without a bound
// to three quarters of what the disk now gives the store: what it holds
// and free, the disk's free room. nats-server sets its own so once, at its
// start, and keeps it: a store full on a disk short of room at the start
// stayed full after room was made, until a restart, and one whose disk
// other writers (a trainer's checkpoints) filled failed to write its own
// files, which may turn JetStream off, instead of refusing messages for
// want of room, which the pipeline waits out. It returns the limit and
// the one before; a server started with a bound keeps it.
func (s *Server) FollowDisk(free int64) (limit, before int64, err error) {
	before = s.StoreLimit()
	if !s.follows {
		return before, before, nil
	}
	limit = (max(free, 0) + s.StoreUsed()) / 4 * 3
	if d := limit - before; before > 0 && max(d, -d) < max(before>>8, 1<<20) {
		return before, before, nil // not worth a change of the account's limits
	}
	if err := s.LimitAccountStore(limit); err != nil {
		return before, before, err
	}
	s.followed.Store(limit)
	return limit, before, nil
}

// Broken says why the server can store nothing more until it is started
// again, or "" while it can: a stream that met a write error (a single
// node's answer to a full disk: every write after it goes unanswered, room
// made or not), or JetStream turned off (a cluster node's).
func (s *Server) Broken() string {
	if !s.ns.JetStreamEnabled() {
		return "JetStream is off"
	}
	for _, e := range s.ns.Healthz(&server.HealthzOptions{Details: true}).Errors {
		if strings.Contains(e.Error, "write error") {
			return e.Error
		}
	}
	return ""
}

// NATS is the nats-server the Server runs, for what this package does not
// wrap (a test turning JetStream off, as a cluster node does on a full
// disk).
func (s *Server) NATS() *server.Server { return s.ns }

// StoreUsed is what the store holds, in bytes, as the account's use.
func (s *Server) StoreUsed() int64 { return int64(s.ns.GlobalAccount().JetStreamUsage().Store) }

// LimitAccountStore sets the JetStream file store limit of the account
// the server's clients use to bytes, -1 for none, as an operator's
// account limit (`max_file`) does on a shared server: writes past it are
// refused ("resource limits exceeded for account") until it is raised.
// Clients read it in their account's info, where the server's own limit
// does not show: StartServer sets it to the store's. It also rehearses a
// full store (deploy/chaos) without filling a disk.
func (s *Server) LimitAccountStore(bytes int64) error {
	set := func(bytes int64) error {
		limits := server.JetStreamAccountLimits{MaxMemory: -1, MaxStore: bytes, MaxStreams: -1, MaxConsumers: -1,
			MaxAckPending: -1, MemoryMaxStreamBytes: -1, StoreMaxStreamBytes: -1} // the server's dynamic limits, but the store's
		return s.ns.GlobalAccount().UpdateJetStreamLimits(map[string]server.JetStreamAccountLimits{"": limits})
	}
	// From unlimited (-1) the server counts a change to the whole store as
	// one byte more than there is, and refuses it; from 0 it does not. The
	// way through 0 is taken only then: meanwhile every write is refused.
	err := set(bytes)
	if err != nil && bytes != 0 {
		if err = set(0); err == nil {
			err = set(bytes)
		}
	}
	if err != nil {
		return fmt.Errorf("natsjs: account store limit %d: %w", bytes, err)
	}
	return nil
}
