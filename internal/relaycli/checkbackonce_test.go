package relaycli

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
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

// `relay checkback --once --check-schedule ' off'` does not resolve (a row due for a check
// stays prepared, and NATS being down does not fail the run) and prints no resolve line: the
// schedule is read as the check-back reads it, white space around it ignored.
func TestCheckbackOnceScheduleOffWithSpaces(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	n := testsvc.NewNATS(t)
	n.Stop()
	db := testsvc.NewDB(t)
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	h, err := client.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created"}, &outbox.PrepareOptions{Group: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{"DATABASE_URL": db.DSN, "NATS_URL": n.URL(), "TXOUTBOX_SCHEMA": db.Schema}
	code, out, errOut := cliEnv(t, vars, "checkback", "--once", "--check-transaction-timeout", "1ms", "--check-schedule", " off", "--stale-schedule", "off ")
	if code != 0 || strings.Contains(out, "resolve:") || strings.Contains(out, "stale:") || !strings.Contains(out, "purge:") {
		t.Fatalf("resolve and stale off: exit %d, want 0 with the purge line alone:\n%s%s", code, out, errOut)
	}
	var state string
	if err := db.Pool.QueryRow(ctx, `SELECT state FROM txoutbox_messages WHERE message_id = $1`, h.ID).Scan(&state); err != nil {
		t.Fatal(err)
	}
	if state != "prepared" {
		t.Fatalf("the row is %s, want prepared (the resolve job is off)", state)
	}
}

// `relay checkback --once` with NATS up fails exactly when a due check got no answer from its
// checker: an UNKNOWN answer is an answer (exit 0), a checker that fails (error) or nobody
// serving the group (no_responders, covered in TestCheckbackAndPreparedCommands) is not.
func TestCheckbackOnceFailsOnUnansweredChecks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	n := testsvc.NewNATS(t)
	for _, tc := range []struct {
		answer  outbox.LocalState
		err     error
		code    int
		outcome string
	}{
		{answer: outbox.StateUnknown, code: 0, outcome: "unknown 1"},
		{err: errors.New("the ledger is down"), code: 1, outcome: "error 1"},
	} {
		db := testsvc.NewDB(t)
		id, err := checker.OutboxIdentity(ctx, db.Pool, db.Schema)
		if err != nil {
			t.Fatal(err)
		}
		srv, err := checker.Serve(n.Conn, "orders", func(context.Context, checker.Request) (outbox.LocalState, error) {
			return tc.answer, tc.err
		}, &checker.Config{Outbox: id})
		if err != nil {
			t.Fatal(err)
		}
		client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := client.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created"}, &outbox.PrepareOptions{Group: "orders"}); err != nil {
			t.Fatal(err)
		}
		vars := map[string]string{"DATABASE_URL": db.DSN, "NATS_URL": n.URL(), "TXOUTBOX_SCHEMA": db.Schema}
		code, out, errOut := cliEnv(t, vars, "checkback", "--once", "--check-transaction-timeout", "1ms", "--log-level", "error")
		if err := srv.Stop(); err != nil {
			t.Fatal(err)
		}
		if code != tc.code || !strings.Contains(out, tc.outcome) {
			t.Fatalf("checker answering %q/%v: exit %d, want %d with %q:\n%s%s", tc.answer, tc.err, code, tc.code, tc.outcome, out, errOut)
		}
		if tc.code == 1 && !strings.Contains(errOut, "got no answer from its checker ("+tc.outcome+")") {
			t.Fatalf("the failure does not say which checks failed:\n%s", errOut)
		}
	}
}
