package outbox_test

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
)

// The order-timeout pattern: "close this order if it is still unpaid in 30 minutes". The
// timeout is a delayed message committed with the order; paying cancels it in the payment's
// own transaction, so a paid order never times out. If the payment comes after the relay took
// the timeout, CancelTx says so (ErrNotScheduled) and the timeout's consumer decides: it closes
// the order only if it is still unpaid, under the order's row lock, so payment and timeout
// never both win.
//
// The business key names the timer and its due time: an order may have several timers (a
// reminder, a timeout, a timeout re-armed for a later time), and idempotent consumers
// deduplicate on the business key, so each must be a key of its own. Two ways to move a
// timer, shown below: RescheduleTx moves the same message (same id, same business key, which
// still names the first time: look it up by id or by that key); a timer re-armed as a new
// business event is a cancel and a new message whose key names the new time.
func Example_orderTimeout() {
	ctx := context.Background()
	schema := cmp.Or(os.Getenv("TXOUTBOX_SCHEMA"), txoutbox.DefaultSchema) // the outbox's schema, as relay run reads it
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := m.Up(ctx, pool); err != nil {
		fmt.Println(err)
		return
	}
	orders := pgx.Identifier{schema, "orders_unpaid_timeout"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+orders+` (id text PRIMARY KEY, status text NOT NULL)`); err != nil {
		fmt.Println(err)
		return
	}
	client, err := outbox.NewClient(&outbox.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}

	// Place the order: the order, its event and its timeout commit together.
	orderID := uuid.NewString()
	timeoutKey := func(due time.Time) string { return "order:" + orderID + ":timeout:" + due.UTC().Format(time.RFC3339) }
	due := time.Now().Add(30 * time.Minute).UTC().Truncate(time.Second)
	var timeoutID uuid.UUID
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO `+orders+` VALUES ($1, 'unpaid')`, orderID); err != nil {
			return err
		}
		ids, err := client.EnqueueTx(ctx, tx,
			outbox.Message{Subject: "orders.placed", Key: orderID, Payload: []byte(orderID)},
			outbox.Message{
				Subject:   "orders.timeout",
				Key:       orderID,
				BizKey:    timeoutKey(due),
				DeliverAt: due,
				Payload:   []byte(orderID),
			})
		if err != nil {
			return err
		}
		timeoutID = ids[1]
		return nil
	})
	if err != nil {
		fmt.Println(err)
		return
	}

	// The same timeout, 15 minutes later: RescheduleTx moves the message and keeps its id and
	// its business key, which still names the first due time. A key rebuilt from the new time
	// finds nothing; the message is found by its id, or by the key it was enqueued with.
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return client.RescheduleTx(ctx, tx, timeoutID, due.Add(15*time.Minute))
	}); err != nil {
		fmt.Println(err)
		return
	}
	_, err = client.CancelBizKeyTx(ctx, pool, timeoutKey(due.Add(15*time.Minute)))
	if err != nil && !errors.Is(err, outbox.ErrNotScheduled) {
		fmt.Println(err)
		return
	}
	fmt.Println("rescheduled; a key naming the new time finds it:", err == nil)

	// The order is changed and gets a new timeout, a business event of its own: cancel the
	// old timer (here by the key it was enqueued with) and enqueue a new one whose key names
	// the new time, in one transaction.
	rearmed := due.Add(time.Hour)
	firstTimeout := timeoutID
	var cancelled []uuid.UUID
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		if cancelled, err = client.CancelBizKeyTx(ctx, tx, timeoutKey(due)); err != nil {
			return err
		}
		ids, err := client.EnqueueTx(ctx, tx, outbox.Message{
			Subject:   "orders.timeout",
			Key:       orderID,
			BizKey:    timeoutKey(rearmed),
			DeliverAt: rearmed,
			Payload:   []byte(orderID),
		})
		if err != nil {
			return err
		}
		timeoutID = ids[0]
		return nil
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("re-armed with a new business key; old timer cancelled:", len(cancelled) == 1 && cancelled[0] == firstTimeout)

	// The customer pays: the order is paid and its timeout withdrawn, in one transaction.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `UPDATE `+orders+` SET status = 'paid' WHERE id = $1 AND status = 'unpaid'`, orderID)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			return errors.New("the order was closed before it was paid: refund")
		}
		err = client.CancelTx(ctx, tx, timeoutID)
		if errors.Is(err, outbox.ErrNotScheduled) {
			fmt.Println("the timeout went out already; its consumer will find the order paid")
			return nil
		}
		return err
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("paid; timeout cancelled")

	// Cancelling again: the timeout is no longer scheduled (it is rolled back).
	err = client.CancelTx(ctx, pool, timeoutID)
	var se *outbox.ScheduleError
	fmt.Println(errors.Is(err, outbox.ErrNotScheduled), errors.As(err, &se) && se.State == "rolled_back")

	// The timeout's consumer handler (run by consumer.Consumer in the message's transaction):
	// close the order only if it is still unpaid. A late timeout of a paid order does nothing.
	closeIfUnpaid := func(ctx context.Context, tx pgx.Tx, orderID string) (bool, error) {
		tag, err := tx.Exec(ctx, `UPDATE `+orders+` SET status = 'closed' WHERE id = $1 AND status = 'unpaid'`, orderID)
		return tag.RowsAffected() == 1, err
	}
	var closed bool
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		closed, err = closeIfUnpaid(ctx, tx, orderID)
		return err
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	var status string
	if err := pool.QueryRow(ctx, `SELECT status FROM `+orders+` WHERE id = $1`, orderID).Scan(&status); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("closed by a late timeout:", closed, "- status:", status)
	// Output:
	// rescheduled; a key naming the new time finds it: false
	// re-armed with a new business key; old timer cancelled: true
	// paid; timeout cancelled
	// true true
	// closed by a late timeout: false - status: paid
}
