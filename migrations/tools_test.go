package migrations_test

import (
	"context"
	"errors"
	"fmt"
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
		// goose down runs the down migration and records the revert as a row of its own.
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			for _, s := range []string{"SET LOCAL search_path TO " + pgx.Identifier{schema}.Sanitize(), m.Migrations()[m.Latest()-1].Down} {
				if _, err := tx.Exec(ctx, s); err != nil {
					return err
				}
			}
			_, err := tx.Exec(ctx, "INSERT INTO goose_db_version (version_id, is_applied) VALUES ($1, false)", m.Latest())
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		if v, err := m.Version(ctx, pool); err != nil || v != m.Latest()-1 {
			t.Fatalf("Version after a goose down = %d, %v; want %d", v, err, m.Latest()-1)
		}
	})
}

// inSchema runs stmts in one transaction with schema (created first) on the search_path.
func inSchema(t *testing.T, pool *pgxpool.Pool, schema string, stmts ...string) {
	t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		pre := []string{"CREATE SCHEMA IF NOT EXISTS " + pgx.Identifier{schema}.Sanitize(), "SET LOCAL search_path TO " + pgx.Identifier{schema}.Sanitize()}
		for _, s := range append(pre, stmts...) {
			if _, err := tx.Exec(ctx, s); err != nil {
				return fmt.Errorf("%s: %w", s, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// An application's own migration tool in the schema txoutbox shares with it (public, by
// default): golang-migrate, goose or Rails, at any version, clean or dirty. Its version table
// is never taken for txoutbox's: Up installs txoutbox as in an empty schema, records it in
// txoutbox's own table, and leaves the application's table as it was.
func TestAppOwnMigrationToolInSharedSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rails := []string{`CREATE TABLE schema_migrations (version varchar PRIMARY KEY)`, `CREATE TABLE ar_internal_metadata (key varchar PRIMARY KEY, value varchar)`,
		`INSERT INTO schema_migrations VALUES ('20240101120000'), ('20240102120000')`}
	cases := map[string][]string{"rails": rails}
	for _, v := range []int{1, 2, 3, 57} {
		cases["golang-migrate at "+itoa(v)] = []string{golangMigrateDDL, `INSERT INTO schema_migrations VALUES (` + itoa(v) + `, false)`}
		cases["goose at "+itoa(v)] = []string{gooseDDL, `INSERT INTO goose_db_version (version_id, is_applied) VALUES (0, true)`,
			`INSERT INTO goose_db_version (version_id, is_applied) SELECT g, true FROM generate_series(1, ` + itoa(v) + `) g`}
	}
	cases["golang-migrate dirty at 2"] = []string{golangMigrateDDL, `INSERT INTO schema_migrations VALUES (2, true)`}
	for name, stmts := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool, schema := newSchema(t, "app")
			inSchema(t, pool, schema, append([]string{`CREATE TABLE orders (id bigint PRIMARY KEY)`}, stmts...)...)
			snapshot := func() string {
				var s string
				table := migrations.GolangMigrateTable
				if strings.HasPrefix(name, "goose") {
					table = migrations.GooseTable
				}
				if err := pool.QueryRow(ctx, "SELECT string_agg(t::text, ';' ORDER BY t::text) FROM "+pgx.Identifier{schema, table}.Sanitize()+" t").Scan(&s); err != nil {
					t.Fatal(err)
				}
				return s
			}
			before := snapshot()
			m, err := migrations.New(&migrations.Config{Schema: schema})
			if err != nil {
				t.Fatal(err)
			}
			if v, err := m.Version(ctx, pool); err != nil || v != 0 {
				t.Fatalf("Version before Up = %d, %v; want 0 (nothing of txoutbox's is there)", v, err)
			}
			done, err := m.Up(ctx, pool)
			if err != nil || len(done) != m.Latest() {
				t.Fatalf("Up = %v, %v; want every migration applied", done, err)
			}
			st, err := m.Status(ctx, pool)
			if err != nil || !st[len(st)-1].Applied || st[0].Source != migrations.VersionTable || st[0].AppliedAt.IsZero() {
				t.Fatalf("Status = %+v, %v; want every version applied, read from %s", st, err, migrations.VersionTable)
			}
			var exists bool
			if err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", pgx.Identifier{schema, "txoutbox_messages"}.Sanitize()).Scan(&exists); err != nil || !exists {
				t.Fatalf("txoutbox_messages exists: %v, %v", exists, err)
			}
			if after := snapshot(); after != before {
				t.Fatalf("the application's version table changed: %q, was %q", after, before)
			}
			if done, err := m.Down(ctx, pool, migrations.DownAll); err != nil || len(done) != m.Latest() {
				t.Fatalf("Down = %v, %v; want every migration reverted", done, err)
			}
			if v, err := m.Version(ctx, pool); err != nil || v != 0 {
				t.Fatalf("Version after Down = %d, %v; want 0", v, err)
			}
		})
	}
}

// txoutbox's migrations applied by the application's own tool in a shared schema (copied
// among its own files, renumbered): the tool's version counts the application's migrations
// too, so the version is read from txoutbox's tables, and says so. Up has nothing to do on an
// up-to-date schema and refuses one that is behind, naming the version found and where.
// With a version table of txoutbox's own (golang-migrate's x-migrations-table, goose's
// -table) in the same schema, that table is read.
func TestTxoutboxAppliedByAppToolInSharedSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	all, err := migrations.Load(migrations.FS)
	if err != nil {
		t.Fatal(err)
	}
	ups := func(n int) []string {
		var out []string
		for _, mig := range all[:n] {
			out = append(out, mig.Up)
		}
		return out
	}
	latest := len(all)
	for _, tc := range []struct {
		name    string
		stmts   []string
		version int
		source  string
	}{
		{"renumbered in the app's golang-migrate at 57, up to date", append([]string{golangMigrateDDL, `INSERT INTO schema_migrations VALUES (57, false)`}, ups(latest)...), latest, "txoutbox's tables"},
		{"renumbered in the app's golang-migrate at 57, behind", append([]string{golangMigrateDDL, `INSERT INTO schema_migrations VALUES (57, false)`}, ups(latest-1)...), latest - 1, "txoutbox's tables"},
		{"renumbered in the app's goose at 40, behind", append([]string{gooseDDL, `INSERT INTO goose_db_version (version_id, is_applied) SELECT g, true FROM generate_series(0, 40) g`}, ups(latest-1)...), latest - 1, "txoutbox's tables"},
		{"applied by hand, no version table", ups(latest), latest, "txoutbox's tables"},
		{"golang-migrate with a table of txoutbox's own", append([]string{golangMigrateDDL, `INSERT INTO schema_migrations VALUES (2, false)`,
			strings.Replace(golangMigrateDDL, "schema_migrations", migrations.OwnGolangMigrateTable, 1),
			`INSERT INTO ` + migrations.OwnGolangMigrateTable + ` VALUES (` + itoa(latest-1) + `, false)`}, ups(latest-1)...), latest - 1, "golang-migrate's " + `"%s".` + `"` + migrations.OwnGolangMigrateTable + `"`},
		{"goose with a table of txoutbox's own", append([]string{gooseDDL, `INSERT INTO goose_db_version (version_id, is_applied) VALUES (0, true), (1, true)`,
			strings.Replace(gooseDDL, "goose_db_version", migrations.OwnGooseTable, 1),
			`INSERT INTO ` + migrations.OwnGooseTable + ` (version_id, is_applied) SELECT g, true FROM generate_series(0, ` + itoa(latest) + `) g`}, ups(latest)...), latest, "goose's \"%s\"." + `"` + migrations.OwnGooseTable + `"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool, schema := newSchema(t, "app")
			inSchema(t, pool, schema, append([]string{`CREATE TABLE orders (id bigint PRIMARY KEY)`}, tc.stmts...)...)
			m, err := migrations.New(&migrations.Config{Schema: schema})
			if err != nil {
				t.Fatal(err)
			}
			source := tc.source
			if strings.Contains(source, "%s") {
				source = fmt.Sprintf(source, schema)
			}
			st, err := m.Status(ctx, pool)
			if err != nil || !strings.Contains(st[0].Source, source) {
				t.Fatalf("Status = %+v, %v; want the source %q", st, err, source)
			}
			if v, err := m.Version(ctx, pool); err != nil || v != tc.version {
				t.Fatalf("Version = %d, %v; want %d", v, err, tc.version)
			}
			done, err := m.Up(ctx, pool)
			if tc.version == latest {
				if err != nil || len(done) != 0 {
					t.Fatalf("Up on an up-to-date schema = %v, %v; want nothing to do", done, err)
				}
				return
			}
			if !errors.Is(err, migrations.ErrManagedElsewhere) || !strings.Contains(err.Error(), "version "+itoa(tc.version)) || !strings.Contains(err.Error(), source) {
				t.Fatalf("Up on a schema that is behind = %v; want ErrManagedElsewhere naming version %d and %q", err, tc.version, source)
			}
			// With no tool's version table to hand it to, the error says what to apply and how.
			if how := fmt.Sprintf("apply migration %d the way the earlier ones were applied", latest); tc.version == latest-1 && source == migrations.HandAppliedSource &&
				!strings.Contains(err.Error(), how) {
				t.Fatalf("Up on a schema applied without a version table = %v; want it to say %q", err, how)
			}
		})
	}
}

// A schema of its own that golang-migrate brought to a version newer than this binary's
// latest is refused, naming that version (not a version in between).
func TestDeployToolNewerThanBinary(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := newSchema(t, "tool")
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	applyAs(t, pool, schema, "golang-migrate", m.Latest())
	newer := m.Latest() + 5
	if _, err := pool.Exec(ctx, "UPDATE "+pgx.Identifier{schema, migrations.GolangMigrateTable}.Sanitize()+" SET version = $1", newer); err != nil {
		t.Fatal(err)
	}
	_, err = m.Version(ctx, pool)
	if !errors.Is(err, migrations.ErrInconsistentDatabase) || !strings.Contains(err.Error(), "version "+itoa(newer)+" ") || !strings.Contains(err.Error(), "newer") {
		t.Fatalf("Version = %v; want ErrInconsistentDatabase naming version %d as newer", err, newer)
	}
}
