package outbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// The SQL contract's delayed messages: txoutbox_enqueue, txoutbox_prepare (then
// txoutbox_commit) with a delivery time store scheduled rows; txoutbox_cancel,
// txoutbox_reschedule and their business key forms behave as CancelTx and RescheduleTx, with
// TX201 where those return ErrNotScheduled and TX202 where the message does not exist.
func TestSQLScheduledFunctions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	due := time.Date(2031, 5, 1, 12, 0, 0, 0, time.UTC)
	exec := func(sql string, args ...any) string {
		t.Helper()
		_, err := db.Pool.Exec(ctx, sql, args...)
		return sqlOutcome(err)
	}
	var id, other uuid.UUID
	if err := db.Pool.QueryRow(ctx, `SELECT txoutbox_enqueue('orders.timeout', 'x', 'k', NULL, 'order:1:timeout', NULL, $1)`, due).Scan(&id); err != nil {
		t.Fatal(err)
	}
	if err := db.Pool.QueryRow(ctx, `SELECT txoutbox_enqueue('orders.remind', 'x', 'k', NULL, 'order:1:remind', deliver_at => $1)`, due).Scan(&other); err != nil {
		t.Fatal(err)
	}
	if st, at := state(t, db, id); st != "scheduled" || at == nil || !at.Equal(due) {
		t.Fatalf("txoutbox_enqueue with deliver_at: %q at %v", st, at)
	}
	later := due.Add(time.Hour)
	if got := exec(`SELECT txoutbox_reschedule($1, $2)`, id, later); got != "ok" {
		t.Fatalf("txoutbox_reschedule: %s", got)
	}
	if _, at := state(t, db, id); at == nil || !at.Equal(later) {
		t.Fatalf("rescheduled to %v, want %v", at, later)
	}
	if got := exec(`SELECT txoutbox_reschedule($1, '10000-01-01')`, id); got != "TX009" {
		t.Fatalf("txoutbox_reschedule to year 10000: %s, want TX009", got)
	}
	// Cancelled in a transaction that rolls back: still scheduled; that commits: withdrawn.
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT txoutbox_cancel($1)`, id); err != nil {
			return err
		}
		return tx.Rollback(ctx)
	})
	if err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		t.Fatal(err)
	}
	if st, _ := state(t, db, id); st != "scheduled" {
		t.Fatalf("after a rolled back txoutbox_cancel: %q", st)
	}
	if got := exec(`SELECT txoutbox_cancel($1)`, id); got != "ok" {
		t.Fatalf("txoutbox_cancel: %s", got)
	}
	// A message that is not scheduled is TX201 with its state in DETAIL; one that does not
	// exist is TX202 (migration 010; it was TX201), as CancelTx's and RescheduleTx's
	// *ScheduleError then also matches ErrNotFound.
	unknown := uuid.New()
	for _, sql := range []string{`SELECT txoutbox_cancel($1)`, `SELECT txoutbox_reschedule($1, now())`} {
		_, err := db.Pool.Exec(ctx, sql, id)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "TX201" || pgErr.Detail != "state=rolled_back" {
			t.Fatalf("%s of a cancelled message: %v (detail %q), want TX201 with DETAIL state=rolled_back", sql, err, detailOf(err))
		}
		if got := exec(sql, unknown); got != "TX202" {
			t.Fatalf("%s of no message: %s, want TX202", sql, got)
		}
	}
	// The Go client sees the SQL cancel as its own, and agrees on the codes.
	if err := c.CancelTx(ctx, db.Pool, id); !errors.Is(err, outbox.ErrNotScheduled) || goOutcome(err) != "TX201" {
		t.Fatalf("CancelTx after txoutbox_cancel: %v", err)
	}
	if err := c.CancelTx(ctx, db.Pool, unknown); !errors.Is(err, outbox.ErrNotScheduled) || !errors.Is(err, outbox.ErrNotFound) || goOutcome(err) != "TX202" {
		t.Fatalf("CancelTx of no message: %v; want ErrNotScheduled and ErrNotFound (TX202)", err)
	}
	if err := c.RescheduleTx(ctx, db.Pool, unknown, later); !errors.Is(err, outbox.ErrNotScheduled) || !errors.Is(err, outbox.ErrNotFound) || goOutcome(err) != "TX202" {
		t.Fatalf("RescheduleTx of no message: %v; want ErrNotScheduled and ErrNotFound (TX202)", err)
	}
	// Business key forms.
	var ids []uuid.UUID
	if err := db.Pool.QueryRow(ctx, `SELECT txoutbox_reschedule_biz_key('order:1:remind', $1)`, later).Scan(&ids); err != nil || len(ids) != 1 || ids[0] != other {
		t.Fatalf("txoutbox_reschedule_biz_key = %v, %v", ids, err)
	}
	if err := db.Pool.QueryRow(ctx, `SELECT txoutbox_cancel_biz_key('order:1:remind')`).Scan(&ids); err != nil || len(ids) != 1 || ids[0] != other {
		t.Fatalf("txoutbox_cancel_biz_key = %v, %v", ids, err)
	}
	// None of the key scheduled: TX201 with the state of the key's latest message in DETAIL;
	// no message of the key: TX202 (migration 010; both were TX201), as CancelBizKeyTx's and
	// RescheduleBizKeyTx's *ScheduleError says (its State; ErrNotFound too for none).
	if _, err := db.Pool.Exec(ctx, `SELECT txoutbox_enqueue('orders.remind', 'x', biz_key => 'order:2:remind')`); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ key, code, detail string }{
		{"order:1:remind", "TX201", "state=rolled_back"},
		{"order:2:remind", "TX201", "state=ready"},
		{"order:3:remind", "TX202", ""},
	} {
		for _, sql := range []string{`SELECT txoutbox_cancel_biz_key($1)`, `SELECT txoutbox_reschedule_biz_key($1, now())`} {
			_, err := db.Pool.Exec(ctx, sql, tc.key)
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != tc.code || pgErr.Detail != tc.detail {
				t.Fatalf("%s of %s: %v (detail %q), want %s with DETAIL %q", sql, tc.key, err, detailOf(err), tc.code, tc.detail)
			}
		}
		_, cancelErr := c.CancelBizKeyTx(ctx, db.Pool, tc.key)
		_, moveErr := c.RescheduleBizKeyTx(ctx, db.Pool, tc.key, later)
		for _, err := range []error{cancelErr, moveErr} {
			var se *outbox.ScheduleError
			if goOutcome(err) != tc.code || !errors.As(err, &se) || "state="+se.State != tc.detail && se.State != "" {
				t.Fatalf("Go business key form of %s: %v (%s), want %s with %s", tc.key, err, goOutcome(err), tc.code, tc.detail)
			}
		}
	}
	// A half message with a delivery time: prepared, then scheduled when committed.
	var half uuid.UUID
	if err := db.Pool.QueryRow(ctx, `SELECT txoutbox_prepare('orders.timeout', 'x', 'k', fence => true, deliver_at => $1)`, due).Scan(&half); err != nil {
		t.Fatal(err)
	}
	if st, at := state(t, db, half); st != "prepared" || at == nil || !at.Equal(due) {
		t.Fatalf("txoutbox_prepare with deliver_at: %q at %v", st, at)
	}
	if got := exec(`SELECT txoutbox_commit($1)`, half); got != "ok" {
		t.Fatalf("txoutbox_commit: %s", got)
	}
	if st, _ := state(t, db, half); st != "scheduled" {
		t.Fatalf("committed delayed half message: %q, want scheduled", st)
	}
	if n := count(t, db, "state = 'scheduled' AND ready_at IS NOT NULL"); n != 0 {
		t.Fatalf("%d scheduled rows with ready_at", n)
	}
	// Batch: delivery times per message, NULL for none; a length mismatch is TX008.
	var many []uuid.UUID
	if err := db.Pool.QueryRow(ctx, `SELECT txoutbox_enqueue_many(ARRAY['a.b', 'a.c'], ARRAY['x', 'y']::bytea[], deliver_ats => ARRAY[NULL, $1]::timestamptz[])`, due).Scan(&many); err != nil {
		t.Fatal(err)
	}
	if st, _ := state(t, db, many[0]); st != "ready" {
		t.Fatalf("batch message without a delivery time: %q", st)
	}
	if st, _ := state(t, db, many[1]); st != "scheduled" {
		t.Fatalf("batch message with a delivery time: %q", st)
	}
	if got := exec(`SELECT txoutbox_enqueue_many(ARRAY['a.b', 'a.c'], ARRAY['x', 'y']::bytea[], deliver_ats => ARRAY[$1]::timestamptz[])`, due); got != "TX008" {
		t.Fatalf("batch with one delivery time for two messages: %s, want TX008", got)
	}
}

// detailOf is err's DETAIL, when it is a server error.
func detailOf(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Detail
	}
	return ""
}
