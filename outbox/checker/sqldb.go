package checker

import (
	"context"
	"fmt"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/dbhandle"
	"github.com/txoutbox/txoutbox/internal/store"
)

// OutboxIdentitySQL is OutboxIdentity for database/sql: the identity of the outbox in schema
// of the database db (a *sql.DB, *sql.Conn or *sql.Tx of any PostgreSQL driver) is connected
// to. As with OutboxIdentity, a schema without the outbox table is ErrNoOutboxTable and a nil
// db a *txoutbox.ConfigError naming it.
func OutboxIdentitySQL(ctx context.Context, db txoutbox.SQLDBTX, schema string) (string, error) {
	if err := dbhandle.RequireArg("checker", "db", "the producers' database (a *sql.DB)", db); err != nil {
		return "", err
	}
	if schema == "" {
		schema = txoutbox.DefaultSchema
	}
	var sysid int64
	var database string
	var found bool
	if err := db.QueryRowContext(ctx, store.OutboxIdentityQuery, schema).Scan(&sysid, &database, &found); err != nil {
		return "", fmt.Errorf("checker: outbox identity: %w", err)
	}
	return outboxIdentity(sysid, database, schema, found)
}
