package outbox_test

// Delayed messages over database/sql: CancelSQLTx, RescheduleSQLTx and their business key
// forms, with each driver, against CancelTx and RescheduleTx's outcomes.

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// inSQLTx runs f in a transaction of sdb: committed when f returns nil, rolled back otherwise.
func inSQLTx(t *testing.T, sdb *sql.DB, f func(tx *sql.Tx) error) error {
	t.Helper()
	tx := beginSQL(t, sdb)
	if err := f(tx); err != nil {
		return errors.Join(err, tx.Rollback())
	}
	return tx.Commit()
}

// CancelSQLTx: withdrawn if and only if the caller's transaction commits; the same
// *ScheduleError as CancelTx (state, ErrNotScheduled, ErrNotFound) for a message cancelled
// already, unknown, ready, or a half message not committed; the row lock held until the
// transaction ends, so that a promotion skips the row.
func TestCancelSQLTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	q := store.New(db.Schema)
	due := time.Now().Add(time.Hour)
	for _, driver := range sqlDrivers {
		t.Run(driver, func(t *testing.T) {
			sdb := openSQL(t, db, driver)
			var ids []uuid.UUID
			if err := inSQLTx(t, sdb, func(tx *sql.Tx) error {
				var err error
				ids, err = c.EnqueueSQLTx(ctx, tx,
					outbox.Message{Subject: "orders.timeout", Key: "order-" + driver, DeliverAt: due},
					outbox.Message{Subject: "orders.timeout", DeliverAt: due},
					outbox.Message{Subject: "orders.created", Key: "order-" + driver},
					outbox.Message{Subject: "orders.timeout", DeliverAt: due},
				)
				return err
			}); err != nil {
				t.Fatal(err)
			}

			// Rolled back with the caller's transaction: still scheduled.
			errBusiness := errors.New("business change failed")
			err := inSQLTx(t, sdb, func(tx *sql.Tx) error {
				if err := c.CancelSQLTx(ctx, tx, ids[0]); err != nil {
					return err
				}
				return errBusiness
			})
			if !errors.Is(err, errBusiness) {
				t.Fatal(err)
			}
			if st, _ := state(t, db, ids[0]); st != "scheduled" {
				t.Fatalf("after a rolled back cancel: state %q, want scheduled", st)
			}
			// Committed: withdrawn, settled by the cancel.
			if err := inSQLTx(t, sdb, func(tx *sql.Tx) error { return c.CancelSQLTx(ctx, tx, ids[0]) }); err != nil {
				t.Fatal(err)
			}
			if n := count(t, db, "message_id = '"+ids[0].String()+"' AND state = 'rolled_back' AND settled_by = 'cancel' AND settled_at IS NOT NULL"); n != 1 {
				t.Fatalf("after a committed cancel: %d rows rolled back by the cancel, want 1", n)
			}

			var se *outbox.ScheduleError
			// Twice: not scheduled, but found.
			err = c.CancelSQLTx(ctx, sdb, ids[0])
			if !errors.Is(err, outbox.ErrNotScheduled) || errors.Is(err, outbox.ErrNotFound) || !errors.As(err, &se) ||
				se.Op != "cancel" || se.ID != ids[0] || se.State != "rolled_back" {
				t.Fatalf("second cancel = %v; want a *ScheduleError wrapping ErrNotScheduled, state rolled_back", err)
			}
			// No such message: not scheduled, not found.
			unknown := uuid.New()
			err = c.CancelSQLTx(ctx, sdb, unknown)
			if !errors.Is(err, outbox.ErrNotScheduled) || !errors.Is(err, outbox.ErrNotFound) || !errors.As(err, &se) || se.ID != unknown || se.State != "" {
				t.Fatalf("cancel of no message = %v; want a *ScheduleError wrapping ErrNotScheduled and ErrNotFound", err)
			}
			if pgxErr := c.CancelTx(ctx, db.Pool, unknown); pgxErr.Error() != err.Error() {
				t.Fatalf("CancelSQLTx says %q, CancelTx %q", err, pgxErr)
			}
			// Ready: refused, untouched.
			err = c.CancelSQLTx(ctx, sdb, ids[2])
			if !errors.Is(err, outbox.ErrNotScheduled) || errors.Is(err, outbox.ErrNotFound) || !errors.As(err, &se) || se.State != "ready" {
				t.Fatalf("cancel of a ready message = %v; want ErrNotScheduled with state ready", err)
			}
			if st, _ := state(t, db, ids[2]); st != "ready" {
				t.Fatalf("the ready message is %q after a refused cancel", st)
			}
			if st, _ := state(t, db, ids[1]); st != "scheduled" {
				t.Fatalf("the other delayed message is %q, want scheduled", st)
			}
			// A half message with a delivery time: prepared, not scheduled, until committed.
			half, err := c.PrepareSQL(ctx, sdb, outbox.Message{Subject: "orders.timeout", DeliverAt: due}, &outbox.PrepareOptions{Fence: true})
			if err != nil {
				t.Fatal(err)
			}
			if err := c.CancelSQLTx(ctx, sdb, half.ID); !errors.Is(err, outbox.ErrNotScheduled) || !errors.As(err, &se) || se.State != "prepared" {
				t.Fatalf("cancel of a prepared message = %v; want ErrNotScheduled with state prepared", err)
			}
			if err := c.CommitSQL(ctx, sdb, half.ID); err != nil {
				t.Fatal(err)
			}
			if err := c.CancelSQLTx(ctx, sdb, half.ID); err != nil {
				t.Fatalf("cancel of a committed delayed half message: %v", err)
			}

			// A cancel in progress holds the row: a promotion skips it, and after the cancel
			// commits the message was never ready.
			if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET deliver_at = now() - interval '1 second' WHERE message_id = $1`, ids[3]); err != nil {
				t.Fatal(err)
			}
			tx := beginSQL(t, sdb)
			if err := c.CancelSQLTx(ctx, tx, ids[3]); err != nil {
				t.Fatal(err)
			}
			p, err := q.Promote(ctx, db.Pool, store.PromoteLimit)
			if err != nil {
				t.Fatal(err)
			}
			if p.Moved != 0 {
				t.Fatalf("the promotion moved %d rows while the only due one was held by a cancel", p.Moved)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			if st, _ := state(t, db, ids[3]); st != "rolled_back" {
				t.Fatalf("due message cancelled while a promotion ran: %q, want rolled_back", st)
			}
		})
	}
}

// RescheduleSQLTx: moves the time only if the caller's transaction commits, stores it as
// RescheduleTx stores it (rounded up to the microsecond), refuses a time out of range before anything
// is written, and the same *ScheduleError as RescheduleTx when the message is not scheduled.
func TestRescheduleSQLTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	for _, driver := range sqlDrivers {
		t.Run(driver, func(t *testing.T) {
			sdb := openSQL(t, db, driver)
			first := time.Now().Add(time.Hour).Truncate(time.Microsecond)
			ids, err := c.EnqueueSQLTx(ctx, sdb,
				outbox.Message{Subject: "orders.timeout", DeliverAt: first},
				outbox.Message{Subject: "orders.timeout", DeliverAt: first},
				outbox.Message{Subject: "orders.created"},
			)
			if err != nil {
				t.Fatal(err)
			}
			// Nanoseconds and a zone other than UTC: stored as the pgx method stores them,
			// rounded up to the microsecond.
			later := time.Date(2031, 2, 3, 4, 5, 6, 123456789, time.FixedZone("UTC+5:30", 5*3600+1800))
			laterStored := time.Date(2031, 2, 2, 22, 35, 6, 123457000, time.UTC)
			errBusiness := errors.New("business change failed")
			err = inSQLTx(t, sdb, func(tx *sql.Tx) error {
				if err := c.RescheduleSQLTx(ctx, tx, ids[0], later); err != nil {
					return err
				}
				return errBusiness
			})
			if !errors.Is(err, errBusiness) {
				t.Fatal(err)
			}
			if _, at := state(t, db, ids[0]); at == nil || !at.Equal(first) {
				t.Fatalf("after a rolled back reschedule: deliver_at %v, want %v", at, first)
			}
			if err := inSQLTx(t, sdb, func(tx *sql.Tx) error { return c.RescheduleSQLTx(ctx, tx, ids[0], later) }); err != nil {
				t.Fatal(err)
			}
			if err := inTx(t, db, func(tx pgx.Tx) error { return c.RescheduleTx(ctx, tx, ids[1], later) }); err != nil {
				t.Fatal(err)
			}
			st, at := state(t, db, ids[0])
			_, pgxAt := state(t, db, ids[1])
			if st != "scheduled" || at == nil || pgxAt == nil || !at.Equal(*pgxAt) || !at.Equal(laterStored) {
				t.Fatalf("rescheduled: state %q at %v; RescheduleTx stored %v; want scheduled at %v", st, at, pgxAt, laterStored)
			}

			// Out of range: refused, nothing changed.
			for _, bad := range []time.Time{outbox.MinDeliverAt.Add(-time.Nanosecond), outbox.MaxDeliverAt.Add(time.Second), {}} {
				if err := c.RescheduleSQLTx(ctx, sdb, ids[0], bad); !errors.Is(err, outbox.ErrInvalidDeliverAt) {
					t.Fatalf("RescheduleSQLTx to %v: %v, want ErrInvalidDeliverAt", bad, err)
				}
			}
			if _, at := state(t, db, ids[0]); at == nil || !at.Equal(laterStored) {
				t.Fatalf("after refused reschedules: deliver_at %v, want %v", at, laterStored)
			}
			// At the bounds: accepted.
			for _, edge := range []time.Time{outbox.MinDeliverAt, outbox.MaxDeliverAt} {
				if err := c.RescheduleSQLTx(ctx, sdb, ids[1], edge); err != nil {
					t.Fatalf("RescheduleSQLTx to %v: %v", edge, err)
				}
				if _, at := state(t, db, ids[1]); at == nil || !at.Equal(edge) {
					t.Fatalf("rescheduled to %v, stored %v", edge, at)
				}
			}

			var se *outbox.ScheduleError
			unknown := uuid.New()
			err = c.RescheduleSQLTx(ctx, sdb, unknown, later)
			if !errors.Is(err, outbox.ErrNotScheduled) || !errors.Is(err, outbox.ErrNotFound) || !errors.As(err, &se) || se.Op != "reschedule" || se.ID != unknown {
				t.Fatalf("reschedule of no message = %v; want a *ScheduleError wrapping ErrNotScheduled and ErrNotFound", err)
			}
			if pgxErr := c.RescheduleTx(ctx, db.Pool, unknown, later); pgxErr.Error() != err.Error() {
				t.Fatalf("RescheduleSQLTx says %q, RescheduleTx %q", err, pgxErr)
			}
			err = c.RescheduleSQLTx(ctx, sdb, ids[2], later)
			if !errors.Is(err, outbox.ErrNotScheduled) || errors.Is(err, outbox.ErrNotFound) || !errors.As(err, &se) || se.State != "ready" {
				t.Fatalf("reschedule of a ready message = %v; want ErrNotScheduled with state ready", err)
			}
			if st, at := state(t, db, ids[2]); st != "ready" || at != nil {
				t.Fatalf("the ready message is %q at %v after a refused reschedule", st, at)
			}
		})
	}
}

// The business key forms over database/sql: only the scheduled messages of exactly that key
// are cancelled or moved; none is a *ScheduleError naming the key; a bad key or time is
// refused before anything is written.
func TestCancelAndRescheduleByBizKeySQL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	remind := time.Date(2030, 1, 1, 10, 0, 0, 0, time.UTC)
	timeout := remind.Add(time.Hour)
	for _, driver := range sqlDrivers {
		t.Run(driver, func(t *testing.T) {
			sdb := openSQL(t, db, driver)
			// Quotes, commas and braces in the key: sent as one text argument by every driver.
			bk := func(kind string, at time.Time) string {
				return `order:"42",{` + driver + `}:` + kind + ":" + at.Format(time.RFC3339)
			}
			ids, err := c.EnqueueSQLTx(ctx, sdb,
				outbox.Message{Subject: "orders.remind", Key: "order-42", BizKey: bk("remind", remind), DeliverAt: remind},
				outbox.Message{Subject: "orders.timeout", Key: "order-42", BizKey: bk("timeout", timeout), DeliverAt: timeout},
				outbox.Message{Subject: "orders.timeout", Key: "order-42", BizKey: bk("timeout", timeout), DeliverAt: timeout.Add(time.Minute)},
				outbox.Message{Subject: "orders.created", Key: "order-42", BizKey: bk("timeout", timeout)}, // not delayed: never touched
			)
			if err != nil {
				t.Fatal(err)
			}
			// A rolled back cancel changes nothing.
			errBusiness := errors.New("business change failed")
			err = inSQLTx(t, sdb, func(tx *sql.Tx) error {
				if _, err := c.CancelBizKeySQLTx(ctx, tx, bk("timeout", timeout)); err != nil {
					return err
				}
				return errBusiness
			})
			if !errors.Is(err, errBusiness) {
				t.Fatal(err)
			}
			if n := count(t, db, "state = 'scheduled' AND subject = 'orders.timeout' AND headers->'Txoutbox-Biz-Key'->>0 = '"+bk("timeout", timeout)+"'"); n != 2 {
				t.Fatalf("after a rolled back cancel: %d scheduled, want 2", n)
			}
			var got []uuid.UUID
			if err := inSQLTx(t, sdb, func(tx *sql.Tx) error {
				var err error
				got, err = c.CancelBizKeySQLTx(ctx, tx, bk("timeout", timeout))
				return err
			}); err != nil {
				t.Fatal(err)
			}
			if len(got) != 2 || !(got[0] == ids[1] && got[1] == ids[2] || got[0] == ids[2] && got[1] == ids[1]) {
				t.Fatalf("cancelled %v, want %v and %v", got, ids[1], ids[2])
			}
			if st, _ := state(t, db, ids[0]); st != "scheduled" {
				t.Fatalf("the other timer is %q, want scheduled", st)
			}
			if st, _ := state(t, db, ids[3]); st != "ready" {
				t.Fatalf("the ready message of the same business key is %q, want ready", st)
			}
			var se *outbox.ScheduleError
			_, err = c.CancelBizKeySQLTx(ctx, sdb, bk("timeout", timeout))
			if !errors.Is(err, outbox.ErrNotScheduled) || errors.Is(err, outbox.ErrNotFound) || !errors.As(err, &se) ||
				se.Op != "cancel" || se.BizKey != bk("timeout", timeout) || se.ID != uuid.Nil {
				t.Fatalf("second cancel = %v; want a *ScheduleError for the business key wrapping ErrNotScheduled", err)
			}

			moved := remind.Add(15 * time.Minute)
			got, err = c.RescheduleBizKeySQLTx(ctx, sdb, bk("remind", remind), moved)
			if err != nil || len(got) != 1 || got[0] != ids[0] {
				t.Fatalf("RescheduleBizKeySQLTx = %v, %v; want [%v]", got, err, ids[0])
			}
			if _, at := state(t, db, ids[0]); at == nil || !at.Equal(moved) {
				t.Fatalf("rescheduled to %v, want %v", at, moved)
			}
			// The message keeps its business key, which names the old time: a key rebuilt
			// from the new time finds nothing, the original one finds it.
			if _, err := c.CancelBizKeySQLTx(ctx, sdb, bk("remind", moved)); !errors.Is(err, outbox.ErrNotScheduled) {
				t.Fatalf("cancel by a key naming the new time = %v; want ErrNotScheduled", err)
			}
			if n := count(t, db, "message_id = '"+ids[0].String()+"' AND state = 'scheduled' AND headers->'Txoutbox-Biz-Key'->>0 = '"+bk("remind", remind)+"'"); n != 1 {
				t.Fatalf("the rescheduled message no longer has its business key %q", bk("remind", remind))
			}
			_, err = c.RescheduleBizKeySQLTx(ctx, sdb, bk("timeout", timeout), moved)
			if !errors.Is(err, outbox.ErrNotScheduled) || !errors.As(err, &se) || se.Op != "reschedule" || se.BizKey != bk("timeout", timeout) {
				t.Fatalf("reschedule of a key with nothing scheduled = %v; want a *ScheduleError wrapping ErrNotScheduled", err)
			}

			// Refused at the door, nothing changed.
			for _, bad := range []string{"", " padded", "tab\tinside", "\xff", strings.Repeat("k", outbox.MaxKeyLength+1)} {
				if _, err := c.CancelBizKeySQLTx(ctx, sdb, bad); !errors.Is(err, outbox.ErrInvalidKey) {
					t.Fatalf("cancel with business key %q = %v; want ErrInvalidKey", bad, err)
				}
				if _, err := c.RescheduleBizKeySQLTx(ctx, sdb, bad, moved); !errors.Is(err, outbox.ErrInvalidKey) {
					t.Fatalf("reschedule with business key %q = %v; want ErrInvalidKey", bad, err)
				}
			}
			if _, err := c.RescheduleBizKeySQLTx(ctx, sdb, bk("remind", remind), outbox.MaxDeliverAt.Add(time.Second)); !errors.Is(err, outbox.ErrInvalidDeliverAt) {
				t.Fatalf("reschedule by business key past MaxDeliverAt = %v; want ErrInvalidDeliverAt", err)
			}
			if st, at := state(t, db, ids[0]); st != "scheduled" || at == nil || !at.Equal(moved) {
				t.Fatalf("after refused calls: %q at %v, want scheduled at %v", st, at, moved)
			}
		})
	}
}
