package outbox_test

// The SQL contract's arguments where they once differed from the Go client (migration 009):
// a keyed delayed message takes no key lock, the all-zero UUID is no id, arrays of the wrong
// length or shape are named, and a NULL id or business key is refused.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// A keyed delayed message takes no key lock, in Go or in SQL: it draws its final id under its
// key's lock when it falls due. An open transaction holding a key's lock does not hold back a
// delayed message of that key, and delayed messages do not count in the transaction's budget
// of exact key locks (txoutbox.key_locks): after more delayed keys than the budget, a ready
// keyed message still locks its key exactly.
func TestSQLDelayedKeyedMessagesTakeNoKeyLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	const key = "order-9"
	holder := beginTx(t, db)
	if _, err := c.EnqueueTx(ctx, holder, outbox.Message{Subject: "k.v", Key: key}); err != nil {
		t.Fatal(err)
	}
	many := keyed("delayed-", outbox.KeyLockBudget+1)
	for i := range many {
		many[i].DeliverAt = ahead
	}
	one := outbox.Message{Subject: "k.v", Key: key, DeliverAt: ahead}
	ways := []struct {
		name    string
		enqueue func(tx pgx.Tx, msgs []outbox.Message) error
	}{
		{"EnqueueTx", func(tx pgx.Tx, msgs []outbox.Message) error { _, err := c.EnqueueTx(ctx, tx, msgs...); return err }},
		{"txoutbox_enqueue", func(tx pgx.Tx, msgs []outbox.Message) error {
			for _, m := range msgs {
				if _, err := enqueueSQL(ctx, tx, m); err != nil {
					return err
				}
			}
			return nil
		}},
		{"txoutbox_enqueue_many", func(tx pgx.Tx, msgs []outbox.Message) error { _, err := enqueueManySQL(ctx, tx, msgs); return err }},
		{"txoutbox_prepare", func(tx pgx.Tx, msgs []outbox.Message) error {
			// A half message is prepared without a key lock, delayed or not (its commit
			// locks its key, as Go's does).
			_, err := tx.Exec(ctx, `SELECT txoutbox_prepare('k.v', 'x', $1, fence => true, deliver_at => $2)`, msgs[0].Key, msgs[0].DeliverAt)
			return err
		}},
	}
	for _, w := range ways {
		tx := beginTx(t, db)
		// A wait on the holder's lock would fail the call (55P03) rather than hang.
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '5s'`); err != nil {
			t.Fatal(err)
		}
		if err := w.enqueue(tx, []outbox.Message{one}); err != nil {
			t.Fatalf("%s: a delayed message of a key another transaction holds: %v; want it written without waiting", w.name, err)
		}
		if got := keyLocks(t, ctx, tx); got != "0 advisory locks, txoutbox.key_locks 0" {
			t.Errorf("%s: after a keyed delayed message: %s; want none", w.name, got)
		}
		if strings.HasPrefix(w.name, "txoutbox_prepare") {
			_ = tx.Rollback(ctx)
			continue
		}
		if err := w.enqueue(tx, many); err != nil {
			t.Fatalf("%s: %d keyed delayed messages: %v", w.name, len(many), err)
		}
		if err := w.enqueue(tx, []outbox.Message{{Subject: "k.v", Key: "ready-1"}}); err != nil {
			t.Fatal(err)
		}
		// The ready message's exact lock and its bucket's shared lock, the first of the budget.
		if got := keyLocks(t, ctx, tx); got != "2 advisory locks, txoutbox.key_locks 1" {
			t.Errorf("%s: after %d keyed delayed messages and one ready: %s; want the ready one's key and bucket only", w.name, len(many), got)
		}
		_ = tx.Rollback(ctx)
	}
}

// The all-zero UUID as an id is no id, as uuid.Nil is for EnqueueTx and Prepare: a UUIDv7 is
// drawn for it, in every function that takes ids; two messages of one call with it are not
// duplicates; a message with it is not refused as a duplicate of a stored one.
func TestSQLZeroIDIsNoID(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	const zero = "00000000-0000-0000-0000-000000000000"
	tx := beginTx(t, db)
	// What Go does with uuid.Nil, twice in one call.
	goIDs, err := c.EnqueueTx(ctx, tx, outbox.Message{Subject: "a.b", ID: uuid.Nil}, outbox.Message{Subject: "a.b", ID: uuid.Nil})
	if err != nil {
		t.Fatal(err)
	}
	checkDrawnIDs(t, goIDs)
	var one, delayed, half, fenced uuid.UUID
	var many []uuid.UUID
	if err := tx.QueryRow(ctx, `SELECT txoutbox_enqueue('a.b', 'x', id => $1::uuid),
    txoutbox_enqueue('a.b', 'x', 'k', id => $1::uuid, deliver_at => now() + interval '1 hour'),
    txoutbox_enqueue_many(ARRAY['a.b', 'a.c', 'a.d'], ARRAY['x', 'y', 'z']::bytea[], ids => ARRAY[$1, NULL, $1]::uuid[]),
    txoutbox_prepare('a.b', 'x', id => $1::uuid, producer_group => 'g'),
    txoutbox_prepare('a.b', 'x', id => $1::uuid, fence => true, deliver_at => now() + interval '1 hour')`, zero).
		Scan(&one, &delayed, &many, &half, &fenced); err != nil {
		t.Fatalf("the zero id: %v; want ids drawn", err)
	}
	checkDrawnIDs(t, many)
	all := append([]uuid.UUID{one, delayed, half, fenced}, many...)
	seen := map[uuid.UUID]bool{}
	for _, id := range all {
		checkDrawnIDs(t, []uuid.UUID{id})
		if seen[id] {
			t.Fatalf("id %s returned twice", id)
		}
		seen[id] = true
	}
	if n := countIn(t, tx, `message_id = '`+zero+`'`); n != 0 {
		t.Fatalf("%d rows stored with the zero id", n)
	}
	if n := countIn(t, tx, "message_id = ANY('"+uuidArray(all)+"'::uuid[])"); n != len(all) {
		t.Fatalf("%d rows of the %d ids returned", n, len(all))
	}
	// Stored as the ids say: ready, scheduled, prepared.
	var states string
	if err := tx.QueryRow(ctx, `SELECT string_agg(state, ',' ORDER BY ord) FROM unnest($1::uuid[]) WITH ORDINALITY AS u(id, ord)
JOIN txoutbox_messages m ON m.message_id = u.id`, all[:4]).Scan(&states); err != nil || states != "ready,scheduled,prepared,prepared" {
		t.Fatalf("states %q, %v; want ready,scheduled,prepared,prepared", states, err)
	}
}

// countIn counts the outbox rows matching where, in tx.
func countIn(t *testing.T, tx pgx.Tx, where string) int {
	t.Helper()
	var n int
	if err := tx.QueryRow(context.Background(), `SELECT count(*) FROM txoutbox_messages WHERE `+where).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// uuidArray is ids as a PostgreSQL array literal.
func uuidArray(ids []uuid.UUID) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = id.String()
	}
	return "{" + strings.Join(s, ",") + "}"
}

// txoutbox_enqueue_many checks its arrays before anything else, also with no subject: TX008
// names the first argument whose length or shape is wrong, and its length.
func TestSQLEnqueueManyNamesTheWrongArray(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	cases := []struct {
		args string // after subjects and payloads
		subj string
		pay  string
		want string // "" for accepted, else what the message starts with after the function's name
	}{
		{subj: `'{}'`, pay: `'{x}'`, want: "payloads: invalid argument: payloads has 1 element and subjects has 0 elements"},
		{subj: `NULL`, pay: `'{x,y}'`, want: "payloads: invalid argument: payloads has 2 elements and subjects has 0 elements"},
		{subj: `'{a.b,a.c}'`, pay: `'{x}'`, want: "payloads: invalid argument: payloads has 1 element and subjects has 2 elements"},
		{subj: `'{a.b}'`, pay: `NULL`, want: "payloads: invalid argument: payloads is NULL and subjects has 1 element"},
		{subj: `'{a.b,a.c}'`, pay: `'{x,y}'`, args: `, keys => '{k}'`, want: "keys: invalid argument: keys has 1 element and subjects has 2 elements"},
		{subj: `'{a.b,a.c}'`, pay: `'{x,y}'`, args: `, headers => '{}'`, want: "headers: invalid argument: headers has 0 elements and subjects has 2 elements"},
		{subj: `'{a.b,a.c}'`, pay: `'{x,y}'`, args: `, biz_keys => '{a,b,c}'`, want: "biz_keys: invalid argument: biz_keys has 3 elements and subjects has 2 elements"},
		{subj: `'{a.b,a.c}'`, pay: `'{x,y}'`, args: `, ids => ARRAY[gen_random_uuid()]`, want: "ids: invalid argument: ids has 1 element and subjects has 2 elements"},
		{subj: `'{a.b,a.c}'`, pay: `'{x,y}'`, args: `, deliver_ats => ARRAY[now()]`, want: "deliver_ats: invalid argument: deliver_ats has 1 element and subjects has 2 elements"},
		{subj: `'{}'`, pay: `'{}'`, args: `, deliver_ats => ARRAY[now()]`, want: "deliver_ats: invalid argument: deliver_ats has 1 element and subjects has 0 elements"},
		{subj: `'{}'`, pay: `'{}'`, args: `, keys => '{k}'`, want: "keys: invalid argument: keys has 1 element and subjects has 0 elements"},
		// The first wrong one, in argument order.
		{subj: `'{a.b,a.c}'`, pay: `'{x,y}'`, args: `, keys => '{k}', ids => '{}'`, want: "keys: invalid argument: keys has 1 element"},
		{subj: `'{a.b,a.c}'`, pay: `'{x}'`, args: `, keys => '{k}'`, want: "payloads: invalid argument: payloads has 1 element"},
		// Shapes.
		{subj: `'{{a.b},{a.c}}'`, pay: `'{x,y}'`, want: "subjects: invalid argument: subjects is a 2-dimensional array"},
		{subj: `'{a.b,a.c}'`, pay: `'{x,y}'`, args: `, keys => '{{k},{l}}'`, want: "keys: invalid argument: keys is a 2-dimensional array"},
		// Accepted: no subject and nothing else, or NULL for the optional arrays.
		{subj: `'{}'`, pay: `'{}'`},
		{subj: `NULL`, pay: `NULL`},
		{subj: `'{}'`, pay: `'{}'`, args: `, keys => '{}', headers => '{}', biz_keys => '{}', ids => '{}', deliver_ats => '{}'`},
		{subj: `'{a.b,a.c}'`, pay: `'{x,y}'`, args: `, keys => NULL, deliver_ats => ARRAY[NULL, now()]::timestamptz[]`},
	}
	for _, tc := range cases {
		call := fmt.Sprintf(`SELECT txoutbox_enqueue_many(%s, %s%s)`, tc.subj, tc.pay, tc.args)
		tx := beginTx(t, db)
		var ids []uuid.UUID
		err := tx.QueryRow(ctx, call).Scan(&ids)
		_ = tx.Rollback(ctx)
		if tc.want == "" {
			if err != nil {
				t.Errorf("%s: %v; want it accepted", call, err)
			}
			continue
		}
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "TX008" || !strings.HasPrefix(pgErr.Message, "txoutbox_enqueue_many: "+tc.want) {
			t.Errorf("%s: %v; want TX008 %q", call, err, "txoutbox_enqueue_many: "+tc.want)
		}
	}
}

// A NULL id (or business key) is refused with TX008 naming the argument: it matched no
// message, and the error said "no message has id  (never prepared…)". A business key is
// validated as CancelBizKeyTx and RescheduleBizKeyTx validate it (TX002, ErrInvalidKey),
// before the delivery time.
func TestSQLNullIDsAndBizKeysRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	cases := []struct{ call, want string }{
		{`SELECT txoutbox_commit(NULL)`, "txoutbox_commit: id: invalid argument: id is NULL"},
		{`SELECT txoutbox_commit_in_tx(NULL)`, "txoutbox_commit_in_tx: id: invalid argument: id is NULL"},
		{`SELECT txoutbox_rollback(NULL)`, "txoutbox_rollback: id: invalid argument: id is NULL"},
		{`SELECT txoutbox_cancel(NULL)`, "txoutbox_cancel: id: invalid argument: id is NULL"},
		{`SELECT txoutbox_reschedule(NULL, now())`, "txoutbox_reschedule: id: invalid argument: id is NULL"},
		{`SELECT txoutbox_reschedule(NULL, NULL)`, "txoutbox_reschedule: id: invalid argument: id is NULL"},
		{`SELECT txoutbox_cancel_biz_key(NULL)`, "txoutbox_cancel_biz_key: biz_key: invalid argument: biz_key is NULL"},
		{`SELECT txoutbox_reschedule_biz_key(NULL, now())`, "txoutbox_reschedule_biz_key: biz_key: invalid argument: biz_key is NULL"},
	}
	for _, tc := range cases {
		_, err := db.Pool.Exec(ctx, tc.call)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "TX008" || !strings.HasPrefix(pgErr.Message, tc.want) {
			t.Errorf("%s: %v; want TX008 %q", tc.call, err, tc.want)
		}
	}
	// Business keys: the Go client's outcome, the key's problem before the delivery time's.
	at := time.Date(2031, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, bk := range []string{" k", "k\t", "a\x01b", strings.Repeat("b", outbox.MaxKeyLength+1), "", "no-such-key", strings.Repeat("b", outbox.MaxKeyLength),
		"b:Nats-Msg-Id", "b:nats-msg-id"} { // the text Nats-Msg-Id: refused in that case only (migration 011)
		for _, due := range []time.Time{at, tooLate} {
			_, goErr := c.RescheduleBizKeyTx(ctx, db.Pool, bk, due)
			_, sqlErr := db.Pool.Exec(ctx, `SELECT txoutbox_reschedule_biz_key($1, $2)`, bk, due)
			if g, s := goOutcome(goErr), sqlOutcome(sqlErr); g != s || g == "ok" {
				t.Errorf("reschedule business key %.20q to %s: RescheduleBizKeyTx %s (%v), txoutbox_reschedule_biz_key %s (%v): they must agree",
					bk, due, g, goErr, s, sqlErr)
			}
		}
		_, goErr := c.CancelBizKeyTx(ctx, db.Pool, bk)
		_, sqlErr := db.Pool.Exec(ctx, `SELECT txoutbox_cancel_biz_key($1)`, bk)
		if g, s := goOutcome(goErr), sqlOutcome(sqlErr); g != s || g == "ok" {
			t.Errorf("cancel business key %.20q: CancelBizKeyTx %s (%v), txoutbox_cancel_biz_key %s (%v): they must agree", bk, g, goErr, s, sqlErr)
		}
	}
}

// A TX error aborts the caller's transaction, as any PostgreSQL error does; a caller that wants
// to carry on wraps the call in a savepoint (README, "The SQL contract").
func TestSQLErrorAbortsTheTransactionButNotASavepoint(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	tx := beginTx(t, db)
	if _, err := tx.Exec(ctx, `SELECT txoutbox_enqueue('a..b', 'x')`); sqlOutcome(err) != "TX001" {
		t.Fatalf("invalid subject: %v", err)
	}
	if _, err := tx.Exec(ctx, `SELECT txoutbox_enqueue('a.b', 'x')`); sqlOutcome(err) != "25P02" {
		t.Fatalf("after a TX error, the transaction: %v; want 25P02 (aborted)", err)
	}
	_ = tx.Rollback(ctx)

	tx = beginTx(t, db)
	var kept uuid.UUID
	if err := tx.QueryRow(ctx, `SELECT txoutbox_enqueue('a.b', 'kept')`).Scan(&kept); err != nil {
		t.Fatal(err)
	}
	for _, sql := range []string{`SAVEPOINT msg`, `SELECT txoutbox_enqueue('a..b', 'x')`, `ROLLBACK TO SAVEPOINT msg`,
		`SELECT txoutbox_enqueue('a.c', 'after')`} {
		if _, err := tx.Exec(ctx, sql); err != nil && sqlOutcome(err) != "TX001" {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_messages WHERE subject IN ('a.b', 'a.c')`).Scan(&n); err != nil || n != 2 {
		t.Fatalf("%d messages committed, %v; want the one before the savepoint and the one after", n, err)
	}
}

// The SQL functions' size limit is the setting txoutbox.max_message_bytes, as EnqueueTx's is
// Config.MaxMessageBytes: with both set alike, both accept a message at the limit and refuse
// one a byte over (TX005, ErrMessageTooLarge), above and below the default, one message and
// a batch; the error names the limit. A setting out of range is refused naming it (22023).
func TestSQLMaxMessageBytesSetting(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	full := outbox.Message{Subject: "s.v", Key: "order-1", BizKey: "order:1:created", Headers: map[string][]string{"traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}}
	for _, limit := range []int{4096, 2 << 20, outbox.MaxMessageBytesLimit} {
		c := newClient(t, db, &outbox.Config{MaxMessageBytes: limit})
		for _, tc := range []struct {
			m    outbox.Message
			want string
		}{
			{payloadFor(full, limit), "ok"},
			{payloadFor(full, limit+1), "TX005"},
		} {
			run := func(name string, call func(tx pgx.Tx) error) string {
				tx, err := db.Pool.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = tx.Rollback(ctx) }()
				if name != "EnqueueTx" {
					if _, err := tx.Exec(ctx, fmt.Sprintf("SET LOCAL txoutbox.max_message_bytes = %d", limit)); err != nil {
						t.Fatal(err)
					}
				}
				err = call(tx)
				var pgErr *pgconn.PgError
				if tc.want == "TX005" && errors.As(err, &pgErr) && !strings.Contains(pgErr.Message, fmt.Sprintf("over the limit of %d bytes", limit)) {
					t.Errorf("limit %d: %s: %q does not name the limit", limit, name, pgErr.Message)
				}
				if name == "EnqueueTx" {
					return goOutcome(err)
				}
				return sqlOutcome(err)
			}
			g := run("EnqueueTx", func(tx pgx.Tx) error { _, err := c.EnqueueTx(ctx, tx, tc.m); return err })
			one := run("txoutbox_enqueue", func(tx pgx.Tx) error { _, err := enqueueSQL(ctx, tx, tc.m); return err })
			many := run("txoutbox_enqueue_many", func(tx pgx.Tx) error {
				_, err := enqueueManySQL(ctx, tx, []outbox.Message{{Subject: "s.v"}, tc.m})
				return err
			})
			if g != tc.want || one != tc.want || many != tc.want {
				t.Errorf("limit %d, message of %d bytes: EnqueueTx %s, txoutbox_enqueue %s, txoutbox_enqueue_many %s; want %s for all",
					limit, len(tc.m.Payload)+outbox.HeaderBlockSize(&tc.m), g, one, many, tc.want)
			}
		}
	}
	for _, bad := range []string{"abc", "1023", "33553375", "99999999999", "-5", "1 MiB"} {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SELECT set_config('txoutbox.max_message_bytes', $1, true)", bad); err != nil {
			t.Fatal(err)
		}
		_, err = enqueueSQL(ctx, tx, outbox.Message{Subject: "s.v"})
		_ = tx.Rollback(ctx)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "22023" || !strings.Contains(pgErr.Message, "txoutbox.max_message_bytes") {
			t.Errorf("txoutbox.max_message_bytes = %q: %v; want 22023 naming the setting", bad, err)
		}
	}
}

// Arrays numbered from another index than 1 ('[0:1]={k1,k2}', what a PL/pgSQL producer
// filling s[i] from 0 passes) are taken by position (migration 010): each message is stored
// with its own key's partition and those keys are locked, as EnqueueTx of the same messages
// does, and a refused message is named by its position from 1 with its own code. Migration 9
// paired unnest's positions with subscripts: k1 was stored with k2's hash, and a bad subject
// at [0] was an internal error (XX000).
func TestSQLArraysNumberedFrom0(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	msgs := []outbox.Message{
		{Subject: "a.b", Key: "k1", BizKey: "b:1", Payload: []byte("p"), Headers: map[string][]string{"traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}},
		{Subject: "a.c", Key: "k2", Payload: []byte("q"), Headers: map[string][]string{"X": {"1", "2"}}},
		{Subject: "a.d", Payload: []byte("r"), ID: uuid.Must(uuid.NewV7())}, // unkeyed: its partition comes from its id
	}
	stored := func(tx pgx.Tx) string {
		t.Helper()
		rows, err := tx.Query(ctx, `SELECT concat_ws(' ', subject, msg_key, partition_key, txoutbox_key_hash(coalesce(msg_key, message_id::text)), headers::text, encode(payload, 'escape'))
FROM txoutbox_messages ORDER BY id`)
		if err != nil {
			t.Fatal(err)
		}
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return strings.Join(out, "\n")
	}
	tx := beginTx(t, db)
	if _, err := c.EnqueueTx(ctx, tx, msgs...); err != nil {
		t.Fatal(err)
	}
	wantRows, wantLocks := stored(tx), keyLocksHeld(t, ctx, tx)
	_ = tx.Rollback(ctx)
	for _, lower := range []int{1, 0} {
		tx := beginTx(t, db)
		if _, err := enqueueManySQLFrom(ctx, tx, msgs, false, lower); err != nil {
			t.Fatalf("arrays from %d: %v", lower, err)
		}
		if got := stored(tx); got != wantRows {
			t.Errorf("arrays from %d: stored\n%s\nwant (EnqueueTx)\n%s", lower, got, wantRows)
		}
		if got := keyLocksHeld(t, ctx, tx); got != wantLocks {
			t.Errorf("arrays from %d: key locks %s, want (EnqueueTx) %s", lower, got, wantLocks)
		}
		_ = tx.Rollback(ctx)
	}
	// The auditor's statements, as psql runs them.
	tx = beginTx(t, db)
	var hashes []bool
	if _, err := tx.Exec(ctx, `SELECT txoutbox_enqueue_many('{a,b}', '{x,y}', keys => '[0:1]={k1,k2}')`); err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(ctx, `SELECT array_agg(partition_key = txoutbox_key_hash(msg_key) ORDER BY id) FROM txoutbox_messages`).Scan(&hashes); err != nil || fmt.Sprint(hashes) != "[true true]" {
		t.Errorf("keys => '[0:1]={k1,k2}': partition keys are the keys' hashes: %v, %v", hashes, err)
	}
	_ = tx.Rollback(ctx)
	for _, tc := range []struct{ call, code, msg string }{
		{`SELECT txoutbox_enqueue_many('[0:1]={"a b",c}', '{x,y}')`, "TX001", "txoutbox_enqueue_many: message 1: subject: invalid subject"},
		{`SELECT txoutbox_enqueue_many('{a,b}', '[5:6]={x,y}', keys => '[0:1]={k1," k2"}')`, "TX002", "txoutbox_enqueue_many: message 2: key: invalid key"},
		{`SELECT txoutbox_enqueue_many('{a,b}', '{x,y}', headers => '[-1:0]={"{}","{\"Status\": [\"1\"]}"}')`, "TX003", "txoutbox_enqueue_many: message 2: headers: invalid header"},
		{`SELECT txoutbox_enqueue_many('{a,b}', '{x,y}', ids => '[0:1]={a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11,a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}')`, "TX006", "txoutbox_enqueue_many: message 2: id: duplicate message id: message 1 of this call"},
		{`SELECT txoutbox_enqueue_many('{a,b}', '{x,y}', deliver_ats => '[0:1]={NULL,"10000-01-01 00:00:00+00"}')`, "TX009", "txoutbox_enqueue_many: message 2: deliver_at: invalid delivery time"},
	} {
		tx := beginTx(t, db)
		_, err := tx.Exec(ctx, tc.call)
		_ = tx.Rollback(ctx)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != tc.code || !strings.HasPrefix(pgErr.Message, tc.msg) {
			t.Errorf("%s: %v; want %s %q", tc.call, err, tc.code, tc.msg)
		}
	}
}

// Headers that are JSON null ('null'::jsonb: psycopg's Jsonb(None), JSON.stringify(null)) are
// no headers in every function taking headers, as SQL NULL and {} are (migration 010): they
// were refused with TX003. The agreement table has rows of them for txoutbox_enqueue and
// txoutbox_enqueue_many; here txoutbox_prepare, and an element of txoutbox_enqueue_many's
// headers among others.
func TestSQLHeadersJSONNullAreNone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	tx := beginTx(t, db)
	for _, call := range []string{
		`SELECT ARRAY[txoutbox_prepare('a.b', 'p', headers => 'null', producer_group => 'g')]`,
		`SELECT ARRAY[txoutbox_prepare('a.b', 'p', headers => 'null', biz_key => 'b:1', fence => true)]`,
		`SELECT ARRAY[txoutbox_enqueue('a.b', 'p', headers => 'null'::jsonb)]`,
		`SELECT txoutbox_enqueue_many('{a.b,a.c,a.d}', '{p,q,r}', headers => ARRAY['null', NULL, '{"X": ["1"]}']::jsonb[])`,
	} {
		var ids []uuid.UUID
		if err := tx.QueryRow(ctx, call).Scan(&ids); err != nil {
			t.Fatalf("%s: %v", call, err)
		}
	}
	var got string
	if err := tx.QueryRow(ctx, `SELECT string_agg(coalesce(headers::text, 'NULL'), ' | ' ORDER BY id) FROM txoutbox_messages`).Scan(&got); err != nil {
		t.Fatal(err)
	}
	if want := `NULL | {"Txoutbox-Biz-Key": ["b:1"]} | NULL | NULL | NULL | {"X": ["1"]}`; got != want {
		t.Fatalf("stored headers %s, want %s", got, want)
	}
}

// txoutbox_partition_keys hashes a batch's shared prefix once and each text's rest after it
// (migration 010): every partition key is still store.KeyHash of the key, or of the id's text
// for a message without one, whatever the keys share — nothing, a prefix with 0 to 7 bytes
// left or more, the whole key, multi-byte characters — and with drawn or given ids.
func TestSQLPartitionKeysOfSharedPrefixes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	batches := [][]outbox.Message{}
	add := func(keys ...string) {
		var ms []outbox.Message
		for i, k := range keys {
			m := outbox.Message{Subject: "a.b", Key: k}
			if i%4 == 3 && k == "" {
				m.ID = uuid.New() // a given id among drawn ones: no shared prefix
			}
			ms = append(ms, m)
		}
		batches = append(batches, ms)
	}
	add("order-1", "order-2", "order-10", "order-100", "order-1000000000", "order-1", "")
	add("k", "k", "k")
	add("x", "ключ🔑", "ключ🔒", "ключ", "é", "e", strings.Repeat("p", 1024), strings.Repeat("p", 1023)+"q")
	add("", "", "", "", "", "", "", "", "")
	add("same-prefix-then-much-longer-0", "same-prefix-then-much-longer-1-and-more-bytes-than-seven", "")
	many := make([]string, 300)
	for i := range many {
		many[i] = fmt.Sprintf("tenant-7/order-%d", i*37)
		if i%5 == 0 {
			many[i] = ""
		}
	}
	add(many...)
	for _, b := range batches {
		tx := beginTx(t, db)
		ids, err := enqueueManySQL(ctx, tx, b)
		if err != nil {
			t.Fatal(err)
		}
		for i, id := range ids {
			var part int32
			if err := tx.QueryRow(ctx, `SELECT partition_key FROM txoutbox_messages WHERE message_id = $1`, id).Scan(&part); err != nil {
				t.Fatal(err)
			}
			want := store.KeyHash(b[i].Key)
			if b[i].Key == "" {
				want = store.KeyHash(id.String())
			}
			if part != want {
				t.Errorf("message %d (key %.40q, id %s): partition %d, want store.KeyHash's %d", i+1, b[i].Key, id, part, want)
			}
		}
		_ = tx.Rollback(ctx)
	}
}

// A traceparent header (name in any case) that is not a W3C trace context is refused by the
// SQL functions as EnqueueTx refuses it (migration 010; the agreement table has the rows):
// TX003, the message named, the value's problem in outbox.ValidateTraceparent's words.
// txoutbox_traceparent_value_ok and txoutbox_traceparent_problem agree with
// ValidateTraceparent on every value here, and txoutbox_prepare refuses as Prepare does.
func TestSQLTraceparentRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	values := []string{
		tp, "01" + tp[2:], "cc" + tp[2:] + "-more", strings.ToUpper(tp), "ff" + tp[2:],
		"00-00000000000000000000000000000000-00f067aa0ba902b7-01", "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
		tp[:54], tp + "-x", tp + "x", "01" + tp[2:] + "x", "", "garbage", tp[:53] + "0g", "0g" + tp[2:],
		"00-4bf92f3577b34da6a3ce929d0e0e473é-00f067aa0ba902b7-01", "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01é",
		// Version 00's flags: 00 to 03 (migration 011); a later version's: any.
		tp[:53] + "00", tp[:53] + "03", tp[:53] + "04", tp[:53] + "0f", tp[:53] + "10", tp[:53] + "ff", tp[:53] + "ff-x",
		"01" + tp[2:53] + "ff", "fe" + tp[2:53] + "04-x",
	}
	for _, v := range values {
		var ok *bool
		var problem *string
		if err := db.Pool.QueryRow(ctx, `SELECT txoutbox_traceparent_value_ok($1), txoutbox_traceparent_problem($1)`, v).Scan(&ok, &problem); err != nil {
			t.Fatal(err)
		}
		goErr := outbox.ValidateTraceparent(v)
		if ok == nil || *ok != (goErr == nil) {
			t.Errorf("%q: txoutbox_traceparent_value_ok %v, ValidateTraceparent %v: they must agree", v, ok, goErr)
		}
		if goErr == nil && problem != nil || goErr != nil && (problem == nil || *problem != goErr.Error()) {
			t.Errorf("%q: txoutbox_traceparent_problem %v, ValidateTraceparent %v: they must agree", v, problem, goErr)
		}
	}
	tx := beginTx(t, db)
	defer func() { _ = tx.Rollback(ctx) }()
	for _, tc := range []struct{ call, want string }{
		{`SELECT txoutbox_enqueue_many('{a.b,a.c,a.d}', '{p,q,r}', headers => ARRAY['{"traceparent": ["` + tp + `"]}', '{"Traceparent": ["00-00000000000000000000000000000000-00f067aa0ba902b7-01"]}', NULL]::jsonb[])`,
			`txoutbox_enqueue_many: message 2: headers: invalid header: traceparent is not a W3C trace context: "Traceparent" "00-00000000000000000000000000000000-00f067aa0ba902b7-01" has an all-zero trace id; the consumer's propagator would drop it`},
		{`SELECT txoutbox_enqueue('a.b', 'p', headers => '{"traceparent": ["` + tp + `"], "TRACEPARENT": ["` + tp + `"]}')`,
			`txoutbox_enqueue: headers: invalid header: traceparent is not a W3C trace context: 2 traceparent values: a message carries one trace context`},
		{`SELECT txoutbox_prepare('a.b', 'p', headers => '{"traceparent": ["` + strings.ToUpper(tp) + `"]}', producer_group => 'g')`,
			`txoutbox_prepare: headers: invalid header: traceparent is not a W3C trace context: "traceparent" "` + strings.ToUpper(tp) + `" has a trace id that is not lower-case hex`},
	} {
		_, err := tx.Exec(ctx, "SAVEPOINT s")
		if err != nil {
			t.Fatal(err)
		}
		_, err = tx.Exec(ctx, tc.call)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "TX003" || !strings.HasPrefix(pgErr.Message, tc.want) {
			t.Errorf("%s: %v; want TX003 %q", tc.call, err, tc.want)
		}
		if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT s"); err != nil {
			t.Fatal(err)
		}
	}
	// Prepare refuses what txoutbox_prepare refuses.
	c := newClient(t, db, nil)
	_, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "a.b", Headers: map[string][]string{"traceparent": {strings.ToUpper(tp)}}}, &outbox.PrepareOptions{Group: "g"})
	if !errors.Is(err, outbox.ErrInvalidTraceparent) || goOutcome(err) != "TX003" {
		t.Errorf("Prepare of an upper-case traceparent: %v; want ErrInvalidTraceparent (TX003)", err)
	}
}
