package store

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// dedupSQL holds the idempotent consumer's statements for one schema.
type dedupSQL struct {
	insert string
}

func newDedupSQL(table string) dedupSQL {
	return dedupSQL{
		// A conflict means another transaction already recorded (and committed, or is about to
		// commit) this key: READ COMMITTED makes a concurrent insert of the same key wait for
		// the first transaction and then report the conflict.
		insert: `INSERT INTO ` + table + ` (consumer, idempotency_key, message_id, stream_seq)
VALUES ($1, $2, $3, $4) ON CONFLICT (consumer, idempotency_key) DO NOTHING`,
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
