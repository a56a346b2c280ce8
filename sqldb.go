package txoutbox

import (
	"context"
	"database/sql"
)

// SQLDBTX runs statements through database/sql: *sql.Tx, *sql.Conn and *sql.DB satisfy it, and
// so do sqlx's *sqlx.Tx and *sqlx.DB and GORM's connection pool (gorm.DB.Statement.ConnPool,
// the *sql.Tx inside a GORM transaction). A call given a *sql.Tx runs its statements in that
// transaction. The driver must speak to PostgreSQL and accept string, []byte, int64, float64,
// bool and nil arguments, as every database/sql driver does; pgx's stdlib driver
// (github.com/jackc/pgx/v5/stdlib) and lib/pq are tested. It is the database/sql counterpart
// of DBTX: the packages' database/sql methods (their names say SQL) take it.
type SQLDBTX interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// SQLBeginner begins database/sql transactions: *sql.DB, *sql.Conn and sqlx's *sqlx.DB
// satisfy it. It is the database/sql counterpart of Beginner.
type SQLBeginner interface {
	BeginTx(ctx context.Context, opts *sql.TxOptions) (*sql.Tx, error)
}

// SQLDB runs statements and begins transactions through database/sql: usually a *sql.DB. It is
// the database/sql counterpart of DB.
type SQLDB interface {
	SQLDBTX
	SQLBeginner
}
