package store

import (
	"context"
	"errors"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// MessageDetail is one outbox row as an operator inspects it (relay dead show, relay prepared
// show): what would be published and why it is stuck.
type MessageDetail struct {
	ID          int64
	MessageID   uuid.UUID
	State       string
	Subject     string
	Key         string
	Headers     HeaderMap
	Payload     []byte
	Attempts    int32
	LastError   string
	CreatedAt   time.Time
	Group       string
	Mode        string
	CheckCount  int32
	NextCheckAt *time.Time
}

// Message returns the row of messageID, or ErrNoRow.
func (q *Queries) Message(ctx context.Context, db DBTX, messageID uuid.UUID) (*MessageDetail, error) {
	var d MessageDetail
	var key, lastErr, group, mode *string
	err := db.QueryRow(ctx, `SELECT id, message_id, state, subject, msg_key, headers, payload, attempts, last_error,
       created_at, producer_group, check_mode, check_count, next_check_at
FROM `+q.Messages+` WHERE message_id = $1`, messageID).Scan(&d.ID, &d.MessageID, &d.State, &d.Subject, &key, &d.Headers,
		&d.Payload, &d.Attempts, &lastErr, &d.CreatedAt, &group, &mode, &d.CheckCount, &d.NextCheckAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, ErrNoRow
	}
	if err != nil {
		return nil, err
	}
	for _, p := range []struct {
		dst *string
		src *string
	}{{&d.Key, key}, {&d.LastError, lastErr}, {&d.Group, group}, {&d.Mode, mode}} {
		if p.src != nil {
			*p.dst = *p.src
		}
	}
	return &d, nil
}
