package store

import (
	"strconv"

	"github.com/jackc/pgx/v5"
)

// Key locks. For one key, id order must be commit order: two transactions that write a row of
// one key serialise on a transaction-scoped advisory lock taken before the row's id is drawn.
// One lock per key would make the number of locks a transaction holds unbounded, and
// PostgreSQL's lock table is small and shared by every session (max_locks_per_transaction ×
// (max_connections + max_prepared_transactions) entries): a transaction writing some 10,000
// keys fails with "out of shared memory", and a few thousand already starve other sessions.
// So key locks are intention locks over KeyLockBuckets buckets of key hashes
// (bucket = hash % KeyLockBuckets), and each transaction has a budget of KeyLockBudget exact key locks:
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
// deadlock with another one (PostgreSQL detects it and aborts one), as with row locks.
//
// The count of exact key locks a transaction took lives in a transaction-local setting
// (set_config(…, true)), so it spans every call in the transaction, of every client, and the
// mode is decided in SQL: locking stays in the caller's round trip. A rollback to a savepoint
// restores the count as it was at the savepoint and releases the advisory locks taken since,
// so the two stay in step.
const (
	// KeyLockBuckets is the number of buckets key hashes fall into for bucket-mode locks.
	KeyLockBuckets = 256
	// KeyLockBudget is how many exact key locks one transaction may take; a call that would
	// take more locks buckets instead.
	KeyLockBudget = 256

	// Transaction-local settings: how many exact key locks the transaction holds, and the
	// mode of the current call (exact or bucket).
	keyLockCountSetting = "txoutbox.key_locks"
	keyLockModeSetting  = "txoutbox.key_lock_mode"
)

// keyLockSQL holds the statements that lock the keys a source query yields.
type keyLockSQL struct {
	decide  string // counts the call's keys against the budget and records the mode
	buckets string // shared (exact mode) or exclusive (bucket mode) bucket locks, sorted
	keys    string // exclusive key locks, sorted, in exact mode only
}

// newKeyLockSQL builds the statements locking the key hashes of src, a query whose column h
// yields them (duplicates allowed) and whose parameters, if any, are every statement's.
func newKeyLockSQL(q *Queries, src string) keyLockSQL {
	budget := strconv.Itoa(KeyLockBudget)
	buckets := strconv.Itoa(KeyLockBuckets)
	keyClass := strconv.Itoa(int(q.KeyLockClass)) + "::int4"
	bucketClass := strconv.Itoa(int(q.KeyBucketLockClass)) + "::int4"
	exact := `current_setting('` + keyLockModeSetting + `', true) = 'exact'`
	var k keyLockSQL
	// n: exact key locks taken so far in this transaction ('' once a setting made local in an
	// earlier transaction of the session was reset); k: distinct keys of this call. c is
	// MATERIALIZED so that n is read once, before the count is set (inlined, the mode's
	// expression would read the new count).
	k.decide = `WITH c AS MATERIALIZED (
  SELECT coalesce(nullif(current_setting('` + keyLockCountSetting + `', true), ''), '0')::int4 AS n,
         (SELECT count(DISTINCT s.h)::int4 FROM (` + src + `) s) AS k
)
SELECT set_config('` + keyLockCountSetting + `', (c.n + CASE WHEN c.n + c.k <= ` + budget + ` THEN c.k ELSE 0 END)::text, true),
       set_config('` + keyLockModeSetting + `', CASE WHEN c.n + c.k <= ` + budget + ` THEN 'exact' ELSE 'bucket' END, true)
FROM c`
	// ARRAY(… ORDER BY) and unnest keep the order: locks are taken in it.
	k.buckets = `SELECT count(CASE WHEN ` + exact + ` THEN pg_advisory_xact_lock_shared(` + bucketClass + `, u.b)
    ELSE pg_advisory_xact_lock(` + bucketClass + `, u.b) END)
FROM unnest(ARRAY(SELECT DISTINCT s.h % ` + buckets + ` FROM (` + src + `) s ORDER BY 1)) AS u(b)`
	k.keys = `SELECT count(pg_advisory_xact_lock(` + keyClass + `, u.h))
FROM unnest(ARRAY(SELECT DISTINCT s.h FROM (` + src + `) s ORDER BY 1)) AS u(h)
WHERE ` + exact
	return k
}

// queue adds the lock statements to b; args are src's parameters.
func (k *keyLockSQL) queue(b *pgx.Batch, args ...any) {
	b.Queue(k.decide, args...)
	b.Queue(k.buckets, args...)
	b.Queue(k.keys, args...)
}

// results reads the results of the statements queue added.
func (k *keyLockSQL) results(br pgx.BatchResults) error {
	for range 3 {
		if _, err := br.Exec(); err != nil {
			return err
		}
	}
	return nil
}
