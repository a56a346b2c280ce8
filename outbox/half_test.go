package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

type halfRow struct {
	id         int64
	state      string
	group      *string
	mode       *string
	settledBy  *string
	checkDue   *time.Time
	checkCount int
}

func readHalf(t *testing.T, db *testsvc.DB, id uuid.UUID) halfRow {
	t.Helper()
	var r halfRow
	err := db.Pool.QueryRow(context.Background(), `SELECT id, state, producer_group, check_mode, settled_by, next_check_at, check_count
		FROM txoutbox_messages WHERE message_id = $1`, id).Scan(&r.id, &r.state, &r.group, &r.mode, &r.settledBy, &r.checkDue, &r.checkCount)
	if err != nil {
		t.Fatalf("read %s: %v", id, err)
	}
	return r
}

func TestPrepareValidation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	ok := outbox.Message{Subject: "orders.created", Payload: []byte("x")}
	cases := []struct {
		name string
		msg  outbox.Message
		opts *outbox.PrepareOptions
		want error
	}{
		{"nil options: no group", ok, nil, outbox.ErrInvalidGroup},
		{"empty group without fence", ok, &outbox.PrepareOptions{}, outbox.ErrInvalidGroup},
		{"group with a dot", ok, &outbox.PrepareOptions{Group: "orders.svc"}, outbox.ErrInvalidGroup},
		{"group with a space", ok, &outbox.PrepareOptions{Group: "orders svc"}, outbox.ErrInvalidGroup},
		{"negative check immunity", ok, &outbox.PrepareOptions{Group: "orders", CheckImmunity: -1}, txoutbox.ErrInvalidConfig},
		{"check immunity below -1", ok, &outbox.PrepareOptions{Fence: true, CheckImmunity: -time.Second}, txoutbox.ErrInvalidConfig},
		{"bad subject", outbox.Message{Subject: "orders.*"}, &outbox.PrepareOptions{Group: "orders"}, outbox.ErrInvalidSubject},
		{"bad header", outbox.Message{Subject: "a.b", Headers: map[string][]string{"Nats-Msg-Id": {"x"}}}, &outbox.PrepareOptions{Fence: true}, outbox.ErrInvalidHeader},
	}
	for _, tc := range cases {
		_, err := c.Prepare(ctx, db.Pool, tc.msg, tc.opts)
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: got %v, want %v", tc.name, err, tc.want)
		}
	}
	if n := count(t, db, "true"); n != 0 {
		t.Fatalf("%d rows written by invalid prepares", n)
	}
	// A duplicate id is refused.
	id := uuid.New()
	if _, err := c.Prepare(ctx, db.Pool, outbox.Message{ID: id, Subject: "a.b"}, &outbox.PrepareOptions{Group: "g"}); err != nil {
		t.Fatal(err)
	}
	// A duplicate id is a bad message like any other: a *MessageError naming it.
	_, err := c.Prepare(ctx, db.Pool, outbox.Message{ID: id, Subject: "a.b"}, &outbox.PrepareOptions{Group: "g"})
	var me *outbox.MessageError
	if !errors.Is(err, outbox.ErrDuplicateID) || !errors.As(err, &me) || me.Index != 0 || me.ID != id || me.Subject != "a.b" || !strings.Contains(me.Detail, "already in the outbox (") || !strings.Contains(me.Detail, "23505") {
		t.Fatalf("duplicate prepare: got %#v, want a *MessageError of message 0 (id %s, subject a.b) wrapping ErrDuplicateID, its detail keeping the server's error", err, id)
	}
}

func TestHalfCommitAndRollbackSentinels(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)

	h, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created", Key: "o1", Payload: []byte("x")},
		&outbox.PrepareOptions{Group: "orders", CheckImmunity: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	r := readHalf(t, db, h.ID)
	if r.state != "prepared" || *r.group != "orders" || *r.mode != "checker" || r.checkDue == nil || time.Until(*r.checkDue) < 59*time.Minute {
		t.Fatalf("prepared row: %+v (next check in %v)", r, time.Until(*r.checkDue))
	}
	// A message of the same key committed after the prepare gets a later id...
	var later []uuid.UUID
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		later, err = c.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.paid", Key: "o1"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	laterID := readHalf(t, db, later[0]).id
	if r.id > laterID {
		t.Fatalf("prepare id %d should be older than %d", r.id, laterID)
	}
	// ...and committing the half message redraws its id after it: commit order is id order.
	if err := c.Commit(ctx, db.Pool, h.ID); err != nil {
		t.Fatal(err)
	}
	r2 := readHalf(t, db, h.ID)
	if r2.state != "ready" || r2.id <= laterID || *r2.settledBy != "producer" || r2.checkDue != nil {
		t.Fatalf("committed row: %+v, want ready with an id above %d", r2, laterID)
	}

	var se *outbox.SettleError
	err = c.Commit(ctx, db.Pool, h.ID)
	if !errors.Is(err, outbox.ErrAlreadyCommitted) || !errors.As(err, &se) || se.State != "ready" || se.ID != h.ID {
		t.Fatalf("second commit: %v", err)
	}
	if err := c.Rollback(ctx, db.Pool, h.ID); !errors.Is(err, outbox.ErrAlreadyCommitted) {
		t.Fatalf("rollback of a committed message: %v", err)
	}

	h2, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created"}, &outbox.PrepareOptions{Group: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Rollback(ctx, db.Pool, h2.ID); err != nil {
		t.Fatal(err)
	}
	if st := readHalf(t, db, h2.ID).state; st != "rolled_back" {
		t.Fatalf("state %s, want rolled_back", st)
	}
	if err := c.Commit(ctx, db.Pool, h2.ID); !errors.Is(err, outbox.ErrRolledBack) || !errors.As(err, &se) || se.State != "rolled_back" {
		t.Fatalf("commit after rollback: %v", err)
	}
	if err := c.Rollback(ctx, db.Pool, h2.ID); !errors.Is(err, outbox.ErrRolledBack) {
		t.Fatalf("second rollback: %v", err)
	}
	if err := c.Commit(ctx, db.Pool, uuid.New()); !errors.Is(err, outbox.ErrNotFound) {
		t.Fatalf("commit of an unknown id: %v", err)
	}
	if err := c.Rollback(ctx, db.Pool, uuid.New()); !errors.Is(err, outbox.ErrNotFound) {
		t.Fatalf("rollback of an unknown id: %v", err)
	}

	// A message the check-back gave up on can still be settled by its producer.
	h3, _ := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created"}, &outbox.PrepareOptions{Group: "orders"})
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'check_exhausted' WHERE message_id = $1`, h3.ID); err != nil {
		t.Fatal(err)
	}
	if err := c.Commit(ctx, db.Pool, h3.ID); err != nil {
		t.Fatalf("commit of a check_exhausted message: %v", err)
	}
}

func TestCommitTxLosingToRollbackFailsTheTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE orders (id int PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	h, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created"}, &outbox.PrepareOptions{Fence: true})
	if err != nil {
		t.Fatal(err)
	}
	// The check-back (or anyone) rolled it back first.
	if err := c.Rollback(ctx, db.Pool, h.ID); err != nil {
		t.Fatal(err)
	}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO orders VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	if err := c.CommitTx(ctx, tx, h.ID); !errors.Is(err, outbox.ErrRolledBack) {
		t.Fatalf("CommitTx: %v, want ErrRolledBack", err)
	}
	// A caller that ignores the error still cannot commit the business change.
	if err := tx.Commit(ctx); !errors.Is(err, pgx.ErrTxCommitRollback) {
		t.Fatalf("tx.Commit after a failed CommitTx: %v, want pgx.ErrTxCommitRollback", err)
	}
	var n int
	_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&n)
	if n != 0 {
		t.Fatal("the business row committed although its message was rolled back")
	}

	// CommitTx of an unknown id fails the transaction too; a repeated CommitTx does not.
	tx, _ = db.Pool.Begin(ctx)
	if err := c.CommitTx(ctx, tx, uuid.New()); !errors.Is(err, outbox.ErrNotFound) {
		t.Fatalf("CommitTx of an unknown id: %v", err)
	}
	if err := tx.Commit(ctx); !errors.Is(err, pgx.ErrTxCommitRollback) {
		t.Fatalf("tx.Commit: %v", err)
	}
	h2, _ := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created"}, &outbox.PrepareOptions{Fence: true})
	tx, _ = db.Pool.Begin(ctx)
	if err := c.CommitTx(ctx, tx, h2.ID); err != nil {
		t.Fatal(err)
	}
	if err := c.CommitTx(ctx, tx, h2.ID); !errors.Is(err, outbox.ErrAlreadyCommitted) {
		t.Fatalf("second CommitTx: %v", err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO orders VALUES (2)`); err != nil {
		t.Fatalf("tx unusable after ErrAlreadyCommitted: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if st := readHalf(t, db, h2.ID).state; st != "ready" {
		t.Fatalf("state %s, want ready", st)
	}
}

// CommitTx takes a txoutbox.DBTX, as the other …Tx methods do: a connection inside a BEGIN of
// its own works as a pgx.Tx does, both when the commit wins (the message is ready once the
// transaction commits) and when it loses (the transaction fails and the business row is gone).
func TestCommitTxTakesAConnectionInATransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE orders (id int PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var dbtx txoutbox.DBTX = conn // *pgxpool.Conn: a DBTX, not a pgx.Tx

	h, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created"}, &outbox.PrepareOptions{Fence: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dbtx.Exec(ctx, `BEGIN`); err != nil {
		t.Fatal(err)
	}
	if _, err := dbtx.Exec(ctx, `INSERT INTO orders VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	if err := c.CommitTx(ctx, dbtx, h.ID); err != nil {
		t.Fatalf("CommitTx on a connection in a transaction: %v", err)
	}
	if st := readHalf(t, db, h.ID).state; st != "prepared" {
		t.Fatalf("state %s before the transaction commits, want prepared (seen from outside)", st)
	}
	if tag, err := dbtx.Exec(ctx, `COMMIT`); err != nil || tag.String() != "COMMIT" {
		t.Fatalf("COMMIT: %v %v", tag, err)
	}
	if st := readHalf(t, db, h.ID).state; st != "ready" {
		t.Fatalf("state %s after the transaction committed, want ready", st)
	}

	h2, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created"}, &outbox.PrepareOptions{Fence: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Rollback(ctx, db.Pool, h2.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := dbtx.Exec(ctx, `BEGIN`); err != nil {
		t.Fatal(err)
	}
	if _, err := dbtx.Exec(ctx, `INSERT INTO orders VALUES (2)`); err != nil {
		t.Fatal(err)
	}
	if err := c.CommitTx(ctx, dbtx, h2.ID); !errors.Is(err, outbox.ErrRolledBack) {
		t.Fatalf("CommitTx of a rolled back message: %v, want ErrRolledBack", err)
	}
	// The server ends a failed transaction's COMMIT as a ROLLBACK.
	if tag, err := dbtx.Exec(ctx, `COMMIT`); err != nil || tag.String() != "ROLLBACK" {
		t.Fatalf("COMMIT after a failed CommitTx: %v %v, want ROLLBACK", tag, err)
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM orders WHERE id = 2`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("business row of the rolled back message: %d rows (%v), want none", n, err)
	}
}

// A half message committed while another transaction holds its key waits for it, then takes
// an id after it: for one key, id order is commit order.
func TestCommitWaitsForItsKeyAndDrawsALaterID(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	h, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created", Key: "k1"}, &outbox.PrepareOptions{Group: "g"})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := c.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.paid", Key: "k1"})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Commit(ctx, db.Pool, h.ID) }()
	// The commit waits on the key's advisory lock.
	class, key := store.New(db.Schema).KeyLockClass, store.KeyHash("k1")
	testsvc.Eventually(t, 10*time.Second, "the commit to wait on the key lock", func() bool {
		var n int
		_ = db.AdminPool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
			AND classid = $1::int8::oid AND objid = $2::int8::oid AND objsubid = 2`, class, key).Scan(&n)
		return n > 0
	})
	select {
	case err := <-done:
		t.Fatalf("commit returned while the key was held: %v", err)
	default:
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if a, b := readHalf(t, db, ids[0]).id, readHalf(t, db, h.ID).id; b <= a {
		t.Fatalf("half message id %d, want above %d (committed later)", b, a)
	}
}

func TestSendInTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	reg := prometheus.NewRegistry()
	c := newClient(t, db, &outbox.Config{Registerer: reg})
	// A second client on the same registry shares the counters.
	c2 := newClient(t, db, &outbox.Config{Registerer: reg})
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE orders (id int PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	msg := outbox.Message{Subject: "orders.created"}
	group := &outbox.PrepareOptions{Group: "orders"}
	boom := errors.New("boom")

	h, st, err := c.SendInTransaction(ctx, db.Pool, msg, group, func(ctx context.Context, h outbox.Half) (outbox.LocalState, error) {
		if readHalf(t, db, h.ID).state != "prepared" {
			t.Error("the message is not prepared while the local transaction runs")
		}
		return outbox.StateCommit, nil
	})
	if err != nil || st != outbox.StateCommit || readHalf(t, db, h.ID).state != "ready" {
		t.Fatalf("commit: %v %v %s", err, st, readHalf(t, db, h.ID).state)
	}
	h, _, err = c2.SendInTransaction(ctx, db.Pool, msg, group, func(context.Context, outbox.Half) (outbox.LocalState, error) {
		return outbox.StateRollback, nil
	})
	if err != nil || readHalf(t, db, h.ID).state != "rolled_back" {
		t.Fatalf("rollback: %v %s", err, readHalf(t, db, h.ID).state)
	}
	h, st, err = c.SendInTransaction(ctx, db.Pool, msg, group, func(context.Context, outbox.Half) (outbox.LocalState, error) {
		return outbox.StateUnknown, nil
	})
	if err != nil || st != outbox.StateUnknown || readHalf(t, db, h.ID).state != "prepared" {
		t.Fatalf("unknown: %v %s", err, readHalf(t, db, h.ID).state)
	}
	// An error without an answer leaves the message to the check-back, as RocketMQ does.
	h, _, err = c.SendInTransaction(ctx, db.Pool, msg, group, func(context.Context, outbox.Half) (outbox.LocalState, error) {
		return 0, boom
	})
	if !errors.Is(err, boom) || readHalf(t, db, h.ID).state != "prepared" {
		t.Fatalf("error: %v %s", err, readHalf(t, db, h.ID).state)
	}
	// Same-database work settles with CommitTx inside its own transaction, then answers COMMIT.
	h, _, err = c.SendInTransaction(ctx, db.Pool, msg, &outbox.PrepareOptions{Fence: true}, func(ctx context.Context, h outbox.Half) (outbox.LocalState, error) {
		return outbox.StateCommit, pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO orders VALUES (1)`); err != nil {
				return err
			}
			return c.CommitTx(ctx, tx, h.ID)
		})
	})
	if err != nil || readHalf(t, db, h.ID).state != "ready" {
		t.Fatalf("fence + CommitTx: %v %s", err, readHalf(t, db, h.ID).state)
	}

	got := map[string]float64{}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		got[mf.GetName()] = mf.GetMetric()[0].GetCounter().GetValue()
	}
	if got["txoutbox_outbox_half_prepared_total"] != 5 || got["txoutbox_outbox_half_committed_total"] != 2 || got["txoutbox_outbox_half_rolled_back_total"] != 1 {
		t.Fatalf("counters: %v", got)
	}
}

// A CommitTx whose context is already done cannot settle the message; it must still make the
// business transaction fail, or a caller committing with another context would commit the
// business change while the message stays prepared (and gets fenced).
func TestCommitTxOnADoneContextFailsTheTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE orders (id int PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	h, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created"}, &outbox.PrepareOptions{Fence: true})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO orders VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	done, cancel := context.WithCancel(ctx)
	cancel()
	if err := c.CommitTx(done, tx, h.ID); err == nil {
		t.Fatal("CommitTx on a cancelled context succeeded")
	}
	if err := tx.Commit(ctx); !errors.Is(err, pgx.ErrTxCommitRollback) {
		t.Fatalf("tx.Commit after a failed CommitTx: %v, want pgx.ErrTxCommitRollback", err)
	}
	var n int
	_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&n)
	var st string
	_ = db.Pool.QueryRow(ctx, `SELECT state FROM txoutbox_messages WHERE message_id = $1`, h.ID).Scan(&st)
	if n != 0 || st != "prepared" {
		t.Fatalf("business rows %d, message %s: want 0 and prepared", n, st)
	}
}
