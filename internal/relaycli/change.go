package relaycli

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/google/uuid"
	"github.com/txoutbox/txoutbox/internal/store"
)

// changeResult is what an admin command that changes rows did — relay dead requeue|purge,
// prepared resume|commit|rollback, scheduled cancel — in one shape (--json): the action, the
// ids changed, and each id asked for by name (or business key) that was not changed, with why.
// An id asked for and not changed makes the exit status 1, whatever the command.
type changeResult struct {
	Action string `json:"action"`
	// DryRun is set by the commands that take --dry-run (relay dead), and shown by them only.
	DryRun     *bool           `json:"dry_run,omitempty"`
	MessageIDs []uuid.UUID     `json:"message_ids"`
	Failed     []changeFailure `json:"failed"`
}

// changeFailure is an id (or a business key) not changed and why. MessageID is null only for
// a business key with no message to name (relay scheduled cancel --biz-key), whose key the
// reason quotes.
type changeFailure struct {
	MessageID *uuid.UUID `json:"message_id"`
	Reason    string     `json:"reason"`
}

// fail records that id was not changed, and why.
func (r *changeResult) fail(id uuid.UUID, reason string) {
	r.Failed = append(r.Failed, changeFailure{MessageID: &id, Reason: reason})
}

// reasonNoSuchMessage is why an id that names no row was not changed.
const reasonNoSuchMessage = "no such message (never enqueued, or published and deleted, or purged)"

// whyUnchanged says why the row of id, asked for by name, was not changed by an action that
// changes rows in states (named what): no such row, or the state it is in; a row in one of
// states was left out by the command's other filters or --limit.
func whyUnchanged(ctx context.Context, db store.DBTX, q *store.Queries, id uuid.UUID, states []string, what string) (string, error) {
	d, err := q.Message(ctx, db, id)
	switch {
	case errors.Is(err, store.ErrNoRow):
		return reasonNoSuchMessage, nil
	case err != nil:
		return "", err
	case !slices.Contains(states, d.State):
		return "not " + what + ": it is " + d.State, nil
	}
	return "left out by the other filters or --limit (it is " + d.State + ")", nil
}

// unchanged returns the ids of asked that are not in done, in the order asked, once each.
func unchanged(asked, done []uuid.UUID) []uuid.UUID {
	var not []uuid.UUID
	for _, id := range asked {
		if !slices.Contains(done, id) && !slices.Contains(not, id) {
			not = append(not, id)
		}
	}
	return not
}

// write prints r as one JSON object, or as text: a line per id changed ("committed ID"), a
// count ("2 committed", also when it is 0; count names what is counted) and, on stderr, a
// line per id not changed with why. It returns an error (exit status 1) when an id was not
// changed: "1 of 3 messages not committed".
func (r changeResult) write(env *Env, asJSON bool, verb, count, notVerb string) error {
	if r.MessageIDs == nil {
		r.MessageIDs = []uuid.UUID{}
	}
	if r.Failed == nil {
		r.Failed = []changeFailure{}
	}
	if asJSON {
		if err := writeJSON(env, r); err != nil {
			return err
		}
	} else {
		for _, id := range r.MessageIDs {
			fmt.Fprintf(env.Stdout, "%s %s\n", verb, id)
		}
		fmt.Fprintf(env.Stdout, "%d %s\n", len(r.MessageIDs), count)
		for _, f := range r.Failed {
			if f.MessageID == nil {
				fmt.Fprintln(env.Stderr, printable(f.Reason, false))
				continue
			}
			fmt.Fprintf(env.Stderr, "%s: %s\n", f.MessageID, printable(f.Reason, false))
		}
	}
	if n := len(r.Failed); n > 0 {
		return fmt.Errorf("%d of %d %s %s", n, n+len(r.MessageIDs), plural(n+len(r.MessageIDs), "message", "messages"), notVerb)
	}
	return nil
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
