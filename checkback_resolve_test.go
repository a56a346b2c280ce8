package txoutbox_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/txoutbox/txoutbox/checkback"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
)

// A half message whose stored headers do not decode is not asked about without them (the
// checker's answer may depend on them, and they used to be dropped without a word): the
// check is an error, recorded on the row and logged, and the other rows are checked as usual.
// The check-back's effective outbox identity is observable (OutboxIdentity) although
// Config().Outbox stays as configured.
func TestCheckBackRefusesUndecodableStoredHeaders(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	identity, err := checker.OutboxIdentity(ctx, db.Pool, db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	asked := map[uuid.UUID]checker.Request{}
	srv, err := checker.Serve(n.Conn, "orders", func(_ context.Context, req checker.Request) (outbox.LocalState, error) {
		mu.Lock()
		defer mu.Unlock()
		asked[req.MessageID] = req
		return outbox.StateCommit, nil
	}, &checker.Config{Outbox: identity, Logger: testsvc.Logger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := srv.Stop(); err != nil {
			t.Error(err)
		}
	})
	msg := outbox.Message{Subject: "orders.created", Headers: map[string][]string{"X-Tenant": {"7"}}, Payload: []byte("x")}
	opts := &outbox.PrepareOptions{Group: "orders"}
	good, err := client.Prepare(ctx, db.Pool, msg, opts)
	if err != nil {
		t.Fatal(err)
	}
	bad, err := client.Prepare(ctx, db.Pool, msg, opts)
	if err != nil {
		t.Fatal(err)
	}
	// A value that is not an array: valid JSON, not what a producer stores.
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET headers = '{"X-Tenant": "7"}'::jsonb WHERE message_id = $1`, bad.ID); err != nil {
		t.Fatal(err)
	}
	// Past the transaction timeout without waiting for it.
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET created_at = created_at - interval '1 hour' WHERE state = 'prepared'`); err != nil {
		t.Fatal(err)
	}
	var logs testsvc.LogBuffer
	cb, err := checkback.New(db.Pool, n.Conn, &checkback.Config{Schema: db.Schema, TransactionTimeout: time.Minute,
		BackoffBase: time.Hour, BackoffMax: time.Hour, Logger: logs.Logger()})
	if err != nil {
		t.Fatal(err)
	}
	if got := cb.Config().Outbox; got != "" {
		t.Fatalf("Config().Outbox = %q, want it as configured (empty)", got)
	}
	if got, err := cb.OutboxIdentity(ctx); err != nil || got != identity {
		t.Fatalf("OutboxIdentity = %q, %v; want %q", got, err, identity)
	}
	rep, err := cb.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Resolve.Committed != 1 || rep.Resolve.Checks[checkback.OutcomeCommit] != 1 || rep.Resolve.Checks[checkback.OutcomeError] != 1 {
		t.Fatalf("resolve: %+v, want the good row committed and the bad one an error", rep.Resolve)
	}
	mu.Lock()
	_, askedBad := asked[bad.ID]
	req, askedGood := asked[good.ID]
	mu.Unlock()
	if askedBad || !askedGood || len(req.Headers["X-Tenant"]) != 1 || req.Headers["X-Tenant"][0] != "7" {
		t.Fatalf("asked about the bad row %v, the good one %v with headers %v; want only the good one, with its headers", askedBad, askedGood, req.Headers)
	}
	var state, lastErr string
	var checks int
	if err := db.Pool.QueryRow(ctx, `SELECT state, check_count, last_error FROM txoutbox_messages WHERE message_id = $1`, bad.ID).Scan(&state, &checks, &lastErr); err != nil {
		t.Fatal(err)
	}
	if state != "prepared" || checks != 1 || !strings.Contains(lastErr, "stored headers") {
		t.Fatalf("the bad row: %s after %d checks, last_error %q; want prepared, 1, naming the stored headers", state, checks, lastErr)
	}
	if lines := logs.Lines(t, "check-back: a half message's stored headers do not decode; its checker is not asked", "message_id", bad.ID.String()); len(lines) != 1 {
		t.Fatalf("%d log lines about the bad row, want 1; the log:\n%s", len(lines), logs.String())
	}
}
