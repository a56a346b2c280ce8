// Package dbhandle refuses, for the components that use a database handle from several
// goroutines at once, the handles that are one connection.
package dbhandle

import (
	"database/sql"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox"
)

// SingleConnection returns what db is when it is one connection or one transaction, which
// are not safe for concurrent use (a *pgx.Conn, a *pgxpool.Conn, a pgx.Tx, a *sql.Conn or a
// *sql.Tx), and "" otherwise (a pool, or a type it does not know).
func SingleConnection(db any) string {
	switch db.(type) {
	case *pgx.Conn:
		return "*pgx.Conn"
	case *pgxpool.Conn:
		return "*pgxpool.Conn"
	case pgx.Tx:
		return "pgx.Tx"
	case *sql.Conn:
		return "*sql.Conn"
	case *sql.Tx:
		return "*sql.Tx"
	}
	return ""
}

// RequirePool returns a *txoutbox.ConfigError of package pkg naming the argument arg when db
// is one connection or one transaction (see SingleConnection), and nil otherwise.
func RequirePool(pkg, arg string, db any) error {
	what := SingleConnection(db)
	if what == "" {
		return nil
	}
	return &txoutbox.ConfigError{Package: pkg, Field: arg,
		Reason: "must be safe for concurrent use (a pool, such as a *pgxpool.Pool or a *sql.DB), got a " + what +
			": one connection, which the " + pkg + "'s goroutines cannot share"}
}
