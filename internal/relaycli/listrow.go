package relaycli

import (
	"time"

	"github.com/google/uuid"
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

// noNilHeaders makes an absent header map {} (a list is never null).
func (r *listRow) noNilHeaders() {
	if r.Headers == nil {
		r.Headers = map[string][]string{}
	}
}
