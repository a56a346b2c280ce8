package migrations_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox/migrations"
)

// The version tables exactly as golang-migrate's postgres driver and goose create them.
const (
	golangMigrateDDL = `CREATE TABLE IF NOT EXISTS schema_migrations (version bigint NOT NULL PRIMARY KEY, dirty boolean NOT NULL)`
	gooseDDL         = `CREATE TABLE goose_db_version (id serial NOT NULL, version_id bigint NOT NULL, is_applied boolean NOT NULL, tstamp timestamp NULL DEFAULT now(), PRIMARY KEY (id))`
)

// applyAs applies the first n migrations the way tool does: the files as they are, in a
// transaction with the schema on the search_path, recording versions in the tool's table.
func applyAs(t *testing.T, pool *pgxpool.Pool, schema, tool string, n int) {
	t.Helper()
	ctx := context.Background()
	all, err := migrations.Load(migrations.FS)
	if err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		stmts := []string{"CREATE SCHEMA " + pgx.Identifier{schema}.Sanitize(), "SET LOCAL search_path TO " + pgx.Identifier{schema}.Sanitize()}
		if tool == "golang-migrate" {
			stmts = append(stmts, golangMigrateDDL)
		} else {
			stmts = append(stmts, gooseDDL, `INSERT INTO goose_db_version (version_id, is_applied) VALUES (0, true)`)
		}
		for _, m := range all[:n] {
			stmts = append(stmts, m.Up)
			if tool == "golang-migrate" {
				stmts = append(stmts, `DELETE FROM schema_migrations`, `INSERT INTO schema_migrations VALUES (`+itoa(m.Version)+`, false)`)
			} else {
				stmts = append(stmts, `INSERT INTO goose_db_version (version_id, is_applied) VALUES (`+itoa(m.Version)+`, true)`)
			}
		}
		for _, s := range stmts {
			if _, err := tx.Exec(ctx, s); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func itoa(v int) string { return strconv.Itoa(v) }

// A schema golang-migrate or goose brought up to date is accepted as it is: its version is
// read from the tool's table, status says where, and up has nothing to do (and creates
// nothing); one that is behind is refused naming the version and the table; a dirty
// golang-migrate schema is refused.
func TestSchemaMigratedByDeployTools(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tool := range []string{"golang-migrate", "goose"} {
		t.Run(tool, func(t *testing.T) {
			pool, schema := newSchema(t, "tool")
			m, err := migrations.New(&migrations.Config{Schema: schema})
			if err != nil {
				t.Fatal(err)
			}
			applyAs(t, pool, schema, tool, m.Latest())
			if v, err := m.Version(ctx, pool); err != nil || v != m.Latest() {
				t.Fatalf("Version = %d, %v; want %d", v, err, m.Latest())
			}
			st, err := m.Status(ctx, pool)
			if err != nil || !st[len(st)-1].Applied || !strings.Contains(st[0].Source, tool) {
				t.Fatalf("Status = %+v, %v", st, err)
			}
			done, err := m.Up(ctx, pool)
			if err != nil || len(done) != 0 {
				t.Fatalf("Up on an up-to-date schema: %v, %v (want nothing to do, no 'already exists')", done, err)
			}
			var own bool
			if err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", pgx.Identifier{schema, migrations.VersionTable}.Sanitize()).Scan(&own); err != nil || own {
				t.Fatalf("Up created %s in a schema %s manages (%v)", migrations.VersionTable, tool, err)
			}
			if _, err := m.Down(ctx, pool, 1); !errors.Is(err, migrations.ErrManagedElsewhere) {
				t.Fatalf("Down: %v, want ErrManagedElsewhere", err)
			}
		})
		t.Run(tool+" behind", func(t *testing.T) {
			pool, schema := newSchema(t, "tool")
			m, err := migrations.New(&migrations.Config{Schema: schema})
			if err != nil {
				t.Fatal(err)
			}
			applyAs(t, pool, schema, tool, m.Latest()-1)
			if v, err := m.Version(ctx, pool); err != nil || v != m.Latest()-1 {
				t.Fatalf("Version = %d, %v; want %d", v, err, m.Latest()-1)
			}
			_, err = m.Up(ctx, pool)
			if !errors.Is(err, migrations.ErrManagedElsewhere) || !strings.Contains(err.Error(), tool) || !strings.Contains(err.Error(), "version "+itoa(m.Latest()-1)) {
				t.Fatalf("Up on a schema %s keeps one version behind: %v", tool, err)
			}
		})
	}
	t.Run("golang-migrate dirty", func(t *testing.T) {
		pool, schema := newSchema(t, "tool")
		m, err := migrations.New(&migrations.Config{Schema: schema})
		if err != nil {
			t.Fatal(err)
		}
		applyAs(t, pool, schema, "golang-migrate", m.Latest())
		if _, err := pool.Exec(ctx, "UPDATE "+pgx.Identifier{schema, migrations.GolangMigrateTable}.Sanitize()+" SET dirty = true"); err != nil {
			t.Fatal(err)
		}
		if _, err := m.Version(ctx, pool); !errors.Is(err, migrations.ErrInconsistentDatabase) || !strings.Contains(err.Error(), "dirty") {
			t.Fatalf("Version of a dirty schema: %v", err)
		}
	})
	t.Run("goose reverted", func(t *testing.T) {
		pool, schema := newSchema(t, "tool")
		m, err := migrations.New(&migrations.Config{Schema: schema})
		if err != nil {
			t.Fatal(err)
		}
		applyAs(t, pool, schema, "goose", m.Latest())
		// goose down records the revert as a row of its own.
		if _, err := pool.Exec(ctx, "INSERT INTO "+pgx.Identifier{schema, migrations.GooseTable}.Sanitize()+" (version_id, is_applied) VALUES ($1, false)", m.Latest()); err != nil {
			t.Fatal(err)
		}
		if v, err := m.Version(ctx, pool); err != nil || v != m.Latest()-1 {
			t.Fatalf("Version after a goose down = %d, %v; want %d", v, err, m.Latest()-1)
		}
	})
}
