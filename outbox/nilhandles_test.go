package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
)

// Every call that takes a database handle or a function refuses a nil one — an untyped nil
// or a typed nil pointer — with a *txoutbox.ConfigError naming the argument, before it does
// anything: no panic, and nothing stored (SendInTransaction without its local function used to
// store the half message, then panic).
func TestNilHandlesAreRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	m := outbox.Message{Subject: "orders.created", Payload: []byte("x")}
	opts := &outbox.PrepareOptions{Group: "orders"}
	local := func(context.Context, outbox.Half) (outbox.LocalState, error) { return outbox.StateCommit, nil }
	var nilPool *pgxpool.Pool
	var nilTx pgx.Tx
	var nilSQL *sql.DB
	var nilSQLTx *sql.Tx
	id := uuid.New()
	mig, err := migrations.New(&migrations.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	calls := map[string]struct {
		arg string
		run func() error
	}{
		"EnqueueTx":                 {"tx", func() error { _, err := c.EnqueueTx(ctx, nilTx, m); return err }},
		"EnqueueTx typed nil":       {"tx", func() error { _, err := c.EnqueueTx(ctx, nilPool, m); return err }},
		"Prepare":                   {"db", func() error { _, err := c.Prepare(ctx, nil, m, opts); return err }},
		"Commit":                    {"db", func() error { return c.Commit(ctx, nilPool, id) }},
		"CommitTx":                  {"tx", func() error { return c.CommitTx(ctx, nil, id) }},
		"Rollback":                  {"db", func() error { return c.Rollback(ctx, nil, id) }},
		"SendInTransaction db":      {"db", func() error { _, _, err := c.SendInTransaction(ctx, nilPool, m, opts, local); return err }},
		"SendInTransaction fn":      {"local", func() error { _, _, err := c.SendInTransaction(ctx, db.Pool, m, opts, nil); return err }},
		"CancelTx":                  {"tx", func() error { return c.CancelTx(ctx, nil, id) }},
		"RescheduleTx":              {"tx", func() error { return c.RescheduleTx(ctx, nil, id, time.Now()) }},
		"CancelBizKeyTx":            {"tx", func() error { _, err := c.CancelBizKeyTx(ctx, nil, "b"); return err }},
		"RescheduleBizKeyTx":        {"tx", func() error { _, err := c.RescheduleBizKeyTx(ctx, nil, "b", time.Now()); return err }},
		"EnqueueSQLTx":              {"tx", func() error { _, err := c.EnqueueSQLTx(ctx, nilSQLTx, m); return err }},
		"PrepareSQL":                {"db", func() error { _, err := c.PrepareSQL(ctx, nilSQL, m, opts); return err }},
		"CommitSQL":                 {"db", func() error { return c.CommitSQL(ctx, nilSQL, id) }},
		"CommitSQLTx":               {"tx", func() error { return c.CommitSQLTx(ctx, nilSQLTx, id) }},
		"RollbackSQL":               {"db", func() error { return c.RollbackSQL(ctx, nil, id) }},
		"SendInTransactionSQL":      {"db", func() error { _, _, err := c.SendInTransactionSQL(ctx, nilSQL, m, opts, local); return err }},
		"CancelSQLTx":               {"tx", func() error { return c.CancelSQLTx(ctx, nil, id) }},
		"RescheduleSQLTx":           {"tx", func() error { return c.RescheduleSQLTx(ctx, nil, id, time.Now()) }},
		"CancelBizKeySQLTx":         {"tx", func() error { _, err := c.CancelBizKeySQLTx(ctx, nil, "b"); return err }},
		"RescheduleBizKeySQLTx":     {"tx", func() error { _, err := c.RescheduleBizKeySQLTx(ctx, nil, "b", time.Now()); return err }},
		"checker.OutboxIdentity":    {"db", func() error { _, err := checker.OutboxIdentity(ctx, nilPool, db.Schema); return err }},
		"checker.OutboxIdentitySQL": {"db", func() error { _, err := checker.OutboxIdentitySQL(ctx, nilSQL, db.Schema); return err }},
		"Migrator.Up":               {"db", func() error { _, err := mig.Up(ctx, nil); return err }},
		"Migrator.Down":             {"db", func() error { _, err := mig.Down(ctx, nilPool, 1); return err }},
		"Migrator.Status":           {"db", func() error { _, err := mig.Status(ctx, nil); return err }},
		"Migrator.Version":          {"db", func() error { _, err := mig.Version(ctx, nil); return err }},
	}
	for name, call := range calls {
		var ce *txoutbox.ConfigError
		if err := call.run(); !errors.Is(err, txoutbox.ErrInvalidConfig) || !errors.As(err, &ce) || ce.Field != call.arg {
			t.Errorf("%s with a nil %s: %v, want a *txoutbox.ConfigError naming %s", name, call.arg, err, call.arg)
		}
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_messages`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d rows stored by the refused calls, %v; want none", n, err)
	}
}

// A LocalTxFunc answer that is none of the three states settles nothing and says so
// (ErrInvalidLocalState): the half message stays prepared for the check-back.
func TestSendInTransactionRefusesAnInvalidState(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	h, st, err := c.SendInTransaction(ctx, db.Pool, outbox.Message{Subject: "orders.created", Payload: []byte("x")},
		&outbox.PrepareOptions{Group: "orders"}, func(context.Context, outbox.Half) (outbox.LocalState, error) { return outbox.LocalState(7), nil })
	if !errors.Is(err, outbox.ErrInvalidLocalState) || st != outbox.LocalState(7) {
		t.Fatalf("SendInTransaction with LocalState(7): %v, %v; want ErrInvalidLocalState", st, err)
	}
	var state string
	if err := db.Pool.QueryRow(ctx, `SELECT state FROM txoutbox_messages WHERE message_id = $1`, h.ID).Scan(&state); err != nil || state != "prepared" {
		t.Fatalf("the half message is %q, %v; want prepared", state, err)
	}
	if _, err := outbox.ParseLocalState("MAYBE"); !errors.Is(err, outbox.ErrInvalidLocalState) {
		t.Fatalf("ParseLocalState(MAYBE): %v, want ErrInvalidLocalState", err)
	}
	// SendInTransactionSQL has the same rules.
	sdb := openSQL(t, db, "pgx")
	h, st, err = c.SendInTransactionSQL(ctx, sdb, outbox.Message{Subject: "orders.created", Payload: []byte("x")},
		&outbox.PrepareOptions{Group: "orders"}, func(context.Context, outbox.Half) (outbox.LocalState, error) { return outbox.LocalState(7), nil })
	if !errors.Is(err, outbox.ErrInvalidLocalState) || st != outbox.LocalState(7) {
		t.Fatalf("SendInTransactionSQL with LocalState(7): %v, %v; want ErrInvalidLocalState", st, err)
	}
	if err := db.Pool.QueryRow(ctx, `SELECT state FROM txoutbox_messages WHERE message_id = $1`, h.ID).Scan(&state); err != nil || state != "prepared" {
		t.Fatalf("the half message is %q, %v; want prepared", state, err)
	}
}
