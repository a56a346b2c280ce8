package relaycli

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/migrations"
)

// relay run's schema check accepts a schema golang-migrate brought up to date, and names the
// version and the table it read when the schema is behind.
func TestCheckSchemaReadsGolangMigrate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t) // migrated by relay migrate's runner: move its record to golang-migrate's table
	q := func(sql string) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	own := pgx.Identifier{db.Schema, migrations.VersionTable}.Sanitize()
	gm := pgx.Identifier{db.Schema, migrations.GolangMigrateTable}.Sanitize()
	q(`DROP TABLE ` + own)
	q(`CREATE TABLE ` + gm + ` (version bigint NOT NULL PRIMARY KEY, dirty boolean NOT NULL)`)
	q(`INSERT INTO ` + gm + ` VALUES (0, false)`)
	m, err := migrations.New(&migrations.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE `+gm+` SET version = $1`, m.Latest()); err != nil {
		t.Fatal(err)
	}
	if err := checkSchema(ctx, db.Pool, db.Schema); err != nil {
		t.Fatalf("an up-to-date golang-migrate schema is refused: %v", err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE `+gm+` SET version = $1`, m.Latest()-1); err != nil {
		t.Fatal(err)
	}
	err = checkSchema(ctx, db.Pool, db.Schema)
	if err == nil || !strings.Contains(err.Error(), "schema_migrations") || !strings.Contains(err.Error(), "golang-migrate") {
		t.Fatalf("a schema one version behind: %v, want a refusal naming golang-migrate's schema_migrations", err)
	}
}
