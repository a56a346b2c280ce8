package dbhandle_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/dbhandle"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

func TestMain(m *testing.M) { os.Exit(testsvc.Main(m)) }

// Every single-connection handle, pgx's and database/sql's, is refused with a ConfigError
// naming the argument; pools are accepted.
func TestRequirePool(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	handles := map[string]any{}
	for name, h := range testsvc.SingleConnections(t, db) {
		handles[name] = h
	}
	sdb, err := sql.Open("pgx", db.DSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sdb.Close() })
	ctx := context.Background()
	sconn, err := sdb.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sconn.Close() })
	stx, err := sdb.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = stx.Rollback() })
	handles["*sql.Conn"], handles["*sql.Tx"] = sconn, stx
	for name, h := range handles {
		err := dbhandle.RequirePool("consumer", "db", h)
		var ce *txoutbox.ConfigError
		if !errors.As(err, &ce) || ce.Package != "consumer" || ce.Field != "db" || !errors.Is(err, txoutbox.ErrInvalidConfig) {
			t.Errorf("%s: %v; want a *txoutbox.ConfigError naming db", name, err)
		}
	}
	for name, h := range map[string]any{"*pgxpool.Pool": db.Pool, "*sql.DB": sdb} {
		if err := dbhandle.RequirePool("consumer", "db", h); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}
