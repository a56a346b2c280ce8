package migrations_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/migrations"
)

// A producer role granted at migration 4 (before delayed messages) keeps working after
// migrations 5, 7, 8, 9 and 10 without a new grant: committing a half message (which now reads
// deliver_at), the new cancel and reschedule functions, and enqueueing (migration 7's
// txoutbox_partition_keys, migration 8's txoutbox_uuidv7s, migration 9's txoutbox_write with
// delivery times, migration 10's replacements of txoutbox_write, txoutbox_partition_keys,
// txoutbox_uuidv7s and txoutbox_raise_not_scheduled, migration 11's txoutbox_holds_msg_id_text
// in the checks), and loses EXECUTE on migration 004's retired functions (migration 12). Without the grants migration 5 carries over, the commit fails with
// "permission denied for table txoutbox_messages".
func TestProducerGrantedBeforeMigration5KeepsWorking(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	ctx := context.Background()
	m, err := migrations.New(&migrations.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	for v, err := m.Version(ctx, db.Pool); v > 4; v, err = m.Version(ctx, db.Pool) {
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.Down(ctx, db.Pool, 1); err != nil {
			t.Fatalf("down from %d: %v", v, err)
		}
	}
	role := "Prod_" + strings.TrimPrefix(db.Schema, "t_") // a name that needs quoting: every migration's grant loop must quote it
	if len(role) > 63 {
		role = role[:63]
	}
	grants, err := migrations.Grants(migrations.RoleProducer, db.Schema, role, nil)
	if err != nil {
		t.Fatal(err)
	}
	// The producer's grants as migration 4 knew them: without the deliver_at column, which
	// does not exist yet, and with INSERT on every column, as the grants of that time gave it
	// (they now list the columns a producer writes, deliver_at among them, which migration 5
	// does not carry over).
	var old []string
	for _, line := range strings.Split(grants, "\n") {
		switch {
		case strings.HasPrefix(line, "REVOKE INSERT ON "):
		case strings.HasPrefix(line, "GRANT INSERT ("):
			old = append(old, "GRANT INSERT ON "+pgx.Identifier{db.Schema, "txoutbox_messages"}.Sanitize()+" TO "+pgx.Identifier{role}.Sanitize()+";")
		case !strings.Contains(line, "deliver_at"):
			old = append(old, line)
		}
	}
	if _, err := db.AdminPool.Exec(ctx, strings.Join(old, "\n")); err != nil {
		t.Fatalf("grants at migration 4: %v", err)
	}
	t.Cleanup(func() {
		_, _ = db.AdminPool.Exec(context.Background(), "DROP OWNED BY "+pgx.Identifier{role}.Sanitize())
		_, _ = db.AdminPool.Exec(context.Background(), "DROP ROLE "+pgx.Identifier{role}.Sanitize())
	})
	if _, err := m.Up(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}

	asProducer := func(what, sql string) {
		t.Helper()
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "SET LOCAL ROLE "+pgx.Identifier{role}.Sanitize()); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, sql)
			return err
		})
		if err != nil {
			t.Fatalf("%s as the producer granted at migration 4: %v", what, err)
		}
	}
	asProducer("enqueue", `SELECT txoutbox_enqueue('orders.x', 'p')`)
	// Migration 7's txoutbox_partition_keys, which txoutbox_write calls with the caller's rights.
	asProducer("enqueue many with keys", `SELECT txoutbox_enqueue_many(ARRAY['orders.x', 'orders.y'], ARRAY['p', 'q']::bytea[], ARRAY['k1', ''])`)
	asProducer("prepare and commit a half message", `SELECT txoutbox_commit(txoutbox_prepare('orders.x', 'p', producer_group => 'g1'))`)
	asProducer("prepare and roll back a half message", `SELECT txoutbox_rollback(txoutbox_prepare('orders.x', 'p', producer_group => 'g1'))`)
	asProducer("enqueue a delayed message and reschedule it", `SELECT txoutbox_reschedule(txoutbox_enqueue('orders.y', 'p', deliver_at => now() + interval '1 hour'), now() + interval '2 hours')`)
	asProducer("enqueue a delayed message and cancel it", `SELECT txoutbox_cancel(txoutbox_enqueue('orders.z', 'p', deliver_at => now() + interval '1 hour'))`)
	// Migration 9's txoutbox_write, which takes the delivery times.
	asProducer("enqueue many delayed messages", `SELECT txoutbox_enqueue_many(ARRAY['orders.x', 'orders.y'], ARRAY['p', 'q']::bytea[], ARRAY['k1', ''], deliver_ats => ARRAY[now() + interval '1 hour', NULL])`)
	asProducer("prepare a delayed half message and commit it", `SELECT txoutbox_commit(txoutbox_prepare('orders.x', 'p', 'k1', producer_group => 'g1', deliver_at => now() + interval '1 hour'))`)
	asProducer("enqueue a delayed message with a business key", `SELECT txoutbox_enqueue('orders.z', 'p', biz_key => 'b:1', deliver_at => now() + interval '1 hour')`)
	asProducer("reschedule by business key", `SELECT txoutbox_reschedule_biz_key('b:1', now() + interval '2 hours')`)
	asProducer("cancel by business key", `SELECT txoutbox_cancel_biz_key('b:1')`)
	// Migration 10: arrays numbered from 0, JSON null headers.
	asProducer("enqueue many of arrays from 0", `SELECT txoutbox_enqueue_many('[0:1]={orders.x,orders.y}', '{p,q}', '[0:1]={k1,""}', '[0:1]={null,"{}"}')`)
	// Migration 10's traceparent checks, which txoutbox_write and txoutbox_check_message call
	// with the caller's rights, and the business key forms' lookup of the key's latest message.
	asProducer("enqueue with a traceparent", `SELECT txoutbox_enqueue_many('{orders.x,orders.y}', '{p,q}', headers => ARRAY['{"Traceparent": ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"]}', NULL]::jsonb[])`)
	asProducerRefused := func(what, sql, code string) {
		t.Helper()
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "SET LOCAL ROLE "+pgx.Identifier{role}.Sanitize()); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, sql)
			return err
		})
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != code {
			t.Fatalf("%s as the producer granted at migration 4: %v, want SQLSTATE %s", what, err, code)
		}
	}
	asProducerRefused("enqueue with a bad traceparent", `SELECT txoutbox_enqueue('orders.x', 'p', headers => '{"traceparent": ["00-00000000000000000000000000000000-00f067aa0ba902b7-01"]}')`, "TX003")
	// Migration 11's txoutbox_holds_msg_id_text, which the checks call with the caller's
	// rights: a key or header holding Nats-Msg-Id is the message's error, not a permission.
	asProducerRefused("enqueue with a key holding Nats-Msg-Id", `SELECT txoutbox_enqueue('orders.x', 'p', 'k-Nats-Msg-Id')`, "TX002")
	asProducerRefused("enqueue with a header value holding Nats-Msg-Id", `SELECT txoutbox_enqueue('orders.x', 'p', headers => '{"a": ["Nats-Msg-Id"]}')`, "TX003")
	asProducerRefused("cancel by a business key holding Nats-Msg-Id", `SELECT txoutbox_cancel_biz_key('b:Nats-Msg-Id')`, "TX002")
	asProducerRefused("cancel by business key, none scheduled", `SELECT txoutbox_cancel_biz_key('b:1')`, "TX201")
	asProducerRefused("reschedule by business key, no message", `SELECT txoutbox_reschedule_biz_key('b:none', now())`, "TX202")
	// Migration 12: migration 004's functions, kept by 005 as *_v4 and called by nothing,
	// are no longer the producer's to call (their checks are 004's); txoutbox_settle_half_v4,
	// which the commit above calls, is.
	for _, call := range []string{`SELECT txoutbox_enqueue_v4('orders.x', 'p')`,
		`SELECT txoutbox_enqueue_many_v4(ARRAY['orders.x'], ARRAY['p']::bytea[])`,
		`SELECT txoutbox_prepare_v4('orders.x', 'p', producer_group => 'g1', check_immunity => '-1 day')`} {
		asProducerRefused(call, call, "42501")
	}
	// The Go client's commit statement reads deliver_at too (internal/store/half.go).
	asProducer("read deliver_at", `SELECT deliver_at FROM txoutbox_messages LIMIT 1`)
	// Migration 13: txoutbox_prepare's new txoutbox_check_immunity is the producer's to call
	// (EXECUTE carried over from txoutbox_prepare's grantees), and both bounds are TX008.
	asProducer("prepare after 013", `SELECT txoutbox_prepare('orders.x', 'p', producer_group => 'g1', check_immunity => '1 hour')`)
	asProducerRefused("prepare with a negative check immunity after 013", `SELECT txoutbox_prepare('orders.x', 'p', producer_group => 'g1', check_immunity => '-1 day')`, "TX008")
	asProducerRefused("prepare with a check immunity of 1000 years after 013", `SELECT txoutbox_prepare('orders.x', 'p', producer_group => 'g1', check_immunity => '1000 years')`, "TX008")
	// Reverting 013 and 012 gives the role EXECUTE on 004's functions back, as it had it.
	if _, err := m.Down(ctx, db.Pool, 2); err != nil {
		t.Fatalf("down from 13 to 11: %v", err)
	}
	asProducer("migration 004's enqueue after 012 is reverted", `SELECT txoutbox_enqueue_v4('orders.x', 'p')`)
}

// The role that owns the earlier migrations' functions keeps enqueueing when another role (an
// operator, a superuser) applies the later migrations, whose new functions the public ones
// call with the caller's privileges: txoutbox_uuidv7s (008), txoutbox_partition_keys (007,
// whose own grant passed over txoutbox_write's owner; 008 repairs it) and the txoutbox_write
// that takes delivery times (009), the functions 010 replaces, and 011's
// txoutbox_holds_msg_id_text. Migrations 1–10 (then 1–9, 1–8, 1–7, 1–6) run as the owner, the
// rest as the superuser of the test database.
func TestOwnerOfEarlierMigrationsKeepsEnqueueing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, keep := range []int{10, 9, 8, 7, 6} {
		admin, schema := newSchema(t, "owner"+strconv.Itoa(keep))
		role := "own_" + strings.TrimPrefix(schema, "owner")
		if _, err := admin.Exec(ctx, "CREATE ROLE "+pgx.Identifier{role}.Sanitize()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_, _ = admin.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
			_, _ = admin.Exec(context.Background(), "DROP OWNED BY "+pgx.Identifier{role}.Sanitize())
			_, _ = admin.Exec(context.Background(), "DROP ROLE "+pgx.Identifier{role}.Sanitize())
		})
		if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()+" AUTHORIZATION "+pgx.Identifier{role}.Sanitize()); err != nil {
			t.Fatal(err)
		}
		cfg, err := pgxpool.ParseConfig(testsvc.PostgresDSN(t))
		if err != nil {
			t.Fatal(err)
		}
		cfg.ConnConfig.RuntimeParams["role"] = role
		asOwner, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer asOwner.Close()
		m, err := migrations.New(&migrations.Config{Schema: schema})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.Up(ctx, asOwner); err != nil {
			t.Fatalf("up as the owner: %v", err)
		}
		if _, err := m.Down(ctx, asOwner, m.Latest()-keep); err != nil {
			t.Fatalf("down to %d as the owner: %v", keep, err)
		}
		if _, err := m.Up(ctx, admin); err != nil {
			t.Fatalf("up from %d as the superuser: %v", keep, err)
		}
		for _, sql := range []string{
			`SELECT txoutbox_enqueue('orders.x', 'p')`,
			`SELECT txoutbox_enqueue_many(ARRAY['orders.x', 'orders.y'], ARRAY['p', 'q']::bytea[], ARRAY['k1', ''])`,
			`SELECT txoutbox_enqueue_many(ARRAY['orders.x', 'orders.y'], ARRAY['p', 'q']::bytea[], deliver_ats => ARRAY[now() + interval '1 hour', NULL])`,
			`SELECT txoutbox_prepare('orders.x', 'p', producer_group => 'g1', deliver_at => now() + interval '1 hour')`,
			`SELECT txoutbox_enqueue('orders.x', 'p', headers => '{"traceparent": ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"]}')`,
		} {
			err := pgx.BeginFunc(ctx, asOwner, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "SET LOCAL search_path TO "+pgx.Identifier{schema}.Sanitize()+"; "+sql)
				return err
			})
			if err != nil {
				t.Errorf("migrations 1-%d by the owner, the rest by a superuser: %s as the owner: %v", keep, sql, err)
			}
		}
		// A bad traceparent is the message's error (TX003), not a permission the owner lacks
		// on migration 10's checks.
		err = pgx.BeginFunc(ctx, asOwner, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "SET LOCAL search_path TO "+pgx.Identifier{schema}.Sanitize()+`; SELECT txoutbox_enqueue('orders.x', 'p', headers => '{"traceparent": ["ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"]}')`)
			return err
		})
		if pgErr := (*pgconn.PgError)(nil); !errors.As(err, &pgErr) || pgErr.Code != "TX003" {
			t.Errorf("migrations 1-%d by the owner, the rest by a superuser: a bad traceparent as the owner: %v, want TX003", keep, err)
		}
		// Nor is a header value holding Nats-Msg-Id (migration 11's check).
		err = pgx.BeginFunc(ctx, asOwner, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "SET LOCAL search_path TO "+pgx.Identifier{schema}.Sanitize()+`; SELECT txoutbox_enqueue('orders.x', 'p', headers => '{"a": ["Nats-Msg-Id"]}')`)
			return err
		})
		if pgErr := (*pgconn.PgError)(nil); !errors.As(err, &pgErr) || pgErr.Code != "TX003" {
			t.Errorf("migrations 1-%d by the owner, the rest by a superuser: a header value holding Nats-Msg-Id as the owner: %v, want TX003", keep, err)
		}
	}
}

// Re-running the producer grants on a schema granted by an earlier version replaces its
// producer update policy, whose time test (created_at = now() OR settled_at >= now()) let a
// transaction held open since before another service's commit roll that message back: the
// policy afterwards tests the row version's writer (OwnRowVersionFunc) and no longer now().
func TestProducerGrantsReplaceTheTimeTestPolicy(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	ctx := context.Background()
	role := "produp_" + strings.TrimPrefix(db.Schema, "t_")
	if len(role) > 63 {
		role = role[:63]
	}
	t.Cleanup(func() {
		_, _ = db.AdminPool.Exec(context.Background(), "DROP OWNED BY "+pgx.Identifier{role}.Sanitize())
		_, _ = db.AdminPool.Exec(context.Background(), "DROP ROLE "+pgx.Identifier{role}.Sanitize())
	})
	grants, err := migrations.Grants(migrations.RoleProducer, db.Schema, role, nil)
	if err != nil {
		t.Fatal(err)
	}
	messages := pgx.Identifier{db.Schema, "txoutbox_messages"}.Sanitize()
	// The earlier version's grants: the same, with the time test and without the function.
	if _, err := db.AdminPool.Exec(ctx, grants); err != nil {
		t.Fatal(err)
	}
	if _, err := db.AdminPool.Exec(ctx, `ALTER POLICY txoutbox_producer_update ON `+messages+`
		USING (state IN ('prepared', 'check_exhausted', 'scheduled') OR (state = 'ready' AND (created_at = now() OR settled_at >= now())))`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.AdminPool.Exec(ctx, `DROP FUNCTION `+pgx.Identifier{db.Schema, migrations.OwnRowVersionFunc}.Sanitize()+`(xid)`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.AdminPool.Exec(ctx, grants); err != nil {
		t.Fatalf("re-running the producer grants: %v", err)
	}
	var qual string
	if err := db.AdminPool.QueryRow(ctx, `SELECT pg_get_expr(polqual, polrelid) FROM pg_policy
		WHERE polrelid = $1::regclass AND polname = 'txoutbox_producer_update'`, messages).Scan(&qual); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(qual, "now()") || !strings.Contains(qual, migrations.OwnRowVersionFunc+"(xmin)") {
		t.Errorf("the producer update policy after re-running the grants: %s, want the row version test and no now()", qual)
	}
}

// This binary's producer grants on a schema below migration 12 (here 6, where the public
// enqueue and prepare functions still call migration 004's, kept as *_v4) include those: the
// producer enqueues and prepares there, and still after the schema is migrated up.
func TestProducerGrantedAtMigration6Enqueues(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	ctx := context.Background()
	m, err := migrations.New(&migrations.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Down(ctx, db.Pool, m.Latest()-6); err != nil {
		t.Fatal(err)
	}
	if v, err := m.Version(ctx, db.Pool); err != nil || v != 6 {
		t.Fatalf("version %d, %v; want 6", v, err)
	}
	producer := roleBeginner{db.Pool, grantedRole(t, db, migrations.RoleProducer, "prod6_")}
	asProducer := func(what, sql string) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, sql)
			return err
		}); err != nil {
			t.Fatalf("%s as a producer granted at migration 6: %v", what, err)
		}
	}
	asProducer("enqueue", `SELECT txoutbox_enqueue('orders.x', 'p', 'k1')`)
	asProducer("enqueue many", `SELECT txoutbox_enqueue_many(ARRAY['orders.x'], ARRAY['p']::bytea[])`)
	asProducer("prepare and commit", `SELECT txoutbox_commit(txoutbox_prepare('orders.x', 'p', producer_group => 'g1'))`)
	if _, err := m.Up(ctx, db.Pool); err != nil {
		t.Fatal(err)
	}
	asProducer("enqueue after the migrations", `SELECT txoutbox_enqueue('orders.x', 'p', 'k1')`)
}

// grantedRole creates a role named prefix + the schema's suffix with this binary's grants of
// kind on db's schema, dropped when the test ends, and returns its name.
func grantedRole(t *testing.T, db *testsvc.DB, kind, prefix string) string {
	t.Helper()
	role := prefix + strings.TrimPrefix(db.Schema, "t_")
	if len(role) > 63 {
		role = role[:63]
	}
	grants, err := migrations.Grants(kind, db.Schema, role, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.AdminPool.Exec(context.Background(), grants); err != nil {
		t.Fatalf("%s grants: %v", kind, err)
	}
	t.Cleanup(func() {
		_, _ = db.AdminPool.Exec(context.Background(), "DROP OWNED BY "+pgx.Identifier{role}.Sanitize())
		_, _ = db.AdminPool.Exec(context.Background(), "DROP ROLE "+pgx.Identifier{role}.Sanitize())
	})
	return role
}

// roleBeginner begins transactions as role (SET LOCAL ROLE): the migrator's reads as that role.
type roleBeginner struct {
	pool *pgxpool.Pool
	role string
}

func (b roleBeginner) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := b.pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	if _, err := tx.Exec(ctx, "SET LOCAL ROLE "+pgx.Identifier{b.role}.Sanitize()); err != nil {
		_ = tx.Rollback(ctx)
		return nil, err
	}
	return tx, nil
}

// The relay role reads the schema's version wherever a deploy tool keeps it: txoutbox's own
// golang-migrate table (a shared schema's x-migrations-table) included, as the README
// recommends it.
func TestRelayRoleReadsTxoutboxsOwnToolTables(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	ctx := context.Background()
	m, err := migrations.New(&migrations.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	// As golang-migrate with x-migrations-table=txoutbox_golang_migrate leaves it.
	if _, err := db.Pool.Exec(ctx, `DROP TABLE txoutbox_schema_migrations;
CREATE TABLE `+migrations.OwnGolangMigrateTable+` (version bigint NOT NULL PRIMARY KEY, dirty boolean NOT NULL);
INSERT INTO `+migrations.OwnGolangMigrateTable+` VALUES (`+strconv.Itoa(m.Latest())+`, false)`); err != nil {
		t.Fatal(err)
	}
	role := grantedRole(t, db, migrations.RoleRelay, "relay_")
	if v, err := m.Version(ctx, roleBeginner{db.Pool, role}); err != nil || v != m.Latest() {
		t.Fatalf("the relay role reads version %d, %v; want %d from %s", v, err, m.Latest(), migrations.OwnGolangMigrateTable)
	}
}

// The relay grants give UPDATE of the columns the relay and the check-back write only, and
// take back UPDATE on every column, which earlier versions granted: re-run on a role granted
// that way (here also holding a producer's column grants, as one grantee given both roles
// would), the role keeps UPDATE of the relay's columns and of the producer's, and loses it on
// payload, subject, headers, msg_key, partition_key and message_id (SQLSTATE 42501 as that
// role). Re-running them again changes nothing.
func TestRelayGrantsNarrowTableWideUpdate(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	ctx := context.Background()
	role := grantedRole(t, db, migrations.RoleProducer, "relay_")
	messages := pgx.Identifier{db.Schema, "txoutbox_messages"}.Sanitize()
	// As earlier versions' relay grants left it.
	if _, err := db.AdminPool.Exec(ctx, "GRANT SELECT, UPDATE, DELETE ON "+messages+" TO "+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	may := func(col string) bool {
		t.Helper()
		var ok bool
		if err := db.AdminPool.QueryRow(ctx, `SELECT has_column_privilege($1, $2::regclass, $3, 'UPDATE')`, role, messages, col).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if !may("payload") {
		t.Fatal("the old relay grants did not give UPDATE of payload: the test proves nothing")
	}
	grants, err := migrations.Grants(migrations.RoleRelay, db.Schema, role, nil)
	if err != nil {
		t.Fatal(err)
	}
	for run := 1; run <= 2; run++ {
		if _, err := db.AdminPool.Exec(ctx, grants); err != nil {
			t.Fatalf("relay grants, run %d: %v", run, err)
		}
		var table bool
		if err := db.AdminPool.QueryRow(ctx, `SELECT has_table_privilege($1, $2::regclass, 'UPDATE')`, role, messages).Scan(&table); err != nil || table {
			t.Errorf("run %d: UPDATE on the whole table is kept (%v)", run, err)
		}
		for _, col := range []string{"payload", "subject", "headers", "msg_key", "partition_key", "message_id", "created_at", "check_mode"} {
			if may(col) {
				t.Errorf("run %d: the role may still update %s", run, col)
			}
		}
		// The relay's columns, and the producer's (deliver_at is the producer's alone).
		for _, col := range []string{"id", "state", "attempts", "next_attempt_at", "last_error", "published_at", "stream", "stream_seq",
			"next_check_at", "settled_by", "settled_at", "check_count", "ready_at", "deliver_at"} {
			if !may(col) {
				t.Errorf("run %d: the role may not update %s", run, col)
			}
		}
	}
	for _, set := range []string{"payload = 'tampered'", "subject = 'tampered'", `headers = '{"X-Tampered": ["1"]}'`, "msg_key = 'tampered'"} {
		_, err := roleExec(ctx, db.Pool, role, "UPDATE txoutbox_messages SET "+set)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			t.Errorf("UPDATE ... SET %s as the re-granted role: %v, want SQLSTATE 42501", set, err)
		}
	}
	if _, err := roleExec(ctx, db.Pool, role, "UPDATE txoutbox_messages SET state = state, stream = stream WHERE false"); err != nil {
		t.Errorf("UPDATE of the relay's columns as the re-granted role: %v", err)
	}
}

// roleExec runs sql in a transaction as role (SET LOCAL ROLE), rolled back.
func roleExec(ctx context.Context, pool *pgxpool.Pool, role, sql string) (pgconn.CommandTag, error) {
	tx, err := roleBeginner{pool, role}.Begin(ctx)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	return tx.Exec(ctx, sql)
}

// The functions the producer grants create (txoutbox_row_version_is_mine,
// txoutbox_producer_partition_key) belong to the owner of txoutbox_messages, as txoutbox's
// other objects, whichever of the producer and admin grants ran first: so `relay migrate down
// --all` as the admin login drops them with the outbox and leaves no txoutbox_* function in the
// schema. Before, they were the property of whoever ran the grants (a superuser), outlived
// the outbox, and the admin could not drop them.
func TestProducerGrantFunctionsGoDownWithTheOutbox(t *testing.T) {
	t.Parallel()
	for _, order := range [][]string{{migrations.RoleProducer, migrations.RoleAdmin}, {migrations.RoleAdmin, migrations.RoleProducer}} {
		t.Run(strings.Join(order, "_then_"), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			dsn := testsvc.PostgresDSN(t)
			super, err := pgxpool.New(ctx, dsn)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(super.Close)
			suffix := strings.ReplaceAll(uuid.NewString()[:13], "-", "") // unique across parallel subtests and runs
			grantee := map[string]string{migrations.RoleProducer: "txo_gp_" + suffix, migrations.RoleAdmin: "txo_ga_" + suffix}
			for _, name := range grantee {
				testsvc.CreateRole(t, super, name, "LOGIN")
			}
			db := testsvc.NewDB(t)
			for _, role := range order {
				grants, err := migrations.Grants(role, db.Schema, grantee[role], nil)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := super.Exec(ctx, grants); err != nil {
					t.Fatalf("%s grants: %v", role, err)
				}
			}
			functions := func() []string {
				t.Helper()
				rows, err := super.Query(ctx, `SELECT p.oid::regprocedure::text || ' owned by ' || pg_get_userbyid(p.proowner)
					FROM pg_proc p WHERE p.pronamespace = $1::regnamespace AND p.proname LIKE 'txoutbox\_%' ORDER BY 1`, db.Schema)
				if err != nil {
					t.Fatal(err)
				}
				out, err := pgx.CollectRows(rows, pgx.RowTo[string])
				if err != nil {
					t.Fatal(err)
				}
				return out
			}
			for _, f := range []string{migrations.OwnRowVersionFunc, migrations.PartitionKeyFunc} {
				var owner string
				if err := super.QueryRow(ctx, `SELECT pg_get_userbyid(p.proowner) FROM pg_proc p
					WHERE p.pronamespace = $1::regnamespace AND p.proname = $2`, db.Schema, f).Scan(&owner); err != nil || owner != grantee[migrations.RoleAdmin] {
					t.Errorf("%s is owned by %q (%v), want the admin role %s", f, owner, err, grantee[migrations.RoleAdmin])
				}
			}
			cfg, err := pgxpool.ParseConfig(dsn)
			if err != nil {
				t.Fatal(err)
			}
			cfg.ConnConfig.User = grantee[migrations.RoleAdmin]
			asAdmin, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(asAdmin.Close)
			m, err := migrations.New(&migrations.Config{Schema: db.Schema})
			if err != nil {
				t.Fatal(err)
			}
			if done, err := m.Down(ctx, asAdmin, migrations.DownAll); err != nil || len(done) != m.Latest() {
				t.Fatalf("down --all as the admin login: reverted %v, %v", done, err)
			}
			if left := functions(); len(left) > 0 {
				t.Errorf("after down --all as the admin login, txoutbox functions are left in the schema:\n%s", strings.Join(left, "\n"))
			}
		})
	}
}
