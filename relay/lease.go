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
	"sync/atomic"
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
// A lock alone cannot stop a relay that was paused (SIGSTOP, a VM pause, a long GC) and wakes
// up with a claimed batch: its session may have been ended and its partitions taken while it
// slept, and nothing tells it before it sends. So a lease also has an expiry, on the holder's
// monotonic clock: it lasts leaseTTLFactor lease intervals from the start of the holder's last
// successful lease round (the round that wrote its heartbeat). The holder checks it, and that
// it has released or lost no partition since it claimed the batch (the lease generation),
// immediately before it hands each message to the NATS client (leaser.valid); a relay that
// wakes past its expiry sends nothing more and leaves the rest of its batch ready.
//
// Another relay ends the session of a holder that stopped heartbeating (the fence, which frees
// its locks) only after watching the holder's heartbeat unchanged for fenceFactor of the
// holder's lease intervals on its own monotonic clock. It first saw that heartbeat after the
// holder wrote it, so after the start of the holder's last round: by the time it fences, the
// holder's lease has expired on any clock that runs within 10% of its own, however long the
// holder was paused. The fence statement checks that the heartbeat is still the one watched,
// so a holder that renewed meanwhile is left alone. Neither side reads a wall clock (the
// stall estimate below subtracts two of the database's timestamps, and decides only whether
// free partitions are kept for a member, never a fence).
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
// while another responsive member is below its own share (someone is waiting for them), so
// nothing is released that nobody would take. A member is responsive while this relay has
// seen its heartbeat move within silentFactor of its lease intervals. A member below its
// share waits for partitions only once it knows it is short: its heartbeat moved since this
// relay first saw it short (a relay runs a round, which moves its heartbeat, and sees its own
// share there), or it has just started (its first round found it short). Free partitions
// that no waiting member is waiting for are taken at once by whoever sees them, beyond its
// share if need be: a member that froze at its share before a kill made it short never ran
// the round that would tell it, and nothing is kept or released for it (a frozen member still
// counted alive keeps a share nobody else would take). A waiting member whose heartbeat has
// not moved for stalledFactor of its lease intervals waits for nothing either (it runs a round
// every waitingRounds-th of its interval while it waits; counted from when it wrote that
// heartbeat, estimated from the database's timestamps of its heartbeat and of this relay's
// own). The shares even out
// again by the release rule once that member comes back or is fenced. Rounds
// run when the relay claims (the previous batch may still be publishing: a release bumps the
// lease generation, so its old holder sends nothing more of it; the rows it already sent may
// be sent again by the new holder at once), sleeps, or waits for a batch in flight (on the
// lease connection, idle then: a long batch neither leaves freed partitions unheld nor lets
// the relay's own lease run out). Because a key's messages are published
// one after another (the next only after the previous PubAck, whoever sent it) and deduplicated
// by Nats-Msg-Id, order per key holds across a handover and the overlap costs only duplicate
// PubAcks.
//
// Relays configured with different partition counts would publish one key from two relays at
// once. A relay that finds a live member with another count at its first round refuses to run
// (ErrPartitionMismatch); one that finds such a member later logs an error and reports it.

// Lease timing, in lease intervals (Config.LeaseInterval; a fence uses the holder's own, from
// its membership row).
const (
	// leaseTTLFactor: a lease lasts this many lease intervals from the start of the round that
	// renewed it.
	leaseTTLFactor = 10
	// fenceFactor: another relay ends the session of a member whose heartbeat it has watched
	// unchanged for this many of the member's lease intervals (the TTL plus 10% for clocks
	// that run at different rates).
	fenceFactor = 11
	// sessionEndBound: how long PostgreSQL takes at most to end the lease session of a relay
	// whose host died or whose network was cut (the session's TCP keepalives: 5s idle, then 3
	// probes 2s apart; its TCP user timeout is 10s). Kept in step with the TCP settings of
	// store.SetupRelaySession.
	sessionEndBound = 11 * time.Second
	// silentFactor: a member whose heartbeat has not moved for this many of its lease
	// intervals is not waiting for anything (its share does not hold partitions back).
	silentFactor = 2
	// waitingRounds: a relay below its share runs this many rounds per lease interval until
	// it has its share (the partitions it waits for are being released).
	waitingRounds = 10
	// stalledFactor: a member waiting for partitions (below its share, and known to know it,
	// see waitingLocked) whose heartbeat has not moved for this many of its lease intervals
	// waits for nothing either, though it is not silent yet. A relay that has seen itself
	// below its share runs a lease round (which moves its heartbeat) every waitingRounds-th of
	// its lease interval, at a claim, while idle or while it waits for a batch in flight: one
	// whose heartbeat has not moved for half an interval (five such rounds) froze only just
	// now, or cannot reach its database: free partitions are not kept for it, nothing is released for it, and once its
	// heartbeat moves it waits as before and is given its share. The half interval counts from
	// when the member wrote its heartbeat, as this relay estimates it (seenBeat.written), not
	// from when this relay first read it (up to one of its own rounds later).
	stalledFactor = 0.5
	// watchRounds: a busy relay looks at the membership table (a cheap count, on a pool
	// connection of its own, off the claim path) this many times per lease interval, at most
	// every maxMemberWatch (every 250 ms with the default 2 s), so that a relay joining or
	// leaving is seen within a fraction of a lease interval rather than at the next lease
	// round. Looking every 100 ms cost 3.4 % of a draining relay's CPU in its profile; every
	// 250 ms, about 1.4 %.
	watchRounds    = 8
	maxMemberWatch = 250 * time.Millisecond
)

// memberWatchEvery is how often a busy relay looks at the membership table.
func memberWatchEvery(leaseInterval time.Duration) time.Duration {
	return max(min(leaseInterval/watchRounds, maxMemberWatch), 10*time.Millisecond)
}

// watchMembers runs while the relay runs: while it is busy (it claimed rows within the last
// lease interval) it looks at the membership table every memberWatchEvery and, when a relay
// joined or left since its last lease round, makes its next claim run a round at once. A
// relay joining a busy holder of every partition so gets its share within a batch or two
// instead of up to a lease interval later; a relay leaving hands its partitions over as fast.
func (r *Relay) watchMembers(ctx context.Context) {
	every := memberWatchEvery(r.cfg.LeaseInterval)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		last := r.lastWork.Load()
		mark := r.lease.mark.Load()
		if mark == nil || last == 0 || time.Since(time.Unix(0, last)) > r.cfg.LeaseInterval || r.lease.recheck.Load() {
			continue // idle (the lease rounds suffice), no round yet, or a round already due
		}
		qctx, cancel := context.WithTimeout(ctx, max(5*every, time.Second))
		n, newest, err := r.q.MemberMark(qctx, r.pool)
		cancel()
		if err == nil && (n != mark.n || !newest.Equal(mark.newest)) {
			r.lease.recheck.Store(true)
		}
	}
}

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
	return fmt.Sprintf("%v: this relay has Config.Partitions (relay run --partitions) %d but %s; every relay of one outbox must use the same count (stop them all to change it)",
		ErrPartitionMismatch, e.Partitions, strings.Join(parts, ", "))
}

func (e *PartitionMismatchError) Unwrap() error { return ErrPartitionMismatch }

// LeaseStatus is what the relay last saw of the partition sharing.
type LeaseStatus struct {
	Held     []int32 // partitions this relay holds, sorted
	Target   int     // its fair share
	Relays   int     // alive relays with the same partition count, itself included
	Mismatch bool    // a live relay has a different partition count
	// Silent counts the other members counted in the shares whose heartbeat this relay has
	// not seen move for two of their lease intervals (frozen, hung, or about to be fenced):
	// free partitions are not kept for them.
	Silent int
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
	silent      int
	stalled     int
	unaware     int
	roundStart  time.Time // of the last round
	rate        rateMeter // the publish rate reported with the heartbeat

	// validUntil is when the lease ends, on this process's monotonic clock: leaseTTLFactor
	// lease intervals after the start of the last successful round. gen counts the releases
	// and losses of partitions. The publisher reads both through snap, without the lock.
	validUntil time.Time
	gen        uint64
	snap       atomic.Pointer[leaseSnap]
	// status is what Relay.Lease returns: statusLocked as of the last time l.mu was released
	// (see unlock), read without the lock, which a lease round holds while PostgreSQL answers.
	status atomic.Pointer[LeaseStatus]
	// seen is, per member, the heartbeat last read and when this relay first read it (its
	// monotonic clock, when the answer arrived).
	seen map[uuid.UUID]seenBeat

	// mark is what the last round saw of the membership table; recheck is set when the
	// membership watch (Relay.watchMembers) finds the table changed since: a relay joined or
	// left, and the next claim runs a round at once instead of at the next lease interval.
	mark    atomic.Pointer[memberMark]
	recheck atomic.Bool
}

// memberMark summarises the membership table: its rows and their latest start.
type memberMark struct {
	n      int64
	newest time.Time
}

// leaseSnap is what the publisher checks before each message.
type leaseSnap struct {
	until time.Time
	gen   uint64
}

type seenBeat struct {
	beat time.Time
	at   time.Time
	// written estimates, on this relay's monotonic clock, when the member wrote beat: from
	// the database timestamps of beat and of this relay's own heartbeat of the round that
	// first read it (one clock, the database's), never earlier than the start of this relay's
	// previous round that read the member's previous heartbeat (beat was not visible then),
	// never later than at. It only tells when the member stalls (see stalledFactor), which
	// keeps nothing safe: the fence and the silence are measured from at.
	written time.Time
	// read is the start of the last round that read beat.
	read time.Time
	// shortBeat is the heartbeat this relay read in the round that first saw the member below
	// its share, zero while it is not; newcomer: the member joined after this relay's previous
	// round (see waitingLocked).
	shortBeat time.Time
	newcomer  bool
	// fencedAt is when this relay ended the member's session for this heartbeat (zero if it
	// has not): the backend may outlive pg_terminate_backend's return for a moment, and the
	// fence is not sent (nor logged) again for it until another fence interval has passed.
	fencedAt time.Time
}

func newLeaser(r *Relay) *leaser {
	l := &leaser{r: r, reg: store.RelayRegistration{
		Instance:      uuid.New(),
		RelayID:       r.cfg.ID,
		Partitions:    r.cfg.Partitions,
		LeaseInterval: r.cfg.LeaseInterval,
	}, seen: map[uuid.UUID]seenBeat{}}
	l.snap.Store(&leaseSnap{})
	l.status.Store(&LeaseStatus{})
	return l
}

// unlock publishes the lease status for Relay.Lease and releases l.mu. Every section that
// may change the status ends with it.
func (l *leaser) unlock() {
	st := l.statusLocked()
	l.status.Store(&st)
	l.mu.Unlock()
}

// valid reports whether a batch claimed under lease generation gen may still be published:
// no partition was released or lost since, and the lease has not expired on this process's
// monotonic clock. It is called before each message is handed to the NATS client.
func (l *leaser) valid(gen uint64) bool {
	s := l.snap.Load()
	return s.gen == gen && time.Now().Before(s.until)
}

// expiry returns when the lease of generation gen expires on the monotonic clock, and false
// once a partition was released or lost since gen (its batches may send nothing more).
func (l *leaser) expiry(gen uint64) (time.Time, bool) {
	s := l.snap.Load()
	return s.until, s.gen == gen
}

// publishSnapLocked makes the lease state visible to the publisher.
func (l *leaser) publishSnapLocked() {
	l.snap.Store(&leaseSnap{until: l.validUntil, gen: l.gen})
}

// lostLocked records that partitions were released or lost: batches claimed before send
// nothing more.
func (l *leaser) lostLocked() {
	l.gen++
	l.publishSnapLocked()
}

// acquire returns the lease connection and the partitions held, connecting and running a
// lease round when one is due. It runs when the relay claims.
func (l *leaser) acquire(ctx context.Context) (*pgx.Conn, []int32, error) {
	conn, parts, _, err := l.acquireGen(ctx)
	return conn, parts, err
}

// acquireGen is acquire, also returning the lease generation the claim is made under (see
// valid).
func (l *leaser) acquireGen(ctx context.Context) (*pgx.Conn, []int32, uint64, error) {
	l.mu.Lock()
	defer l.unlock()
	if err := l.maintainLocked(ctx); err != nil {
		return nil, nil, 0, err
	}
	if len(l.held) == 0 {
		if l.handedOver {
			return nil, nil, 0, errHandedOver
		}
		return nil, nil, 0, errNoPartitions
	}
	return l.conn, l.held, l.gen, nil
}

// maintain runs a lease round if one is due (the relay calls it while it sleeps, so that
// rebalancing does not wait for the next claim). It reports whether the relay went from no
// partition to some.
func (l *leaser) maintain(ctx context.Context) (gained bool, err error) {
	l.mu.Lock()
	defer l.unlock()
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
		// The relay's own session settings (generic plans that walk the indexes, no WAL flush
		// waits, TCP keepalives): see store.SetupRelaySession.
		if err := store.SetupRelaySession(ctx, l.conn, l.r.appName()); err != nil {
			l.dropLocked()
			return fmt.Errorf("relay: connect: %w", err)
		}
	}
	// A round is due every lease interval, at once when the lease has expired (a pause):
	// the relay claims nothing on an expired lease, and at once when a relay joined or left.
	if now := time.Now(); now.Before(l.nextRound) && now.Before(l.validUntil) && !l.recheck.Load() {
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
	if h := l.r.hooks.afterRound; h != nil {
		h(l.roundStart, l.statusLocked())
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
	// The lease is renewed from before the heartbeat is sent: whoever reads the heartbeat
	// this round writes reads it later than this.
	start := time.Now()
	l.roundStart = start
	l.recheck.Store(false)
	l.reg.RelayInfo = l.r.fleetInfo(&l.rate, start)
	view, err := l.r.q.Membership(ctx, l.conn, &l.reg)
	if err != nil {
		return fmt.Errorf("relay: lease round: %w", err)
	}
	now := time.Now()
	l.validUntil = start.Add(leaseTTLFactor * cfg.LeaseInterval)
	l.publishSnapLocked()
	l.nextRound = now.Add(cfg.LeaseInterval)
	l.watchLocked(view.Members, start, now)
	if l.fenceStaleLocked(ctx, view, now) {
		// The fenced sessions are gone with their locks: look again, so that their
		// partitions are taken in this round.
		if view, err = l.r.q.Membership(ctx, l.conn, nil); err != nil {
			return fmt.Errorf("relay: lease round: %w", err)
		}
	}

	mark := &memberMark{n: int64(len(view.Members)), newest: time.Unix(0, 0)}
	for _, m := range view.Members {
		if m.StartedAt.After(mark.newest) {
			mark.newest = m.StartedAt
		}
	}
	l.mark.Store(mark)

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
	// What the waiting others wait for: the most we release, and what free partitions are
	// kept for. A silent member waits for nothing, nor does one below its share that does not
	// know it yet (unaware: see waitingLocked), nor a stalled one (waiting, and its heartbeat
	// still for stalledFactor of its lease intervals). stallAt is when the first of the
	// waiting members stalls if its heartbeat does not move.
	deficit, silent, stalled, unaware := 0, 0, 0, 0
	var stallAt time.Time
	for i, m := range alive {
		if i == me {
			continue
		}
		if l.silentLocked(m, now) {
			silent++
			continue
		}
		if !l.waitingLocked(m, heldBy[m.PID] < share(i)) {
			if heldBy[m.PID] < share(i) {
				unaware++
			}
			continue
		}
		if s, ok := l.seen[m.Instance]; ok {
			at := s.written.Add(time.Duration(stalledFactor * float64(memberInterval(m, cfg.LeaseInterval))))
			if !now.Before(at) {
				stalled++
				continue
			}
			if stallAt.IsZero() || at.Before(stallAt) {
				stallAt = at
			}
		}
		deficit += share(i) - heldBy[m.PID]
	}
	free := cfg.Partitions - len(locked)
	waiting := deficit - free
	if n != l.relays || target != l.target || silent != l.silent || stalled != l.stalled || unaware != l.unaware {
		l.r.log.Info("partition shares computed", "relays", n, "target", target, "held", len(l.held), "of", cfg.Partitions,
			"silent", silent, "stalled", stalled, "unaware", unaware)
	}
	l.relays, l.target, l.silent, l.stalled, l.unaware = n, target, silent, stalled, unaware
	l.r.m.relays.Set(float64(n))
	l.r.m.target.Set(float64(target))

	// Free partitions: up to our share, plus those no waiting member waits for.
	want := max(target-len(l.held), 0)
	want += max(free-want-deficit, 0)
	switch {
	case len(l.held) > target && waiting > 0:
		extra := slices.Clone(l.held[max(target, len(l.held)-waiting):])
		// The batch in flight stops sending before the partitions are free.
		l.lostLocked()
		released, err := l.r.q.UnlockPartitions(ctx, l.conn, extra)
		if err != nil {
			return fmt.Errorf("relay: release partitions: %w", err)
		}
		l.held = slices.DeleteFunc(l.held, func(p int32) bool { return slices.Contains(released, p) })
		free += len(released) // kept for the waiting members: look again when they would stall
		l.r.m.changes.WithLabelValues("released").Add(float64(len(released)))
		l.r.log.Info("partitions released for rebalancing", "released", released, "held", len(l.held), "target", target, "relays", n)
	case want > 0 && free > 0:
		var cands []int32
		for p := int32(0); p < int32(cfg.Partitions); p++ {
			if !locked[p] {
				cands = append(cands, p)
			}
		}
		// Relays taking at the same moment start at different places.
		rand.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
		var taken []int32
		for left := want; left > 0 && len(cands) > 0; left = want - len(taken) {
			try := cands[:min(left, len(cands))]
			cands = cands[len(try):]
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
			if len(l.held) > target {
				l.r.log.Info("partitions taken beyond the fair share: no responsive relay is waiting for them",
					"taken", taken, "held", len(l.held), "target", target, "relays", n, "silent", silent, "stalled", stalled, "unaware", unaware)
			} else {
				l.r.log.Info("partitions taken", "taken", taken, "held", len(l.held), "target", target, "relays", n)
			}
		}
	}
	if len(l.held) < target {
		// Someone is about to release what we wait for (it runs a round as soon as its
		// membership watch sees this relay): look again soon.
		l.nextRound = now.Add(max(cfg.LeaseInterval/waitingRounds, 10*time.Millisecond))
	}
	if deficit > 0 && free > 0 && !stallAt.IsZero() && stallAt.Before(l.nextRound) {
		l.nextRound = stallAt // free partitions are kept for a member: look again when it would stall
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

// watchLocked records when this relay first read each member's current heartbeat, and
// estimates when the member wrote it (seenBeat.written), in a round that started at start and
// got its answer at now.
func (l *leaser) watchLocked(members []store.RelayMember, start, now time.Time) {
	present := make(map[uuid.UUID]bool, len(members))
	var own time.Time // this relay's heartbeat of this round, on the database's clock
	for _, m := range members {
		if m.Instance == l.reg.Instance {
			own = m.HeartbeatAt
		}
	}
	for _, m := range members {
		present[m.Instance] = true
		s, ok := l.seen[m.Instance]
		if ok && s.beat.Equal(m.HeartbeatAt) {
			s.read = start
			l.seen[m.Instance] = s
			continue
		}
		written := now
		if ok && !own.IsZero() {
			// Our own heartbeat was written between start and now: the member's was written
			// at the latest now + (its timestamp - ours), and after the start of our round
			// that read its previous one.
			if est := now.Add(m.HeartbeatAt.Sub(own)); est.Before(written) {
				written = est
			}
			if written.Before(s.read) {
				written = s.read
			}
		}
		// A member first seen in a round after this relay's first joined since, and one first
		// seen in this relay's first round that started within one of its lease intervals
		// before this heartbeat (relays started together): its own first round found it short
		// (it held nothing).
		newcomer := s.newcomer || !ok && (l.joined || m.HeartbeatAt.Sub(m.StartedAt) < memberInterval(m, l.r.cfg.LeaseInterval))
		l.seen[m.Instance] = seenBeat{beat: m.HeartbeatAt, at: now, written: written, read: start, shortBeat: s.shortBeat, newcomer: newcomer}
	}
	for id := range l.seen {
		if !present[id] {
			delete(l.seen, id)
		}
	}
}

// waitingLocked reports whether member m, below its share when short is true, waits for
// partitions: it knows it is short. A relay learns its share only in its own lease rounds, and
// each round moves its heartbeat; so m knows once its heartbeat has moved since this relay
// first saw it short (that heartbeat was written after the change that made it short: the
// heartbeat read then was already visible), or when it joined since this relay's previous
// round, or, seen first in this relay's first round, started within one of its lease
// intervals before its heartbeat (a new relay's first round finds it short: it holds
// nothing). A member that froze at
// its share just before a kill made it short never knows: free partitions are not kept for
// it, nor released for it, until its heartbeat moves. It records, per member, the heartbeat
// read when it was first seen short (seenBeat.shortBeat), and forgets it, and that the member
// is new, once the member is not short.
func (l *leaser) waitingLocked(m store.RelayMember, short bool) bool {
	s, ok := l.seen[m.Instance]
	if !ok {
		return short
	}
	if !short {
		if !s.shortBeat.IsZero() || s.newcomer {
			s.shortBeat, s.newcomer = time.Time{}, false
			l.seen[m.Instance] = s
		}
		return false
	}
	if s.shortBeat.IsZero() {
		s.shortBeat = m.HeartbeatAt
		l.seen[m.Instance] = s
	}
	return s.newcomer || !m.HeartbeatAt.Equal(s.shortBeat)
}

// silentLocked reports whether this relay has not seen m's heartbeat move for silentFactor of
// m's lease intervals.
func (l *leaser) silentLocked(m store.RelayMember, now time.Time) bool {
	if m.Instance == l.reg.Instance {
		return false
	}
	s, ok := l.seen[m.Instance]
	return ok && now.Sub(s.at) >= silentFactor*memberInterval(m, l.r.cfg.LeaseInterval)
}

// memberInterval is m's lease interval, or def if its row does not say.
func memberInterval(m store.RelayMember, def time.Duration) time.Duration {
	if m.LeaseInterval > 0 {
		return m.LeaseInterval
	}
	return def
}

// errHandedOver: the relay handed its partitions over (its NATS connection is down).
var errHandedOver = fmt.Errorf("%w: this relay's NATS connection is down; its partitions are handed over", errBrokerUnavailable)

// handoverLocked hands the relay's partitions over when its own NATS connection has been down
// for Config.HandoverAfter (their messages would wait for it while other relays can publish
// them; an idle relay counts from the poll that found the connection down), and rejoins once the connection is back and
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
		l.lostLocked() // the batch in flight stops sending before the partitions are free
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
// this relay has watched its heartbeat unchanged for fenceFactor of its lease intervals: a
// frozen (SIGSTOP, a VM pause) or hung relay would otherwise keep its partitions until its
// session died, and their messages would wait. By then its lease has expired on its own
// clock, so it sends nothing more if it wakes (see leaser.valid). Its locks go with its
// session. It reports whether it fenced anyone.
func (l *leaser) fenceStaleLocked(ctx context.Context, view store.Membership, now time.Time) bool {
	heldBy := map[int32]int{}
	for _, lk := range view.Locks {
		heldBy[lk.PID]++
	}
	fencedAny := false
	for _, m := range view.Members {
		s, ok := l.seen[m.Instance]
		interval := fenceFactor * memberInterval(m, l.r.cfg.LeaseInterval)
		if m.Instance == l.reg.Instance || heldBy[m.PID] == 0 || !ok || now.Sub(s.at) < interval ||
			(!s.fencedAt.IsZero() && now.Sub(s.fencedAt) < interval) {
			continue
		}
		fenced, err := l.r.q.FenceRelay(ctx, l.conn, m.Instance, s.beat)
		switch {
		case err != nil:
			if !l.fenceFailed {
				l.fenceFailed = true
				l.r.log.Error("cannot end the session of a relay that stopped heartbeating; its partitions stay blocked until it dies "+
					"(the relay's role needs pg_signal_backend, or to be the same role)", "relay_id", m.RelayID, "backend_pid", m.PID, "err", err)
			}
		case fenced:
			fencedAny = true
			s.fencedAt = now
			l.seen[m.Instance] = s
			l.r.m.changes.WithLabelValues("fenced").Add(float64(heldBy[m.PID]))
			l.r.log.Warn("ended the lease session of a relay that stopped heartbeating; its partitions are free",
				"relay_id", m.RelayID, "backend_pid", m.PID, "partitions", heldBy[m.PID],
				"silent_for", now.Sub(s.at).Round(time.Millisecond).String(), "last_heartbeat", m.HeartbeatAt)
		}
	}
	return fencedAny
}

// broken is called when a statement on the lease connection failed: if the connection is
// gone, so are the leases.
func (l *leaser) broken(err error) {
	if err == nil || errors.Is(err, context.Canceled) {
		return
	}
	l.mu.Lock()
	defer l.unlock()
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
	l.validUntil = time.Time{}
	l.lostLocked()
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

// Partitions returns the partitions this relay holds: Lease().Held.
func (r *Relay) Partitions() []int32 {
	return r.Lease().Held
}

// Lease returns what the relay last saw of the partition sharing. It does not wait for a
// lease round under way (a round waits for PostgreSQL): it returns what the last one left.
func (r *Relay) Lease() LeaseStatus {
	st := *r.lease.status.Load()
	st.Held = slices.Clone(st.Held)
	return st
}

func (l *leaser) statusLocked() LeaseStatus {
	return LeaseStatus{Held: slices.Clone(l.held), Target: l.target, Relays: l.relays, Mismatch: l.mismatch, Silent: l.silent}
}

// close leaves the membership table and releases every lease by closing the connection.
func (l *leaser) close() {
	l.mu.Lock()
	defer l.unlock()
	l.resetLocked("released")
}

// Close stops the relay for good. A running Run is stopped as cancelling its context does
// (the batch in flight is published and settled, within Config.MaxStopTime) and Close waits
// for it to return; then Close releases the relay's partitions and its lease connection (as
// Run does when it returns), stops watching the NATS connection's errors for permission
// violations (see ErrPublishDenied), which Run leaves in place for a later Run, and leaves
// the connection's WriteFence, if it has one. Call it once the relay is no longer needed:
// until then, the relay's error handler stays chained onto the connection's. Run returns
// ErrClosed after Close. Close is safe to call more than once and from several goroutines:
// every call returns once the relay is released.
func (r *Relay) Close() {
	// Once, and a concurrent Close waits for the first: it returns once the relay is released.
	r.closeOnce.Do(func() {
		r.run.close()
		r.lease.close()
		r.unwatch()
		if r.fenceOwner != nil {
			r.fenceOwner.unbind(r.fence)
		}
	})
}
