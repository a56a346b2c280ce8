package relaycli

import (
	"fmt"
	"io"
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

// writeMore says that a list was cut at limit and more rows match: "(first N shown; raise
// --limit for more)". Text lists print it under their table; with --json it goes to stderr
// (w is env.Stderr), so that stdout stays one JSON array and a script still learns that the
// array is not every row.
func writeMore(w io.Writer, limit int) {
	fmt.Fprintf(w, "(first %d shown; raise --limit for more)\n", limit)
}
