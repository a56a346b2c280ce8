package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// KeyOrderTable is the ordered consumer's per-key applied sequence (migration 003).
const KeyOrderTable = "txoutbox_consumer_key_order"

func (q *Queries) keyOrderTable() string { return pgx.Identifier{q.Schema, KeyOrderTable}.Sanitize() }

// LockKeyOrder locks the (consumer, stream, key) row of the ordered consumer in tx, creating
// it when missing, and returns the highest stream sequence applied for the key (0: none). The
// lock is held until tx ends, so that one message of a key is checked and applied at a time.
func (q *Queries) LockKeyOrder(ctx context.Context, tx DBTX, consumer, stream, key string) (uint64, error) {
	// The no-op update locks an existing row as SELECT ... FOR UPDATE would, and a row
	// inserted concurrently is waited for, in one round trip.
	var applied int64
	err := tx.QueryRow(ctx, q.lockKeyOrderSQL(), consumer, stream, key).Scan(&applied)
	return uint64(applied), err
}

// LockKeyOrderSQL is LockKeyOrder over database/sql.
func (q *Queries) LockKeyOrderSQL(ctx context.Context, tx SQLDBTX, consumer, stream, key string) (uint64, error) {
	var applied int64
	err := tx.QueryRowContext(ctx, q.lockKeyOrderSQL(), consumer, stream, key).Scan(&applied)
	return uint64(applied), err
}

func (q *Queries) lockKeyOrderSQL() string {
	return `INSERT INTO ` + q.keyOrderTable() + ` AS k (consumer, stream, order_key, applied_seq)
VALUES ($1, $2, $3, 0)
ON CONFLICT (consumer, stream, order_key) DO UPDATE SET applied_seq = k.applied_seq
RETURNING applied_seq`
}

func (q *Queries) advanceKeyOrderSQL() string {
	return `INSERT INTO ` + q.keyOrderTable() + ` AS k (consumer, stream, order_key, applied_seq)
VALUES ($1, $2, $3, $4)
ON CONFLICT (consumer, stream, order_key) DO UPDATE SET applied_seq = greatest(k.applied_seq, excluded.applied_seq), updated_at = now()`
}

// AdvanceKeyOrder records seq as the key's highest applied stream sequence (it never moves
// back), in tx.
func (q *Queries) AdvanceKeyOrder(ctx context.Context, tx DBTX, consumer, stream, key string, seq uint64) error {
	_, err := tx.Exec(ctx, q.advanceKeyOrderSQL(), consumer, stream, key, int64(seq))
	return err
}

// AdvanceKeyOrderSQL is AdvanceKeyOrder over database/sql.
func (q *Queries) AdvanceKeyOrderSQL(ctx context.Context, tx SQLDBTX, consumer, stream, key string, seq uint64) error {
	_, err := tx.ExecContext(ctx, q.advanceKeyOrderSQL(), consumer, stream, key, int64(seq))
	return err
}

// QueueAdvanceKeyOrder queues AdvanceKeyOrder's statement on b.
func (q *Queries) QueueAdvanceKeyOrder(b *pgx.Batch, consumer, stream, key string, seq uint64) {
	b.Queue(q.advanceKeyOrderSQL(), consumer, stream, key, int64(seq))
}

// ErrNoKeyOrderTable: the schema lacks migration 003's table.
var ErrNoKeyOrderTable = errors.New("store: " + KeyOrderTable + " does not exist (run the migrations)")

// ErrKeyOrderPrivileges: the session's role may not read, insert and update the table.
var ErrKeyOrderPrivileges = errors.New("store: " + KeyOrderTable + " needs SELECT, INSERT and UPDATE")

// CheckKeyOrderTable reports ErrNoKeyOrderTable when the schema lacks the table, and
// ErrKeyOrderPrivileges when the session's role cannot use it.
func (q *Queries) CheckKeyOrderTable(ctx context.Context, db DBTX) error {
	var exists, allowed bool
	err := db.QueryRow(ctx, checkKeyOrderTableSQL, q.keyOrderTable()).Scan(&exists, &allowed)
	return keyOrderTableState(err, exists, allowed)
}

// CheckKeyOrderTableSQL is CheckKeyOrderTable over database/sql.
func (q *Queries) CheckKeyOrderTableSQL(ctx context.Context, db SQLDBTX) error {
	var exists, allowed bool
	err := db.QueryRowContext(ctx, checkKeyOrderTableSQL, q.keyOrderTable()).Scan(&exists, &allowed)
	return keyOrderTableState(err, exists, allowed)
}

// checkKeyOrderTableSQL reads whether the table ($1) exists and the session's role may read,
// insert and update it (a list of privileges in one has_table_privilege would mean "any of").
const checkKeyOrderTableSQL = `SELECT to_regclass($1) IS NOT NULL,
       CASE WHEN to_regclass($1) IS NULL THEN false
            ELSE has_table_privilege(to_regclass($1), 'SELECT') AND has_table_privilege(to_regclass($1), 'INSERT')
                 AND has_table_privilege(to_regclass($1), 'UPDATE') END`

// ErrNoDedupTable: the schema lacks migration 001's consumer dedup table.
var ErrNoDedupTable = errors.New("store: " + DedupTable + " does not exist (run the migrations)")

// ErrDedupPrivileges: the session's role may not insert into the dedup table and read it
// (the batch insert returns the keys it recorded).
var ErrDedupPrivileges = errors.New("store: " + DedupTable + " needs INSERT and SELECT")

// checkDedupTableSQL reads whether the dedup table ($1) exists and the session's role may
// insert into it and read it.
const checkDedupTableSQL = `SELECT to_regclass($1) IS NOT NULL,
       CASE WHEN to_regclass($1) IS NULL THEN false
            ELSE has_table_privilege(to_regclass($1), 'SELECT') AND has_table_privilege(to_regclass($1), 'INSERT') END`

// CheckDedupTable reports ErrNoDedupTable when the schema lacks the consumer dedup table, and
// ErrDedupPrivileges when the session's role cannot use it.
func (q *Queries) CheckDedupTable(ctx context.Context, db DBTX) error {
	var exists, allowed bool
	err := db.QueryRow(ctx, checkDedupTableSQL, q.Dedup).Scan(&exists, &allowed)
	return tableState(err, exists, allowed, ErrNoDedupTable, ErrDedupPrivileges)
}

// CheckDedupTableSQL is CheckDedupTable over database/sql.
func (q *Queries) CheckDedupTableSQL(ctx context.Context, db SQLDBTX) error {
	var exists, allowed bool
	err := db.QueryRowContext(ctx, checkDedupTableSQL, q.Dedup).Scan(&exists, &allowed)
	return tableState(err, exists, allowed, ErrNoDedupTable, ErrDedupPrivileges)
}

func keyOrderTableState(err error, exists, allowed bool) error {
	return tableState(err, exists, allowed, ErrNoKeyOrderTable, ErrKeyOrderPrivileges)
}

func tableState(err error, exists, allowed bool, missing, denied error) error {
	switch {
	case SQLState(err) == "42501": // no USAGE on the schema: to_regclass itself is refused
		return fmt.Errorf("%w: %v", denied, err)
	case err != nil:
		return err
	case !exists:
		return missing
	case !allowed:
		return denied
	}
	return nil
}
