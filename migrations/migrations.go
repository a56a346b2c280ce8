// Package migrations holds txoutbox's SQL schema as versioned migration files and a small
// runner that applies them.
//
// The files are plain SQL named NNN_name.up.sql / NNN_name.down.sql, the layout golang-migrate
// reads as it is; they use unqualified table names, so a deploy tool chooses the schema through
// the connection's search_path. The same files are embedded in this package (FS) for the
// project's own runner, used by `relay migrate`:
//
//	m, err := migrations.New(&migrations.Config{Schema: "outbox"})
//	if err != nil {
//		return err
//	}
//	applied, err := m.Up(ctx, pool) // the versions it applied: none when up to date
//	if err != nil {
//		return err
//	}
//
// The runner records applied versions in txoutbox_schema_migrations inside the target schema,
// serialises concurrent runners with an advisory lock, applies each migration in its own
// transaction, and refuses to run when the embedded files or the recorded versions have a
// duplicate or a gap.
package migrations

import (
	"cmp"
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/dbhandle"
)

// FS holds the migration files, for tools that want to read or copy them.
//
//go:embed *.sql
var FS embed.FS

// VersionTable is the table, inside the configured schema, where the runner records versions.
const VersionTable = "txoutbox_schema_migrations"

// lockID is the advisory lock (two-int form, first half) that serialises migration runners.
const lockClass = 0x74786d67 // "txmg"

var (
	// ErrInvalidFiles means the migration files themselves are inconsistent (a duplicate
	// version, a gap, a missing up or down file, a malformed name).
	ErrInvalidFiles = errors.New("migrations: invalid migration files")
	// ErrInconsistentDatabase means the versions recorded in the database do not form a
	// prefix of the known migrations (a skipped version, or a version this binary does not know).
	ErrInconsistentDatabase = errors.New("migrations: recorded versions are inconsistent")
)

// Migration is one versioned schema change.
type Migration struct {
	Version int
	Name    string
	Up      string
	Down    string
}

// Config configures a Migrator.
type Config struct {
	// Schema is the Postgres schema that holds txoutbox's tables: at most 63 bytes, no NUL
	// byte. It is created by Up if it does not exist. Defaults to txoutbox.DefaultSchema
	// ("public").
	Schema string
}

// WithDefaults returns a copy of c with Schema, its only field, set to its default when
// unset. c may be nil.
func (c *Config) WithDefaults() *Config {
	out := Config{}
	if c != nil {
		out = *c
	}
	out.Schema = cmp.Or(out.Schema, txoutbox.DefaultSchema)
	return &out
}

func (c *Config) validate() error {
	if err := ValidateSchemaName(c.Schema); err != nil {
		return &txoutbox.ConfigError{Package: "migrations", Field: "Config.Schema", Reason: err.Error()}
	}
	return nil
}

// ValidateConfig reports whether cfg, with defaults applied, is valid; errors are
// *txoutbox.ConfigError values naming the field. New returns the same errors.
func ValidateConfig(cfg *Config) error { return cfg.WithDefaults().validate() }

// Migrator applies and reverts the embedded migrations.
type Migrator struct {
	cfg        *Config
	schema     string
	migrations []Migration
}

// New returns a Migrator for the embedded migrations. An invalid cfg is refused with a
// *txoutbox.ConfigError naming the field (ValidateConfig's errors; it matches
// txoutbox.ErrInvalidConfig).
func New(cfg *Config) (*Migrator, error) {
	c := cfg.WithDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	ms, err := Load(FS)
	if err != nil {
		return nil, err
	}
	return &Migrator{cfg: c, schema: c.Schema, migrations: ms}, nil
}

// Config returns the migrator's effective configuration.
func (m *Migrator) Config() Config { return *m.cfg }

// ValidateSchemaName reports whether name can be used as a schema name. Names are always
// quoted when used, so any non-empty name of at most 63 bytes without NUL is accepted.
func ValidateSchemaName(name string) error {
	if name == "" {
		return errors.New("must not be empty")
	}
	if len(name) > 63 {
		return fmt.Errorf("%q is longer than Postgres's 63-byte identifier limit", name)
	}
	for i := 0; i < len(name); i++ {
		if name[i] == 0 {
			return fmt.Errorf("%q contains a NUL byte", name)
		}
	}
	return nil
}

var fileRe = regexp.MustCompile(`^(\d+)_([A-Za-z0-9_]+)\.(up|down)\.sql$`)

// Load reads and checks migrations from fsys: every file must be named NNN_name.up.sql or
// NNN_name.down.sql, every version must have both, and versions must run 1, 2, 3, … with no
// duplicate or gap. Errors wrap ErrInvalidFiles.
func Load(fsys fs.FS) ([]Migration, error) {
	entries, err := fs.ReadDir(fsys, ".")
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidFiles, err)
	}
	byVersion := map[int]*Migration{}
	seen := map[string]bool{} // version.direction: an empty file counts too
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		m := fileRe.FindStringSubmatch(e.Name())
		if m == nil {
			if len(e.Name()) > 4 && e.Name()[len(e.Name())-4:] == ".sql" {
				return nil, fmt.Errorf("%w: %s is not named NNN_name.up.sql or NNN_name.down.sql", ErrInvalidFiles, e.Name())
			}
			continue
		}
		v, _ := strconv.Atoi(m[1])
		body, err := fs.ReadFile(fsys, e.Name())
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrInvalidFiles, err)
		}
		mig := byVersion[v]
		if mig == nil {
			mig = &Migration{Version: v, Name: m[2]}
			byVersion[v] = mig
		} else if mig.Name != m[2] {
			return nil, fmt.Errorf("%w: version %d is used by both %q and %q", ErrInvalidFiles, v, mig.Name, m[2])
		}
		dir := &mig.Up
		if m[3] == "down" {
			dir = &mig.Down
		}
		key := strconv.Itoa(v) + "." + m[3]
		if seen[key] {
			return nil, fmt.Errorf("%w: version %d has two %s files (%s is one)", ErrInvalidFiles, v, m[3], e.Name())
		}
		seen[key] = true
		*dir = string(body)
	}
	out := make([]Migration, 0, len(byVersion))
	for _, m := range byVersion {
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	for i, m := range out {
		if m.Version != i+1 {
			return nil, fmt.Errorf("%w: expected version %d, found %d (versions must run 1, 2, 3, … without gaps)", ErrInvalidFiles, i+1, m.Version)
		}
		if m.Up == "" {
			return nil, fmt.Errorf("%w: version %d (%s) has no .up.sql file", ErrInvalidFiles, m.Version, m.Name)
		}
		if m.Down == "" {
			return nil, fmt.Errorf("%w: version %d (%s) has no .down.sql file", ErrInvalidFiles, m.Version, m.Name)
		}
	}
	return out, nil
}

// Migrations returns the known migrations in version order.
func (m *Migrator) Migrations() []Migration { return append([]Migration(nil), m.migrations...) }

// Latest returns the newest known version.
func (m *Migrator) Latest() int { return len(m.migrations) }

// Status describes one known migration and whether it is applied.
type Status struct {
	Version   int
	Name      string
	Applied   bool
	AppliedAt time.Time // zero when the version was read from another tool's table
	// Source says where Applied was read, in one of these forms (the same in every Status of
	// one call):
	//   - VersionTable ("txoutbox_schema_migrations"): txoutbox's runner recorded the versions;
	//   - "<tool>'s <schema>.<table>", quoted as SQL identifiers, such as
	//     `goose's "public"."txoutbox_goose_db_version"`: the version table of golang-migrate or goose (tool "golang-migrate" or "goose"; table
	//     OwnGolangMigrateTable, OwnGooseTable, GolangMigrateTable or GooseTable);
	//   - HandAppliedSource followed by ` in schema "<schema>" (no version table records
	//     txoutbox's migrations)`: the version was read from the tables themselves;
	//   - "": nothing is applied.
	Source string
}

func (m *Migrator) qschema() string { return pgx.Identifier{m.schema}.Sanitize() }
func (m *Migrator) qtable() string  { return pgx.Identifier{m.schema, VersionTable}.Sanitize() }

// begin opens a transaction with the schema on its search_path and the runner's lock held.
func (m *Migrator) begin(ctx context.Context, db txoutbox.Beginner, create bool) (pgx.Tx, error) {
	for attempt := 1; ; attempt++ {
		tx, err := m.beginOnce(ctx, db, create)
		// An advisory lock does not make PostgreSQL process catalog invalidations, so a runner
		// that waited on another one can still see a stale "schema does not exist" and trip
		// over the schema (or table) the other one just created. A new transaction sees it.
		var pgErr *pgconn.PgError
		if err != nil && attempt < 5 && errors.As(err, &pgErr) && (pgErr.Code == "23505" || pgErr.Code == "42P06" || pgErr.Code == "42P07") {
			continue
		}
		return tx, err
	}
}

func (m *Migrator) beginOnce(ctx context.Context, db txoutbox.Beginner, create bool) (pgx.Tx, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrations: begin: %w", err)
	}
	fail := func(err error) (pgx.Tx, error) {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return nil, err
	}
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1, hashtext($2))", int32(lockClass), m.schema); err != nil {
		return fail(fmt.Errorf("migrations: lock: %w", err))
	}
	if create {
		// CREATE SCHEMA IF NOT EXISTS needs the CREATE privilege on the database even when the
		// schema exists: a schema owner without it (the admin role of relay migrate grants)
		// migrates a schema created for it.
		var exists bool
		if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", m.schema).Scan(&exists); err != nil {
			return fail(fmt.Errorf("migrations: look up schema %q: %w", m.schema, err))
		}
		if !exists {
			if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+m.qschema()); err != nil {
				return fail(fmt.Errorf("migrations: create schema %q: %w", m.schema, err))
			}
		}
		if _, err := tx.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+m.qtable()+` (
			version    integer PRIMARY KEY,
			name       text NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
			return fail(fmt.Errorf("migrations: create version table: %w", err))
		}
	}
	if _, err := tx.Exec(ctx, "SET LOCAL search_path TO "+m.qschema()); err != nil {
		return fail(fmt.Errorf("migrations: set search_path: %w", err))
	}
	return tx, nil
}

type applied struct {
	version int
	at      time.Time
}

// Version tables of the deploy tools the README offers, read when txoutbox's own records
// nothing, so that a schema golang-migrate or goose brought up to date is accepted as it is.
const (
	// GolangMigrateTable is golang-migrate's: one row, the current version and a dirty flag.
	GolangMigrateTable = "schema_migrations"
	// GooseTable is goose's: one row per applied (or reverted) version.
	GooseTable = "goose_db_version"
	// OwnGolangMigrateTable and OwnGooseTable are version tables of txoutbox's own for those
	// tools, for a schema the application's own golang-migrate or goose also uses: run
	// golang-migrate with x-migrations-table=txoutbox_golang_migrate, goose with
	// -table txoutbox_goose_db_version.
	OwnGolangMigrateTable = "txoutbox_golang_migrate"
	OwnGooseTable         = "txoutbox_goose_db_version"
)

// ErrManagedElsewhere: Up and Down leave alone a schema whose versions txoutbox's runner did
// not record (VersionTable records nothing) and which has txoutbox's tables: either another
// tool's version table records them (golang-migrate or goose: apply the missing migrations
// with that tool), or none does and they were read from the tables themselves (Status.Source
// starts with HandAppliedSource: applied by hand, or by a tool whose version table is the
// application's; apply the rest the way the others were). Up on such a schema that is up to
// date returns no error and applies nothing.
var ErrManagedElsewhere = errors.New("migrations: schema managed by another migration tool")

// foreignTable is a version table another tool keeps.
type foreignTable struct {
	tool, name string
	own        bool // a table name of txoutbox's own: never the application's
}

// foreignTables are read in this order; txoutbox's own names first.
var foreignTables = []foreignTable{
	{"golang-migrate", OwnGolangMigrateTable, true},
	{"goose", OwnGooseTable, true},
	{"golang-migrate", GolangMigrateTable, false},
	{"goose", GooseTable, false},
}

// createTableRe finds the tables and functions a migration creates: its fingerprint in a
// schema (migration 4 creates functions only).
var createTableRe = regexp.MustCompile(`(?i)\bCREATE\s+(?:TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?|(?:OR\s+REPLACE\s+)?FUNCTION\s+)"?([A-Za-z_][A-Za-z0-9_]*)`)

// tablesOf returns the tables and functions migration version v (1-based) creates, leaving
// out those an earlier version created (migration 5 re-creates functions of migration 4 with
// a new argument: they are 4's fingerprint, not 5's).
func (m *Migrator) tablesOf(v int) []string {
	earlier := map[string]bool{}
	for k := 1; k < v; k++ {
		for _, g := range createTableRe.FindAllStringSubmatch(m.migrations[k-1].Up, -1) {
			earlier[strings.ToLower(g[1])] = true
		}
	}
	var out []string
	for _, g := range createTableRe.FindAllStringSubmatch(m.migrations[v-1].Up, -1) {
		if name := strings.ToLower(g[1]); !earlier[name] {
			out = append(out, name)
		}
	}
	return out
}

// schemaTables returns the names of the tables in the schema, and of its functions named
// txoutbox_* (the functions of migration 4).
func (m *Migrator) schemaTables(ctx context.Context, tx pgx.Tx) (map[string]bool, error) {
	rows, err := tx.Query(ctx, `SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
UNION SELECT p.proname::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = $1 AND p.proname LIKE 'txoutbox\_%'`, m.schema)
	if err != nil {
		return nil, fmt.Errorf("migrations: list the tables of schema %q: %w", m.schema, err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("migrations: list the tables of schema %q: %w", m.schema, err)
	}
	out := make(map[string]bool, len(names))
	for _, n := range names {
		out[n] = true
	}
	return out, nil
}

// tablesVersion is the version txoutbox's tables in the schema show: the highest version
// whose tables, and those of every version before it, all exist (a migration that creates no
// table counts as applied only below one whose tables exist).
func (m *Migrator) tablesVersion(tables map[string]bool) int {
	v := 0
	for k := 1; k <= len(m.migrations); k++ {
		ts := m.tablesOf(k)
		all := true
		for _, t := range ts {
			all = all && tables[t]
		}
		if !all {
			break
		}
		if len(ts) > 0 {
			v = k
		}
	}
	return v
}

// fits reports whether version v agrees with the tables in the schema: every table of
// versions up to v exists, none of a later version does.
func (m *Migrator) fits(v int, tables map[string]bool) bool {
	for k := 1; k <= len(m.migrations); k++ {
		for _, t := range m.tablesOf(k) {
			if tables[t] != (k <= v) {
				return false
			}
		}
	}
	return true
}

// applied returns the applied versions, in order, and where they were read from:
//
//  1. txoutbox's VersionTable, when it records anything;
//  2. else, when txoutbox's tables are in the schema, a version table of golang-migrate or
//     goose (OwnGolangMigrateTable, OwnGooseTable, GolangMigrateTable, GooseTable, in that
//     order) of the tool's shape, believed when it is txoutbox's (an own name, or a schema
//     holding nothing but txoutbox's tables and the tools' version tables) or, in a schema
//     shared with the application, when its version agrees with txoutbox's tables: every
//     table of the versions up to it exists, none of a later one;
//  3. else the tables themselves (applied by hand, or by a tool whose version table also
//     counts the application's own migrations);
//  4. else nothing ("").
//
// An application's own golang-migrate, goose or Rails table in a shared schema (public, by
// default) is therefore never taken for txoutbox's: it is read only when txoutbox's tables
// exist, and only believed when it agrees with them.
func (m *Migrator) applied(ctx context.Context, tx pgx.Tx) ([]applied, string, error) {
	out, err := m.readOwn(ctx, tx)
	if err != nil || len(out) > 0 {
		return out, VersionTable, err
	}
	tables, err := m.schemaTables(ctx, tx)
	if err != nil {
		return nil, "", err
	}
	tv := m.tablesVersion(tables)
	if tv == 0 {
		return nil, "", nil
	}
	dedicated := true // nothing in the schema but txoutbox's tables and tools' version tables
	for t := range tables {
		if !strings.HasPrefix(t, "txoutbox_") && t != GolangMigrateTable && t != GooseTable {
			dedicated = false
		}
	}
	for _, ft := range foreignTables {
		if !tables[ft.name] {
			continue
		}
		v, dirty, ok, err := m.readForeign(ctx, tx, ft)
		if err != nil {
			return nil, "", err
		}
		if !ok {
			continue // not the tool's shape: someone else's table of that name
		}
		src := ft.tool + "'s " + pgx.Identifier{m.schema, ft.name}.Sanitize()
		ours := ft.own || dedicated
		switch {
		case dirty && (ours || v == tv || v == tv+1):
			return nil, "", fmt.Errorf("%w: %s says version %d is dirty (a migration failed half way): fix the schema, then `migrate force`", ErrInconsistentDatabase, src, v)
		case dirty:
			continue
		case v > len(m.migrations) && ours:
			return nil, "", fmt.Errorf("%w: schema %q is at version %d (%s), newer than this binary's latest %d", ErrInconsistentDatabase, m.schema, v, src, len(m.migrations))
		case v <= len(m.migrations) && (ours || m.fits(v, tables)):
			return upTo(v), src, nil
		}
	}
	return upTo(tv), fmt.Sprintf(HandAppliedSource+" in schema %q (no version table records txoutbox's migrations)", m.schema), nil
}

// HandAppliedSource starts Status.Source for a schema whose version was read from its
// tables, not from a version table: its migrations were applied by hand, or by a tool whose
// version table is the application's. Up and Down leave such a schema alone
// (ErrManagedElsewhere): apply the missing migrations the way the others were.
const HandAppliedSource = "txoutbox's tables"

// migrationRange says "migration 12" or "migrations 11 to 12".
func migrationRange(from, to int) string {
	if from == to {
		return fmt.Sprintf("migration %d", from)
	}
	return fmt.Sprintf("migrations %d to %d", from, to)
}

// upTo returns versions 1 to v as applied, with no time.
func upTo(v int) []applied {
	out := make([]applied, v)
	for i := range out {
		out[i] = applied{version: i + 1}
	}
	return out
}

func (m *Migrator) exists(ctx context.Context, tx pgx.Tx, table string) (bool, error) {
	var ok bool
	err := tx.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", pgx.Identifier{m.schema, table}.Sanitize()).Scan(&ok)
	return ok, err
}

func (m *Migrator) readOwn(ctx context.Context, tx pgx.Tx) ([]applied, error) {
	exists, err := m.exists(ctx, tx, VersionTable)
	if err != nil {
		return nil, fmt.Errorf("migrations: read versions: %w", err)
	}
	if !exists {
		return nil, nil
	}
	rows, err := tx.Query(ctx, "SELECT version, applied_at FROM "+m.qtable()+" ORDER BY version")
	if err != nil {
		return nil, fmt.Errorf("migrations: read versions: %w", err)
	}
	var out []applied
	for rows.Next() {
		var a applied
		if err := rows.Scan(&a.version, &a.at); err != nil {
			return nil, err
		}
		out = append(out, a)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("migrations: read versions: %w", err)
	}
	return out, m.checkOrder(out, VersionTable)
}

func (m *Migrator) checkOrder(out []applied, src string) error {
	for i, a := range out {
		if a.version != i+1 {
			return fmt.Errorf("%w: schema %q records version %d where %d was expected in %s (a version was skipped)", ErrInconsistentDatabase, m.schema, a.version, i+1, src)
		}
	}
	if n := len(out); n > len(m.migrations) {
		return fmt.Errorf("%w: schema %q is at version %d (%s), newer than this binary's latest %d", ErrInconsistentDatabase, m.schema, out[n-1].version, src, len(m.migrations))
	}
	return nil
}

// foreignShape is, per tool, the columns (name and type) its version table must have.
var foreignShape = map[string]map[string]string{
	"golang-migrate": {"version": "bigint", "dirty": "boolean"},
	"goose":          {"id": "integer", "version_id": "bigint", "is_applied": "boolean"},
}

// readForeign reads a golang-migrate or goose version table: the current version, whether
// golang-migrate marked it dirty, and whether the table has the tool's shape at all (ok false:
// another table of that name, such as Rails's schema_migrations).
func (m *Migrator) readForeign(ctx context.Context, tx pgx.Tx, ft foreignTable) (v int, dirty, ok bool, err error) {
	qt := pgx.Identifier{m.schema, ft.name}.Sanitize()
	rows, err := tx.Query(ctx, `SELECT attname, format_type(atttypid, NULL) FROM pg_attribute
WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped`, qt)
	if err != nil {
		return 0, false, false, fmt.Errorf("migrations: read the columns of %s: %w", qt, err)
	}
	cols := map[string]string{}
	for rows.Next() {
		var name, typ string
		if err := rows.Scan(&name, &typ); err != nil {
			rows.Close()
			return 0, false, false, err
		}
		cols[name] = typ
	}
	if err := rows.Err(); err != nil {
		return 0, false, false, fmt.Errorf("migrations: read the columns of %s: %w", qt, err)
	}
	for col, typ := range foreignShape[ft.tool] {
		if t, found := cols[col]; !found || t != typ && !(typ == "bigint" && t == "integer") {
			return 0, false, false, nil
		}
	}
	src := ft.tool + "'s " + pgx.Identifier{m.schema, ft.name}.Sanitize()
	var v64 int64
	switch ft.tool {
	case "golang-migrate":
		err = tx.QueryRow(ctx, "SELECT version, dirty FROM "+qt+" ORDER BY version DESC LIMIT 1").Scan(&v64, &dirty)
		if errors.Is(err, pgx.ErrNoRows) {
			return 0, false, true, nil
		}
	case "goose":
		// A version is applied when its newest row says so (goose records reverts as rows with
		// is_applied false); goose's own row for version 0 is not a migration.
		err = tx.QueryRow(ctx, `SELECT coalesce(max(version_id), 0) FROM (
  SELECT DISTINCT ON (version_id) version_id, is_applied FROM `+qt+`
  WHERE version_id > 0 ORDER BY version_id, id DESC) g WHERE is_applied`).Scan(&v64)
	}
	if err != nil {
		return 0, false, false, fmt.Errorf("migrations: read %s: %w", src, err)
	}
	return int(v64), dirty, true, nil
}

// ErrNotUTF8 means the database's encoding is not UTF8. txoutbox stores text from outside
// the process (checker, JetStream and handler errors) as valid UTF-8, cut on a character
// boundary with a trailing "…" (U+2026), which a LATIN1 database, for one, cannot store
// (SQLSTATE 22P05): Up refuses to install txoutbox there.
var ErrNotUTF8 = errors.New("migrations: the database encoding is not UTF8")

// checkEncoding refuses a database whose encoding is not UTF8.
func checkEncoding(ctx context.Context, tx pgx.Tx) error {
	var enc string
	if err := tx.QueryRow(ctx, "SELECT pg_encoding_to_char(encoding) FROM pg_database WHERE datname = current_database()").Scan(&enc); err != nil {
		return fmt.Errorf("migrations: read the database encoding: %w", err)
	}
	if enc != "UTF8" {
		return fmt.Errorf("%w: it is %s; create the database with ENCODING 'UTF8' (e.g. CREATE DATABASE … ENCODING 'UTF8' TEMPLATE template0)", ErrNotUTF8, enc)
	}
	return nil
}

// Up applies every pending migration, each in its own transaction, and returns the versions
// it applied. It refuses, with an error wrapping the sentinel: a database whose encoding is
// not UTF8 (ErrNotUTF8); a schema whose recorded versions are not a prefix of the known
// migrations (ErrInconsistentDatabase: a skipped version, a version newer than this binary
// knows, or a golang-migrate version marked dirty); and a schema whose versions another tool
// records or that was migrated by hand (ErrManagedElsewhere). A nil db is a
// *txoutbox.ConfigError naming it.
func (m *Migrator) Up(ctx context.Context, db txoutbox.Beginner) ([]int, error) {
	if err := dbhandle.RequireArg("migrations", "db", "a pool or a connection (a *pgxpool.Pool, a *pgx.Conn)", db); err != nil {
		return nil, err
	}
	if upToDate, err := m.notManagedElsewhere(ctx, db, "up"); err != nil || upToDate {
		return nil, err
	}
	var done []int
	for {
		tx, err := m.begin(ctx, db, true)
		if err != nil {
			return done, err
		}
		app, _, err := m.applied(ctx, tx)
		if err == nil && len(app) < len(m.migrations) {
			err = checkEncoding(ctx, tx)
		}
		if err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			return done, err
		}
		if len(app) == len(m.migrations) {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			return done, nil
		}
		next := m.migrations[len(app)]
		if _, err := tx.Exec(ctx, next.Up); err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			return done, fmt.Errorf("migrations: apply %03d_%s: %w", next.Version, next.Name, err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+m.qtable()+" (version, name) VALUES ($1, $2)", next.Version, next.Name); err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			return done, fmt.Errorf("migrations: record %03d_%s: %w", next.Version, next.Name, err)
		}
		if err := tx.Commit(ctx); err != nil {
			return done, fmt.Errorf("migrations: commit %03d_%s: %w", next.Version, next.Name, err)
		}
		done = append(done, next.Version)
	}
}

// Down reverts the newest steps applied migrations (every one with DownAll; none with 0) and
// returns the versions it reverted, newest first. steps below DownAll are refused, before
// anything is read, with a *txoutbox.ConfigError (Field "steps"; errors.Is(err,
// txoutbox.ErrInvalidConfig) holds), and so is a nil db (naming it). It refuses, as Up does,
// a schema whose recorded versions are inconsistent (ErrInconsistentDatabase) and one whose
// versions another tool records or that was migrated by hand (ErrManagedElsewhere).
func (m *Migrator) Down(ctx context.Context, db txoutbox.Beginner, steps int) ([]int, error) {
	if err := dbhandle.RequireArg("migrations", "db", "a pool or a connection (a *pgxpool.Pool, a *pgx.Conn)", db); err != nil {
		return nil, err
	}
	if steps < DownAll {
		return nil, &txoutbox.ConfigError{Package: "migrations", Field: "steps",
			Reason: fmt.Sprintf("must be at least 0, or DownAll (-1), got %d", steps)}
	}
	if _, err := m.notManagedElsewhere(ctx, db, "down"); err != nil {
		return nil, err
	}
	var done []int
	for steps < 0 || len(done) < steps {
		tx, err := m.begin(ctx, db, false)
		if err != nil {
			return done, err
		}
		app, _, err := m.applied(ctx, tx)
		if err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			return done, err
		}
		if len(app) == 0 {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			return done, nil
		}
		cur := m.migrations[len(app)-1]
		if _, err := tx.Exec(ctx, cur.Down); err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			return done, fmt.Errorf("migrations: revert %03d_%s: %w", cur.Version, cur.Name, err)
		}
		if _, err := tx.Exec(ctx, "DELETE FROM "+m.qtable()+" WHERE version = $1", cur.Version); err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			return done, fmt.Errorf("migrations: unrecord %03d_%s: %w", cur.Version, cur.Name, err)
		}
		if err := tx.Commit(ctx); err != nil {
			return done, fmt.Errorf("migrations: commit revert of %03d_%s: %w", cur.Version, cur.Name, err)
		}
		done = append(done, cur.Version)
	}
	return done, nil
}

// notManagedElsewhere refuses to run up or down on a schema whose versions another tool
// records (that tool applies what is missing), and reports an up-to-date one, for which up
// has nothing to do and creates nothing.
func (m *Migrator) notManagedElsewhere(ctx context.Context, db txoutbox.Beginner, what string) (upToDate bool, err error) {
	tx, err := m.begin(ctx, db, false)
	if err != nil {
		return false, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	app, src, err := m.applied(ctx, tx)
	if err != nil || src == "" || src == VersionTable {
		return false, err
	}
	if what == "up" && len(app) == len(m.migrations) {
		return true, nil
	}
	if strings.HasPrefix(src, HandAppliedSource) {
		// Nobody's version table to hand it to: say how the rest is applied.
		next := "nothing to apply"
		if len(app) < len(m.migrations) {
			next = fmt.Sprintf("apply %s the way the earlier ones were applied (`relay migrate export --dir DIR` writes them)", migrationRange(len(app)+1, len(m.migrations)))
		}
		return false, fmt.Errorf("%w: schema %q is at version %d according to %s, applied without txoutbox's runner, which "+
			"therefore leaves the schema alone (it cannot tell what else applies migrations to it); %s",
			ErrManagedElsewhere, m.schema, len(app), src, next)
	}
	return false, fmt.Errorf("%w: schema %q is at version %d according to %s; apply migrations with that tool (this binary's latest is %d)",
		ErrManagedElsewhere, m.schema, len(app), src, len(m.migrations))
}

// DownAll, given to Down as steps, reverts every applied migration: it is txoutbox.Forever
// (-1), the convention's "no bound", under the name Down's callers read best.
const DownAll = txoutbox.Forever

// Status lists every known migration and whether the database has it. Recorded versions
// that are not a prefix of the known migrations (a skipped version, a version newer than this
// binary knows, a golang-migrate version marked dirty) are an error wrapping
// ErrInconsistentDatabase; a nil db is a *txoutbox.ConfigError naming it.
func (m *Migrator) Status(ctx context.Context, db txoutbox.Beginner) ([]Status, error) {
	if err := dbhandle.RequireArg("migrations", "db", "a pool or a connection (a *pgxpool.Pool, a *pgx.Conn)", db); err != nil {
		return nil, err
	}
	tx, err := m.begin(ctx, db, false)
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	app, src, err := m.applied(ctx, tx)
	if err != nil {
		return nil, err
	}
	out := make([]Status, len(m.migrations))
	for i, mig := range m.migrations {
		out[i] = Status{Version: mig.Version, Name: mig.Name, Source: src}
		if i < len(app) {
			out[i].Applied = true
			out[i].AppliedAt = app[i].at
		}
	}
	return out, nil
}

// Version returns the newest applied version (0 when none is). Its errors are Status's.
func (m *Migrator) Version(ctx context.Context, db txoutbox.Beginner) (int, error) {
	if err := dbhandle.RequireArg("migrations", "db", "a pool or a connection (a *pgxpool.Pool, a *pgx.Conn)", db); err != nil {
		return 0, err
	}
	st, err := m.Status(ctx, db)
	if err != nil {
		return 0, err
	}
	v := 0
	for _, s := range st {
		if s.Applied {
			v = s.Version
		}
	}
	return v, nil
}
