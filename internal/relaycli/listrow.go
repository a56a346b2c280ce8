package relaycli

import (
	"context"
	"time"

	"github.com/google/uuid"
	"github.com/txoutbox/txoutbox/internal/store"
)

// listRow holds the fields every row of relay dead list, prepared list and scheduled list
// --json has, whatever the list: each list adds its own after them (prepared: group, mode,
// checks, next_check_at; scheduled: biz_key, deliver_at, due_at). Every field is present.
type listRow struct {
	MessageID    uuid.UUID           `json:"message_id"`
	State        string              `json:"state"`
	Subject      string              `json:"subject"`
	Key          string              `json:"key"`
	Attempts     int32               `json:"attempts"`
	CreatedAt    time.Time           `json:"created_at"`
	LastError    string              `json:"last_error"`
	PayloadBytes int64               `json:"payload_bytes"`
	Headers      map[string][]string `json:"headers"`
}

// listRowFields reads the common fields a list's own query leaves out (attempts, last error,
// payload size, headers) for the rows of ids, in one statement.
func listRowFields(ctx context.Context, db store.DBTX, q *store.Queries, ids []uuid.UUID) (map[uuid.UUID]listRow, error) {
	out := map[uuid.UUID]listRow{}
	if len(ids) == 0 {
		return out, nil
	}
	rows, err := db.Query(ctx, `SELECT message_id, state, attempts, coalesce(last_error, ''), octet_length(payload), headers
FROM `+q.Messages+` WHERE message_id = ANY($1)`, ids)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var r listRow
		var size *int64
		if err := rows.Scan(&r.MessageID, &r.State, &r.Attempts, &r.LastError, &size, &r.Headers); err != nil {
			return nil, err
		}
		if size != nil {
			r.PayloadBytes = *size
		}
		out[r.MessageID] = r
	}
	return out, rows.Err()
}

// noNilHeaders makes an absent header map {} (a list is never null).
func (r *listRow) noNilHeaders() {
	if r.Headers == nil {
		r.Headers = map[string][]string{}
	}
}
