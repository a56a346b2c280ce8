package relaycli

import (
	"context"
	"strings"
	"testing"

	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// `relay checkback --once` with NATS down fails when a half message was due for a check (a
// cron job must see it), and succeeds when nothing was due.
func TestCheckbackOnceFailsWhenItCouldNotCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	n := testsvc.NewNATS(t)
	n.Stop()
	idle := testsvc.NewDB(t)
	vars := map[string]string{"DATABASE_URL": idle.DSN, "NATS_URL": n.URL(), "TXOUTBOX_SCHEMA": idle.Schema}
	if code, out, errOut := cliEnv(t, vars, "checkback", "--once", "--check-transaction-timeout", "1ms"); code != 0 {
		t.Fatalf("nothing due, NATS down: exit %d, want 0:\n%s%s", code, out, errOut)
	}

	db := testsvc.NewDB(t)
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	h, err := client.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created"}, &outbox.PrepareOptions{Group: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	vars = map[string]string{"DATABASE_URL": db.DSN, "NATS_URL": n.URL(), "TXOUTBOX_SCHEMA": db.Schema}
	code, out, errOut := cliEnv(t, vars, "checkback", "--once", "--check-transaction-timeout", "1ms")
	if code != 1 || !strings.Contains(errOut, "could not check 1 half message") || !strings.Contains(errOut, "NATS at "+n.URL()+" does not answer") ||
		!strings.Contains(out, "not checked 1") {
		t.Fatalf("a row due, NATS down: exit %d, want 1 saying what could not be done:\n%s%s", code, out, errOut)
	}
	var state string
	var checks int
	if err := db.Pool.QueryRow(ctx, `SELECT state, check_count FROM txoutbox_messages WHERE message_id = $1`, h.ID).Scan(&state, &checks); err != nil {
		t.Fatal(err)
	}
	if state != "prepared" || checks != 0 {
		t.Fatalf("the row is %s after %d checks, want prepared with none counted", state, checks)
	}
}
