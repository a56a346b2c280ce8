package testsvc

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox"
)

// SingleConnections returns, by name, one of each database handle that is one connection or
// one transaction, which the components that use their handle from several goroutines refuse:
// a *pgx.Conn, a *pgxpool.Conn of db's pool, a transaction of the pool, one of the connection
// and a savepoint. The test's cleanup closes them.
func SingleConnections(tb testing.TB, db *DB) map[string]txoutbox.DB {
	tb.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, db.DSN)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = conn.Close(context.Background()) })
	pooled, err := db.Pool.Acquire(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(pooled.Release)
	poolTx, err := db.Pool.Begin(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = poolTx.Rollback(context.Background()) })
	connTx, err := conn.Begin(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	savepoint, err := connTx.Begin(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	return map[string]txoutbox.DB{
		"*pgx.Conn": conn, "*pgxpool.Conn": pooled, "pgx.Tx of a pool": poolTx,
		"pgx.Tx of a connection": connTx, "pgx.Tx of a savepoint": savepoint,
	}
}
