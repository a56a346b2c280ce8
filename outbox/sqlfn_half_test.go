package outbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
)

// stateOf is the row's state, or "none".
func stateOf(t *testing.T, db *testsvc.DB, id uuid.UUID) string {
	t.Helper()
	var st string
	err := db.Pool.QueryRow(context.Background(), `SELECT state FROM txoutbox_messages WHERE message_id = $1`, id).Scan(&st)
	if errors.Is(err, pgx.ErrNoRows) {
		return "none"
	}
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// The half-message functions have the Go API's states and errors: every settle (commit,
// commit in a transaction, roll back) from every state, once through Go and once through
// SQL, gives the same outcome and leaves the same state. Each side settles a message the
// other side prepared.
func TestSQLHalfMessagesAgreeWithGo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)

	prepareGo := func(key string) uuid.UUID {
		h, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "h.v", Key: key, Payload: []byte("x")}, &outbox.PrepareOptions{Group: "g"})
		if err != nil {
			t.Fatal(err)
		}
		return h.ID
	}
	prepareSQL := func(key string) uuid.UUID {
		var id uuid.UUID
		if err := db.Pool.QueryRow(ctx, `SELECT txoutbox_prepare('h.v', 'x', $1, producer_group => 'g')`, nilIfEmpty(key)).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	// setup returns a message in state, prepared by prepare.
	setup := func(state string, prepare func(string) uuid.UUID) uuid.UUID {
		if state == "none" {
			return uuid.New()
		}
		id := prepare("k-" + uuid.NewString()[:8])
		var err error
		switch state {
		case "ready":
			err = c.Commit(ctx, db.Pool, id)
		case "rolled_back":
			err = c.Rollback(ctx, db.Pool, id)
		case "check_exhausted":
			_, err = db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'check_exhausted', next_check_at = NULL WHERE message_id = $1`, id)
		}
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	inTx := func(f func(tx pgx.Tx) (string, bool)) string {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		out, commit := f(tx)
		if !commit {
			// A failed settle aborted the transaction on the server: it cannot commit.
			if err := tx.Commit(ctx); !errors.Is(err, pgx.ErrTxCommitRollback) {
				t.Fatalf("commit after a failed settle in the transaction: %v, want pgx.ErrTxCommitRollback", err)
			}
			return out
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		return out
	}
	ops := []struct {
		name   string
		goOp   func(uuid.UUID) string
		sqlOp  func(uuid.UUID) string
		prefix string
	}{
		{"commit", func(id uuid.UUID) string { return goOutcome(c.Commit(ctx, db.Pool, id)) },
			func(id uuid.UUID) string {
				_, err := db.Pool.Exec(ctx, `SELECT txoutbox_commit($1)`, id)
				return sqlOutcome(err)
			}, "txoutbox_commit"},
		{"commit in a transaction", func(id uuid.UUID) string {
			return inTx(func(tx pgx.Tx) (string, bool) {
				err := c.CommitTx(ctx, tx, id)
				return goOutcome(err), err == nil || errors.Is(err, outbox.ErrAlreadyCommitted)
			})
		}, func(id uuid.UUID) string {
			return inTx(func(tx pgx.Tx) (string, bool) {
				var committed bool
				if err := tx.QueryRow(ctx, `SELECT txoutbox_commit_in_tx($1)`, id).Scan(&committed); err != nil {
					return sqlOutcome(err), false
				}
				if !committed {
					return "TX102", true // already committed: the transaction stays usable, as with CommitTx
				}
				return "ok", true
			})
		}, "txoutbox_commit_in_tx"},
		{"roll back", func(id uuid.UUID) string { return goOutcome(c.Rollback(ctx, db.Pool, id)) },
			func(id uuid.UUID) string {
				_, err := db.Pool.Exec(ctx, `SELECT txoutbox_rollback($1)`, id)
				return sqlOutcome(err)
			}, "txoutbox_rollback"},
	}
	want := map[string]map[string]string{
		"commit":                  {"prepared": "ok", "check_exhausted": "ok", "ready": "TX102", "rolled_back": "TX101", "none": "TX103"},
		"commit in a transaction": {"prepared": "ok", "check_exhausted": "ok", "ready": "TX102", "rolled_back": "TX101", "none": "TX103"},
		"roll back":               {"prepared": "ok", "check_exhausted": "ok", "ready": "TX102", "rolled_back": "TX101", "none": "TX103"},
	}
	for _, op := range ops {
		for _, state := range []string{"prepared", "check_exhausted", "ready", "rolled_back", "none"} {
			goID, sqlID := setup(state, prepareSQL), setup(state, prepareGo)
			g, s := op.goOp(goID), op.sqlOp(sqlID)
			if g != want[op.name][state] || s != g {
				t.Errorf("%s of a %s message: Go %s, SQL %s; want both %s", op.name, state, g, s, want[op.name][state])
			}
			if gs, ss := stateOf(t, db, goID), stateOf(t, db, sqlID); gs != ss {
				t.Errorf("%s of a %s message: Go left it %s, SQL %s", op.name, state, gs, ss)
			}
		}
	}

	// Groups and fence, as Prepare: a group is required unless fence is set.
	for _, tc := range []struct {
		group string
		fence bool
		want  string
	}{
		{"orders", false, "ok"}, {"", false, "TX007"}, {"bad group", false, "TX007"}, {strings.Repeat("g", outbox.MaxGroupLength), false, "ok"},
		{strings.Repeat("g", outbox.MaxGroupLength+1), false, "TX007"}, {"", true, "ok"}, {"a.b", true, "TX007"},
	} {
		_, goErr := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "h.v"}, &outbox.PrepareOptions{Group: tc.group, Fence: tc.fence})
		var id uuid.UUID
		sqlErr := db.Pool.QueryRow(ctx, `SELECT txoutbox_prepare('h.v', '', producer_group => $1, fence => $2)`, tc.group, tc.fence).Scan(&id)
		if g, s := goOutcome(goErr), sqlOutcome(sqlErr); g != tc.want || s != tc.want {
			t.Errorf("prepare with group %.20q, fence %v: Go %s, SQL %s; want %s", tc.group, tc.fence, g, s, tc.want)
		}
		if sqlErr == nil {
			var mode string
			var group *string
			if err := db.Pool.QueryRow(ctx, `SELECT check_mode, producer_group FROM txoutbox_messages WHERE message_id = $1 AND state = 'prepared'`, id).Scan(&mode, &group); err != nil {
				t.Fatal(err)
			}
			if wantMode := map[bool]string{true: "fence", false: "checker"}[tc.fence]; mode != wantMode || (group == nil) != (tc.group == "") {
				t.Errorf("prepared with group %q, fence %v: check_mode %s, producer_group %v", tc.group, tc.fence, mode, group)
			}
		}
	}
	// Check immunity: none, some, negative (refused by both).
	for _, tc := range []struct {
		immunity time.Duration
		want     string
	}{{0, "ok"}, {5 * time.Second, "ok"}, {-time.Second, "TX008"}, {-time.Microsecond, "TX008"}} {
		_, goErr := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "h.v"}, &outbox.PrepareOptions{Group: "orders", CheckImmunity: tc.immunity})
		sqlErr := db.Pool.QueryRow(ctx, `SELECT txoutbox_prepare('h.v', '', producer_group => 'orders', check_immunity => $1)`, tc.immunity).Scan(new(uuid.UUID))
		if g, s := goOutcome(goErr), sqlOutcome(sqlErr); g != tc.want || s != tc.want {
			t.Errorf("prepare with check immunity %s: Go %s, SQL %s; want %s", tc.immunity, g, s, tc.want)
		}
	}
	// The largest check immunity Prepare can be given (the largest time.Duration) is accepted
	// by both; above it, which only SQL can be given, is TX008 naming check_immunity (it was
	// 'timestamp out of range', 22008, from the INSERT), however large.
	_, goErr := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "h.v"}, &outbox.PrepareOptions{Group: "orders", CheckImmunity: math.MaxInt64})
	sqlErr := db.Pool.QueryRow(ctx, `SELECT txoutbox_prepare('h.v', '', producer_group => 'orders', check_immunity => $1)`, time.Duration(math.MaxInt64)).Scan(new(uuid.UUID))
	if g, s := goOutcome(goErr), sqlOutcome(sqlErr); g != "ok" || s != "ok" {
		t.Errorf("prepare with the largest check immunity: Go %s (%v), SQL %s (%v); want ok", g, goErr, s, sqlErr)
	}
	for _, iv := range []string{"2562047:47:16.854776", "300 years", "100000000 years"} {
		err := db.Pool.QueryRow(ctx, `SELECT txoutbox_prepare('h.v', '', producer_group => 'orders', check_immunity => $1::interval)`, iv).Scan(new(uuid.UUID))
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "TX008" || !strings.HasPrefix(pgErr.Message, "txoutbox_prepare: check_immunity: invalid argument: at most ") {
			t.Errorf("txoutbox_prepare with check immunity %s: %v; want TX008 naming check_immunity", iv, err)
		}
	}
	// Both wrong: the same first complaint.
	_, goErr = c.Prepare(ctx, db.Pool, outbox.Message{Subject: "h.v"}, &outbox.PrepareOptions{Group: "bad group", CheckImmunity: -time.Second})
	sqlErr = db.Pool.QueryRow(ctx, `SELECT txoutbox_prepare('h.v', '', producer_group => 'bad group', check_immunity => '-1 second')`).Scan(new(uuid.UUID))
	if g, s := goOutcome(goErr), sqlOutcome(sqlErr); g != "TX008" || s != "TX008" {
		t.Errorf("prepare with a bad group and a negative check immunity: Go %s, SQL %s; want TX008", g, s)
	}
	// Prepare validates the message as txoutbox_enqueue does.
	if err := db.Pool.QueryRow(ctx, `SELECT txoutbox_prepare('a..b', '', producer_group => 'g')`).Scan(new(uuid.UUID)); sqlOutcome(err) != "TX001" {
		t.Errorf("txoutbox_prepare of a bad subject: %v, want TX001", err)
	}

	// Committing draws a new id: after the messages of the key enqueued since the prepare.
	half := prepareSQL("order-7")
	tx := beginTx(t, db)
	ids, err := c.EnqueueTx(ctx, tx, outbox.Message{Subject: "k.v", Key: "order-7"})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `SELECT txoutbox_commit($1)`, half); err != nil {
		t.Fatal(err)
	}
	if a, b := keyID(t, db, "order-7", ids[0]), keyID(t, db, "order-7", half); a >= b {
		t.Fatalf("ids %d (enqueued), %d (committed half): the commit must draw a later id", a, b)
	}
}

// A message enqueued by txoutbox_enqueue is published by the relay exactly as the same
// message enqueued by EnqueueTx: subject, payload and headers (Nats-Msg-Id aside, the id).
func TestSQLEnqueuedMessagePublishesLikeGo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	nc := testsvc.NewNATS(t)
	nc.Stream(t, "SQLFN", "sqlfn.>")
	c := newClient(t, db, nil)
	m := outbox.Message{
		Subject: "sqlfn.orders.created", Key: "order-42", BizKey: "order:42:created",
		Headers: map[string][]string{"traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}, "Multi": {"1", "", "zürich ☃"}, "multi": {"lower"}, "Tab": {"a\tb"}},
		Payload: []byte{0, 1, 2, 0xff, 0xfe, '\r', '\n', 0},
	}
	tx := beginTx(t, db)
	goIDs, err := c.EnqueueTx(ctx, tx, m)
	if err != nil {
		t.Fatal(err)
	}
	sqlID, err := enqueueSQL(ctx, tx, m)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	r, err := relay.New(db.Pool, nc.JS, &relay.Config{Schema: db.Schema, PollMax: 50 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	defer func() {
		cancel()
		<-done
	}()
	testsvc.Eventually(t, 20*time.Second, "the relay to publish both messages", func() bool {
		return count(t, db, "true") == 0
	})
	msgs := testsvc.StreamMsgs(t, nc.JS, "SQLFN")
	if len(msgs) != 2 {
		t.Fatalf("%d messages in the stream, want 2", len(msgs))
	}
	byID := map[string]int{}
	for i, sm := range msgs {
		byID[sm.Header.Get(outbox.HeaderMsgID)] = i
	}
	gi, ok1 := byID[goIDs[0].String()]
	si, ok2 := byID[sqlID.String()]
	if !ok1 || !ok2 {
		t.Fatalf("Nats-Msg-Id of the stream's messages %v, want %s and %s", byID, goIDs[0], sqlID)
	}
	g, s := msgs[gi], msgs[si]
	gh, sh := g.Header, s.Header
	gh.Del(outbox.HeaderMsgID)
	sh.Del(outbox.HeaderMsgID)
	if g.Subject != s.Subject || !bytes.Equal(g.Data, s.Data) || fmt.Sprint(gh) != fmt.Sprint(sh) {
		t.Fatalf("published differently:\n  Go:  %s %q %v\n  SQL: %s %q %v", g.Subject, g.Data, gh, s.Subject, s.Data, sh)
	}
	if !bytes.Equal(s.Data, m.Payload) || sh.Get(outbox.HeaderKey) != m.Key || sh.Get(outbox.HeaderBizKey) != m.BizKey || fmt.Sprint(sh.Values("Multi")) != fmt.Sprint(m.Headers["Multi"]) {
		t.Fatalf("the SQL message arrived changed: %q %v", s.Data, sh)
	}
}

// The plain-SQL example (testdata/sql_producer.sql) enqueues, prepares, commits and rolls
// back: run through psql when the machine has it, else through pgx (one multi-statement
// simple-protocol Exec, which is what psql sends, statement by statement).
func TestPlainSQLExample(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	script, err := os.ReadFile(filepath.Join("testdata", "sql_producer.sql"))
	if err != nil {
		t.Fatal(err)
	}
	if psql, err := exec.LookPath("psql"); err == nil {
		cmd := exec.CommandContext(ctx, psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-f", filepath.Join("testdata", "sql_producer.sql"), testsvc.PostgresDSN(t))
		cmd.Env = append(os.Environ(), "PGOPTIONS=-c search_path="+db.Schema)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("psql: %v\n%s", err, out)
		}
		t.Logf("ran testdata/sql_producer.sql through %s", psql)
	} else {
		t.Logf("psql is not installed: running testdata/sql_producer.sql through pgx instead")
		conn, err := db.Pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Release()
		if err := conn.Conn().PgConn().Exec(ctx, string(script)).Close(); err != nil {
			t.Fatal(err)
		}
	}
	rows, err := db.Pool.Query(ctx, `SELECT subject, coalesce(msg_key, ''), state, convert_from(payload, 'UTF8') FROM txoutbox_messages ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for rows.Next() {
		var subject, key, state, payload string
		if err := rows.Scan(&subject, &key, &state, &payload); err != nil {
			t.Fatal(err)
		}
		got = append(got, strings.Join([]string{subject, key, state, payload}, " "))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	want := []string{
		`orders.created order-42 ready {"order":42}`,
		`orders.line_added order-42 ready {"line":1}`,
		`orders.line_added order-42 ready {"line":2}`,
		`payments.captured order-42 ready {"order":42}`, // committed: a new id, after the key's earlier messages
		`payments.captured  rolled_back {"order":43}`,
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("rows after the example:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// The producer role of `relay migrate grants` may call the functions, and nobody else:
// EXECUTE is not granted to PUBLIC.
func TestSQLFunctionsNeedTheProducerGrant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	role := "sqlfn_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	t.Cleanup(func() {
		_, _ = db.AdminPool.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = db.AdminPool.Exec(context.Background(), `DROP ROLE IF EXISTS `+role)
	})
	if _, err := db.AdminPool.Exec(ctx, `CREATE ROLE `+role+` NOLOGIN`); err != nil {
		t.Fatal(err)
	}
	call := func() error {
		tx := beginTx(t, db)
		defer func() { _ = tx.Rollback(ctx) }()
		if _, err := tx.Exec(ctx, `SET LOCAL ROLE `+role); err != nil {
			t.Fatal(err)
		}
		var id uuid.UUID
		if err := tx.QueryRow(ctx, `SELECT txoutbox_enqueue('a.b', 'x', 'k')`).Scan(&id); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, `SELECT txoutbox_enqueue_many(ARRAY['a.b'], ARRAY['\x'::bytea], ARRAY['k'])`).Scan(new([]uuid.UUID)); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, `SELECT txoutbox_prepare('a.b', 'x', 'k', fence => true)`).Scan(&id); err != nil {
			return err
		}
		var ok bool
		if err := tx.QueryRow(ctx, `SELECT txoutbox_commit_in_tx($1)`, id).Scan(&ok); err != nil || !ok {
			return fmt.Errorf("commit in tx: %v, %v", ok, err)
		}
		if err := tx.QueryRow(ctx, `SELECT txoutbox_prepare('a.b', 'x', producer_group => 'g')`).Scan(&id); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `SELECT txoutbox_rollback($1)`, id); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, `SELECT txoutbox_prepare('a.b', 'x', producer_group => 'g')`).Scan(&id); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `SELECT txoutbox_commit($1)`, id)
		return err
	}
	// With the schema visible but no grant, the functions are refused: not executable by PUBLIC.
	if _, err := db.AdminPool.Exec(ctx, `GRANT USAGE ON SCHEMA `+pgx.Identifier{db.Schema}.Sanitize()+` TO `+role); err != nil {
		t.Fatal(err)
	}
	if err := call(); sqlOutcome(err) != "42501" || !strings.Contains(err.Error(), "function txoutbox_enqueue") {
		t.Fatalf("without grants: %v, want insufficient_privilege (42501) on function txoutbox_enqueue", err)
	}
	grants, err := migrations.Grants(migrations.RoleProducer, db.Schema, role, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.AdminPool.Exec(ctx, grants); err != nil {
		t.Fatal(err)
	}
	if err := call(); err != nil {
		t.Fatalf("with the producer's grants: %v", err)
	}
}

// txoutbox_commit_in_tx is fence-aware: while the business transaction that committed a fence
// message is open, the check-back's fence skips the row (its row lock); once the fence has
// rolled a message back, txoutbox_commit_in_tx fails and its transaction with it.
func TestSQLCommitInTxAndTheFence(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	q := store.New(db.Schema)
	prepare := func() uuid.UUID {
		var id uuid.UUID
		if err := db.Pool.QueryRow(ctx, `SELECT txoutbox_prepare('f.v', 'x', 'k', fence => true)`).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	fence := func() []uuid.UUID {
		tx := beginTx(t, db)
		rows, err := q.LockFences(ctx, tx, 0, 10)
		if err != nil {
			t.Fatal(err)
		}
		ids, err := q.Fence(ctx, tx, rows)
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		return ids
	}

	// A commit in flight holds the row: the fence skips it, and the message is committed.
	id := prepare()
	biz := beginTx(t, db)
	var ok bool
	if err := biz.QueryRow(ctx, `SELECT txoutbox_commit_in_tx($1)`, id).Scan(&ok); err != nil || !ok {
		t.Fatalf("txoutbox_commit_in_tx: %v, %v", ok, err)
	}
	if fenced := fence(); len(fenced) != 0 {
		t.Fatalf("the fence rolled back %v while its commit was in flight", fenced)
	}
	if err := biz.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if st := stateOf(t, db, id); st != "ready" {
		t.Fatalf("state %s, want ready", st)
	}

	// The fence first: the late commit fails (TX101) and so does its transaction.
	id = prepare()
	if fenced := fence(); len(fenced) != 1 || fenced[0] != id {
		t.Fatalf("fenced %v, want %s", fenced, id)
	}
	biz = beginTx(t, db)
	err := biz.QueryRow(ctx, `SELECT txoutbox_commit_in_tx($1)`, id).Scan(&ok)
	if sqlOutcome(err) != "TX101" {
		t.Fatalf("txoutbox_commit_in_tx after the fence: %v, want TX101", err)
	}
	if err := biz.Commit(ctx); !errors.Is(err, pgx.ErrTxCommitRollback) {
		t.Fatalf("the business transaction's commit: %v, want pgx.ErrTxCommitRollback", err)
	}
	if st := stateOf(t, db, id); st != "rolled_back" {
		t.Fatalf("state %s, want rolled_back", st)
	}
}
