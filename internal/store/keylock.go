package store

import (
	"errors"
	"fmt"
	"slices"
	"strconv"

	"github.com/jackc/pgx/v5/pgconn"
)

// Key locks. For one key, id order must be commit order: two transactions that write a row of
// one key serialise on a transaction-scoped advisory lock taken before the row's id is drawn.
// One lock per key would make the number of locks a transaction holds unbounded, and
// PostgreSQL's lock table is small and shared by every session (max_locks_per_transaction ×
// (max_connections + max_prepared_transactions) entries): a transaction writing some 10,000
// keys fails with "out of shared memory", and a few thousand already starve other sessions.
// So key locks are intention locks over KeyLockBuckets buckets of key hashes
// (bucket = hash % KeyLockBuckets), and each transaction has a budget of KeyLockBudget exact
// key locks:
//
//   - exact mode, while the transaction stays within its budget: a shared lock on each of the
//     keys' buckets (sorted), then an exclusive lock on each key hash (sorted). Two exact-mode
//     transactions conflict only on a common key hash.
//   - bucket mode, for a call that would exceed the budget: an exclusive lock on each of the
//     keys' buckets (sorted). It conflicts with every exact-mode holder of the bucket (their
//     shared lock) and with every bucket-mode holder.
//
// Any two transactions with a common key therefore serialise, whatever their modes. Whatever
// number of keys it writes, a transaction holds (per outbox schema) at most KeyLockBudget key
// locks, as many shared bucket locks and KeyLockBuckets exclusive ones: at most
// KeyLockBuckets + 2 × KeyLockBudget rows in pg_locks, and KeyLockBuckets + KeyLockBudget lock
// table entries (a shared and an exclusive lock on one bucket are one entry).
//
// Within one call the locks are taken in one order (buckets before keys, each sorted), so
// calls cannot deadlock each other; a transaction that locks keys in several calls can
// deadlock with another one (PostgreSQL detects it and aborts one), as with row locks, and
// once in bucket mode even without a common key (a common bucket suffices).
//
// The count of exact key locks a transaction took lives in a transaction-local setting
// (set_config(…, true)), so it spans every call in the transaction, of every client, and the
// mode is decided in SQL, in the statement that takes the locks: locking stays in the
// caller's round trip. A rollback to a savepoint restores the count as it was at the savepoint
// and releases the advisory locks taken since, so the two stay in step.
const (
	// KeyLockBuckets is the number of buckets key hashes fall into for bucket-mode locks.
	KeyLockBuckets = 256
	// KeyLockBudget is how many exact key locks one transaction may take; a call that would
	// take more locks buckets instead.
	KeyLockBudget = 256

	// keyLockCountSetting is the transaction-local setting counting the exact key locks the
	// transaction took.
	keyLockCountSetting = "txoutbox.key_locks"
)

// keyLockSQL returns the statement that locks the key hashes of keys, given with their
// buckets: both SQL int4[] expressions over the statement's parameters, sorted and without
// duplicates (keyLockArgs makes them).
//
// x reads the count (OFFSET 0: evaluated once, not inlined); c decides the mode and sets the
// new count, once (MATERIALIZED); the locks are then taken in array order: the buckets, and
// in exact mode the keys after them.
func keyLockSQL(q *Queries, keys, buckets string) string {
	budget := strconv.Itoa(KeyLockBudget)
	keyClass := strconv.Itoa(int(q.KeyLockClass)) + "::int4"
	bucketClass := strconv.Itoa(int(q.KeyBucketLockClass)) + "::int4"
	return `WITH c AS MATERIALIZED (
  SELECT x.n + cardinality(x.k) <= ` + budget + ` AS exact, x.k, x.b,
         set_config('` + keyLockCountSetting + `',
           (x.n + CASE WHEN x.n + cardinality(x.k) <= ` + budget + ` THEN cardinality(x.k) ELSE 0 END)::text, true) AS n
  FROM (SELECT coalesce(nullif(current_setting('` + keyLockCountSetting + `', true), ''), '0')::int4 AS n,
               ` + keys + ` AS k, ` + buckets + ` AS b
        OFFSET 0) x
)
SELECT count(CASE WHEN u.i > cardinality(c.b) THEN pg_advisory_xact_lock(` + keyClass + `, u.v)
                  WHEN c.exact THEN pg_advisory_xact_lock_shared(` + bucketClass + `, u.v)
                  ELSE pg_advisory_xact_lock(` + bucketClass + `, u.v) END)
FROM c CROSS JOIN LATERAL unnest(CASE WHEN c.exact THEN c.b || c.k ELSE c.b END) WITH ORDINALITY AS u(v, i)`
}

// keyLockArgs returns the sorted distinct key hashes of hashes (which it sorts) and their
// sorted distinct buckets. Sorting here, not in SQL, keeps a one-key call as cheap as it was
// with one lock per key.
func keyLockArgs(hashes []int32) (keys, buckets []int32) {
	slices.Sort(hashes)
	keys = slices.Compact(hashes)
	buckets = make([]int32, len(keys))
	for i, h := range keys {
		buckets[i] = h % KeyLockBuckets
	}
	slices.Sort(buckets)
	return keys, slices.Compact(buckets)
}

// ErrLockTableFull means PostgreSQL's shared lock table had no room for a lock a statement
// needed (SQLSTATE 53200, "out of shared memory"). The transaction is aborted and wrote
// nothing. Package outbox wraps it in outbox.ErrLockTableFull (LockTableFull).
var ErrLockTableFull = errors.New("PostgreSQL's lock table is full (SQLSTATE 53200, out of shared memory)")

// LockTableFull wraps err in sentinel when it is (or wraps) ErrLockTableFull; any other error
// is returned as it is.
func LockTableFull(err, sentinel error) error {
	if errors.Is(err, ErrLockTableFull) {
		return fmt.Errorf("%w: %w", sentinel, err)
	}
	return err
}

// lockTableHint says what fills the lock table and how to make room, with the arithmetic.
var lockTableHint = fmt.Sprintf("the lock table has max_locks_per_transaction × (max_connections + max_prepared_transactions) entries "+
	"(6,400 with PostgreSQL's defaults), shared by every session; a transaction enqueueing keys takes at most %d of them per outbox schema "+
	"(a lock per key up to KeyLockBudget = %d keys, plus a lock per bucket of KeyLockBuckets = %d), "+
	"so N such transactions at once need up to N × %d entries besides every other lock held: raise max_locks_per_transaction "+
	"(a server restart), or run fewer bulk keyed transactions at once and commit them sooner",
	KeyLockBuckets+KeyLockBudget, KeyLockBudget, KeyLockBuckets, KeyLockBuckets+KeyLockBudget)

// lockTableFull wraps err in ErrLockTableFull, with what to do, when PostgreSQL ran out of
// lock table entries; any other error is returned as it is.
func lockTableFull(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "53200" {
		return fmt.Errorf("%w: %s: %w", ErrLockTableFull, lockTableHint, err)
	}
	return err
}
