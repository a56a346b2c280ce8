package outbox_test

import (
	"context"
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

// state returns the message's state and delivery time ("" when there is no row).
func state(t *testing.T, db *testsvc.DB, id uuid.UUID) (string, *time.Time) {
	t.Helper()
	var st string
	var at *time.Time
	err := db.Pool.QueryRow(context.Background(), `SELECT state, deliver_at FROM txoutbox_messages WHERE message_id = $1`, id).Scan(&st, &at)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return st, at
}

func inTx(t *testing.T, db *testsvc.DB, f func(tx pgx.Tx) error) error {
	t.Helper()
	return pgx.BeginFunc(context.Background(), db.Pool, f)
}

func TestDeliverAtStoresScheduled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	due := time.Now().Add(time.Hour).Truncate(time.Microsecond)
	var ids []uuid.UUID
	if err := inTx(t, db, func(tx pgx.Tx) error {
		var err error
		ids, err = c.EnqueueTx(ctx, tx,
			outbox.Message{Subject: "orders.timeout", Key: "order-1", DeliverAt: due},
			outbox.Message{Subject: "orders.created", Key: "order-1"},
			outbox.Message{Subject: "orders.past", DeliverAt: time.Now().Add(-time.Hour)},
		)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if st, at := state(t, db, ids[0]); st != "scheduled" || at == nil || !at.Equal(due) {
		t.Fatalf("delayed message: state %q, deliver_at %v; want scheduled at %v", st, at, due)
	}
	if st, at := state(t, db, ids[1]); st != "ready" || at != nil {
		t.Fatalf("immediate message: state %q, deliver_at %v; want ready without a delivery time", st, at)
	}
	// A time already past is "as soon as possible": still scheduled, promoted at the relay's next pass.
	if st, _ := state(t, db, ids[2]); st != "scheduled" {
		t.Fatalf("message due in the past: state %q, want scheduled", st)
	}
	// The scheduled rows are outside the claim's index and hold no ready_at.
	if n := count(t, db, "state = 'scheduled' AND ready_at IS NULL"); n != 2 {
		t.Fatalf("%d scheduled rows without ready_at, want 2", n)
	}
}

func TestDeliverAtOutOfRangeRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	for _, at := range []time.Time{
		time.Date(1969, 12, 31, 23, 59, 59, 0, time.UTC),
		time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC),
	} {
		err := inTx(t, db, func(tx pgx.Tx) error {
			_, err := c.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.ok"}, outbox.Message{Subject: "orders.timeout", DeliverAt: at})
			return err
		})
		var me *outbox.MessageError
		if !errors.Is(err, outbox.ErrInvalidDeliverAt) || !errors.As(err, &me) || me.Index != 1 {
			t.Fatalf("DeliverAt %v: err = %v; want a *MessageError for message 1 wrapping ErrInvalidDeliverAt", at, err)
		}
		if !strings.HasPrefix(me.Detail, "DeliverAt ") || !strings.Contains(me.Detail, " is outside ") || strings.Contains(me.Detail, outbox.ErrInvalidDeliverAt.Error()) {
			t.Fatalf("DeliverAt %v: detail %q, want the field and the range, without the sentinel's text", at, me.Detail)
		}
		if _, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.timeout", DeliverAt: at}, &outbox.PrepareOptions{Fence: true}); !errors.Is(err, outbox.ErrInvalidDeliverAt) {
			t.Fatalf("Prepare with DeliverAt %v: err = %v; want ErrInvalidDeliverAt", at, err)
		}
		if err := c.RescheduleTx(ctx, db.Pool, uuid.New(), at); !errors.Is(err, outbox.ErrInvalidDeliverAt) {
			t.Fatalf("RescheduleTx to %v: err = %v; want ErrInvalidDeliverAt", at, err)
		}
	}
	if n := count(t, db, "true"); n != 0 {
		t.Fatalf("%d rows stored, want none", n)
	}
}

func TestCancelTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	due := time.Now().Add(time.Hour)
	var ids []uuid.UUID
	if err := inTx(t, db, func(tx pgx.Tx) error {
		var err error
		ids, err = c.EnqueueTx(ctx, tx,
			outbox.Message{Subject: "orders.timeout", DeliverAt: due},
			outbox.Message{Subject: "orders.timeout", DeliverAt: due},
			outbox.Message{Subject: "orders.created"},
		)
		return err
	}); err != nil {
		t.Fatal(err)
	}

	// Rolled back with the caller's transaction: the message stays scheduled.
	errBusiness := errors.New("business change failed")
	err := inTx(t, db, func(tx pgx.Tx) error {
		if err := c.CancelTx(ctx, tx, ids[0]); err != nil {
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
	// Committed: withdrawn (rolled back, settled by the cancel; purged with the rolled-back rows).
	if err := inTx(t, db, func(tx pgx.Tx) error { return c.CancelTx(ctx, tx, ids[0]) }); err != nil {
		t.Fatal(err)
	}
	if n := count(t, db, "state = 'rolled_back' AND settled_by = 'cancel' AND settled_at IS NOT NULL"); n != 1 {
		t.Fatalf("after a committed cancel: %d rows rolled back by the cancel, want 1", n)
	}
	// Twice: not scheduled.
	err = c.CancelTx(ctx, db.Pool, ids[0])
	var se *outbox.ScheduleError
	if !errors.Is(err, outbox.ErrNotScheduled) || errors.Is(err, outbox.ErrNotFound) || !errors.As(err, &se) || se.ID != ids[0] || se.State != "rolled_back" {
		t.Fatalf("second cancel = %v; want a *ScheduleError wrapping ErrNotScheduled, state rolled_back", err)
	}
	// No such message: not scheduled, not found.
	err = c.CancelTx(ctx, db.Pool, uuid.New())
	if !errors.Is(err, outbox.ErrNotScheduled) || !errors.Is(err, outbox.ErrNotFound) || !errors.As(err, &se) || se.State != "" {
		t.Fatalf("cancel of no message = %v; want a *ScheduleError wrapping ErrNotScheduled and ErrNotFound", err)
	}
	// The nil id is an id like any other: the error names it, not a business key.
	for name, op := range map[string]func() error{
		"CancelTx":     func() error { return c.CancelTx(ctx, db.Pool, uuid.Nil) },
		"RescheduleTx": func() error { return c.RescheduleTx(ctx, db.Pool, uuid.Nil, time.Now().Add(time.Hour)) },
	} {
		err := op()
		if !errors.Is(err, outbox.ErrNotFound) || !errors.As(err, &se) || se.BizKey != "" ||
			!strings.Contains(err.Error(), "message "+uuid.Nil.String()) || strings.Contains(err.Error(), "business key") {
			t.Fatalf("%s(uuid.Nil) = %v; want ErrNotFound naming message %s", name, err, uuid.Nil)
		}
	}
	// A message that is not delayed (or whose time came and the relay took it): ready.
	err = c.CancelTx(ctx, db.Pool, ids[2])
	if !errors.Is(err, outbox.ErrNotScheduled) || errors.Is(err, outbox.ErrNotFound) || !errors.As(err, &se) || se.State != "ready" {
		t.Fatalf("cancel of a ready message = %v; want ErrNotScheduled with state ready", err)
	}
	if st, _ := state(t, db, ids[2]); st != "ready" {
		t.Fatalf("the ready message is %q after a refused cancel", st)
	}
	// The other one is untouched.
	if st, _ := state(t, db, ids[1]); st != "scheduled" {
		t.Fatalf("the other delayed message is %q, want scheduled", st)
	}
	// A half message with a delivery time is not scheduled until it is committed.
	half, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.timeout", DeliverAt: due}, &outbox.PrepareOptions{Fence: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.CancelTx(ctx, db.Pool, half.ID); !errors.As(err, &se) || se.State != "prepared" {
		t.Fatalf("cancel of a prepared message = %v; want ErrNotScheduled with state prepared", err)
	}
	if err := c.Commit(ctx, db.Pool, half.ID); err != nil {
		t.Fatal(err)
	}
	if st, at := state(t, db, half.ID); st != "scheduled" || at == nil {
		t.Fatalf("committed half message with a delivery time: state %q, deliver_at %v; want scheduled", st, at)
	}
	if err := c.CancelTx(ctx, db.Pool, half.ID); err != nil {
		t.Fatalf("cancel of a committed delayed half message: %v", err)
	}
}

func TestRescheduleTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	ids, err := c.EnqueueTx(ctx, db.Pool, outbox.Message{Subject: "orders.timeout", DeliverAt: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	later := time.Now().Add(48 * time.Hour).Truncate(time.Microsecond)
	if err := inTx(t, db, func(tx pgx.Tx) error { return c.RescheduleTx(ctx, tx, ids[0], later) }); err != nil {
		t.Fatal(err)
	}
	if st, at := state(t, db, ids[0]); st != "scheduled" || at == nil || !at.Equal(later) {
		t.Fatalf("rescheduled: state %q at %v; want scheduled at %v", st, at, later)
	}
	if err := c.RescheduleTx(ctx, db.Pool, uuid.New(), later); !errors.Is(err, outbox.ErrNotFound) || !errors.Is(err, outbox.ErrNotScheduled) {
		t.Fatalf("reschedule of no message = %v; want ErrNotScheduled and ErrNotFound", err)
	}
}

func TestCancelAndRescheduleByBizKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	// One order, two timers: the business key names each timer's due time.
	remind := time.Date(2030, 1, 1, 10, 0, 0, 0, time.UTC)
	timeout := remind.Add(time.Hour)
	bk := func(kind string, at time.Time) string { return "order:42:" + kind + ":" + at.Format(time.RFC3339) }
	ids, err := c.EnqueueTx(ctx, db.Pool,
		outbox.Message{Subject: "orders.remind", Key: "order-42", BizKey: bk("remind", remind), DeliverAt: remind},
		outbox.Message{Subject: "orders.timeout", Key: "order-42", BizKey: bk("timeout", timeout), DeliverAt: timeout},
		outbox.Message{Subject: "orders.created", Key: "order-42", BizKey: bk("timeout", timeout)}, // same key, not delayed: never cancelled
	)
	if err != nil {
		t.Fatal(err)
	}
	var got []uuid.UUID
	if err := inTx(t, db, func(tx pgx.Tx) error {
		var err error
		got, err = c.CancelBizKeyTx(ctx, tx, bk("timeout", timeout))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0] != ids[1] {
		t.Fatalf("cancelled %v, want [%v]", got, ids[1])
	}
	if st, _ := state(t, db, ids[0]); st != "scheduled" {
		t.Fatalf("the other timer is %q, want scheduled", st)
	}
	if st, _ := state(t, db, ids[2]); st != "ready" {
		t.Fatalf("the ready message of the same business key is %q, want ready", st)
	}
	_, err = c.CancelBizKeyTx(ctx, db.Pool, bk("timeout", timeout))
	var se *outbox.ScheduleError
	if !errors.Is(err, outbox.ErrNotScheduled) || errors.Is(err, outbox.ErrNotFound) || !errors.As(err, &se) || se.BizKey != bk("timeout", timeout) {
		t.Fatalf("second cancel = %v; want a *ScheduleError for the business key wrapping ErrNotScheduled", err)
	}
	moved := remind.Add(15 * time.Minute)
	got, err = c.RescheduleBizKeyTx(ctx, db.Pool, bk("remind", remind), moved)
	if err != nil || len(got) != 1 || got[0] != ids[0] {
		t.Fatalf("RescheduleBizKeyTx = %v, %v; want [%v]", got, err, ids[0])
	}
	if _, at := state(t, db, ids[0]); at == nil || !at.Equal(moved) {
		t.Fatalf("rescheduled to %v, want %v", at, moved)
	}
	if _, err := c.CancelBizKeyTx(ctx, db.Pool, " bad"); !errors.Is(err, outbox.ErrInvalidKey) {
		t.Fatalf("cancel with an invalid business key = %v; want ErrInvalidKey", err)
	}
	for _, bad := range []string{"", " bad"} { // an empty key names no message
		if _, err := c.CancelBizKeyTx(ctx, db.Pool, bad); !errors.Is(err, outbox.ErrInvalidKey) {
			t.Fatalf("cancel with business key %q = %v; want ErrInvalidKey", bad, err)
		}
		if _, err := c.RescheduleBizKeyTx(ctx, db.Pool, bad, time.Now()); !errors.Is(err, outbox.ErrInvalidKey) {
			t.Fatalf("reschedule with business key %q = %v; want ErrInvalidKey", bad, err)
		}
	}
}

// The business key forms say why nothing was scheduled under the key: the state of the key's
// latest message (ready: the timer fell due and goes out; rolled_back: cancelled before;
// published, kept by a retention), wrapping ErrNotScheduled, or, when the key has no message
// at all (never enqueued, or published and deleted with retention 0), ErrNotFound as well.
// Cancel and reschedule, pgx and database/sql alike.
func TestBizKeyNotScheduledSaysWhy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	sdb := openSQL(t, db, "pgx")
	q := store.New(db.Schema)
	at := time.Now().Add(time.Hour)
	ids, err := c.EnqueueTx(ctx, db.Pool,
		outbox.Message{Subject: "orders.timeout", BizKey: "fell-due", DeliverAt: at},
		outbox.Message{Subject: "orders.timeout", BizKey: "cancelled", DeliverAt: at},
		outbox.Message{Subject: "orders.timeout", BizKey: "published", DeliverAt: at},
		outbox.Message{Subject: "orders.timeout", BizKey: "deleted", DeliverAt: at},
	)
	if err != nil {
		t.Fatal(err)
	}
	// Fixtures: the first falls due and a relay's promotion takes it; the second is
	// cancelled; the third and fourth were published, kept by a retention or deleted.
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET deliver_at = now() - interval '1 second' WHERE message_id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	if p, err := q.Promote(ctx, db.Pool, store.PromoteLimit); err != nil || p.Moved != 1 {
		t.Fatalf("promotion: %+v, %v; want the due row moved", p, err)
	}
	if err := c.CancelTx(ctx, db.Pool, ids[1]); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'published', settled_at = now() WHERE message_id = ANY($1)`, ids[2:]); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `DELETE FROM txoutbox_messages WHERE message_id = $1`, ids[3]); err != nil {
		t.Fatal(err)
	}
	later := at.Add(time.Hour)
	forms := map[string]func(bizKey string) error{
		"CancelBizKeyTx": func(k string) error { _, err := c.CancelBizKeyTx(ctx, db.Pool, k); return err },
		"RescheduleBizKeyTx": func(k string) error {
			_, err := c.RescheduleBizKeyTx(ctx, db.Pool, k, later)
			return err
		},
		"CancelBizKeySQLTx": func(k string) error { _, err := c.CancelBizKeySQLTx(ctx, sdb, k); return err },
		"RescheduleBizKeySQLTx": func(k string) error {
			_, err := c.RescheduleBizKeySQLTx(ctx, sdb, k, later)
			return err
		},
	}
	for name, form := range forms {
		for key, want := range map[string]string{"fell-due": "ready", "cancelled": "rolled_back", "published": "published", "deleted": "", "never": ""} {
			err := form(key)
			var se *outbox.ScheduleError
			if !errors.As(err, &se) || !errors.Is(err, outbox.ErrNotScheduled) || se.BizKey != key || se.State != want {
				t.Fatalf("%s(%q) = %v (%+v); want a *ScheduleError wrapping ErrNotScheduled with state %q", name, key, err, se, want)
			}
			if notFound := errors.Is(err, outbox.ErrNotFound); notFound != (want == "") {
				t.Fatalf("%s(%q) = %v: matches ErrNotFound %v, want %v", name, key, err, notFound, want == "")
			}
			if want != "" && !strings.Contains(err.Error(), want) {
				t.Fatalf("%s(%q) = %v: does not name the state %s", name, key, err, want)
			}
		}
	}
}
