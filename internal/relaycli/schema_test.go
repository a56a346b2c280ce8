package relaycli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
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

// The advice for a schema that is behind names a way that works for whichever tool keeps its
// versions: relay migrate up for txoutbox's own table (and it then succeeds), the other tool
// for golang-migrate's or goose's table (relay migrate up refuses those schemas).
func TestCheckSchemaAdviceNamesTheToolThatKeepsTheVersions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tc := range []struct{ tool, ddl, record, advice string }{
		{"txoutbox", "", "", "relay migrate up"},
		// Applied by hand (no version table): relay migrate up leaves it alone, so the advice
		// is to apply the rest the same way (it sent users to relay migrate up, which refused).
		{"hand", "-", "", "apply migration LATEST the way the earlier ones were applied (`relay migrate export --dir DIR` writes them"},
		{"golang-migrate", `CREATE TABLE %s (version bigint NOT NULL PRIMARY KEY, dirty boolean NOT NULL)`,
			`INSERT INTO %s VALUES ($1, false)`, "with golang-migrate"},
		{"goose", `CREATE TABLE %s (id serial NOT NULL, version_id bigint NOT NULL, is_applied boolean NOT NULL, tstamp timestamp NULL DEFAULT now(), PRIMARY KEY (id))`,
			`INSERT INTO %s (version_id, is_applied) SELECT g, true FROM generate_series(0, $1::int) g`, "with goose"},
	} {
		t.Run(tc.tool, func(t *testing.T) {
			t.Parallel()
			db := testsvc.NewDB(t)
			m, err := migrations.New(&migrations.Config{Schema: db.Schema})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := m.Down(ctx, db.Pool, 1); err != nil {
				t.Fatal(err)
			}
			if tc.ddl == "-" {
				if _, err := db.Pool.Exec(ctx, "DROP TABLE "+pgx.Identifier{db.Schema, migrations.VersionTable}.Sanitize()); err != nil {
					t.Fatal(err)
				}
			} else if tc.ddl != "" { // move the record to the other tool's table
				table := map[string]string{"golang-migrate": migrations.GolangMigrateTable, "goose": migrations.GooseTable}[tc.tool]
				q := pgx.Identifier{db.Schema, table}.Sanitize()
				for _, stmt := range []string{
					"DROP TABLE " + pgx.Identifier{db.Schema, migrations.VersionTable}.Sanitize(),
					fmt.Sprintf(tc.ddl, q),
				} {
					if _, err := db.Pool.Exec(ctx, stmt); err != nil {
						t.Fatal(err)
					}
				}
				if _, err := db.Pool.Exec(ctx, fmt.Sprintf(tc.record, q), m.Latest()-1); err != nil {
					t.Fatal(err)
				}
			}
			err = checkSchema(ctx, db.Pool, db.Schema)
			advice := strings.ReplaceAll(tc.advice, "LATEST", strconv.Itoa(m.Latest()))
			if err == nil || !strings.Contains(err.Error(), advice) {
				t.Fatalf("a schema one version behind (%s): %v, want advice %q", tc.tool, err, advice)
			}
			_, upErr := m.Up(ctx, db.Pool)
			if says := strings.Contains(err.Error(), "run `relay migrate up"); says != (upErr == nil) {
				t.Fatalf("the advice %q recommends relay migrate up: %v, but relay migrate up returns %v", err, says, upErr)
			}
			if tc.ddl != "" && !errors.Is(upErr, migrations.ErrManagedElsewhere) {
				t.Fatalf("relay migrate up on a %s schema: %v, want ErrManagedElsewhere", tc.tool, upErr)
			}
		})
	}
}

// relay migrate export run again on its own directory (as after an upgrade) succeeds: it
// leaves the files already there and writes the missing ones; a file of one of txoutbox's
// names with other contents makes it exit 1 naming the file, and nothing is written. It
// exited 1 on any second run ("holds 001_outbox.down.sql").
func TestMigrateExportAgain(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "txoutbox")
	code, out, stderr := cli(t, "migrate", "export", "--dir", dir)
	if code != 0 || !strings.Contains(out, "wrote "+filepath.Join(dir, "001_outbox.up.sql")) {
		t.Fatalf("migrate export: exit %d\n%s%s", code, out, stderr)
	}
	code, out, stderr = cli(t, "migrate", "export", "--dir", dir)
	if code != 0 || strings.Contains(out, "wrote") || !strings.Contains(out, "nothing written") {
		t.Fatalf("migrate export again: exit %d\n%s%s", code, out, stderr)
	}
	missing := filepath.Join(dir, "001_outbox.down.sql")
	if err := os.Remove(missing); err != nil {
		t.Fatal(err)
	}
	code, out, stderr = cli(t, "migrate", "export", "--dir", dir)
	if code != 0 || strings.TrimSpace(out) != "wrote "+missing {
		t.Fatalf("migrate export into a directory missing a file: exit %d\n%s%s", code, out, stderr)
	}
	edited := filepath.Join(dir, "002_relays.up.sql")
	if err := os.WriteFile(edited, []byte("-- edited\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(missing); err != nil {
		t.Fatal(err)
	}
	code, out, stderr = cli(t, "migrate", "export", "--dir", dir)
	if code != 1 || out != "" || !strings.Contains(stderr, edited) {
		t.Fatalf("migrate export over an edited file: exit %d\n%s%s; want exit 1 naming %s", code, out, stderr, edited)
	}
	if _, err := os.Stat(missing); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the refused export wrote %s: %v", missing, err)
	}
}

// A directory an earlier txoutbox version exported, whose migration 001 down step has changed
// since (it now drops the producer grants' functions), is brought up to date by exporting
// again: that file is replaced (a deploy tool keeps no checksum of a down step), in both
// formats; it made the export exit 1, naming the file, after every upgrade.
func TestMigrateExportReplacesAnEarlierVersionsFile(t *testing.T) {
	t.Parallel()
	const oldDown = "DROP TABLE txoutbox_consumer_dedup;\nDROP TABLE txoutbox_messages;\n"
	for _, c := range []struct{ format, file string }{
		{"golang-migrate", "001_outbox.down.sql"},
		{"goose", "001_outbox.sql"},
	} {
		dir := filepath.Join(t.TempDir(), c.format)
		if code, out, stderr := cli(t, "migrate", "export", "--dir", dir, "--format", c.format); code != 0 {
			t.Fatalf("%s export: exit %d\n%s%s", c.format, code, out, stderr)
		}
		path := filepath.Join(dir, c.file)
		current, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		// The file as the earlier version exported it: the old down step in place of the new.
		old := string(current)
		if c.format == "golang-migrate" {
			old = oldDown
		} else {
			i := strings.Index(old, "-- +goose Down\n-- +goose StatementBegin\n")
			if i < 0 {
				t.Fatalf("no down block in %s:\n%s", path, old)
			}
			old = old[:i] + "-- +goose Down\n-- +goose StatementBegin\n" + strings.TrimRight(oldDown, "\n") + "\n-- +goose StatementEnd\n"
		}
		if err := os.WriteFile(path, []byte(old), 0o644); err != nil {
			t.Fatal(err)
		}
		code, out, stderr := cli(t, "migrate", "export", "--dir", dir, "--format", c.format)
		if code != 0 || strings.TrimSpace(out) != "wrote "+path {
			t.Fatalf("%s export over an earlier version's %s: exit %d\n%s%s; want it replaced", c.format, c.file, code, out, stderr)
		}
		if got, err := os.ReadFile(path); err != nil || string(got) != string(current) {
			t.Fatalf("%s after the export: %v\n%s\nwant this version's:\n%s", path, err, got, current)
		}
	}
}
