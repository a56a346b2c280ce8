// Package dbhandle refuses, for the components that use a database handle from several
// goroutines at once, the handles that are one connection.
package dbhandle

import (
	"database/sql"
	"reflect"

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

// RequireArg returns a *txoutbox.ConfigError of package pkg naming the argument arg when v is
// nil, a nil interface or an interface holding a nil pointer, map, slice, channel or function
// (a (*pgxpool.Pool)(nil) passed as a Beginner), and nil otherwise. want says what the
// argument should be, for the message.
func RequireArg(pkg, arg, want string, v any) error {
	if !isNil(v) {
		return nil
	}
	return &txoutbox.ConfigError{Package: pkg, Field: arg, Reason: "must not be nil: pass " + want}
}

func isNil(v any) bool {
	if v == nil {
		return true
	}
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Slice, reflect.Chan, reflect.Func, reflect.Interface:
		return rv.IsNil()
	}
	return false
}
