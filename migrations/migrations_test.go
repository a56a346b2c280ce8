package migrations_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"testing/fstest"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/migrations"
)

func TestMain(m *testing.M) { os.Exit(testsvc.ExampleMain(m)) }

// The examples read TXOUTBOX_SCHEMA as a service does; unset, they must work in the default
// schema too.
func TestExamplesInDefaultSchema(t *testing.T) { testsvc.RunExamplesInDefaultSchema(t) }

func TestLoadRefusesBadFiles(t *testing.T) {
	t.Parallel()
	f := func(s string) *fstest.MapFile { return &fstest.MapFile{Data: []byte(s)} }
	cases := map[string]fstest.MapFS{
		"version 1 is used by both":  {"001_a.up.sql": f("x"), "001_a.down.sql": f("x"), "001_b.up.sql": f("x"), "001_b.down.sql": f("x")},
		"expected version 2":         {"001_a.up.sql": f("x"), "001_a.down.sql": f("x"), "003_c.up.sql": f("x"), "003_c.down.sql": f("x")},
		"has no .down.sql":           {"001_a.up.sql": f("x")},
		"has no .up.sql":             {"001_a.down.sql": f("x")},
		"is not named":               {"001_a.sql": f("x")},
		"expected version 1":         {"002_a.up.sql": f("x"), "002_a.down.sql": f("x")},
		"version 1 has two up files": {"001_a.up.sql": f("x"), "1_a.up.sql": f("y"), "001_a.down.sql": f("x")},
	}
	for want, fsys := range cases {
		_, err := migrations.Load(fsys)
		if !errors.Is(err, migrations.ErrInvalidFiles) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: err = %v", want, err)
		}
	}
	ms, err := migrations.Load(migrations.FS)
	if err != nil || len(ms) == 0 || ms[0].Version != 1 {
		t.Fatalf("embedded migrations: %v, %v", ms, err)
	}
}

// newSchema returns a pool and a fresh schema name: name plus a random suffix, so that
// concurrent runs (CI, other checkouts) on one server never share it.
func newSchema(t *testing.T, name string) (*pgxpool.Pool, string) {
	t.Helper()
	ctx := context.Background()
	name += "_" + uuid.NewString()[:8]
	pool, err := pgxpool.New(ctx, testsvc.PostgresDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{name}.Sanitize()+" CASCADE")
		pool.Close()
	})
	_, _ = pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{name}.Sanitize()+" CASCADE")
	return pool, name
}

func TestUpDownStatus(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// A name that needs quoting: it must never be concatenated unquoted.
	pool, schema := newSchema(t, `tx "odd"; schema`)
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	applied, err := m.Up(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	if len(applied) != m.Latest() {
		t.Fatalf("applied %v, want all %d", applied, m.Latest())
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{schema, "txoutbox_messages"}.Sanitize()).Scan(&n); err != nil {
		t.Fatalf("outbox table not in the schema: %v", err)
	}
	again, err := m.Up(ctx, pool)
	if err != nil || len(again) != 0 {
		t.Fatalf("second Up applied %v, %v; want nothing", again, err)
	}
	st, err := m.Status(ctx, pool)
	if err != nil || !st[0].Applied || st[0].AppliedAt.IsZero() {
		t.Fatalf("status %+v, %v", st, err)
	}
	reverted, err := m.Down(ctx, pool, migrations.DownAll)
	if err != nil || len(reverted) != m.Latest() {
		t.Fatalf("Down reverted %v, %v", reverted, err)
	}
	if v, err := m.Version(ctx, pool); err != nil || v != 0 {
		t.Fatalf("version after down = %d, %v", v, err)
	}
	var exists bool
	if err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", pgx.Identifier{schema, "txoutbox_messages"}.Sanitize()).Scan(&exists); err != nil || exists {
		t.Fatalf("outbox table still exists after down: %v %v", exists, err)
	}
}

func TestConcurrentUpAppliesOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := newSchema(t, "txmig_concurrent")
	m, _ := migrations.New(&migrations.Config{Schema: schema})
	var wg sync.WaitGroup
	total := make([]int, 4)
	errs := make([]error, 4)
	for i := range total {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			v, err := m.Up(ctx, pool)
			total[i], errs[i] = len(v), err
		}(i)
	}
	wg.Wait()
	sum := 0
	for i := range total {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		sum += total[i]
	}
	if sum != m.Latest() {
		t.Fatalf("migrations applied %d times in all, want %d", sum, m.Latest())
	}
}

func TestRefusesSkippedVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := newSchema(t, "txmig_skipped")
	m, _ := migrations.New(&migrations.Config{Schema: schema})
	if _, err := m.Up(ctx, pool); err != nil {
		t.Fatal(err)
	}
	// Someone recorded a version out of sequence.
	tbl := pgx.Identifier{schema, migrations.VersionTable}.Sanitize()
	if _, err := pool.Exec(ctx, "INSERT INTO "+tbl+" (version, name) VALUES (99, 'future')"); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Up(ctx, pool); !errors.Is(err, migrations.ErrInconsistentDatabase) {
		t.Fatalf("Up = %v, want ErrInconsistentDatabase", err)
	}
	if _, err := m.Status(ctx, pool); !errors.Is(err, migrations.ErrInconsistentDatabase) || !strings.Contains(err.Error(), "skipped") {
		t.Fatalf("Status = %v, want ErrInconsistentDatabase naming the skip", err)
	}
}

func TestSchemaNameValidation(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{strings.Repeat("s", 64), "a\x00b"} {
		if _, err := migrations.New(&migrations.Config{Schema: bad}); err == nil {
			t.Errorf("schema %q accepted", bad)
		}
	}
}

func TestExport(t *testing.T) {
	t.Parallel()
	ms, err := migrations.Load(migrations.FS)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	written, err := migrations.Export(dir, migrations.FormatGoose)
	if err != nil || len(written) != len(ms) {
		t.Fatalf("goose export wrote %v, %v", written, err)
	}
	body, err := os.ReadFile(written[0])
	if err != nil {
		t.Fatal(err)
	}
	up, down, ok := strings.Cut(string(body), "-- +goose Down")
	if !ok || !strings.HasPrefix(up, "-- +goose Up\n-- +goose StatementBegin\n") ||
		!strings.Contains(up, "CREATE TABLE txoutbox_messages") || !strings.Contains(down, "DROP TABLE txoutbox_messages") {
		t.Fatalf("goose file:\n%s", body)
	}
	// Exported again (as after an upgrade): the files already there are left alone, the
	// missing ones written; one of our names with other contents is refused, naming it, and
	// nothing is written.
	if again, err := migrations.Export(dir, migrations.FormatGoose); err != nil || len(again) != 0 {
		t.Fatalf("a second export into the same directory: wrote %v, %v; want nothing written and no error", again, err)
	}
	last := written[len(written)-1]
	if err := os.Remove(last); err != nil {
		t.Fatal(err)
	}
	if again, err := migrations.Export(dir, migrations.FormatGoose); err != nil || len(again) != 1 || again[0] != last {
		t.Fatalf("an export into a directory missing the newest migration: wrote %v, %v; want %s only", again, err, last)
	}
	if got, err := os.ReadFile(last); err != nil || !strings.Contains(string(got), "-- +goose Up") {
		t.Fatalf("the rewritten %s: %v\n%s", last, err, got)
	}
	edited := append(body, []byte("-- a local edit\n")...)
	if err := os.WriteFile(written[0], edited, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(last); err != nil {
		t.Fatal(err)
	}
	if again, err := migrations.Export(dir, migrations.FormatGoose); !errors.Is(err, migrations.ErrExportDiffers) || len(again) != 0 ||
		!strings.Contains(err.Error(), written[0]) {
		t.Fatalf("an export over an edited file: wrote %v, %v; want ErrExportDiffers naming %s and nothing written", again, err, written[0])
	}
	if got, _ := os.ReadFile(written[0]); string(got) != string(edited) {
		t.Fatal("the refused export overwrote the edited file")
	}
	if _, err := os.Stat(last); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the refused export wrote the missing %s: %v", last, err)
	}
	// The other format's files are not ours in this format.
	if again, err := migrations.Export(dir, migrations.FormatGolangMigrate); !errors.Is(err, migrations.ErrSharedDir) || len(again) != 0 {
		t.Fatalf("a golang-migrate export into a goose export's directory: wrote %v, %v; want ErrSharedDir", again, err)
	}
	// The application's own goose directory: versions 1 and 2 would collide with its own.
	app := t.TempDir()
	if err := os.WriteFile(filepath.Join(app, "00001_users.sql"), []byte("-- +goose Up\nCREATE TABLE users (id int);\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if written, err := migrations.Export(app, migrations.FormatGoose); !errors.Is(err, migrations.ErrSharedDir) || len(written) != 0 ||
		!strings.Contains(err.Error(), migrations.OwnGooseTable) {
		t.Fatalf("export into the application's goose directory: %v, %v; want ErrSharedDir naming %s", written, err, migrations.OwnGooseTable)
	}
	if entries, _ := os.ReadDir(app); len(entries) != 1 {
		t.Fatalf("the refused export wrote into the directory: %v", entries)
	}
	// Ours beside the application's: still refused.
	mixed := t.TempDir()
	if _, err := migrations.Export(mixed, migrations.FormatGoose); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(mixed, "00001_users.sql"), []byte("-- +goose Up\nCREATE TABLE users (id int);\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if written, err := migrations.Export(mixed, migrations.FormatGoose); !errors.Is(err, migrations.ErrSharedDir) || len(written) != 0 ||
		!strings.Contains(err.Error(), "00001_users.sql") {
		t.Fatalf("export into a directory of txoutbox's files and the application's: %v, %v; want ErrSharedDir naming 00001_users.sql", written, err)
	}
	gm := t.TempDir()
	written, err = migrations.Export(gm, migrations.FormatGolangMigrate)
	if err != nil || len(written) != 2*len(ms) {
		t.Fatalf("golang-migrate export wrote %v, %v", written, err)
	}
	again, err := migrations.Load(os.DirFS(gm))
	if err != nil || len(again) != len(ms) || again[0].Up != ms[0].Up {
		t.Fatalf("exported golang-migrate files do not load back: %v", err)
	}
	if _, err := migrations.Export(t.TempDir(), "flyway"); err == nil {
		t.Fatal("unknown format accepted")
	}
}

// Up refuses a database whose encoding is not UTF8, creating nothing there: txoutbox stores
// text cut with a trailing "…", which LATIN1 cannot hold.
func TestUpRefusesNonUTF8Database(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	base := testsvc.PostgresDSN(t)
	admin, err := pgx.Connect(ctx, base)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	name := "txoutbox_latin1_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name+" ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), base)
		if err == nil {
			_, _ = c.Exec(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
			_ = c.Close(context.Background())
		}
	})
	cfg, err := pgx.ParseConfig(base)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Database = name
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	m, err := migrations.New(&migrations.Config{Schema: "outbox"})
	if err != nil {
		t.Fatal(err)
	}
	done, err := m.Up(ctx, conn)
	if !errors.Is(err, migrations.ErrNotUTF8) || len(done) != 0 || !strings.Contains(err.Error(), "LATIN1") {
		t.Fatalf("Up on a LATIN1 database = %v, %v; want ErrNotUTF8 naming LATIN1", done, err)
	}
	var schemas int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_namespace WHERE nspname = 'outbox'").Scan(&schemas); err != nil || schemas != 0 {
		t.Fatalf("the refused Up left the schema behind (%d, %v)", schemas, err)
	}
}

// Every down migration restores exactly the schema of the version before it: the same
// tables, columns, constraints, indexes and functions (their whole definitions, bodies
// included), and the same privileges on them. Migrations that replace function bodies
// (007) restore the bodies they replaced, byte for byte.
func TestDownRestoresThePreviousVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := newSchema(t, "downs")
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	all := m.Migrations()
	snap := func() map[string]string {
		t.Helper()
		rows, err := pool.Query(ctx, `
SELECT 'function ' || p.oid::regprocedure::text, pg_get_functiondef(p.oid) || coalesce(p.proacl::text, '')
FROM pg_proc p WHERE p.pronamespace = $1::regnamespace
UNION ALL
SELECT 'relation ' || c.relname, c.relkind::text || coalesce(c.relacl::text, '') || coalesce((
    SELECT string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod) || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
                      || coalesce(' default ' || pg_get_expr(d.adbin, d.adrelid), '') || coalesce(' ' || a.attacl::text, ''), ', ' ORDER BY a.attnum)
    FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '')
FROM pg_class c WHERE c.relnamespace = $1::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
UNION ALL
SELECT 'index ' || c.relname, pg_get_indexdef(c.oid)
FROM pg_class c WHERE c.relnamespace = $1::regnamespace AND c.relkind = 'i'
UNION ALL
SELECT 'constraint ' || r.conrelid::regclass::text || ' ' || r.conname, pg_get_constraintdef(r.oid)
FROM pg_constraint r WHERE r.connamespace = $1::regnamespace
UNION ALL
SELECT 'trigger ' || g.tgname, pg_get_triggerdef(g.oid)
FROM pg_trigger g JOIN pg_class c ON c.oid = g.tgrelid WHERE c.relnamespace = $1::regnamespace AND NOT g.tgisinternal`,
			pgx.Identifier{schema}.Sanitize())
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for rows.Next() {
			var k, v string
			if err := rows.Scan(&k, &v); err != nil {
				t.Fatal(err)
			}
			out[k] = v
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return out
	}
	inSchema(t, pool, schema) // an empty schema
	before := []map[string]string{snap()}
	for _, mig := range all {
		inSchema(t, pool, schema, mig.Up)
		before = append(before, snap())
	}
	for v := len(all); v >= 1; v-- {
		inSchema(t, pool, schema, all[v-1].Down)
		got, want := snap(), before[v-1]
		for k, w := range want {
			if g, ok := got[k]; !ok {
				t.Errorf("down %d: %s is missing (version %d has it)", v, k, v-1)
			} else if g != w {
				t.Errorf("down %d: %s differs from version %d's:\n got: %s\nwant: %s", v, k, v-1, g, w)
			}
		}
		for k := range got {
			if _, ok := want[k]; !ok {
				t.Errorf("down %d: %s is left (version %d has none)", v, k, v-1)
			}
		}
		if t.Failed() {
			t.FailNow()
		}
	}
}

// A step count below DownAll is a caller's mistake, reported like every other bad argument:
// a *txoutbox.ConfigError naming the field, before the database is touched.
func TestDownRefusesABadStepCount(t *testing.T) {
	t.Parallel()
	m, err := migrations.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	// Never connected: the check comes before anything is read.
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	done, err := m.Down(context.Background(), pool, migrations.DownAll-1)
	var ce *txoutbox.ConfigError
	if !errors.As(err, &ce) || ce.Package != "migrations" || ce.Field != "steps" || !errors.Is(err, txoutbox.ErrInvalidConfig) {
		t.Fatalf("Down(-2) = %v, %#v; want a *txoutbox.ConfigError for migrations steps", done, err)
	}
	if !strings.Contains(err.Error(), "got -2") {
		t.Errorf("error %q does not say what it got", err)
	}
}
