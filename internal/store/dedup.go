package store

import (
	"context"
	"sort"

	"github.com/jackc/pgx/v5"
)

// dedupSQL holds the idempotent consumer's statements for one schema.
type dedupSQL struct {
	insert     string
	insertMany string
}

func newDedupSQL(table string) dedupSQL {
	return dedupSQL{
		// A conflict means another transaction already recorded (and committed, or is about to
		// commit) this key: READ COMMITTED makes a concurrent insert of the same key wait for
		// the first transaction and then report the conflict.
		insert: `INSERT INTO ` + table + ` (consumer, idempotency_key, message_id, stream_seq)
VALUES ($1, $2, $3, $4) ON CONFLICT (consumer, idempotency_key) DO NOTHING`,
		insertMany: `INSERT INTO ` + table + ` (consumer, idempotency_key, message_id, stream_seq)
SELECT $1, u.k, u.m, u.s FROM unnest($2::text[], $3::text[], $4::int8[]) WITH ORDINALITY AS u(k, m, s, ord)
ORDER BY u.ord
ON CONFLICT (consumer, idempotency_key) DO NOTHING
RETURNING idempotency_key`,
	}
}

// Savepoint statements of the consumer's batch mode: one savepoint per message, released
// before the next one so that the nesting depth stays at one.
const (
	SavepointSQL           = `SAVEPOINT txoutbox_msg`
	ReleaseSavepointSQL    = `RELEASE SAVEPOINT txoutbox_msg`
	RollbackToSavepointSQL = `ROLLBACK TO SAVEPOINT txoutbox_msg`
)

// DedupRow is one processed message of a consumer.
type DedupRow struct {
	Consumer       string
	IdempotencyKey string
	MessageID      string // "" stores NULL
	StreamSeq      uint64 // 0 stores NULL
}

func (r DedupRow) args() []any {
	var msgID, seq any
	if r.MessageID != "" {
		msgID = r.MessageID
	}
	if r.StreamSeq != 0 {
		seq = int64(r.StreamSeq)
	}
	return []any{r.Consumer, r.IdempotencyKey, msgID, seq}
}

// InsertDedup records r in db (the consumer's transaction). It reports false when the key is
// already recorded: the message is a duplicate.
func (q *Queries) InsertDedup(ctx context.Context, db DBTX, r DedupRow) (bool, error) {
	tag, err := db.Exec(ctx, q.dedup.insert, r.args()...)
	if err != nil {
		return false, err
	}
	return tag.RowsAffected() == 1, nil
}

// QueueInsertDedup queues InsertDedup's statement on b; the batch result's RowsAffected is 1
// when the row was inserted and 0 for a duplicate.
func (q *Queries) QueueInsertDedup(b *pgx.Batch, r DedupRow) {
	b.Queue(q.dedup.insert, r.args()...)
}

// InsertDedupMany records rows (all of one consumer, with distinct keys) in one statement and
// returns the keys it inserted; the others are duplicates. Rows are inserted in key order, so
// that two transactions recording overlapping keys wait for each other instead of deadlocking.
func (q *Queries) InsertDedupMany(ctx context.Context, db DBTX, consumer string, rows []DedupRow) (map[string]bool, error) {
	sorted := append([]DedupRow(nil), rows...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].IdempotencyKey < sorted[j].IdempotencyKey })
	keys := make([]string, len(sorted))
	ids := make([]*string, len(sorted))
	seqs := make([]*int64, len(sorted))
	for i, r := range sorted {
		keys[i] = r.IdempotencyKey
		if r.MessageID != "" {
			id := r.MessageID
			ids[i] = &id
		}
		if r.StreamSeq != 0 {
			seq := int64(r.StreamSeq)
			seqs[i] = &seq
		}
	}
	res, err := db.Query(ctx, q.dedup.insertMany, consumer, keys, ids, seqs)
	if err != nil {
		return nil, err
	}
	got, err := pgx.CollectRows(res, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	inserted := make(map[string]bool, len(got))
	for _, k := range got {
		inserted[k] = true
	}
	return inserted, nil
}
