package migrations_test

import (
	"cmp"
	"context"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/migrations"
)

// Migrations are applied by deploy tooling — `relay migrate up`, or this, from a deploy step
// of your own. Up applies what is missing, in one transaction per version, serialised with
// other runners by an advisory lock; Status reports each version.
func ExampleMigrator_Up() {
	ctx := context.Background()
	schema := cmp.Or(os.Getenv("TXOUTBOX_SCHEMA"), txoutbox.DefaultSchema) // the outbox's schema, as relay run reads it
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := m.Up(ctx, pool); err != nil { // the versions it applied: none when up to date
		fmt.Println(err)
		return
	}
	status, err := m.Status(ctx, pool)
	if err != nil {
		fmt.Println(err)
		return
	}
	pending := 0
	for _, s := range status {
		if !s.Applied {
			pending++
		}
	}
	fmt.Println("pending migrations:", pending)
	// Output: pending migrations: 0
}
