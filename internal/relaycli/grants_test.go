package relaycli

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
)

// wantDenied fails unless err is PostgreSQL's insufficient_privilege (42501).
func wantDenied(t *testing.T, what string, err error) {
	t.Helper()
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
		t.Errorf("%s: got %v, want permission denied (SQLSTATE 42501)", what, err)
	}
}

// leastPrivilege is a test schema migrated and granted, with one LOGIN role per
// least-privilege role granted by `relay migrate grants`.
type leastPrivilege struct {
	db    *testsvc.DB
	login map[string]string // role -> its login role's name
	dsnOf func(role string) string
	// poolOf opens a pool logged in as role, closed by the test's cleanup.
	poolOf func(role string) *pgxpool.Pool
}

func newLeastPrivilege(t *testing.T) *leastPrivilege {
	t.Helper()
	return newLeastPrivilegeAt(t, 0)
}

// newLeastPrivilegeAt is newLeastPrivilege with the schema migrated (as the test database's
// superuser) to the latest version but down migrations, before the grants.
func newLeastPrivilegeAt(t *testing.T, down int) *leastPrivilege {
	t.Helper()
	ctx := context.Background()
	base := testsvc.PostgresDSN(t)
	super, err := pgxpool.New(ctx, base)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(super.Close)
	suffix := randomSuffix()
	login := map[string]string{}
	for _, r := range migrations.Roles {
		name := "txo_" + r + "_" + suffix
		login[r] = name
		testsvc.CreateRole(t, super, name, "LOGIN")
	}
	db := testsvc.NewDB(t)
	if down > 0 {
		m, err := migrations.New(&migrations.Config{Schema: db.Schema})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.Down(ctx, db.Pool, down); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range migrations.Roles {
		code, sql, stderr := cli(t, "migrate", "grants", "--role", r, "--schema", db.Schema, "--grantee", login[r])
		if code != 0 {
			t.Fatalf("grants --role %s: exit %d: %s", r, code, stderr)
		}
		conn, err := super.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, err = conn.Conn().PgConn().Exec(ctx, sql).ReadAll()
		conn.Release()
		if err != nil {
			t.Fatalf("grants --role %s: %v\n%s", r, err, sql)
		}
	}
	dsnOf := func(role string) string {
		return testsvc.WithSearchPath(withURL(t, base, func(u *url.URL) { u.User = url.User(login[role]) }), db.Schema)
	}
	poolOf := func(role string) *pgxpool.Pool {
		p, err := pgxpool.New(ctx, dsnOf(role))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		return p
	}
	return &leastPrivilege{db: db, login: login, dsnOf: dsnOf, poolOf: poolOf}
}

// The core paths run as the four least-privilege roles `relay migrate grants` prints, each a
// LOGIN role of its own: the producer enqueues and prepares, commits and rolls back half
// messages, and cannot delete outbox rows, read payloads back or read dedup rows; the relay
// publishes and the check-back resolves half messages (checker and fence) and purges, and the
// relay cannot insert messages; the consumer applies messages and cannot read the outbox; the
// admin owns the schema and migrates.
func TestLeastPrivilegeRoles(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lp := newLeastPrivilege(t)
	db, login, dsnOf, poolOf := lp.db, lp.login, lp.dsnOf, lp.poolOf
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE ledger (message_id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `GRANT INSERT ON ledger TO `+login[migrations.RoleConsumer]); err != nil {
		t.Fatal(err)
	}
	n := testsvc.NewNATS(t)
	n.Stream(t, "ORDERS", "orders.>")
	n.Stream(t, "DEAD_LETTERS", consumer.DefaultDeadLetterPrefix+">")
	got := make(chan *nats.Msg, 16)
	if _, err := n.Conn.ChanSubscribe("orders.>", got); err != nil {
		t.Fatal(err)
	}
	if err := n.Conn.Flush(); err != nil {
		t.Fatal(err)
	}

	// Producer.
	producer := poolOf(migrations.RoleProducer)
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{}
	if err := pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error {
		ids, err := client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.created", Key: "o1", Payload: []byte("enqueued")})
		for _, id := range ids {
			want[id.String()] = true
		}
		return err
	}); err != nil {
		t.Fatalf("producer EnqueueTx: %v", err)
	}
	prep := func(key string, opts *outbox.PrepareOptions) outbox.Half {
		t.Helper()
		h, err := client.Prepare(ctx, producer, outbox.Message{Subject: "orders.created", Key: key, Payload: []byte("half " + key)}, opts)
		if err != nil {
			t.Fatalf("producer Prepare: %v", err)
		}
		return h
	}
	committed := prep("o1", &outbox.PrepareOptions{Group: "payments"})
	if err := client.Commit(ctx, producer, committed.ID); err != nil {
		t.Fatalf("producer Commit: %v", err)
	}
	want[committed.ID.String()] = true
	if err := client.Rollback(ctx, producer, prep("o2", &outbox.PrepareOptions{Group: "payments"}).ID); err != nil {
		t.Fatalf("producer Rollback: %v", err)
	}
	fenced := prep("o3", &outbox.PrepareOptions{Fence: true})
	if err := pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error { return client.CommitTx(ctx, tx, fenced.ID) }); err != nil {
		t.Fatalf("producer CommitTx: %v", err)
	}
	want[fenced.ID.String()] = true
	// Left to the check-back: one its checker commits, one it fences.
	toCheck := prep("o4", &outbox.PrepareOptions{Group: "payments"})
	toFence := prep("o5", &outbox.PrepareOptions{Fence: true})
	want[toCheck.ID.String()] = true
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET created_at = now() - interval '1 hour', next_check_at = now() - interval '1 second' WHERE message_id = ANY($1)`,
		[]string{toCheck.ID.String(), toFence.ID.String()}); err != nil {
		t.Fatal(err)
	}
	_, err = producer.Exec(ctx, `DELETE FROM txoutbox_messages`)
	wantDenied(t, "producer DELETE outbox rows", err)
	_, err = producer.Exec(ctx, `SELECT payload FROM txoutbox_messages`)
	wantDenied(t, "producer SELECT payload", err)
	_, err = producer.Exec(ctx, `UPDATE txoutbox_messages SET payload = ''`)
	wantDenied(t, "producer UPDATE payload", err)
	_, err = producer.Exec(ctx, `SELECT * FROM txoutbox_consumer_dedup`)
	wantDenied(t, "producer SELECT dedup rows", err)
	_, err = producer.Exec(ctx, `INSERT INTO txoutbox_consumer_dedup (consumer, idempotency_key) VALUES ('billing', 'k')`)
	wantDenied(t, "producer INSERT a dedup row", err)
	outboxID, err := checker.OutboxIdentity(ctx, producer, db.Schema)
	if err != nil {
		t.Fatalf("producer OutboxIdentity: %v", err)
	}

	// Relay: the check-back resolves (as relay checkback --once does), then relay run publishes.
	srv, err := checker.Serve(n.Conn, "payments", func(context.Context, checker.Request) (outbox.LocalState, error) {
		return outbox.StateCommit, nil
	}, &checker.Config{Outbox: outboxID})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Stop() })
	code, out, stderr := cli(t, "checkback", "--once", "--database-url", dsnOf(migrations.RoleRelay), "--schema", db.Schema, "--nats-url", n.URL())
	if code != 0 || !strings.Contains(out, "resolve: fenced 1, committed 1,") || !strings.Contains(out, "purge:") {
		t.Fatalf("relay checkback --once as the relay role: exit %d\n%s%s", code, out, stderr)
	}
	p := startRelay(t, "relay", "run", "--no-checkback", "--database-url", dsnOf(migrations.RoleRelay), "--schema", db.Schema,
		"--nats-url", n.URL(), "--log-format", "json")
	for len(want) > 0 {
		select {
		case m := <-got:
			id := m.Header.Get("Nats-Msg-Id")
			if !want[id] {
				t.Fatalf("published %s, not expected (left %v)", id, want)
			}
			delete(want, id)
		case <-p.done:
			t.Fatalf("the relay exited:\n%s", p.output())
		case <-time.After(30 * time.Second):
			t.Fatalf("not published within 30s: %v\n%s", want, p.output())
		}
	}
	if code := p.stop(t, syscall.SIGTERM); code != 0 || strings.Contains(p.output(), "permission denied") {
		t.Errorf("relay run as the relay role: exit %d after SIGTERM:\n%s", code, p.output())
	}
	relayPool := poolOf(migrations.RoleRelay)
	_, err = relayPool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload) VALUES (gen_random_uuid(), 'x', 0, '')`)
	wantDenied(t, "relay INSERT a message", err)
	for _, set := range []string{"payload = 'tampered'", "subject = 'tampered'", `headers = '{"X-Tampered": ["1"]}'`, "msg_key = 'tampered'"} {
		_, err = relayPool.Exec(ctx, `UPDATE txoutbox_messages SET `+set)
		wantDenied(t, "relay UPDATE ... SET "+set, err)
	}

	// Consumer.
	cons, err := consumer.New(poolOf(migrations.RoleConsumer), n.JS, func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO ledger (message_id) VALUES ($1)`, msg.Headers.Get("Nats-Msg-Id"))
		return err
	}, &consumer.Config{Stream: "ORDERS", Durable: "billing", Schema: db.Schema, Ordered: true, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	cctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- cons.Run(cctx) }()
	testsvc.Eventually(t, 30*time.Second, "the consumer to apply the 4 messages", func() bool {
		select {
		case err := <-done:
			t.Fatalf("the consumer stopped: %v", err)
		default:
		}
		return cons.Stats().Processed >= 4
	})
	stop()
	if err := <-done; err != nil {
		t.Errorf("consumer as the consumer role: %v", err)
	}
	var dedup int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_consumer_dedup`).Scan(&dedup); err != nil || dedup != 4 {
		t.Errorf("%d dedup rows (%v), want 4", dedup, err)
	}
	_, err = poolOf(migrations.RoleConsumer).Exec(ctx, `SELECT count(*) FROM txoutbox_messages`)
	wantDenied(t, "consumer SELECT the outbox", err)
	// An ordered consumer whose role cannot update the key-order table refuses to start,
	// instead of waiting for the database forever.
	if _, err := db.Pool.Exec(ctx, `REVOKE UPDATE ON txoutbox_consumer_key_order FROM `+login[migrations.RoleConsumer]); err != nil {
		t.Fatal(err)
	}
	if _, err := cons.Setup(ctx); !errors.Is(err, consumer.ErrKeyOrderTable) {
		t.Errorf("ordered consumer without UPDATE on the key-order table: Setup returned %v, want consumer.ErrKeyOrderTable", err)
	}

	// Admin: owns the schema, migrates and administers.
	for _, args := range [][]string{{"migrate", "up"}, {"migrate", "status"}, {"prepared", "list"}, {"dead", "list"}} {
		code, out, stderr := cli(t, append(args, "--database-url", dsnOf(migrations.RoleAdmin), "--schema", db.Schema)...)
		if code != 0 {
			t.Errorf("relay %s as the admin role: exit %d\n%s%s", strings.Join(args, " "), code, out, stderr)
		}
	}
	var owner string
	if err := db.Pool.QueryRow(ctx, `SELECT tableowner FROM pg_tables WHERE schemaname = $1 AND tablename = 'txoutbox_messages'`, db.Schema).Scan(&owner); err != nil || owner != login[migrations.RoleAdmin] {
		t.Errorf("txoutbox_messages is owned by %q (%v), want %s", owner, err, login[migrations.RoleAdmin])
	}
}

// relay migrate grants refuses what it does not know, and writes a file with --out.
func TestGrantsCommand(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{}, {"--role", "operator"}, {"--role", "producer", "--grantee", "bad name"}, {"--role", "producer", "--signal-backend"},
		{"--role", "producer", "--consumers", "billing"}, {"--role", "consumer", "--consumers", " , "}} {
		if code, _, _ := cli(t, append([]string{"migrate", "grants"}, args...)...); code != 2 {
			t.Errorf("migrate grants %v: exit %d, want 2", args, code)
		}
	}
	code, out, _ := cli(t, "migrate", "grants", "--role", "relay", "--signal-backend")
	if code != 0 || !strings.Contains(out, `GRANT pg_signal_backend TO "txoutbox_relay";`) || !strings.Contains(out, `"public"."txoutbox_relays"`) {
		t.Errorf("exit %d:\n%s", code, out)
	}
}

// The delayed-message paths (migration 5) run as the restricted producer role: EnqueueTx with a
// DeliverAt, CancelTx, RescheduleTx, CancelBizKeyTx and RescheduleBizKeyTx succeed with the
// grants `relay migrate grants --role producer` prints (SELECT of deliver_at and headers,
// UPDATE of deliver_at), and the producer still cannot delete outbox rows, read payloads,
// rewrite a message or touch dedup rows. The admin role lists and cancels scheduled messages.
func TestLeastPrivilegeDelayedMessages(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lp := newLeastPrivilege(t)
	db := lp.db
	producer := lp.poolOf(migrations.RoleProducer)
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	var due time.Time
	if err := db.Pool.QueryRow(ctx, `SELECT now() + interval '1 hour'`).Scan(&due); err != nil {
		t.Fatal(err)
	}
	msg := func(bizKey string) outbox.Message {
		return outbox.Message{Subject: "orders.expire", Key: "orders", BizKey: bizKey, Payload: []byte("expire " + bizKey), DeliverAt: due}
	}
	var ids []uuid.UUID
	if err := pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error {
		ids, err = client.EnqueueTx(ctx, tx, msg("order:1:expire"), msg("order:2:expire"), msg("order:3:expire"),
			msg("order:4:expire"), msg("order:5:expire"))
		return err
	}); err != nil {
		t.Fatalf("producer EnqueueTx with DeliverAt: %v", err)
	}
	byID, rescheduled, byKey, keyRescheduled, forAdmin := ids[0], ids[1], ids[2], ids[3], ids[4]
	later := due.Add(time.Hour)
	inTx := func(what string, f func(tx pgx.Tx) error) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, producer, f); err != nil {
			t.Fatalf("producer %s: %v", what, err)
		}
	}
	inTx("CancelTx", func(tx pgx.Tx) error { return client.CancelTx(ctx, tx, byID) })
	inTx("RescheduleTx", func(tx pgx.Tx) error { return client.RescheduleTx(ctx, tx, rescheduled, later) })
	inTx("CancelBizKeyTx", func(tx pgx.Tx) error {
		got, err := client.CancelBizKeyTx(ctx, tx, "order:3:expire")
		if err == nil && (len(got) != 1 || got[0] != byKey) {
			t.Errorf("CancelBizKeyTx cancelled %v, want [%s]", got, byKey)
		}
		return err
	})
	inTx("RescheduleBizKeyTx", func(tx pgx.Tx) error {
		got, err := client.RescheduleBizKeyTx(ctx, tx, "order:4:expire", later)
		if err == nil && (len(got) != 1 || got[0] != keyRescheduled) {
			t.Errorf("RescheduleBizKeyTx moved %v, want [%s]", got, keyRescheduled)
		}
		return err
	})
	// A cancel of a message no longer scheduled is still refused as such, not as a denial.
	if err := pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error { return client.CancelTx(ctx, tx, byID) }); !errors.Is(err, outbox.ErrNotScheduled) {
		t.Errorf("producer CancelTx of a cancelled message: %v, want ErrNotScheduled", err)
	}

	type row struct {
		state string
		at    time.Time
	}
	read := func(id uuid.UUID) row {
		t.Helper()
		var r row
		if err := db.Pool.QueryRow(ctx, `SELECT state, deliver_at FROM txoutbox_messages WHERE message_id = $1`, id).Scan(&r.state, &r.at); err != nil {
			t.Fatal(err)
		}
		return r
	}
	for id, want := range map[uuid.UUID]row{
		byID: {"rolled_back", due}, rescheduled: {"scheduled", later}, byKey: {"rolled_back", due},
		keyRescheduled: {"scheduled", later}, forAdmin: {"scheduled", due},
	} {
		if got := read(id); got.state != want.state || !got.at.Equal(want.at) {
			t.Errorf("message %s: %s due %s, want %s due %s", id, got.state, got.at, want.state, want.at)
		}
	}

	// What the producer must not do, delayed messages or not.
	for what, sql := range map[string]string{
		"DELETE outbox rows":            `DELETE FROM txoutbox_messages`,
		"SELECT payload":                `SELECT payload FROM txoutbox_messages`,
		"UPDATE payload":                `UPDATE txoutbox_messages SET payload = ''`,
		"UPDATE headers":                `UPDATE txoutbox_messages SET headers = '{}'`,
		"UPDATE subject":                `UPDATE txoutbox_messages SET subject = 'elsewhere'`,
		"SELECT dedup rows":             `SELECT * FROM txoutbox_consumer_dedup`,
		"DELETE dedup rows":             `DELETE FROM txoutbox_consumer_dedup`,
		"SELECT the relays' membership": `SELECT * FROM txoutbox_relays`,
	} {
		_, err := producer.Exec(ctx, sql)
		wantDenied(t, "producer "+what, err)
	}

	// The admin role lists and cancels scheduled messages.
	admin := func(args ...string) string {
		t.Helper()
		code, out, stderr := cli(t, append(args, "--database-url", lp.dsnOf(migrations.RoleAdmin), "--schema", db.Schema)...)
		if code != 0 {
			t.Fatalf("relay %s as the admin role: exit %d\n%s%s", strings.Join(args, " "), code, out, stderr)
		}
		return out
	}
	var listed []struct {
		MessageID uuid.UUID `json:"message_id"`
		BizKey    string    `json:"biz_key"`
	}
	if err := json.Unmarshal([]byte(admin("scheduled", "list", "--json")), &listed); err != nil {
		t.Fatal(err)
	}
	if len(listed) != 3 || listed[0].MessageID != forAdmin {
		t.Errorf("scheduled list as the admin role: %+v, want %s first of 3 (then the two moved to %s)", listed, forAdmin, later)
	}
	if out := admin("scheduled", "cancel", "--biz-key", "order:5:expire"); !strings.Contains(out, "cancelled "+forAdmin.String()) {
		t.Errorf("scheduled cancel --biz-key as the admin role: %q", out)
	}
	if got := read(forAdmin); got.state != "rolled_back" {
		t.Errorf("the admin's cancel left message %s %s", forAdmin, got.state)
	}
}

// The admin role owns every object of the schema the migrations create, functions included,
// once `relay migrate grants --role admin` ran on a schema migrated by another role: so the
// admin applies the next migration (which replaces and drops functions: "must be owner of
// function" before) and reverts it, then applies it again, and the producer still enqueues.
func TestAdminRoleMigratesUpAndDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lp := newLeastPrivilegeAt(t, 1) // migrated by the superuser up to the version before the latest
	db, admin := lp.db, lp.login[migrations.RoleAdmin]
	var others []string
	rows, err := db.Pool.Query(ctx, `
		SELECT 'relation ' || c.relname || ' owned by ' || pg_get_userbyid(c.relowner) FROM pg_class c
		 WHERE c.relnamespace = $1::regnamespace AND pg_get_userbyid(c.relowner) <> $2
		UNION ALL
		SELECT 'routine ' || p.oid::regprocedure || ' owned by ' || pg_get_userbyid(p.proowner) FROM pg_proc p
		 WHERE p.pronamespace = $1::regnamespace AND pg_get_userbyid(p.proowner) <> $2
		UNION ALL
		SELECT 'type ' || t.typname || ' owned by ' || pg_get_userbyid(t.typowner) FROM pg_type t
		 WHERE t.typnamespace = $1::regnamespace AND pg_get_userbyid(t.typowner) <> $2`, db.Schema, admin)
	if err == nil {
		others, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(others) > 0 {
		t.Errorf("after the admin grants, objects of the schema not owned by the admin role %s:\n%s", admin, strings.Join(others, "\n"))
	}
	m, err := migrations.New(&migrations.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	latest := strconv.Itoa(m.Latest())
	asAdmin := func(args ...string) string {
		t.Helper()
		code, out, stderr := cli(t, append(args, "--database-url", lp.dsnOf(migrations.RoleAdmin), "--schema", db.Schema)...)
		if code != 0 {
			t.Fatalf("relay %s as the admin role: exit %d\n%s%s", strings.Join(args, " "), code, out, stderr)
		}
		return out
	}
	version := func() int {
		t.Helper()
		v, err := m.Version(ctx, db.Pool)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	asAdmin("migrate", "up")
	if v := version(); v != m.Latest() {
		t.Fatalf("version %d after migrate up as the admin role, want %s", v, latest)
	}
	asAdmin("migrate", "down", "--steps", "1")
	if v := version(); v != m.Latest()-1 {
		t.Fatalf("version %d after migrate down as the admin role, want %d", v, m.Latest()-1)
	}
	asAdmin("migrate", "up")
	if v := version(); v != m.Latest() {
		t.Fatalf("version %d after migrate up again as the admin role, want %s", v, latest)
	}
	producer := lp.poolOf(migrations.RoleProducer)
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error {
		_, err := client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.created", Payload: []byte("after the admin's migrations")})
		return err
	}); err != nil {
		t.Errorf("producer EnqueueTx after the admin's migrations: %v", err)
	}
}

// `relay migrate grants --role admin` gives the admin role txoutbox's own objects of the
// schema and nothing else: in a schema shared with the application (its table with a serial
// sequence and an index, a view, a function, an enum, all owned by an application role) and
// with an extension's members (citext, or another contrib extension, in that schema), every
// txoutbox_* relation, routine and type becomes the admin's, every other object keeps its
// owner.
func TestAdminRoleOwnsOnlyTxoutboxObjects(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	super, err := pgxpool.New(ctx, testsvc.PostgresDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(super.Close)
	suffix := randomSuffix()
	admin, app := "txo_admin_"+suffix, "txo_app_"+suffix
	for _, name := range []string{admin, app} {
		testsvc.CreateRole(t, super, name, "NOLOGIN")
	}
	db := testsvc.NewDB(t)
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE orders (id serial PRIMARY KEY, note text);
		CREATE INDEX orders_note_idx ON orders (note);
		CREATE VIEW open_orders AS SELECT id FROM orders;
		CREATE FUNCTION order_total(int) RETURNS int LANGUAGE sql AS 'SELECT $1';
		CREATE TYPE order_state AS ENUM ('open', 'closed');
		ALTER TABLE orders OWNER TO `+app+`; ALTER VIEW open_orders OWNER TO `+app+`;
		ALTER FUNCTION order_total(int) OWNER TO `+app+`; ALTER TYPE order_state OWNER TO `+app); err != nil {
		t.Fatal(err)
	}
	ext := ""
	for _, name := range []string{"citext", "hstore", "pgcrypto"} {
		// An extension is installed once per database: another test may hold it elsewhere.
		if _, err := super.Exec(ctx, "CREATE EXTENSION "+name+" SCHEMA "+pgx.Identifier{db.Schema}.Sanitize()); err != nil {
			t.Logf("CREATE EXTENSION %s: %v", name, err)
			continue
		}
		ext = name
		break
	}
	if ext == "" {
		t.Log("no extension could be created in the schema (none available, or each installed elsewhere): the extension members part is not checked")
	}
	owners := func() map[string]string {
		t.Helper()
		rows, err := super.Query(ctx, `
			SELECT 'relation ' || c.relname, pg_get_userbyid(c.relowner) FROM pg_class c WHERE c.relnamespace = $1::regnamespace
			UNION ALL
			SELECT 'routine ' || p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')', pg_get_userbyid(p.proowner)
			  FROM pg_proc p WHERE p.pronamespace = $1::regnamespace
			UNION ALL
			SELECT 'type ' || t.typname, pg_get_userbyid(t.typowner) FROM pg_type t WHERE t.typnamespace = $1::regnamespace`, db.Schema)
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]string{}
		var what, owner string
		if _, err := pgx.ForEachRow(rows, []any{&what, &owner}, func() error { m[what] = owner; return nil }); err != nil {
			t.Fatal(err)
		}
		return m
	}
	before := owners()
	code, sql, stderr := cli(t, "migrate", "grants", "--role", "admin", "--schema", db.Schema, "--grantee", admin)
	if code != 0 {
		t.Fatalf("grants --role admin: exit %d: %s", code, stderr)
	}
	conn, err := super.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = conn.Conn().PgConn().Exec(ctx, sql).ReadAll()
	conn.Release()
	if err != nil {
		t.Fatalf("grants --role admin: %v\n%s", err, sql)
	}
	after := owners()
	var txoutbox, extMembers int
	if ext != "" {
		if err := super.QueryRow(ctx, `SELECT count(*) FROM pg_depend d WHERE d.refclassid = 'pg_extension'::regclass
			AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = $1) AND d.deptype = 'e'`, ext).Scan(&extMembers); err != nil {
			t.Fatal(err)
		}
	}
	for what, owner := range after {
		name := what[strings.Index(what, " ")+1:]
		if strings.HasPrefix(name, "txoutbox_") || strings.HasPrefix(name, "_txoutbox_") {
			txoutbox++
			if owner != admin {
				t.Errorf("%s: owned by %s after the admin grants, want the admin role %s", what, owner, admin)
			}
		} else if owner != before[what] {
			t.Errorf("%s: owned by %s after the admin grants, want its owner before, %s: not txoutbox's", what, owner, before[what])
		}
	}
	if txoutbox < 20 || after["relation orders"] != app || after["relation orders_id_seq"] != app || after["routine order_total(integer)"] != app {
		t.Errorf("the check saw %d txoutbox objects, the application's table, sequence and function owned by %q, %q and %q: want the schema's objects",
			txoutbox, after["relation orders"], after["relation orders_id_seq"], after["routine order_total(integer)"])
	}
	if ext != "" && extMembers == 0 {
		t.Errorf("extension %s has no members", ext)
	}
	if schemaOwner := ""; super.QueryRow(ctx, `SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = $1`, db.Schema).Scan(&schemaOwner) != nil || schemaOwner != admin {
		t.Errorf("the schema is owned by %q after the admin grants, want the admin role %s", schemaOwner, admin)
	}
}

// A producer login cannot change the state of another service's messages that a producer has
// no business with (row-level security of `relay migrate grants --role producer`): the forged
// UPDATE of ready rows to published, or to rolled_back, and of published, dead or rolled back
// rows, changes nothing; a settle to a state a producer never writes, and the insert of one,
// are refused (42501). Meanwhile the producer's own paths still work as that role, the SQL
// functions included: a delayed message enqueued (scheduled at once), a delayed half message
// committed (Go and SQL: scheduled), a half message rolled back, a scheduled one cancelled.
func TestProducerCannotForgeOtherMessagesState(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lp := newLeastPrivilege(t)
	db := lp.db
	producer := lp.poolOf(migrations.RoleProducer)
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	// Another service's messages, written by another role: ready, published, dead, rolled back.
	var others []uuid.UUID
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		others, err = client.EnqueueTx(ctx, tx, outbox.Message{Subject: "payments.charged", Payload: []byte("ready")},
			outbox.Message{Subject: "payments.charged", Payload: []byte("published")},
			outbox.Message{Subject: "payments.charged", Payload: []byte("dead")},
			outbox.Message{Subject: "payments.charged", Payload: []byte("rolled back")})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = (ARRAY['ready', 'published', 'dead', 'rolled_back'])[array_position($1::uuid[], message_id)]
		WHERE message_id = ANY($1)`, others); err != nil {
		t.Fatal(err)
	}
	stateOf := func(id uuid.UUID) string {
		t.Helper()
		var st string
		if err := db.Pool.QueryRow(ctx, `SELECT state FROM txoutbox_messages WHERE message_id = $1`, id).Scan(&st); err != nil {
			t.Fatal(err)
		}
		return st
	}
	for _, sql := range []string{
		`UPDATE txoutbox_messages SET state = 'published' WHERE state = 'ready'`,
		`UPDATE txoutbox_messages SET state = 'rolled_back', settled_at = now() WHERE state = 'ready'`,
		`UPDATE txoutbox_messages SET state = 'scheduled' WHERE state = 'ready'`,
		`UPDATE txoutbox_messages SET state = 'ready' WHERE state IN ('published', 'dead', 'rolled_back')`,
		`UPDATE txoutbox_messages SET next_attempt_at = now() + interval '1 year' WHERE true`,
	} {
		tag, err := producer.Exec(ctx, sql)
		if err != nil {
			t.Errorf("producer %s: %v, want nothing changed", sql, err)
		} else if tag.RowsAffected() != 0 {
			t.Errorf("producer %s changed %d rows, want 0", sql, tag.RowsAffected())
		}
	}
	for i, want := range []string{"ready", "published", "dead", "rolled_back"} {
		if got := stateOf(others[i]); got != want {
			t.Errorf("another service's %s message is %s after the producer's forged updates", want, got)
		}
	}

	// The producer's own half and delayed messages.
	var due time.Time
	if err := db.Pool.QueryRow(ctx, `SELECT now() + interval '1 hour'`).Scan(&due); err != nil {
		t.Fatal(err)
	}
	half, err := client.Prepare(ctx, producer, outbox.Message{Subject: "orders.created", Payload: []byte("half")}, &outbox.PrepareOptions{Group: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	_, err = producer.Exec(ctx, `UPDATE txoutbox_messages SET state = 'published' WHERE message_id = $1`, half.ID)
	wantDenied(t, "producer settles a half message as published", err)
	_, err = producer.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state) VALUES (gen_random_uuid(), 'x', 0, '', 'published')`)
	wantDenied(t, "producer inserts a published row", err)
	// Migration 004's retired functions (kept as *_v4, with 004's checks) are not granted.
	_, err = producer.Exec(ctx, `SELECT txoutbox_prepare_v4('orders.x', 'p', producer_group => 'g1', check_immunity => '-1 day')`)
	wantDenied(t, "producer calls txoutbox_prepare_v4", err)
	var contract int
	if err := producer.QueryRow(ctx, `SELECT txoutbox_contract_version()`).Scan(&contract); err != nil || contract != 13 {
		t.Errorf("producer reads txoutbox_contract_version: %d, %v; want 13", contract, err)
	}
	if err := client.Rollback(ctx, producer, half.ID); err != nil {
		t.Errorf("producer Rollback: %v", err)
	}
	delayedHalf, err := client.Prepare(ctx, producer, outbox.Message{Subject: "orders.created", Payload: []byte("delayed half"), DeliverAt: due},
		&outbox.PrepareOptions{Group: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	if err := client.Commit(ctx, producer, delayedHalf.ID); err != nil {
		t.Errorf("producer Commit of a delayed half message: %v", err)
	}
	var sqlEnqueued, sqlHalf, sqlCancelled uuid.UUID
	for what, q := range map[string]struct {
		sql string
		id  *uuid.UUID
	}{
		"SQL enqueue of a delayed message": {`SELECT txoutbox_enqueue('orders.x', 'p', deliver_at => now() + interval '1 hour')`, &sqlEnqueued},
		"SQL commit of a delayed half message": {`SELECT id FROM (SELECT txoutbox_prepare('orders.x', 'p', producer_group => 'g1', deliver_at => now() + interval '1 hour') AS id) p,
			LATERAL (SELECT txoutbox_commit(p.id)) c`, &sqlHalf},
		"SQL cancel of a delayed message": {`SELECT id FROM (SELECT txoutbox_enqueue('orders.y', 'p', deliver_at => now() + interval '1 hour') AS id) e,
			LATERAL (SELECT txoutbox_cancel(e.id)) c`, &sqlCancelled},
	} {
		if err := producer.QueryRow(ctx, q.sql).Scan(q.id); err != nil {
			t.Errorf("producer %s: %v", what, err)
		}
	}
	for id, want := range map[uuid.UUID]string{half.ID: "rolled_back", delayedHalf.ID: "scheduled", sqlEnqueued: "scheduled", sqlHalf: "scheduled", sqlCancelled: "rolled_back"} {
		if id == uuid.Nil {
			continue
		}
		if got := stateOf(id); got != want {
			t.Errorf("the producer's message %s is %s, want %s", id, got, want)
		}
	}
}

// The row-level security the producer grants enable leaves the relay's hot path as it was:
// the claim and the settle, as the relay role runs them (custom and generic plans), have the
// plans they have for the table's owner, who bypasses it: the same nodes, indexes and
// conditions, no policy filter and no subplan added (the relay's permissive policy folds the
// policies to true; only the order the planner evaluates a filter's terms in may differ).
func TestProducerRowSecurityLeavesRelayPlans(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lp := newLeastPrivilege(t)
	db := lp.db
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	var ids []int64
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		var msgs []outbox.Message
		for i := range 50 {
			msgs = append(msgs, outbox.Message{Subject: "orders.created", Key: "k" + strconv.Itoa(i%5), Payload: []byte("p")})
		}
		_, err := client.EnqueueTx(ctx, tx, msgs...)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	rows, _ := db.Pool.Query(ctx, `SELECT id FROM txoutbox_messages ORDER BY id LIMIT 10`)
	if ids, err = pgx.CollectRows(rows, pgx.RowTo[int64]); err != nil {
		t.Fatal(err)
	}
	var enabled bool
	if err := db.Pool.QueryRow(ctx, `SELECT relrowsecurity FROM pg_class WHERE oid = 'txoutbox_messages'::regclass`).Scan(&enabled); err != nil || !enabled {
		t.Fatalf("row-level security on txoutbox_messages: %v (%v), want enabled by the producer grants", enabled, err)
	}
	q := store.New(db.Schema)
	shapes := func(pool *pgxpool.Pool) []string {
		t.Helper()
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Release()
		var out []string
		for _, generic := range []bool{false, true} {
			claim, err := q.ExplainClaim(ctx, conn.Conn(), store.ClaimArgs{Limit: 20, PartitionCount: 8, Partitions: []int32{0, 1, 2, 3, 4, 5, 6, 7}}, generic)
			if err != nil {
				t.Fatal(err)
			}
			settle, err := q.ExplainSettle(ctx, conn.Conn(), store.SettleArgs{Published: []store.Published{{ID: ids[0]}, {ID: ids[1]}}, MaxAttempts: 5}, generic)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, planShape(t, claim), planShape(t, settle))
		}
		return out
	}
	owner, relay := shapes(db.Pool), shapes(lp.poolOf(migrations.RoleRelay))
	for i := range owner {
		if owner[i] != relay[i] {
			t.Errorf("plan %d as the relay role differs from the owner's:\nowner: %s\nrelay: %s", i, owner[i], relay[i])
		}
	}
}

// A producer login cancels and reschedules by business key through the business key index,
// as the owner does, not by a scan of the whole outbox: under the producer grants' row-level
// security an UPDATE's own condition uses an index only if its functions are leakproof, and
// the business key expression's (jsonb -> and ->>) are not. Each form (CancelBizKeyTx,
// RescheduleBizKeyTx, their database/sql twins, txoutbox_cancel_biz_key and
// txoutbox_reschedule_biz_key) runs as the producer role with sequential scans disabled (so
// that the planner picks an index whenever one can serve, on this small table), then the
// transaction's own table statistics must show that it read about the key's 6 rows of 600,
// not the whole table (a Seq Scan) nor the whole partial index of scheduled rows (the business
// key index with no condition on the key, the plan a producer got before); and EXPLAIN of the
// Go statement as that role shows the business key as the index's condition.
func TestProducerBizKeyUsesIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lp := newLeastPrivilege(t)
	db := lp.db
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	later := time.Now().Add(time.Hour)
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		var msgs []outbox.Message
		for i := range 600 {
			msgs = append(msgs, outbox.Message{Subject: "orders.remind", BizKey: "order-" + strconv.Itoa(i%100), DeliverAt: later, Payload: []byte("p")})
		}
		_, err := client.EnqueueTx(ctx, tx, msgs...)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `ANALYZE txoutbox_messages`); err != nil {
		t.Fatal(err)
	}
	producer := lp.poolOf(migrations.RoleProducer)
	sqlDB := stdlib.OpenDBFromPool(producer)
	t.Cleanup(func() { _ = sqlDB.Close() })
	// The rows of txoutbox_messages read by sequential scans and fetched through indexes, not
	// yet flushed to the statistics (the current transaction's, and the session's earlier ones
	// until a flush: read before and after).
	const readRows = `SELECT seq_tup_read + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables
		WHERE relid = 'txoutbox_messages'::regclass`
	const most = 4 * 6 // the key's rows, fetched by the sub-select and again by id, and slack
	// read runs do as the producer role in a transaction it rolls back, and returns the rows of
	// txoutbox_messages it read.
	read := func(what string, do func(tx pgx.Tx) error) (n int64) {
		t.Helper()
		tx, err := producer.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		var before int64
		if err := tx.QueryRow(ctx, readRows).Scan(&before); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `SET LOCAL enable_seqscan = off`); err != nil {
			t.Fatal(err)
		}
		if err := do(tx); err != nil {
			t.Fatalf("%s as the producer role: %v", what, err)
		}
		if err := tx.QueryRow(ctx, readRows).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n - before
	}
	forms := []struct {
		name string
		do   func(tx pgx.Tx) error
	}{
		{"CancelBizKeyTx", func(tx pgx.Tx) error {
			ids, err := client.CancelBizKeyTx(ctx, tx, "order-1")
			if err == nil && len(ids) != 6 {
				err = fmt.Errorf("cancelled %d messages, want 6", len(ids))
			}
			return err
		}},
		{"RescheduleBizKeyTx", func(tx pgx.Tx) error {
			ids, err := client.RescheduleBizKeyTx(ctx, tx, "order-2", later.Add(time.Hour))
			if err == nil && len(ids) != 6 {
				err = fmt.Errorf("rescheduled %d messages, want 6", len(ids))
			}
			return err
		}},
		{"txoutbox_cancel_biz_key", func(tx pgx.Tx) error {
			var n int
			err := tx.QueryRow(ctx, `SELECT cardinality(txoutbox_cancel_biz_key('order-3'))`).Scan(&n)
			if err == nil && n != 6 {
				err = fmt.Errorf("cancelled %d messages, want 6", n)
			}
			return err
		}},
		{"txoutbox_reschedule_biz_key", func(tx pgx.Tx) error {
			var n int
			err := tx.QueryRow(ctx, `SELECT cardinality(txoutbox_reschedule_biz_key('order-4', now() + interval '2 hours'))`).Scan(&n)
			if err == nil && n != 6 {
				err = fmt.Errorf("rescheduled %d messages, want 6", n)
			}
			return err
		}},
	}
	for _, f := range forms {
		if n := read(f.name, f.do); n > most {
			t.Errorf("%s as the producer role read %d rows of txoutbox_messages for the key's 6 (of 600), want at most %d: the business key index is not used", f.name, n, most)
		}
	}
	// The database/sql twins run the same statements through a *sql.Tx.
	for _, f := range []struct {
		name string
		do   func(tx *sql.Tx) ([]uuid.UUID, error)
	}{
		{"CancelBizKeySQLTx", func(tx *sql.Tx) ([]uuid.UUID, error) { return client.CancelBizKeySQLTx(ctx, tx, "order-5") }},
		{"RescheduleBizKeySQLTx", func(tx *sql.Tx) ([]uuid.UUID, error) {
			return client.RescheduleBizKeySQLTx(ctx, tx, "order-6", later.Add(time.Hour))
		}},
	} {
		tx, err := sqlDB.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		var n, before int64
		if err = tx.QueryRowContext(ctx, readRows).Scan(&before); err == nil {
			_, err = tx.ExecContext(ctx, `SET LOCAL enable_seqscan = off`)
		}
		if err == nil {
			var ids []uuid.UUID
			if ids, err = f.do(tx); err == nil && len(ids) != 6 {
				err = fmt.Errorf("%d messages, want 6", len(ids))
			}
		}
		if err == nil {
			err = tx.QueryRowContext(ctx, readRows).Scan(&n)
		}
		_ = tx.Rollback()
		if err != nil {
			t.Fatalf("%s as the producer role: %v", f.name, err)
		}
		if n -= before; n > most {
			t.Errorf("%s as the producer role read %d rows of txoutbox_messages for the key's 6 (of 600), want at most %d: the business key index is not used", f.name, n, most)
		}
	}
	// The plan of the Go statement, as the producer role: the business key index with the key
	// as its condition, no Seq Scan.
	var plan []byte
	if err := pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL enable_seqscan = off`); err != nil {
			return err
		}
		plan, err = store.New(db.Schema).ExplainScheduledBizKey(ctx, tx, "order-7")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	shape := planShape(t, plan)
	if strings.Contains(shape, "Seq Scan") ||
		!strings.Contains(shape, "Index Name=txoutbox_messages_scheduled_biz_key_idx Index Cond=(((headers -> 'Txoutbox-Biz-Key'::text) ->> 0) = 'order-7'::text)") {
		t.Errorf("business key cancel as the producer role: plan\n%s\nwant the business key index with the key as its condition, and no Seq Scan", shape)
	}
}

// conjuncts returns a condition's top-level AND terms, sorted: the same conditions whatever
// order the planner evaluates them in (it orders them by cost within their security level).
func conjuncts(cond string) string {
	inner := strings.TrimSuffix(strings.TrimPrefix(cond, "("), ")")
	var terms []string
	depth, start := 0, 0
	for i := 0; i < len(inner); i++ {
		switch inner[i] {
		case '(':
			depth++
		case ')':
			depth--
		}
		if depth == 0 && strings.HasPrefix(inner[i:], " AND ") {
			terms = append(terms, inner[start:i])
			start = i + len(" AND ")
		}
	}
	if depth != 0 || len(terms) == 0 {
		return cond // not a conjunction of parenthesised terms
	}
	terms = append(terms, inner[start:])
	slices.Sort(terms)
	return strings.Join(terms, " AND ")
}

// planShape is an EXPLAIN (FORMAT JSON) plan without its numbers: each node's type, relation,
// index, conditions and filters (their terms in a fixed order), depth first.
func planShape(t *testing.T, plan []byte) string {
	t.Helper()
	var doc []struct {
		Plan map[string]any `json:"Plan"`
	}
	if err := json.Unmarshal(plan, &doc); err != nil || len(doc) == 0 {
		t.Fatalf("EXPLAIN output: %v: %s", err, plan)
	}
	var b strings.Builder
	var walk func(n map[string]any, depth int)
	walk = func(n map[string]any, depth int) {
		fmt.Fprintf(&b, "%s%v", strings.Repeat(" ", depth), n["Node Type"])
		for _, k := range []string{"Relation Name", "Index Name", "Index Cond", "Recheck Cond", "Filter", "Join Filter", "One-Time Filter", "Subplan Name", "Parent Relationship"} {
			if v, ok := n[k].(string); ok {
				fmt.Fprintf(&b, " %s=%s", k, conjuncts(v))
			}
		}
		b.WriteString("\n")
		kids, _ := n["Plans"].([]any)
		for _, k := range kids {
			if m, ok := k.(map[string]any); ok {
				walk(m, depth+1)
			}
		}
	}
	walk(doc[0].Plan, 0)
	return b.String()
}

// Grantees whose names share a long start keep a policy each: two 60-character role names
// with a common 55-character start, granted the relay and the restricted consumer roles, each
// have their own policy on every table (before, "txoutbox_relay_"+name was cut at 63 bytes to
// the same name, and granting the second dropped the first's). Re-running a grant leaves one
// policy per grantee and table, and drops the policy an earlier version named for the grantee.
func TestGrantPolicyNamesDoNotCollide(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	super, err := pgxpool.New(ctx, testsvc.PostgresDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(super.Close)
	start := "txo_" + randomSuffix() + "_"
	start += strings.Repeat("p", 55-len(start))
	roles := []string{start + "relay", start + "other", "txo_short_" + randomSuffix()}
	for _, name := range roles {
		if len(name) != 60 && !strings.HasPrefix(name, "txo_short_") {
			t.Fatalf("role name %q is %d bytes, want 60", name, len(name))
		}
		testsvc.DropRoleAtCleanup(t, super, name) // the grants create it
	}
	db := testsvc.NewDB(t)
	grant := func(args ...string) {
		t.Helper()
		code, sql, stderr := cli(t, append([]string{"migrate", "grants", "--schema", db.Schema}, args...)...)
		if code != 0 {
			t.Fatalf("grants %v: exit %d: %s", args, code, stderr)
		}
		conn, err := super.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Release()
		if _, err := conn.Conn().PgConn().Exec(ctx, sql).ReadAll(); err != nil {
			t.Fatalf("grants %v: %v\n%s", args, err, sql)
		}
	}
	// policies counts each grantee's policies on a table of the schema.
	policies := func(table, grantee string) int {
		t.Helper()
		var n int
		if err := super.QueryRow(ctx, `SELECT count(*) FROM pg_policy WHERE polrelid = format('%I.%I', $1::text, $2::text)::regclass
			AND polroles = ARRAY[(SELECT oid FROM pg_roles WHERE rolname = $3)]`, db.Schema, table, grantee).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// An earlier version's policy of the short grantee, as it named it.
	short := roles[2]
	grant("--role", "relay", "--grantee", short)
	oldName, messages := pgx.Identifier{"txoutbox_relay_" + short}.Sanitize(), pgx.Identifier{db.Schema, "txoutbox_messages"}.Sanitize()
	if _, err := super.Exec(ctx, fmt.Sprintf(`DROP POLICY IF EXISTS %[1]s ON %[2]s; CREATE POLICY %[1]s ON %[2]s TO %[3]s USING (true)`,
		oldName, messages, short)); err != nil {
		t.Fatal(err)
	}
	for range 2 { // twice: re-running is idempotent
		for _, r := range roles[:2] {
			grant("--role", "relay", "--grantee", r)
			grant("--role", "consumer", "--consumers", "billing", "--grantee", r)
		}
		grant("--role", "relay", "--grantee", short)
		for i, r := range roles {
			// The long names are relays and consumers (two policies on the dedup table), the
			// short one a relay.
			want := map[string]int{"txoutbox_messages": 1, "txoutbox_consumer_dedup": 2, "txoutbox_consumer_key_order": 1}
			if i == 2 {
				want = map[string]int{"txoutbox_messages": 1, "txoutbox_consumer_dedup": 1, "txoutbox_consumer_key_order": 0}
			}
			for table, w := range want {
				if n := policies(table, r); n != w {
					t.Errorf("%s has %d policies on %s after its grants, want %d", r, n, table, w)
				}
			}
		}
	}
	// Each of the long names still does its job: the relay reads every message.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO txoutbox_consumer_dedup (consumer, idempotency_key) VALUES ('billing', 'k1'), ('shipping', 'k2')`); err != nil {
		t.Fatal(err)
	}
	for _, r := range roles[:2] {
		var n int
		err := pgx.BeginFunc(ctx, super, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "SET LOCAL ROLE "+r); err != nil {
				return err
			}
			return tx.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{db.Schema, "txoutbox_consumer_dedup"}.Sanitize()).Scan(&n)
		})
		if err != nil || n != 2 {
			t.Errorf("%s (relay and consumer of billing) reads %d dedup rows (%v), want 2: its relay policy is gone", r, n, err)
		}
	}
}

// `relay migrate grants --role consumer --consumers billing` limits a consumer login to the
// dedup and key-order rows of consumer billing: another consumer's rows are invisible to it
// (it cannot learn what shipping processed, nor change its key order) and writing one is
// refused (42501: it cannot make shipping skip a message), while an ordered consumer named
// billing runs as that login; the relay role still sees (and purges) every consumer's rows.
func TestConsumerRestrictedToItsNames(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lp := newLeastPrivilege(t)
	db, login := lp.db, lp.login[migrations.RoleConsumer]
	code, sql, stderr := cli(t, "migrate", "grants", "--role", "consumer", "--consumers", "billing", "--schema", db.Schema, "--grantee", login)
	if code != 0 {
		t.Fatalf("grants --role consumer --consumers billing: exit %d: %s", code, stderr)
	}
	conn, err := db.AdminPool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = conn.Conn().PgConn().Exec(ctx, sql).ReadAll()
	conn.Release()
	if err != nil {
		t.Fatalf("%v\n%s", err, sql)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO txoutbox_consumer_dedup (consumer, idempotency_key) VALUES ('shipping', 'k1'), ('billing', 'k0');
		INSERT INTO txoutbox_consumer_key_order (consumer, stream, order_key, applied_seq) VALUES ('shipping', 'ORDERS', 'o1', 7)`); err != nil {
		t.Fatal(err)
	}
	cons := lp.poolOf(migrations.RoleConsumer)
	var seen []string
	rows, err := cons.Query(ctx, `SELECT consumer || '/' || idempotency_key FROM txoutbox_consumer_dedup ORDER BY 1`)
	if err == nil {
		seen, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil || !slices.Equal(seen, []string{"billing/k0"}) {
		t.Errorf("the billing consumer's login reads dedup rows %v (%v), want only billing/k0", seen, err)
	}
	_, err = cons.Exec(ctx, `INSERT INTO txoutbox_consumer_dedup (consumer, idempotency_key) VALUES ('shipping', 'k2')`)
	wantDenied(t, "consumer billing inserts a dedup row of shipping", err)
	_, err = cons.Exec(ctx, `INSERT INTO txoutbox_consumer_key_order (consumer, stream, order_key, applied_seq) VALUES ('shipping', 'ORDERS', 'o2', 1)`)
	wantDenied(t, "consumer billing inserts a key-order row of shipping", err)
	if tag, err := cons.Exec(ctx, `UPDATE txoutbox_consumer_key_order SET applied_seq = 100 WHERE consumer = 'shipping'`); err != nil || tag.RowsAffected() != 0 {
		t.Errorf("consumer billing updates shipping's key order: %v, %v rows; want 0 rows", err, tag.RowsAffected())
	}

	// An ordered consumer named billing runs as that login.
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE ledger (message_id text PRIMARY KEY); GRANT INSERT ON ledger TO `+login); err != nil {
		t.Fatal(err)
	}
	n := testsvc.NewNATS(t)
	n.Stream(t, "ORDERS", "orders.>")
	n.Stream(t, "DEAD_LETTERS", consumer.DefaultDeadLetterPrefix+">")
	for i := range 3 {
		msg := nats.NewMsg("orders.created")
		msg.Header.Set("Nats-Msg-Id", "m"+strconv.Itoa(i))
		msg.Header.Set("Txoutbox-Key", "o1")
		msg.Data = []byte("p")
		if _, err := n.JS.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	c, err := consumer.New(cons, n.JS, func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO ledger (message_id) VALUES ($1)`, msg.Headers.Get("Nats-Msg-Id"))
		return err
	}, &consumer.Config{Stream: "ORDERS", Durable: "billing", Schema: db.Schema, Ordered: true, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	cctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(cctx) }()
	testsvc.Eventually(t, 30*time.Second, "consumer billing to apply the 3 messages", func() bool {
		select {
		case err := <-done:
			t.Fatalf("the consumer stopped: %v", err)
		default:
		}
		return c.Stats().Processed >= 3
	})
	stop()
	if err := <-done; err != nil {
		t.Errorf("consumer billing as the restricted login: %v", err)
	}
	_, err = cons.Exec(ctx, `UPDATE txoutbox_consumer_key_order SET consumer = 'shipping' WHERE consumer = 'billing'`)
	wantDenied(t, "consumer billing moves its key-order rows to shipping", err)
	var shippingSeq int64
	if err := db.Pool.QueryRow(ctx, `SELECT applied_seq FROM txoutbox_consumer_key_order WHERE consumer = 'shipping'`).Scan(&shippingSeq); err != nil || shippingSeq != 7 {
		t.Errorf("shipping's key order is %d (%v), want 7 untouched", shippingSeq, err)
	}
	var all int
	if err := lp.poolOf(migrations.RoleRelay).QueryRow(ctx, `SELECT count(*) FROM txoutbox_consumer_dedup`).Scan(&all); err != nil || all != 5 {
		t.Errorf("the relay role sees %d dedup rows (%v), want all 5", all, err)
	}
}

// A producer login cannot roll back (or otherwise settle) another service's message that was
// committed while the producer's own transaction stood open: the producer's row-level security
// lets it update a ready row only when its own transaction (or one of its savepoints) wrote the
// row's current version, not when the row was settled after its transaction began (the time
// test it replaced let a transaction held open since before txoutbox_commit roll the committed
// message back before the relay published it). Both with and without an xid of its own before
// the other commit. Its own paths keep working in savepoints, in READ COMMITTED and in
// REPEATABLE READ (where a savepoint's xid is newer than the transaction's snapshot).
func TestProducerOpenTransactionCannotSettleLaterCommits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lp := newLeastPrivilege(t)
	db := lp.db
	producer := lp.poolOf(migrations.RoleProducer)
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	stateOf := func(id uuid.UUID) string {
		t.Helper()
		var st string
		if err := db.Pool.QueryRow(ctx, `SELECT state FROM txoutbox_messages WHERE message_id = $1`, id).Scan(&st); err != nil {
			t.Fatal(err)
		}
		return st
	}
	// otherCommits is another service, logged in as a producer too: a half message prepared
	// and committed (ready, settled now), and a message enqueued (ready, created now).
	otherCommits := func() []uuid.UUID {
		t.Helper()
		half, err := client.Prepare(ctx, producer, outbox.Message{Subject: "payments.charged", Payload: []byte("charged")}, &outbox.PrepareOptions{Group: "payments"})
		if err != nil {
			t.Fatal(err)
		}
		if err := client.Commit(ctx, producer, half.ID); err != nil {
			t.Fatal(err)
		}
		var ids []uuid.UUID
		if err := pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error {
			ids, err = client.EnqueueTx(ctx, tx, outbox.Message{Subject: "payments.charged", Payload: []byte("enqueued")})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return append(ids, half.ID)
	}
	for _, ownXid := range []bool{false, true} {
		attacker, err := producer.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var mine []uuid.UUID
		if _, err := attacker.Exec(ctx, `SELECT now()`); err != nil {
			t.Fatal(err)
		}
		if ownXid { // the attacker's transaction has written (an xid older than the other commit's)
			if mine, err = client.EnqueueTx(ctx, attacker, outbox.Message{Subject: "orders.created", Payload: []byte("mine")}); err != nil {
				t.Fatal(err)
			}
		}
		victims := otherCommits()
		for _, sql := range []string{
			`UPDATE txoutbox_messages SET state = 'rolled_back', settled_at = now() WHERE state = 'ready' AND message_id = ANY($1)`,
			`UPDATE txoutbox_messages SET state = 'scheduled', deliver_at = now() + interval '1 year' WHERE state = 'ready' AND message_id = ANY($1)`,
			`UPDATE txoutbox_messages SET state = 'prepared' WHERE message_id = ANY($1)`,
		} {
			tag, err := attacker.Exec(ctx, sql, victims)
			if err != nil {
				t.Fatalf("open transaction (own xid %v): %s: %v", ownXid, sql, err)
			}
			if tag.RowsAffected() != 0 {
				t.Errorf("open transaction (own xid %v): %s changed %d rows committed after it began, want 0", ownXid, sql, tag.RowsAffected())
			}
		}
		if ownXid { // its own ready row, which its own transaction wrote: still its to change
			tag, err := attacker.Exec(ctx, `UPDATE txoutbox_messages SET state = 'rolled_back' WHERE state = 'ready' AND message_id = ANY($1)`, mine)
			if err != nil || tag.RowsAffected() != 1 {
				t.Errorf("the open transaction's update of its own ready row: %v, %d rows, want 1", err, tag.RowsAffected())
			}
		}
		if err := attacker.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		for _, id := range victims {
			if got := stateOf(id); got != "ready" {
				t.Errorf("another service's message %s is %s after an open producer transaction's updates, want ready", id, got)
			}
		}
	}

	// The function the policy calls answers, without an error, for xids that are not the
	// caller's: a frozen xid, and one ahead of the caller's (a frozen version's xmin from an
	// earlier epoch may look so), which pg_xact_status refuses as "in the future".
	for _, x := range []string{`'2'::xid`, `((pg_current_xact_id()::text::bigint + 1000000000) % 4294967296)::text::xid`} {
		var mine bool
		if err := pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error {
			return tx.QueryRow(ctx, `SELECT `+migrations.OwnRowVersionFunc+`(`+x+`)`).Scan(&mine)
		}); err != nil || mine {
			t.Errorf("%s(%s) as the producer: %v, %v, want false", migrations.OwnRowVersionFunc, x, mine, err)
		}
	}

	// The producer's own paths that turn a ready row of their transaction into a delayed one,
	// in savepoints (pgx nested transactions), in both isolation levels.
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead} {
		var ids []uuid.UUID
		err := pgx.BeginTxFunc(ctx, producer, pgx.TxOptions{IsoLevel: iso}, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SELECT count(*) FROM txoutbox_messages`); err != nil { // the snapshot
				return err
			}
			return pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
				var enq, half uuid.UUID
				if err := sp.QueryRow(ctx, `SELECT txoutbox_enqueue('orders.x', 'p', deliver_at => now() + interval '1 hour')`).Scan(&enq); err != nil {
					return fmt.Errorf("SQL enqueue of a delayed message: %w", err)
				}
				return pgx.BeginFunc(ctx, sp, func(sp2 pgx.Tx) error {
					if err := sp2.QueryRow(ctx, `SELECT txoutbox_prepare('orders.x', 'p', producer_group => 'g1', deliver_at => now() + interval '1 hour')`).Scan(&half); err != nil {
						return fmt.Errorf("SQL prepare of a delayed half message: %w", err)
					}
					if _, err := sp2.Exec(ctx, `SELECT txoutbox_commit($1)`, half); err != nil {
						return fmt.Errorf("SQL commit of a delayed half message: %w", err)
					}
					ids = []uuid.UUID{enq, half}
					return nil
				})
			})
		})
		if err != nil {
			t.Errorf("producer in savepoints (%s): %v", iso, err)
			continue
		}
		for _, id := range ids {
			if got := stateOf(id); got != "scheduled" {
				t.Errorf("the producer's delayed message %s, written in savepoints (%s), is %s, want scheduled", id, iso, got)
			}
		}
	}
}

// A producer login cannot write a row that holds back a key, nor one in the wrong partition:
// its INSERT is limited to the columns the Go client and the SQL functions write (not
// attempts, next_attempt_at, created_at, the settle or publish columns), and the row-level
// security refuses a row whose partition_key is not its key's hash (its id's, without a key),
// a row that failed already (attempts > 0) or is not due, and an UPDATE that gives a half or
// delayed message attempts or a retry time in the future. The audit's forged row (attempts 5,
// next attempt at infinity, key victimkey) held back every later message of the key forever.
// The rows the producer writes as the clients do still pass, and so does a settle by a
// transaction older than the message it settles. A login granted INSERT on every column (as
// the grants of earlier versions did) is held to the same rows by the row-level security,
// until re-running the grants takes that INSERT back.
func TestProducerCannotForgeHoldBackOrPartition(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lp := newLeastPrivilege(t)
	db := lp.db
	producer := lp.poolOf(migrations.RoleProducer)
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	forged := `INSERT INTO txoutbox_messages (message_id, subject, payload, partition_key, state, attempts, next_attempt_at, msg_key)
		VALUES (gen_random_uuid(), 'orders.forged', 'p', 0, 'ready', 5, 'infinity', 'victimkey')`
	insert := func(key *string, id uuid.UUID, part int32) error {
		_, err := producer.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, payload, msg_key, partition_key)
			VALUES ($1, 'orders.manual', 'p', $2, $3)`, id, key, part)
		return err
	}
	refused := func(what string, err error) {
		t.Helper()
		wantDenied(t, "producer "+what, err)
	}
	refused("inserts the audit's forged row", func() error { _, err := producer.Exec(ctx, forged); return err }())
	for what, sql := range map[string]string{
		"inserts a row with attempts":              `INSERT INTO txoutbox_messages (message_id, subject, payload, partition_key, attempts) VALUES (gen_random_uuid(), 'x', '', 0, 1)`,
		"inserts a row due later":                  `INSERT INTO txoutbox_messages (message_id, subject, payload, partition_key, next_attempt_at) VALUES (gen_random_uuid(), 'x', '', 0, 'infinity')`,
		"inserts a row with a created_at":          `INSERT INTO txoutbox_messages (message_id, subject, payload, partition_key, created_at) VALUES (gen_random_uuid(), 'x', '', 0, now())`,
		"inserts a row with a last error":          `INSERT INTO txoutbox_messages (message_id, subject, payload, partition_key, last_error) VALUES (gen_random_uuid(), 'x', '', 0, 'e')`,
		"inserts a row with a stream sequence":     `INSERT INTO txoutbox_messages (message_id, subject, payload, partition_key, stream_seq) VALUES (gen_random_uuid(), 'x', '', 0, 1)`,
		"inserts a row with a check count":         `INSERT INTO txoutbox_messages (message_id, subject, payload, partition_key, check_count) VALUES (gen_random_uuid(), 'x', '', 0, 9)`,
		"inserts a row with a settled_by":          `INSERT INTO txoutbox_messages (message_id, subject, payload, partition_key, settled_by) VALUES (gen_random_uuid(), 'x', '', 0, 'producer')`,
		"inserts a row with a published time":      `INSERT INTO txoutbox_messages (message_id, subject, payload, partition_key, published_at) VALUES (gen_random_uuid(), 'x', '', 0, now())`,
		"inserts a keyed row in another partition": `INSERT INTO txoutbox_messages (message_id, subject, payload, partition_key, msg_key) VALUES (gen_random_uuid(), 'x', '', 0, 'victimkey')`,
	} {
		_, err := producer.Exec(ctx, sql)
		refused(what, err)
	}
	victim := "victimkey"
	refused("inserts a keyed row with another key's partition", insert(&victim, uuid.New(), store.KeyHash("otherkey")))
	id := uuid.New()
	refused("inserts an unkeyed row with another partition", insert(nil, id, store.KeyHash(id.String())^1))
	// The rows the clients write: partition_key is the key's hash (store.KeyHash: FNV-1a of the
	// UTF-8 bytes, 31 bits), the id's text's without a key; keys of 0 to 20 bytes and more,
	// multi-byte characters included, hash as the Go client hashes them.
	for _, key := range []string{"k", "victimkey", "order-1041", "ключ-42/ü", strings.Repeat("x", 7), strings.Repeat("y", 8),
		strings.Repeat("z", 9), strings.Repeat("é", 15), strings.Repeat("order:", 30)} {
		if err := insert(&key, uuid.New(), store.KeyHash(key)); err != nil {
			t.Errorf("producer inserts a row of key %q in its partition: %v", key, err)
		}
	}
	id = uuid.New()
	if err := insert(nil, id, store.KeyHash(id.String())); err != nil {
		t.Errorf("producer inserts an unkeyed row in its id's partition: %v", err)
	}

	// Another service's half message of the key: the producer may settle it (by design of the
	// half-message API), not give it attempts or a later retry.
	half, err := client.Prepare(ctx, db.Pool, outbox.Message{Subject: "payments.charged", Key: victim, Payload: []byte("half")},
		&outbox.PrepareOptions{Group: "payments"})
	if err != nil {
		t.Fatal(err)
	}
	for _, sql := range []string{
		`UPDATE txoutbox_messages SET attempts = 5, next_attempt_at = 'infinity' WHERE message_id = $1`,
		`UPDATE txoutbox_messages SET state = 'ready', attempts = 5, next_attempt_at = 'infinity' WHERE message_id = $1`,
		`UPDATE txoutbox_messages SET attempts = 1 WHERE message_id = $1`,
		`UPDATE txoutbox_messages SET state = 'ready', next_attempt_at = now() + interval '1 hour' WHERE message_id = $1`,
	} {
		_, err := producer.Exec(ctx, sql, half.ID)
		refused(sql, err)
	}
	var attempts int
	var late bool
	if err := db.Pool.QueryRow(ctx, `SELECT attempts, next_attempt_at > now() FROM txoutbox_messages WHERE message_id = $1`, half.ID).Scan(&attempts, &late); err != nil {
		t.Fatal(err)
	}
	if attempts != 0 || late {
		t.Errorf("the half message after the producer's forged updates: attempts %d, retry in the future %v", attempts, late)
	}
	// A later retry time on a row that is not ready holds nothing back, and every commit
	// (client, SQL function, check-back) sets it to the commit's time.
	if _, err := producer.Exec(ctx, `UPDATE txoutbox_messages SET next_attempt_at = now() + interval '1 hour' WHERE message_id = $1`, half.ID); err != nil {
		t.Errorf("producer moves a prepared message's retry time: %v", err)
	}
	if err := client.Commit(ctx, producer, half.ID); err != nil {
		t.Errorf("producer Commit of the half message: %v", err)
	}
	if err := db.Pool.QueryRow(ctx, `SELECT next_attempt_at > now() FROM txoutbox_messages WHERE message_id = $1`, half.ID).Scan(&late); err != nil || late {
		t.Errorf("the committed half message's retry time is in the future (%v): it would hold back its key", err)
	}
	if _, err := producer.Exec(ctx, `SELECT txoutbox_commit(txoutbox_prepare('orders.sql', 'p', $1, producer_group => 'g1'))`, victim); err != nil {
		t.Errorf("producer txoutbox_prepare and txoutbox_commit: %v", err)
	}

	// A transaction that began before a message was written still settles it: the message's
	// next_attempt_at (its writer's now()) is later than this transaction's now().
	tx, err := producer.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT now()`); err != nil {
		t.Fatal(err)
	}
	var due time.Time
	if err := db.Pool.QueryRow(ctx, `SELECT now() + interval '1 hour'`).Scan(&due); err != nil {
		t.Fatal(err)
	}
	var later []uuid.UUID
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		later, err = client.EnqueueTx(ctx, tx, outbox.Message{Subject: "payments.expire", Key: victim, Payload: []byte("later"), DeliverAt: due})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	laterHalf, err := client.Prepare(ctx, db.Pool, outbox.Message{Subject: "payments.charged", Key: victim, Payload: []byte("later half")},
		&outbox.PrepareOptions{Group: "payments"})
	if err != nil {
		t.Fatal(err)
	}
	// Half messages with a delivery time, committed by another session after tx began: the
	// commit set their next_attempt_at to that session's now(), later than tx's.
	var timers []uuid.UUID
	for range 2 {
		h, err := client.Prepare(ctx, db.Pool, outbox.Message{Subject: "payments.expire", Key: victim, Payload: []byte("timer half"), DeliverAt: due},
			&outbox.PrepareOptions{Group: "payments"})
		if err != nil {
			t.Fatal(err)
		}
		if err := client.Commit(ctx, db.Pool, h.ID); err != nil {
			t.Fatal(err)
		}
		timers = append(timers, h.ID)
	}
	if err := client.CancelTx(ctx, tx, later[0]); err != nil {
		t.Errorf("producer CancelTx of a message written after its transaction began: %v", err)
	}
	if err := client.CancelTx(ctx, tx, timers[0]); err != nil {
		t.Errorf("producer CancelTx of a half message with a delivery time committed after its transaction began: %v", err)
	}
	if err := client.RescheduleTx(ctx, tx, timers[1], due.Add(time.Hour)); err != nil {
		t.Errorf("producer RescheduleTx of a half message with a delivery time committed after its transaction began: %v", err)
	}
	if err := client.Rollback(ctx, tx, laterHalf.ID); err != nil {
		t.Errorf("producer Rollback of a half message prepared after its transaction began: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Errorf("commit: %v", err)
	}

	// INSERT on every column, as the grants of earlier versions gave it: the row-level security
	// still refuses the forged rows; re-running the grants takes that INSERT back.
	login := lp.login[migrations.RoleProducer]
	if _, err := db.Pool.Exec(ctx, `GRANT INSERT ON txoutbox_messages TO `+login); err != nil {
		t.Fatal(err)
	}
	refused("with INSERT on every column inserts the audit's forged row", func() error { _, err := producer.Exec(ctx, forged); return err }())
	_, err = producer.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, payload, partition_key, msg_key, attempts) VALUES (gen_random_uuid(), 'x', '', $1, 'victimkey', 5)`, store.KeyHash(victim))
	refused("with INSERT on every column inserts a row with attempts", err)
	_, err = producer.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, payload, partition_key, msg_key, next_attempt_at) VALUES (gen_random_uuid(), 'x', '', $1, 'victimkey', 'infinity')`, store.KeyHash(victim))
	refused("with INSERT on every column inserts a row due later", err)
	code, grants, stderr := cli(t, "migrate", "grants", "--role", migrations.RoleProducer, "--schema", db.Schema, "--grantee", login)
	if code != 0 {
		t.Fatalf("grants: exit %d: %s", code, stderr)
	}
	if _, err := db.AdminPool.Exec(ctx, grants); err != nil {
		t.Fatalf("re-running the producer grants: %v", err)
	}
	var canInsert bool
	if err := db.Pool.QueryRow(ctx, `SELECT has_column_privilege($1, 'txoutbox_messages', 'attempts', 'INSERT')`, login).Scan(&canInsert); err != nil || canInsert {
		t.Errorf("after re-running the grants the producer may insert attempts: %v (%v)", canInsert, err)
	}

	var held int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_messages
		WHERE attempts > 0 OR next_attempt_at > now() OR (msg_key = 'victimkey' AND partition_key <> $1)`, store.KeyHash(victim)).Scan(&held); err != nil {
		t.Fatal(err)
	}
	if held != 0 {
		t.Errorf("%d rows the producer wrote hold back a key or sit in another partition", held)
	}
}

// The relay role updates only the columns of txoutbox_messages the relay and the check-back
// write (`relay migrate grants --role relay`): as the relay login, every UPDATE and DELETE
// they run works — the promotion of delayed messages (which draws a new id), the claim, the
// settles (published and retained, failed, dead, published and deleted), the check-back's
// lease of checker rows, its recorded check and release, its commit and rollback of half
// messages, its fence and its purges — and so do the admin commands that change rows (dead
// requeue, prepared resume, scheduled cancel), while an UPDATE of what a message says (payload,
// subject, headers, key, partition key, id, producer group, delivery time) fails with 42501.
// Before, the relay role had UPDATE on every column: a leaked relay credential could rewrite
// the messages the relay then published.
func TestRelayRoleUpdatesOnlyItsColumns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lp := newLeastPrivilege(t)
	db := lp.db
	relay := lp.poolOf(migrations.RoleRelay)
	q := store.New(db.Schema)
	past, later := time.Now().Add(-time.Hour), time.Now().Add(time.Hour)
	row := func(key string, deliverAt *time.Time) store.NewRow {
		return store.NewRow{MessageID: uuid.New(), Subject: "orders.created", Key: key, Payload: []byte("original"), DeliverAt: deliverAt}
	}
	// Written as the owner: four ready rows, two delayed rows due and one not, three checker
	// half messages and a fence one, due for a check, and an old dedup row.
	ready := []store.NewRow{row("a", nil), row("b", nil), row("", nil), row("c", nil)}
	notDue := row("e", &later)
	if err := q.InsertMessages(ctx, db.Pool, append(ready, row("d", &past), row("", &past), notDue)); err != nil {
		t.Fatal(err)
	}
	var checked, rolledBack, exhausted, fenced uuid.UUID
	for _, h := range []struct {
		id   *uuid.UUID
		mode string
	}{{&checked, store.CheckModeChecker}, {&rolledBack, store.CheckModeChecker}, {&exhausted, store.CheckModeChecker}, {&fenced, store.CheckModeFence}} {
		r := row("h"+h.mode, nil)
		*h.id = r.MessageID
		group := ""
		if h.mode == store.CheckModeChecker {
			group = "payments"
		}
		if err := q.InsertPrepared(ctx, db.Pool, store.PrepareArgs{Row: r, Group: group, Mode: h.mode}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET created_at = now() - interval '1 hour', next_check_at = now() - interval '1 second'
		WHERE state = 'prepared';
		INSERT INTO txoutbox_consumer_dedup (consumer, idempotency_key, processed_at) VALUES ('billing', 'k', now() - interval '1 day')`); err != nil {
		t.Fatal(err)
	}

	// The relay: promote and claim, then settle.
	p, claimed, err := q.PromoteAndClaim(ctx, relay, 10, store.Follow{}, store.ClaimArgs{Limit: 20})
	if err != nil || p.Moved != 2 || len(claimed) != 6 {
		t.Fatalf("relay PromoteAndClaim: moved %d, claimed %d, %v; want 2 and 6", p.Moved, len(claimed), err)
	}
	res, err := q.Settle(ctx, relay, store.SettleArgs{
		Published:   []store.Published{{ID: claimed[0].ID, Stream: "ORDERS", Seq: 1}},
		Failed:      []store.Failed{{ID: claimed[1].ID, Err: "boom", Delay: time.Millisecond}, {ID: claimed[2].ID, Err: "too big", Permanent: true}},
		MaxAttempts: 5, Retain: true})
	if err != nil || res.Published != 1 || len(res.Dead) != 1 {
		t.Fatalf("relay Settle (retained): %+v, %v", res, err)
	}
	var rest []store.Published
	for _, c := range claimed[3:] {
		rest = append(rest, store.Published{ID: c.ID, Stream: "ORDERS", Seq: 2})
	}
	if res, err := q.Settle(ctx, relay, store.SettleArgs{Published: rest, MaxAttempts: 5}); err != nil || res.Published != 3 {
		t.Fatalf("relay Settle (deleted): %+v, %v", res, err)
	}

	// The check-back: lease the checker rows, record a check, release, commit and roll back;
	// exhaust one; fence; purge.
	leased, err := q.ClaimChecks(ctx, relay, 0, 10, time.Minute, nil)
	if err != nil || len(leased) != 3 {
		t.Fatalf("relay ClaimChecks: %d rows, %v; want 3", len(leased), err)
	}
	if st, _, ok, err := q.RecordCheck(ctx, relay, checked, "no answer", time.Second, 10); err != nil || !ok || st != store.StatePrepared {
		t.Fatalf("relay RecordCheck: %s %v %v", st, ok, err)
	}
	if st, _, ok, err := q.RecordCheck(ctx, relay, exhausted, "no answer", time.Second, 1); err != nil || !ok || st != store.StateCheckExhausted {
		t.Fatalf("relay RecordCheck (exhausting): %s %v %v", st, ok, err)
	}
	if err := q.ReleaseChecks(ctx, relay, []uuid.UUID{checked, rolledBack}); err != nil {
		t.Fatalf("relay ReleaseChecks: %v", err)
	}
	for _, s := range []store.HalfSettle{{MessageID: checked, Commit: true, By: store.SettledByChecker, CountCheck: true},
		{MessageID: rolledBack, By: store.SettledByChecker, CountCheck: true}} {
		var settled bool
		if err := pgx.BeginFunc(ctx, relay, func(tx pgx.Tx) error {
			var err error
			settled, _, err = q.SettleHalf(ctx, tx, s)
			return err
		}); err != nil || !settled {
			t.Fatalf("relay SettleHalf (commit %v): settled %v, %v", s.Commit, settled, err)
		}
	}
	if err := pgx.BeginFunc(ctx, relay, func(tx pgx.Tx) error {
		ids, err := q.LockFences(ctx, tx, 0, 10)
		if err != nil {
			return err
		}
		done, err := q.Fence(ctx, tx, ids)
		if err == nil && (len(done) != 1 || done[0] != fenced) {
			err = fmt.Errorf("fenced %v, want [%s]", done, fenced)
		}
		return err
	}); err != nil {
		t.Fatalf("relay LockFences and Fence: %v", err)
	}
	for _, st := range []string{store.StatePublished, store.StateRolledBack} {
		if n, err := q.PurgeMessages(ctx, relay, st, 0, 100); err != nil || n == 0 {
			t.Fatalf("relay PurgeMessages(%s): %d, %v", st, n, err)
		}
	}
	if n, err := q.PurgeDedup(ctx, relay, 0, 100); err != nil || n != 1 {
		t.Fatalf("relay PurgeDedup: %d, %v", n, err)
	}

	// The admin commands that change rows, were they run as the relay role.
	if ids, err := q.RequeueDead(ctx, relay, store.DeadFilter{}); err != nil || len(ids) != 1 {
		t.Fatalf("dead requeue as the relay role: %v, %v", ids, err)
	}
	if ids, err := q.Resume(ctx, relay, []uuid.UUID{exhausted}, false, ""); err != nil || len(ids) != 1 {
		t.Fatalf("prepared resume as the relay role: %v, %v", ids, err)
	}
	if ok, st, err := q.CancelScheduled(ctx, relay, notDue.MessageID); err != nil || !ok {
		t.Fatalf("scheduled cancel as the relay role: %v %s %v", ok, st, err)
	}

	// What a message says is not the relay's to change.
	for _, set := range []string{"payload = 'tampered'", "subject = 'tampered'", `headers = '{"X-Tampered": ["1"]}'`,
		"msg_key = 'tampered'", "partition_key = 0", "message_id = gen_random_uuid()", "producer_group = 'tampered'",
		"deliver_at = now()", "created_at = now()", "check_mode = 'fence'"} {
		_, err := relay.Exec(ctx, `UPDATE txoutbox_messages SET `+set)
		wantDenied(t, "relay UPDATE ... SET "+set, err)
	}
	var changed int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_messages WHERE payload <> 'original' OR subject <> 'orders.created'`).Scan(&changed); err != nil || changed != 0 {
		t.Errorf("%d rows changed (%v)", changed, err)
	}
}
