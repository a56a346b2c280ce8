package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// leaser holds the relay's partition leases: session-level advisory locks on a dedicated
// connection. The relay also claims and settles on that connection, so when the connection
// dies the leases and the relay's ability to claim die together.
type leaser struct {
	r *Relay

	mu        sync.Mutex
	conn      *pgx.Conn
	held      []int32 // sorted
	lastTry   time.Time
	heldSince time.Time
}

func newLeaser(r *Relay) *leaser { return &leaser{r: r} }

// acquire returns the lease connection and the partitions held, connecting and trying to take
// free partitions when it is time to.
func (l *leaser) acquire(ctx context.Context) (*pgx.Conn, []int32, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn == nil || l.conn.IsClosed() {
		l.dropLocked()
		pc, err := l.r.pool.Acquire(ctx)
		if err != nil {
			return nil, nil, fmt.Errorf("relay: connect: %w", err)
		}
		// Hijack: a connection holding session locks must never go back to the pool.
		l.conn = pc.Hijack()
		l.lastTry = time.Time{}
		// Name the session so operators (and pg_stat_activity queries) can tell it apart.
		// force_generic_plan: on a table without statistics yet (a fresh outbox, a backlog
		// inserted since the last analyze) the first custom plans of the claim sort the whole
		// backlog instead of walking the ready index (40 ms instead of 0.3 ms at 50,000 rows).
		// synchronous_commit off: a settle lost in a PostgreSQL crash only makes its rows
		// ready again, and they are republished and deduplicated like after a relay crash; in
		// exchange the relay never waits for a WAL flush. It applies to this session only.
		if _, err := l.conn.Exec(ctx, `SELECT set_config('application_name', $1, false),
			set_config('plan_cache_mode', 'force_generic_plan', false),
			set_config('synchronous_commit', 'off', false)`, l.r.appName()); err != nil {
			l.dropLocked()
			return nil, nil, fmt.Errorf("relay: connect: %w", err)
		}
	}
	if len(l.held) < l.r.cfg.Partitions && time.Since(l.lastTry) >= l.r.cfg.LeaseInterval {
		l.lastTry = time.Now()
		if err := l.tryTakeLocked(ctx); err != nil {
			l.dropLocked()
			return nil, nil, err
		}
	}
	if len(l.held) == 0 {
		return nil, nil, ErrNoPartitions
	}
	return l.conn, l.held, nil
}

func (l *leaser) tryTakeLocked(ctx context.Context) error {
	var free []int32
	for p := int32(0); p < int32(l.r.cfg.Partitions); p++ {
		if _, ok := slices.BinarySearch(l.held, p); !ok {
			free = append(free, p)
		}
	}
	rows, err := l.conn.Query(ctx, `SELECT p FROM unnest($2::int4[]) AS u(p) WHERE pg_try_advisory_lock($1::int4, p)`,
		l.r.q.PartitionLockClass, free)
	if err != nil {
		return fmt.Errorf("relay: take partitions: %w", err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return fmt.Errorf("relay: take partitions: %w", err)
	}
	if len(got) > 0 {
		l.held = append(l.held, got...)
		slices.Sort(l.held)
		l.r.log.Info("partitions taken", "taken", got, "held", len(l.held), "of", l.r.cfg.Partitions)
		l.r.m.partitions.Set(float64(len(l.held)))
	}
	return nil
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

func (l *leaser) dropLocked() {
	if len(l.held) > 0 {
		l.r.log.Warn("partition leases lost with their connection", "held", len(l.held))
	}
	l.held = nil
	l.r.m.partitions.Set(0)
	if l.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
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

// close releases every lease by closing the connection.
func (l *leaser) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.held) > 0 {
		l.r.log.Info("partitions released", "held", len(l.held))
	}
	l.held = nil
	l.r.m.partitions.Set(0)
	if l.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = l.conn.Close(ctx)
		cancel()
		l.conn = nil
	}
}

// Close releases the relay's partitions and its connection. Run does this on return; tests
// that drive runOnce directly call it.
func (r *Relay) Close() { r.lease.close() }
