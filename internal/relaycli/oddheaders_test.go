package relaycli

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// A row whose stored headers are not the producers' object of string arrays (written by hand
// or by another tool; the relay makes such a row dead on sight) does not fail the admin
// commands that list or show it: a string value is shown as a one-element list, any other
// value as its JSON text.
func TestAdminCommandsShowOddHeaders(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	vars := map[string]string{"DATABASE_URL": db.DSN, "TXOUTBOX_SCHEMA": db.Schema}
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	var dead, sched string
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := c.EnqueueTx(ctx, tx,
		outbox.Message{Subject: "orders.odd", Payload: []byte("d")},
		outbox.Message{Subject: "orders.later", Payload: []byte("s"), DeliverAt: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	dead, sched = ids[0].String(), ids[1].String()
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET headers = '{"a": "one", "b": 7, "c": ["x", "y"]}', state = 'dead', attempts = 1, last_error = 'odd'
		WHERE message_id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET headers = '[1, 2]' WHERE message_id = $1`, ids[1]); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"dead", "list"}, {"dead", "list", "--json"}, {"dead", "show", dead}, {"dead", "show", dead, "--json"},
		{"scheduled", "list"}, {"scheduled", "list", "--json"},
	} {
		code, out, errOut := cliEnv(t, vars, args...)
		if code != 0 {
			t.Errorf("%q: exit %d: %s %s", args, code, out, errOut)
			continue
		}
		if strings.Contains(strings.Join(args, " "), "json") && args[0] == "dead" && !strings.Contains(out, `"one"`) {
			t.Errorf("%q: %s; want the string header shown as a list", args, out)
		}
		if args[0] == "scheduled" && !strings.Contains(out, sched) {
			t.Errorf("%q: %s; want the scheduled row", args, out)
		}
	}
}
