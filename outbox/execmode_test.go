package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
	"go.opentelemetry.io/otel/propagation"
)

// execModes are pgx's five query exec modes, by the name default_query_exec_mode takes in a
// connection URL. exec and simple_protocol are what PgBouncer's transaction pooling needs
// (no prepared statements): the arguments are sent without their parameter types, so pgx
// must be able to encode each one from its Go type alone.
var execModes = []struct {
	name string
	mode pgx.QueryExecMode
}{
	{"cache_statement", pgx.QueryExecModeCacheStatement},
	{"cache_describe", pgx.QueryExecModeCacheDescribe},
	{"describe_exec", pgx.QueryExecModeDescribeExec},
	{"exec", pgx.QueryExecModeExec},
	{"simple_protocol", pgx.QueryExecModeSimpleProtocol},
}

// execModeConfig is db's pool configuration with default_query_exec_mode=name in its URL, as
// a PgBouncer deployment sets it.
func execModeConfig(t *testing.T, db *testsvc.DB, name string, want pgx.QueryExecMode) *pgxpool.Config {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.DSN + "&default_query_exec_mode=" + name)
	if err != nil {
		t.Fatal(err)
	}
	if got := cfg.ConnConfig.DefaultQueryExecMode; got != want {
		t.Fatalf("default_query_exec_mode=%s parsed as %v, want %v", name, got, want)
	}
	return cfg
}

// producerTx is the producer API inside a transaction, over pgx or database/sql.
type producerTx interface {
	Enqueue(msgs ...outbox.Message) ([]uuid.UUID, error)
	Prepare(m outbox.Message, o *outbox.PrepareOptions) (outbox.Half, error)
	CommitHalf(id uuid.UUID) error // CommitTx
	Rollback(id uuid.UUID) error
	Cancel(id uuid.UUID) error
	Reschedule(id uuid.UUID, at time.Time) error
	CancelBizKey(bizKey string) ([]uuid.UUID, error)
	RescheduleBizKey(bizKey string, at time.Time) ([]uuid.UUID, error)
}

// producerDB is the producer API on a pool.
type producerDB interface {
	// InTx runs f in a transaction and commits it when f succeeds and commit is set.
	InTx(commit bool, f func(producerTx) error) error
	Prepare(m outbox.Message, o *outbox.PrepareOptions) (outbox.Half, error)
	Commit(id uuid.UUID) error
	Rollback(id uuid.UUID) error
	Send(m outbox.Message, o *outbox.PrepareOptions, local outbox.LocalTxFunc) (outbox.Half, outbox.LocalState, error)
	// Ring sends a PostgresDoorbell's notify and returns its error.
	Ring() error
	Identity(schema string) (string, error)
}

type pgxProducer struct {
	ctx  context.Context
	c    *outbox.Client
	pool *pgxpool.Pool
}

type pgxProducerTx struct {
	ctx context.Context
	c   *outbox.Client
	tx  pgx.Tx
}

func (p pgxProducer) InTx(commit bool, f func(producerTx) error) error {
	tx, err := p.pool.Begin(p.ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(p.ctx) }()
	if err := f(pgxProducerTx{p.ctx, p.c, tx}); err != nil || !commit {
		return err
	}
	return tx.Commit(p.ctx)
}
func (p pgxProducer) Prepare(m outbox.Message, o *outbox.PrepareOptions) (outbox.Half, error) {
	return p.c.Prepare(p.ctx, p.pool, m, o)
}
func (p pgxProducer) Commit(id uuid.UUID) error   { return p.c.Commit(p.ctx, p.pool, id) }
func (p pgxProducer) Rollback(id uuid.UUID) error { return p.c.Rollback(p.ctx, p.pool, id) }
func (p pgxProducer) Send(m outbox.Message, o *outbox.PrepareOptions, local outbox.LocalTxFunc) (outbox.Half, outbox.LocalState, error) {
	return p.c.SendInTransaction(p.ctx, p.pool, m, o, local)
}
func (p pgxProducer) Ring() error {
	rec := &execRecorder{DBTX: p.pool}
	d := outbox.NewPostgresDoorbell(rec, "txoutbox_exec_mode_test")
	d.Ring()
	d.Close()
	return rec.result()
}
func (p pgxProducer) Identity(schema string) (string, error) {
	return checker.OutboxIdentity(p.ctx, p.pool, schema)
}

func (t pgxProducerTx) Enqueue(msgs ...outbox.Message) ([]uuid.UUID, error) {
	return t.c.EnqueueTx(t.ctx, t.tx, msgs...)
}
func (t pgxProducerTx) Prepare(m outbox.Message, o *outbox.PrepareOptions) (outbox.Half, error) {
	return t.c.Prepare(t.ctx, t.tx, m, o)
}
func (t pgxProducerTx) CommitHalf(id uuid.UUID) error { return t.c.CommitTx(t.ctx, t.tx, id) }
func (t pgxProducerTx) Rollback(id uuid.UUID) error   { return t.c.Rollback(t.ctx, t.tx, id) }
func (t pgxProducerTx) Cancel(id uuid.UUID) error     { return t.c.CancelTx(t.ctx, t.tx, id) }
func (t pgxProducerTx) Reschedule(id uuid.UUID, at time.Time) error {
	return t.c.RescheduleTx(t.ctx, t.tx, id, at)
}
func (t pgxProducerTx) CancelBizKey(k string) ([]uuid.UUID, error) {
	return t.c.CancelBizKeyTx(t.ctx, t.tx, k)
}
func (t pgxProducerTx) RescheduleBizKey(k string, at time.Time) ([]uuid.UUID, error) {
	return t.c.RescheduleBizKeyTx(t.ctx, t.tx, k, at)
}

// callLog records what the doorbell's statements returned.
type callLog struct {
	mu    sync.Mutex
	calls int
	err   error
}

func (l *callLog) add(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls++
	l.err = errors.Join(l.err, err)
}

func (l *callLog) result() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.calls == 0 {
		return errors.New("the doorbell sent nothing")
	}
	return l.err
}

// execRecorder records what the doorbell's statement returned (pgx).
type execRecorder struct {
	txoutbox.DBTX
	callLog
}

func (r *execRecorder) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	ct, err := r.DBTX.Exec(ctx, sql, args...)
	r.add(err)
	return ct, err
}

type sqlProducer struct {
	ctx context.Context
	c   *outbox.Client
	db  *sql.DB
}

type sqlProducerTx struct {
	ctx context.Context
	c   *outbox.Client
	tx  *sql.Tx
}

func (p sqlProducer) InTx(commit bool, f func(producerTx) error) error {
	tx, err := p.db.BeginTx(p.ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if err := f(sqlProducerTx{p.ctx, p.c, tx}); err != nil || !commit {
		return err
	}
	return tx.Commit()
}
func (p sqlProducer) Prepare(m outbox.Message, o *outbox.PrepareOptions) (outbox.Half, error) {
	return p.c.PrepareSQL(p.ctx, p.db, m, o)
}
func (p sqlProducer) Commit(id uuid.UUID) error   { return p.c.CommitSQL(p.ctx, p.db, id) }
func (p sqlProducer) Rollback(id uuid.UUID) error { return p.c.RollbackSQL(p.ctx, p.db, id) }
func (p sqlProducer) Send(m outbox.Message, o *outbox.PrepareOptions, local outbox.LocalTxFunc) (outbox.Half, outbox.LocalState, error) {
	return p.c.SendInTransactionSQL(p.ctx, p.db, m, o, local)
}
func (p sqlProducer) Ring() error {
	rec := &sqlExecRecorder{SQLDBTX: p.db}
	d := outbox.NewPostgresSQLDoorbell(rec, "txoutbox_exec_mode_test")
	d.Ring()
	d.Close()
	return rec.result()
}
func (p sqlProducer) Identity(schema string) (string, error) {
	return checker.OutboxIdentitySQL(p.ctx, p.db, schema)
}

func (t sqlProducerTx) Enqueue(msgs ...outbox.Message) ([]uuid.UUID, error) {
	return t.c.EnqueueSQLTx(t.ctx, t.tx, msgs...)
}
func (t sqlProducerTx) Prepare(m outbox.Message, o *outbox.PrepareOptions) (outbox.Half, error) {
	return t.c.PrepareSQL(t.ctx, t.tx, m, o)
}
func (t sqlProducerTx) CommitHalf(id uuid.UUID) error { return t.c.CommitSQLTx(t.ctx, t.tx, id) }
func (t sqlProducerTx) Rollback(id uuid.UUID) error   { return t.c.RollbackSQL(t.ctx, t.tx, id) }
func (t sqlProducerTx) Cancel(id uuid.UUID) error     { return t.c.CancelSQLTx(t.ctx, t.tx, id) }
func (t sqlProducerTx) Reschedule(id uuid.UUID, at time.Time) error {
	return t.c.RescheduleSQLTx(t.ctx, t.tx, id, at)
}
func (t sqlProducerTx) CancelBizKey(k string) ([]uuid.UUID, error) {
	return t.c.CancelBizKeySQLTx(t.ctx, t.tx, k)
}
func (t sqlProducerTx) RescheduleBizKey(k string, at time.Time) ([]uuid.UUID, error) {
	return t.c.RescheduleBizKeySQLTx(t.ctx, t.tx, k, at)
}

// sqlExecRecorder is execRecorder for database/sql.
type sqlExecRecorder struct {
	txoutbox.SQLDBTX
	callLog
}

func (r *sqlExecRecorder) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	res, err := r.SQLDBTX.ExecContext(ctx, query, args...)
	r.add(err)
	return res, err
}

// execModeID is the scenario's message id number n: the same in every run, so that the rows
// of the runs can be compared.
func execModeID(n int) uuid.UUID {
	return uuid.NewSHA1(uuid.NameSpaceOID, []byte(fmt.Sprintf("txoutbox.execmode.%d", n)))
}

// Delivery times of the scenario, below the microsecond on purpose: they are stored rounded up
// to the next microsecond in every mode and on both paths.
var (
	execModeAt1 = time.Date(2030, 1, 1, 0, 0, 0, 999_999_999, time.UTC)
	execModeAt2 = time.Date(2031, 6, 15, 12, 30, 45, 123_456_001, time.FixedZone("UTC+5:30", 5*3600+1800))
	execModeAt3 = time.Date(2032, 2, 29, 23, 59, 59, 999_999_500, time.UTC)
	execModeAt4 = outbox.MaxDeliverAt.Add(-time.Nanosecond)
)

// runProducerScenario runs every call of the producer API through p, with the arguments the
// text encodings must get right (quotes, backslashes, braces, commas, the word NULL, every
// byte value, non-ASCII, sub-microsecond times), and the error paths, which run statements of
// their own.
func runProducerScenario(t *testing.T, p producerDB) {
	t.Helper()
	payload := make([]byte, 256)
	for i := range payload {
		payload[i] = byte(i)
	}
	odd := `k"q\b,{c} NULL 'x' $1 -- é`
	msgs := []outbox.Message{
		{ID: execModeID(1), Subject: "orders.created", Key: "order-1", BizKey: "order:1:created", Payload: payload,
			Headers: map[string][]string{"X-Quote": {`he said "hi" \ {x},y`, ""}, "x-quote": {"lower"}, "X-Null": {"NULL"}}},
		{ID: execModeID(2), Subject: "orders.créé", Payload: nil},
		{ID: execModeID(3), Subject: "orders.timeout", Key: "order-1", BizKey: "order:1:timeout", DeliverAt: execModeAt1, Payload: []byte("t1")},
		{ID: execModeID(4), Subject: "orders.timeout", DeliverAt: execModeAt2, Payload: []byte("t2")},
		{ID: execModeID(5), Subject: "orders.odd", Key: odd, BizKey: odd, Payload: []byte(`'; SELECT 1; --`)},
		{ID: execModeID(6), Subject: "orders.odd", Key: "NULL", Payload: []byte{}},
		{ID: execModeID(7), Subject: "orders.timeout", Key: "order-9", BizKey: "order:9:timeout", DeliverAt: execModeAt1},
		{ID: execModeID(8), Subject: "orders.timeout", Key: "order-10", BizKey: "order:10:timeout", DeliverAt: execModeAt1},
		{ID: execModeID(9), Subject: "orders.timeout", BizKey: "order:11:timeout", DeliverAt: execModeAt4},
	}
	// Many keys in the same transaction: past KeyLockBudget, the call locks buckets.
	many := make([]outbox.Message, outbox.KeyLockBudget+44)
	for i := range many {
		many[i] = outbox.Message{ID: execModeID(1000 + i), Subject: "orders.bulk", Key: fmt.Sprintf("bulk-%d", i),
			Headers: map[string][]string{"X-I": {fmt.Sprint(i)}}, Payload: []byte(fmt.Sprint(i))}
	}
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	mustIDs := func(what string, got []uuid.UUID, err error, want ...uuid.UUID) {
		t.Helper()
		must(what, err)
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("%s returned %v, want %v", what, got, want)
		}
	}
	wantErr := func(what string, err, target error) {
		t.Helper()
		if !errors.Is(err, target) {
			t.Fatalf("%s: %v, want %v", what, err, target)
		}
	}

	must("enqueue", p.InTx(true, func(tx producerTx) error {
		ids, err := tx.Enqueue(msgs...)
		mustIDs("EnqueueTx", ids, err, execModeID(1), execModeID(2), execModeID(3), execModeID(4), execModeID(5),
			execModeID(6), execModeID(7), execModeID(8), execModeID(9))
		if _, err := tx.Enqueue(many...); err != nil {
			return fmt.Errorf("EnqueueTx of %d keys: %w", len(many), err)
		}
		return nil
	}))
	must("enqueue one", p.InTx(true, func(tx producerTx) error {
		ids, err := tx.Enqueue(outbox.Message{ID: execModeID(10), Subject: "orders.paid", Key: "order-1", Payload: []byte("paid")})
		mustIDs("EnqueueTx", ids, err, execModeID(10))
		return nil
	}))
	must("duplicate id", p.InTx(false, func(tx producerTx) error {
		_, err := tx.Enqueue(outbox.Message{ID: execModeID(1), Subject: "orders.created", Key: "order-1"})
		var me *outbox.MessageError
		if !errors.Is(err, outbox.ErrDuplicateID) || !errors.As(err, &me) || me.Index != 0 {
			t.Fatalf("EnqueueTx of an id already stored: %v, want a *MessageError of message 0 wrapping ErrDuplicateID", err)
		}
		return nil
	}))

	// Half messages.
	h1, err := p.Prepare(outbox.Message{ID: execModeID(20), Subject: "payments.done", Key: "order-2", Payload: []byte("h1")},
		&outbox.PrepareOptions{Group: "payments", CheckImmunity: 90 * time.Second})
	must("Prepare", err)
	must("Commit", p.Commit(h1.ID))
	wantErr("Commit again", p.Commit(h1.ID), outbox.ErrAlreadyCommitted)
	wantErr("Commit of no message", p.Commit(execModeID(99)), outbox.ErrNotFound)
	h2, err := p.Prepare(outbox.Message{ID: execModeID(21), Subject: "payments.timeout", Key: "order-3", BizKey: "order:3:timeout",
		DeliverAt: execModeAt2}, &outbox.PrepareOptions{Fence: true})
	must("Prepare with DeliverAt", err)
	must("CommitTx", p.InTx(true, func(tx producerTx) error { return tx.CommitHalf(h2.ID) }))
	h3, err := p.Prepare(outbox.Message{ID: execModeID(22), Subject: "payments.done", Key: odd}, &outbox.PrepareOptions{Group: "payments"})
	must("Prepare", err)
	must("Rollback", p.Rollback(h3.ID))
	wantErr("Rollback again", p.Rollback(h3.ID), outbox.ErrRolledBack)
	must("Prepare and Rollback in a transaction", p.InTx(true, func(tx producerTx) error {
		h, err := tx.Prepare(outbox.Message{ID: execModeID(23), Subject: "payments.done"}, &outbox.PrepareOptions{Fence: true})
		if err != nil {
			return err
		}
		return tx.Rollback(h.ID)
	}))
	for i, st := range []outbox.LocalState{outbox.StateCommit, outbox.StateRollback, outbox.StateUnknown} {
		_, got, err := p.Send(outbox.Message{ID: execModeID(30 + i), Subject: "payments.sent", Key: "order-4"},
			&outbox.PrepareOptions{Group: "payments", CheckImmunity: 90 * time.Second},
			func(context.Context, outbox.Half) (outbox.LocalState, error) { return st, nil })
		must("SendInTransaction "+st.String(), err)
		if got != st {
			t.Fatalf("SendInTransaction answered %v, want %v", got, st)
		}
	}

	// Delayed messages.
	must("cancel and reschedule", p.InTx(true, func(tx producerTx) error {
		must("RescheduleTx", tx.Reschedule(execModeID(4), execModeAt3))
		must("CancelTx", tx.Cancel(execModeID(3)))
		wantErr("CancelTx of a cancelled message", tx.Cancel(execModeID(3)), outbox.ErrNotScheduled)
		wantErr("RescheduleTx of a ready message", tx.Reschedule(execModeID(1), execModeAt3), outbox.ErrNotScheduled)
		wantErr("CancelTx of no message", tx.Cancel(execModeID(99)), outbox.ErrNotFound)
		ids, err := tx.CancelBizKey("order:9:timeout")
		mustIDs("CancelBizKeyTx", ids, err, execModeID(7))
		ids, err = tx.RescheduleBizKey("order:10:timeout", execModeAt2)
		mustIDs("RescheduleBizKeyTx", ids, err, execModeID(8))
		ids, err = tx.RescheduleBizKey(odd, execModeAt2)
		wantErr("RescheduleBizKeyTx of a ready message's key", err, outbox.ErrNotScheduled)
		if len(ids) != 0 || errors.Is(err, outbox.ErrNotFound) {
			t.Fatalf("RescheduleBizKeyTx of a ready message's key: %v %v, want ErrNotScheduled alone", ids, err)
		}
		_, err = tx.CancelBizKey("order:12:timeout")
		wantErr("CancelBizKeyTx of no message", err, outbox.ErrNotFound)
		return nil
	}))

	must("PostgresDoorbell", p.Ring())
}

// storedRows returns every row of the schema's outbox as text, the time columns that vary
// between runs as what they say about the row.
func storedRows(t *testing.T, db *testsvc.DB) []string {
	t.Helper()
	rows, err := db.Pool.Query(context.Background(), `SELECT concat_ws(' | ', id, message_id, subject, coalesce(msg_key, '<null>'),
    partition_key, coalesce(headers::text, '<null>'), encode(payload, 'hex'), state, attempts,
    coalesce(to_char(deliver_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US'), '<null>'),
    coalesce(producer_group, '<null>'), coalesce(check_mode, '<null>'), check_count,
    coalesce((next_check_at - created_at)::text, '<null>'), coalesce(settled_by, '<null>'),
    ready_at IS NULL, settled_at IS NULL, last_error IS NULL, published_at IS NULL)
FROM txoutbox_messages ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestProducerAPIEveryExecMode runs the whole producer API — EnqueueTx (keyed, unkeyed,
// delayed, past the key lock budget, with headers), Prepare, Commit, CommitTx, Rollback,
// SendInTransaction, CancelTx, RescheduleTx, CancelBizKeyTx, RescheduleBizKeyTx, their error
// paths, NewPostgresDoorbell and checker.OutboxIdentity — on pools in each of pgx's five query
// exec modes (set as PgBouncer's transaction pooling needs them, default_query_exec_mode in
// the URL), and their database/sql twins on pgx's stdlib driver in each mode, each run in a
// schema of its own: every call succeeds and the rows stored are the same in every run.
func TestProducerAPIEveryExecMode(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	type run struct {
		name string
		rows []string
	}
	var runs []run
	for _, path := range []string{"pgx", "database_sql"} {
		for _, m := range execModes {
			name := path + "/" + m.name
			t.Run(name, func(t *testing.T) {
				db := testsvc.NewDB(t)
				c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema, Propagator: propagation.NewCompositeTextMapPropagator()})
				if err != nil {
					t.Fatal(err)
				}
				cfg := execModeConfig(t, db, m.name, m.mode)
				var p producerDB
				if path == "pgx" {
					pool, err := pgxpool.NewWithConfig(ctx, cfg)
					if err != nil {
						t.Fatal(err)
					}
					defer pool.Close()
					p = pgxProducer{ctx, c, pool}
				} else {
					sdb := stdlib.OpenDB(*cfg.ConnConfig)
					defer func() { _ = sdb.Close() }()
					p = sqlProducer{ctx, c, sdb}
				}
				runProducerScenario(t, p)
				got, err := p.Identity(db.Schema)
				if err != nil {
					t.Fatalf("OutboxIdentity: %v", err)
				}
				if want, err := checker.OutboxIdentity(ctx, db.Pool, db.Schema); err != nil || got != want {
					t.Fatalf("OutboxIdentity = %q, want %q (%v)", got, want, err)
				}
				runs = append(runs, run{name, storedRows(t, db)})
			})
		}
	}
	if t.Failed() || len(runs) == 0 {
		return
	}
	first := runs[0]
	if len(first.rows) < outbox.KeyLockBudget {
		t.Fatalf("%s stored %d rows, want the scenario's", first.name, len(first.rows))
	}
	var notBulk []string
	for _, r := range first.rows {
		if !strings.Contains(r, " | orders.bulk | ") {
			notBulk = append(notBulk, r)
		}
	}
	for _, want := range []string{
		" | 2030-01-01T00:00:01.000000 | ",                 // execModeAt1, rounded up
		" | 2032-03-01T00:00:00.000000 | ",                 // execModeAt3, rescheduled, rounded up
		" | 9999-12-31T23:59:59.000000 | ",                 // execModeAt4, rounded up to MaxDeliverAt
		" | 2031-06-15T07:00:45.123457 | ",                 // execModeAt2 in UTC, rounded up
		" | payments | checker | 0 | 00:01:30 | <null> | ", // the prepared one's CheckImmunity
	} {
		if !strings.Contains(strings.Join(first.rows, "\n"), want) {
			t.Errorf("%s stored no row with %q; the rows but orders.bulk's:\n%s", first.name, want, strings.Join(notBulk, "\n"))
		}
	}
	for _, r := range runs[1:] {
		if len(r.rows) != len(first.rows) {
			t.Errorf("%s stored %d rows, %s %d", r.name, len(r.rows), first.name, len(first.rows))
			continue
		}
		for i := range r.rows {
			if r.rows[i] != first.rows[i] {
				t.Errorf("%s stored, at row %d:\n  %s\n%s stored:\n  %s", r.name, i, r.rows[i], first.name, first.rows[i])
				break
			}
		}
	}
}
