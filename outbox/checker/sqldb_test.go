package checker_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib"
	_ "github.com/lib/pq"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox/checker"
)

// OutboxIdentitySQL agrees with OutboxIdentity, through either database/sql driver.
func TestOutboxIdentitySQL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	want, err := checker.OutboxIdentity(ctx, db.Pool, db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	for _, driver := range []string{"pgx", "postgres"} {
		sdb, err := sql.Open(driver, db.DSN)
		if err != nil {
			t.Fatal(err)
		}
		got, err := checker.OutboxIdentitySQL(ctx, sdb, db.Schema)
		// A schema without the outbox (mistyped): refused, not an identity nobody asks for.
		_, missing := checker.OutboxIdentitySQL(ctx, sdb, db.Schema+"_typo")
		_ = sdb.Close()
		if err != nil || got != want {
			t.Fatalf("%s: %q, %v; want %q", driver, got, err, want)
		}
		if !errors.Is(missing, checker.ErrNoOutboxTable) {
			t.Fatalf("%s: a schema without the outbox: %v, want ErrNoOutboxTable", driver, missing)
		}
	}
	if _, err := checker.OutboxIdentity(ctx, db.Pool, db.Schema+"_typo"); !errors.Is(err, checker.ErrNoOutboxTable) {
		t.Fatalf("a schema without the outbox: %v, want ErrNoOutboxTable", err)
	}
}
