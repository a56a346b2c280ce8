package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// deliverAtWays are the calls that take a delivery time, on one path (pgx or database/sql).
type deliverAtWays struct {
	enqueue          func(m outbox.Message) (uuid.UUID, error)
	prepare          func(m outbox.Message) (uuid.UUID, error)
	reschedule       func(id uuid.UUID, at time.Time) error
	rescheduleBizKey func(bizKey string, at time.Time) ([]uuid.UUID, error)
}

// TestDeliverAtRoundsUpToTheMicrosecond: a delivery time below the microsecond is stored
// rounded up to the next microsecond, never down (a message is never due before the time it
// was given), by every call that takes one — EnqueueTx, Prepare, RescheduleTx,
// RescheduleBizKeyTx and their database/sql twins on every driver — and a time within
// MinDeliverAt..MaxDeliverAt is never rounded out of them: the bounds are whole seconds,
// MaxDeliverAt less a nanosecond is stored as MaxDeliverAt, a nanosecond past either bound is
// refused.
func TestDeliverAtRoundsUpToTheMicrosecond(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)

	for _, b := range []time.Time{outbox.MinDeliverAt, outbox.MaxDeliverAt} {
		if !b.Equal(b.Truncate(time.Second)) {
			t.Fatalf("bound %v is not a whole second: a time within it could be rounded past it", b)
		}
	}
	soon := time.Now().Add(time.Hour) // with a monotonic clock reading
	soonUp := soon.Round(0).Truncate(time.Microsecond)
	if soonUp.Before(soon.Round(0)) {
		soonUp = soonUp.Add(time.Microsecond)
	}
	ist := time.FixedZone("UTC+5:30", 5*3600+1800)
	cases := []struct{ in, want time.Time }{
		{time.Date(2030, 1, 1, 0, 0, 0, 999_999_999, time.UTC), time.Date(2030, 1, 1, 0, 0, 1, 0, time.UTC)},
		{time.Date(2030, 1, 1, 0, 0, 0, 1, time.UTC), time.Date(2030, 1, 1, 0, 0, 0, 1000, time.UTC)},
		{time.Date(2030, 1, 1, 0, 0, 0, 123_456_000, time.UTC), time.Date(2030, 1, 1, 0, 0, 0, 123_456_000, time.UTC)},
		{time.Date(2031, 12, 31, 23, 59, 59, 999_999_001, ist), time.Date(2031, 12, 31, 18, 30, 0, 0, time.UTC)},
		{outbox.MaxDeliverAt.Add(-time.Nanosecond), outbox.MaxDeliverAt},
		{outbox.MaxDeliverAt, outbox.MaxDeliverAt},
		{outbox.MinDeliverAt, outbox.MinDeliverAt},
		{outbox.MinDeliverAt.Add(time.Nanosecond), outbox.MinDeliverAt.Add(time.Microsecond)},
		{soon, soonUp},
	}
	refused := []time.Time{outbox.MaxDeliverAt.Add(time.Nanosecond), outbox.MinDeliverAt.Add(-time.Nanosecond)}
	far := time.Date(2040, 1, 1, 0, 0, 0, 0, time.UTC)

	paths := map[string]deliverAtWays{"pgx": {
		enqueue: func(m outbox.Message) (uuid.UUID, error) {
			ids, err := c.EnqueueTx(ctx, db.Pool, m)
			if err != nil {
				return uuid.Nil, err
			}
			return ids[0], nil
		},
		prepare: func(m outbox.Message) (uuid.UUID, error) {
			h, err := c.Prepare(ctx, db.Pool, m, &outbox.PrepareOptions{Fence: true})
			return h.ID, err
		},
		reschedule:       func(id uuid.UUID, at time.Time) error { return c.RescheduleTx(ctx, db.Pool, id, at) },
		rescheduleBizKey: func(k string, at time.Time) ([]uuid.UUID, error) { return c.RescheduleBizKeyTx(ctx, db.Pool, k, at) },
	}}
	for _, driver := range sqlDrivers {
		sdb := openSQL(t, db, driver)
		paths["database/sql "+driver] = deliverAtWays{
			enqueue: func(m outbox.Message) (uuid.UUID, error) {
				ids, err := c.EnqueueSQLTx(ctx, sdb, m)
				if err != nil {
					return uuid.Nil, err
				}
				return ids[0], nil
			},
			prepare: func(m outbox.Message) (uuid.UUID, error) {
				h, err := c.PrepareSQL(ctx, sdb, m, &outbox.PrepareOptions{Fence: true})
				return h.ID, err
			},
			reschedule: func(id uuid.UUID, at time.Time) error { return c.RescheduleSQLTx(ctx, sdb, id, at) },
			rescheduleBizKey: func(k string, at time.Time) ([]uuid.UUID, error) {
				return c.RescheduleBizKeySQLTx(ctx, sdb, k, at)
			},
		}
	}
	n := 0
	for name, w := range paths {
		t.Run(name, func(t *testing.T) {
			stored := func(what string, id uuid.UUID, want time.Time) {
				t.Helper()
				if _, at := state(t, db, id); at == nil || !at.Equal(want) {
					t.Errorf("%s: deliver_at stored %v, want %v", what, at, want)
				}
			}
			// A scheduled message to reschedule, by id and by business key.
			moved := func() (uuid.UUID, string) {
				t.Helper()
				n++
				bizKey := fmt.Sprintf("round:%d", n)
				id, err := w.enqueue(outbox.Message{Subject: "orders.timeout", BizKey: bizKey, DeliverAt: far})
				if err != nil {
					t.Fatal(err)
				}
				return id, bizKey
			}
			for _, tc := range cases {
				what := tc.in.Format(time.RFC3339Nano)
				id, err := w.enqueue(outbox.Message{Subject: "orders.timeout", Key: "k", DeliverAt: tc.in})
				if err != nil {
					t.Fatalf("enqueue at %s: %v", what, err)
				}
				stored("enqueue at "+what, id, tc.want)
				id, err = w.prepare(outbox.Message{Subject: "orders.timeout", DeliverAt: tc.in})
				if err != nil {
					t.Fatalf("prepare at %s: %v", what, err)
				}
				stored("prepare at "+what, id, tc.want)
				id, _ = moved()
				if err := w.reschedule(id, tc.in); err != nil {
					t.Fatalf("reschedule to %s: %v", what, err)
				}
				stored("reschedule to "+what, id, tc.want)
				id, bizKey := moved()
				if ids, err := w.rescheduleBizKey(bizKey, tc.in); err != nil || len(ids) != 1 || ids[0] != id {
					t.Fatalf("reschedule business key to %s: %v %v", what, ids, err)
				}
				stored("reschedule business key to "+what, id, tc.want)
			}
			for _, bad := range refused {
				what := bad.Format(time.RFC3339Nano)
				if _, err := w.enqueue(outbox.Message{Subject: "orders.timeout", DeliverAt: bad}); !errors.Is(err, outbox.ErrInvalidDeliverAt) {
					t.Errorf("enqueue at %s: %v, want ErrInvalidDeliverAt", what, err)
				}
				if _, err := w.prepare(outbox.Message{Subject: "orders.timeout", DeliverAt: bad}); !errors.Is(err, outbox.ErrInvalidDeliverAt) {
					t.Errorf("prepare at %s: %v, want ErrInvalidDeliverAt", what, err)
				}
				id, bizKey := moved()
				if err := w.reschedule(id, bad); !errors.Is(err, outbox.ErrInvalidDeliverAt) {
					t.Errorf("reschedule to %s: %v, want ErrInvalidDeliverAt", what, err)
				}
				if _, err := w.rescheduleBizKey(bizKey, bad); !errors.Is(err, outbox.ErrInvalidDeliverAt) {
					t.Errorf("reschedule business key to %s: %v, want ErrInvalidDeliverAt", what, err)
				}
				stored("refused reschedules to "+what, id, far)
			}
		})
	}
}
