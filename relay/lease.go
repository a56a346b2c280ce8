package relay

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/store"
)

// Partition leases and fair sharing.
//
// A partition's lease is a session-level advisory lock held on the relay's dedicated lease
// connection, on which the relay also claims and settles: when the connection dies, the leases
// and the relay's ability to claim die together, and another relay can take the partitions at
// its next lease round.
//
// Relays share the partitions fairly. Each relay keeps a row in txoutbox_relays (migration 002),
// refreshed every lease round on the lease connection, which records that session's backend pid.
// A member is alive while that backend exists in pg_stat_activity (so a SIGKILLed relay stops
// counting at the same moment its locks are released) and its heartbeat is recent. Who holds
// what is read from pg_locks, never from the table.
//
// Every round each relay computes the shares from the same data: the alive members, ordered by
// start time, get floor(P/N) partitions each and the first P mod N one more. A relay below its
// share takes free partitions; a relay above its share releases its extra partitions, but only
// while another member is below its own share (someone is waiting for them), so nothing is
// released that nobody would take. Rounds run when the relay claims (the previous batch may
// still be publishing: its old holder finishes and settles it, so two relays may publish the
// same rows for a moment) or sleeps. Because a key's messages are published one after another
// (the next only after the previous PubAck, whoever sent it) and deduplicated by Nats-Msg-Id,
// order per key holds across a handover and the overlap costs only duplicate PubAcks.
//
// Relays configured with different partition counts would publish one key from two relays at
// once. A relay that finds a live member with another count at its first round refuses to run
// (ErrPartitionMismatch); one that finds such a member later logs an error and reports it.

// ErrPartitionMismatch: live relays of this outbox are configured with a different
// Config.Partitions. To change the partition count, stop every relay first.
var ErrPartitionMismatch = errors.New("relay: relays disagree on the partition count")

// PartitionMismatchError names the relays whose partition count differs from this one's.
type PartitionMismatchError struct {
	Partitions int            // this relay's
	Others     map[string]int // relay id -> its partition count
}

func (e *PartitionMismatchError) Error() string {
	var parts []string
	for id, n := range e.Others {
		parts = append(parts, fmt.Sprintf("%s has %d", id, n))
	}
	sort.Strings(parts)
	return fmt.Sprintf("%v: this relay has --partitions %d but %s; every relay of one outbox must use the same count (stop them all to change it)",
		ErrPartitionMismatch, e.Partitions, strings.Join(parts, ", "))
}

func (e *PartitionMismatchError) Unwrap() error { return ErrPartitionMismatch }

// LeaseStatus is what the relay last saw of the partition sharing.
type LeaseStatus struct {
	Held     []int32 // partitions this relay holds, sorted
	Target   int     // its fair share
	Relays   int     // alive relays with the same partition count, itself included
	Mismatch bool    // a live relay has a different partition count
}

type leaser struct {
	r   *Relay
	reg store.RelayRegistration

	mu          sync.Mutex
	conn        *pgx.Conn
	held        []int32 // sorted
	nextRound   time.Time
	joined      bool  // the first round (the partition-count check) passed
	fatal       error // a refusal to run
	target      int
	relays      int
	mismatch    bool
	lastCleanup time.Time
	fenceFailed bool // a fence was refused (logged once)
	handedOver  bool // JetStream is unreachable: partitions released, membership left
}

func newLeaser(r *Relay) *leaser {
	return &leaser{r: r, reg: store.RelayRegistration{
		Instance:      uuid.New(),
		RelayID:       r.cfg.ID,
		Partitions:    r.cfg.Partitions,
		LeaseInterval: r.cfg.LeaseInterval,
	}}
}

// acquire returns the lease connection and the partitions held, connecting and running a
// lease round when one is due. It runs when the relay claims.
func (l *leaser) acquire(ctx context.Context) (*pgx.Conn, []int32, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.maintainLocked(ctx); err != nil {
		return nil, nil, err
	}
	if len(l.held) == 0 {
		if l.handedOver {
			return nil, nil, errHandedOver
		}
		return nil, nil, ErrNoPartitions
	}
	return l.conn, l.held, nil
}

// maintain runs a lease round if one is due (the relay calls it while it sleeps, so that
// rebalancing does not wait for the next claim). It reports whether the relay went from no
// partition to some.
func (l *leaser) maintain(ctx context.Context) (gained bool, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	before := len(l.held)
	err = l.maintainLocked(ctx)
	return before == 0 && len(l.held) > 0, err
}

// untilRound is how long until the next lease round is due.
func (l *leaser) untilRound() time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn == nil {
		return 0
	}
	return time.Until(l.nextRound)
}

func (l *leaser) maintainLocked(ctx context.Context) error {
	if l.fatal != nil {
		return l.fatal
	}
	if l.conn == nil || l.conn.IsClosed() {
		l.dropLocked()
		pc, err := l.r.pool.Acquire(ctx)
		if err != nil {
			return fmt.Errorf("relay: connect: %w", err)
		}
		// Hijack: a connection holding session locks must never go back to the pool.
		l.conn = pc.Hijack()
		l.nextRound = time.Time{}
		// Name the session so operators (and pg_stat_activity queries) can tell it apart.
		// force_generic_plan: on a table without statistics yet (a fresh outbox, a backlog
		// inserted since the last analyze) the first custom plans of the claim sort the whole
		// backlog instead of walking the ready index (40 ms instead of 0.3 ms at 50,000 rows).
		// synchronous_commit off: a settle lost in a PostgreSQL crash only makes its rows
		// ready again, and they are republished and deduplicated like after a relay crash; in
		// exchange the relay never waits for a WAL flush. It applies to this session only.
		// TCP keepalives and user timeout: when the relay's host dies or its network is cut,
		// PostgreSQL ends this session — and releases its partition locks — within seconds
		// instead of the system default of about two hours, so a standby takes over.
		if _, err := l.conn.Exec(ctx, `SELECT set_config('application_name', $1, false),
			set_config('plan_cache_mode', 'force_generic_plan', false),
			set_config('synchronous_commit', 'off', false),
			set_config('tcp_keepalives_idle', '5', false),
			set_config('tcp_keepalives_interval', '2', false),
			set_config('tcp_keepalives_count', '3', false),
			set_config('tcp_user_timeout', '10000', false)`, l.r.appName()); err != nil {
			l.dropLocked()
			return fmt.Errorf("relay: connect: %w", err)
		}
	}
	if time.Now().Before(l.nextRound) {
		return nil
	}
	if err := l.roundLocked(ctx); err != nil {
		if l.fatal != nil {
			return err
		}
		if l.conn != nil && l.conn.IsClosed() {
			l.dropLocked()
		}
		return err
	}
	return nil
}

// roundLocked is one lease round: heartbeat, look at the members and the leases, release
// extra partitions someone is waiting for, take free ones up to the fair share.
func (l *leaser) roundLocked(ctx context.Context) error {
	cfg := l.r.cfg
	if out, err := l.handoverLocked(ctx); out || err != nil {
		return err
	}
	view, err := l.r.q.Membership(ctx, l.conn, &l.reg)
	if err != nil {
		return fmt.Errorf("relay: lease round: %w", err)
	}
	now := time.Now()
	l.nextRound = now.Add(cfg.LeaseInterval)

	var alive []store.RelayMember
	others := map[string]int{}
	for _, m := range view.Members {
		if !m.Alive {
			continue
		}
		if m.Partitions != cfg.Partitions {
			others[m.RelayID] = m.Partitions
			continue
		}
		alive = append(alive, m)
	}
	if len(others) > 0 {
		merr := &PartitionMismatchError{Partitions: cfg.Partitions, Others: others}
		if !l.joined {
			// Refuse to run: take nothing, leave the membership table.
			l.fatal = merr
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			_ = l.r.q.UnregisterRelay(dctx, l.conn, l.reg.Instance)
			cancel()
			l.r.m.mismatch.Set(1)
			l.r.log.Error("refusing to run: relays disagree on the partition count", "err", merr.Error())
			return merr
		}
		if !l.mismatch {
			l.r.log.Error("relays disagree on the partition count; the relay with the other count must be stopped", "err", merr.Error())
		}
		l.mismatch = true
		l.r.m.mismatch.Set(1)
	} else if l.mismatch {
		l.mismatch = false
		l.r.m.mismatch.Set(0)
		l.r.log.Info("relays agree on the partition count again", "partitions", cfg.Partitions)
	}
	l.joined = true

	me := slices.IndexFunc(alive, func(m store.RelayMember) bool { return m.Instance == l.reg.Instance })
	if me < 0 { // our own row must be there; be safe if it is not
		alive = append(alive, store.RelayMember{Instance: l.reg.Instance})
		me = len(alive) - 1
	}
	n := len(alive)
	share := func(i int) int {
		s := cfg.Partitions / n
		if i < cfg.Partitions%n {
			s++
		}
		return s
	}
	target := share(me)
	heldBy := map[int32]int{}
	locked := map[int32]bool{}
	for _, lk := range view.Locks {
		heldBy[lk.PID]++
		locked[lk.Partition] = true
	}
	// What the others wait for beyond what is free already: the most we release.
	deficit := 0
	for i, m := range alive {
		if i != me && heldBy[m.PID] < share(i) {
			deficit += share(i) - heldBy[m.PID]
		}
	}
	waiting := deficit - (cfg.Partitions - len(locked))
	if len(l.held) < target {
		l.fenceStaleLocked(ctx, view.Members, heldBy)
	}
	if n != l.relays || target != l.target {
		l.r.log.Info("partition shares computed", "relays", n, "target", target, "held", len(l.held), "of", cfg.Partitions)
	}
	l.relays, l.target = n, target
	l.r.m.relays.Set(float64(n))
	l.r.m.target.Set(float64(target))

	switch {
	case len(l.held) > target && waiting > 0:
		extra := slices.Clone(l.held[max(target, len(l.held)-waiting):])
		released, err := l.r.q.UnlockPartitions(ctx, l.conn, extra)
		if err != nil {
			return fmt.Errorf("relay: release partitions: %w", err)
		}
		l.held = slices.DeleteFunc(l.held, func(p int32) bool { return slices.Contains(released, p) })
		l.r.m.changes.WithLabelValues("released").Add(float64(len(released)))
		l.r.log.Info("partitions released for rebalancing", "released", released, "held", len(l.held), "target", target, "relays", n)
	case len(l.held) < target:
		var free []int32
		for p := int32(0); p < int32(cfg.Partitions); p++ {
			if !locked[p] {
				free = append(free, p)
			}
		}
		// Relays taking at the same moment start at different places.
		rand.Shuffle(len(free), func(i, j int) { free[i], free[j] = free[j], free[i] })
		var taken []int32
		for want := target - len(l.held); want > 0 && len(free) > 0; want = target - len(l.held) {
			try := free[:min(want, len(free))]
			free = free[len(try):]
			got, err := l.r.q.TryLockPartitions(ctx, l.conn, try)
			if err != nil {
				return fmt.Errorf("relay: take partitions: %w", err)
			}
			taken = append(taken, got...)
			l.held = append(l.held, got...)
			slices.Sort(l.held)
		}
		if len(taken) > 0 {
			slices.Sort(taken)
			l.r.m.changes.WithLabelValues("taken").Add(float64(len(taken)))
			l.r.log.Info("partitions taken", "taken", taken, "held", len(l.held), "target", target, "relays", n)
		}
		if len(l.held) < target {
			// Someone is about to release what we wait for: look again soon.
			l.nextRound = now.Add(max(cfg.LeaseInterval/4, 10*time.Millisecond))
		}
	}
	l.r.m.partitions.Set(float64(len(l.held)))

	if now.Sub(l.lastCleanup) > time.Minute {
		l.lastCleanup = now
		if _, err := l.r.q.CleanupRelays(ctx, l.conn, 10*time.Minute); err != nil {
			return fmt.Errorf("relay: clean up the membership table: %w", err)
		}
	}
	return nil
}

// errHandedOver: the relay handed its partitions over (its NATS connection is down).
var errHandedOver = fmt.Errorf("%w: this relay's NATS connection is down; its partitions are handed over", ErrBrokerUnavailable)

// handoverLocked hands the relay's partitions over when its own NATS connection has been down
// for Config.HandoverAfter while it had messages to publish (their messages would wait for it
// while other relays can publish them), and rejoins once the connection is back and
// JetStream answers. A broker that fails everyone (JetStream down, a stream without quorum)
// with the connection up is not a reason: handing over would only move the waiting. It
// reports whether the relay is out of the shares (the round is over).
//
// Publishes made while the connection is down must fail rather than wait in the client's
// reconnect buffer (nats.ReconnectBufSize(-1)): a buffered publish would reach the stream
// when the connection comes back, possibly after the relays that took over have published
// later messages of its key, and after the duplicate window. New refuses a handover
// otherwise.
func (l *leaser) handoverLocked(ctx context.Context) (bool, error) {
	cfg := l.r.cfg
	if cfg.HandoverAfter < 0 || !l.joined {
		return false, nil
	}
	nc := l.r.pub.Conn()
	now := time.Now()
	if l.handedOver {
		l.nextRound = now.Add(cfg.LeaseInterval)
		if !nc.IsConnected() || !l.r.jetStreamAnswers(ctx) {
			return true, nil
		}
		l.handedOver = false
		l.r.natsDownSince.Store(0)
		l.r.log.Info("NATS is back: rejoining the partition shares")
		return false, nil
	}
	since := l.r.natsDownSince.Load()
	if since == 0 || nc.IsConnected() || now.Sub(time.Unix(0, since)) < cfg.HandoverAfter {
		return false, nil
	}
	released := []int32{}
	if len(l.held) > 0 {
		var err error
		if released, err = l.r.q.UnlockPartitions(ctx, l.conn, l.held); err != nil {
			return false, fmt.Errorf("relay: hand partitions over: %w", err)
		}
		l.held = slices.DeleteFunc(l.held, func(p int32) bool { return slices.Contains(released, p) })
		l.r.m.changes.WithLabelValues("released").Add(float64(len(released)))
		l.r.m.partitions.Set(float64(len(l.held)))
	}
	if err := l.r.q.UnregisterRelay(ctx, l.conn, l.reg.Instance); err != nil {
		return false, fmt.Errorf("relay: leave the membership: %w", err)
	}
	l.handedOver = true
	l.nextRound = now.Add(cfg.LeaseInterval)
	l.r.log.Warn("this relay's NATS connection is down: its partitions are handed over to the relays that can publish; "+
		"it rejoins when the connection is back", "down_for", now.Sub(time.Unix(0, since)).Round(time.Millisecond).String(), "released", released)
	return true, nil
}

// fenceStaleLocked ends the lease session of each member that still holds partitions while
// its heartbeat is stale: a frozen (SIGSTOP) or hung relay would otherwise keep its partitions
// until its session died, and their messages would wait. Its locks go with its session; the
// partitions are free at the next round. If the relay comes back it finds its lease
// connection gone and starts over; a wave it was sending when it froze may still go out,
// which the duplicate window absorbs if it comes back within it (and the consumer's dedup
// table if not).
func (l *leaser) fenceStaleLocked(ctx context.Context, members []store.RelayMember, heldBy map[int32]int) {
	for _, m := range members {
		if m.Alive || m.Instance == l.reg.Instance || heldBy[m.PID] == 0 {
			continue
		}
		fenced, err := l.r.q.FenceRelay(ctx, l.conn, m.Instance)
		switch {
		case err != nil:
			if !l.fenceFailed {
				l.fenceFailed = true
				l.r.log.Error("cannot end the session of a relay that stopped heartbeating; its partitions stay blocked until it dies "+
					"(the relay's role needs pg_signal_backend, or to be the same role)", "relay_id", m.RelayID, "backend_pid", m.PID, "err", err)
			}
		case fenced:
			l.r.m.changes.WithLabelValues("fenced").Add(float64(heldBy[m.PID]))
			l.r.log.Warn("ended the lease session of a relay that stopped heartbeating; its partitions are free",
				"relay_id", m.RelayID, "backend_pid", m.PID, "partitions", heldBy[m.PID], "last_heartbeat", m.HeartbeatAt)
		}
	}
}

// broken is called when a statement on the lease connection failed: if the connection is
// gone, so are the leases.
func (l *leaser) broken(err error) {
	if err == nil || errors.Is(err, context.Canceled) {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn != nil && l.conn.IsClosed() {
		l.dropLocked()
	}
}

func (l *leaser) dropLocked() { l.resetLocked("lost") }

// resetLocked forgets every lease and closes the lease connection, which ends the session and
// with it its locks. change is "lost" (the connection broke) or "released" (the relay is
// closing: it also removes its membership row).
func (l *leaser) resetLocked(change string) {
	if len(l.held) > 0 {
		if change == "lost" {
			l.r.log.Warn("partition leases lost with their connection", "held", len(l.held))
		} else {
			l.r.log.Info("partitions released", "held", len(l.held))
		}
		l.r.m.changes.WithLabelValues(change).Add(float64(len(l.held)))
	}
	l.held = nil
	l.r.m.partitions.Set(0)
	if l.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		if change == "released" && !l.conn.IsClosed() && l.fatal == nil {
			_ = l.r.q.UnregisterRelay(ctx, l.conn, l.reg.Instance)
		}
		_ = l.conn.Close(ctx)
		cancel()
		l.conn = nil
	}
}

// appName is the application_name of the relay's lease connection.
func (r *Relay) appName() string {
	n := "txoutbox-relay " + r.cfg.ID
	if len(n) > 63 {
		n = n[:63]
	}
	return n
}

// Partitions returns the partitions this relay holds.
func (r *Relay) Partitions() []int32 {
	r.lease.mu.Lock()
	defer r.lease.mu.Unlock()
	return slices.Clone(r.lease.held)
}

// Lease returns what the relay last saw of the partition sharing.
func (r *Relay) Lease() LeaseStatus {
	l := r.lease
	l.mu.Lock()
	defer l.mu.Unlock()
	return LeaseStatus{Held: slices.Clone(l.held), Target: l.target, Relays: l.relays, Mismatch: l.mismatch}
}

// close leaves the membership table and releases every lease by closing the connection.
func (l *leaser) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.resetLocked("released")
}

// Close releases the relay's partitions and its connection. Run does this on return; tests
// that drive runOnce directly call it.
func (r *Relay) Close() { r.lease.close() }
