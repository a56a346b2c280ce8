package demo

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// The checks can fail: starting from a consistent end state, each kind of damage makes the
// invariant that describes it fail.
func TestVerifyDetectsViolations(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, businessDDL); err != nil {
			return err
		}
		return (&businessSetup{SKUs: 2}).seed(ctx, tx)
	}); err != nil {
		t.Fatal(err)
	}
	if err := createStreams(ctx, n.JS); err != nil {
		t.Fatal(err)
	}
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	publish := func(subject, id string, hdr map[string]string) {
		t.Helper()
		m := nats.NewMsg(subject)
		m.Header.Set(outbox.HeaderMsgID, id)
		for k, v := range hdr {
			m.Header.Set(k, v)
		}
		if _, err := n.JS.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	failing := func() []string {
		t.Helper()
		tally, err := verify(ctx, db.Pool, n.JS)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, inv := range tally.Invariants {
			if !inv.OK {
				names = append(names, inv.Name)
			}
		}
		return names
	}
	mustFail := func(step string, names ...string) {
		t.Helper()
		got := failing()
		for _, name := range names {
			if !slices.Contains(got, name) {
				t.Errorf("%s: %q holds, want it to fail (failing: %q)", step, name, got)
			}
		}
	}

	// A consistent state: order 1 applied once and published; a poisoned order 2 published and
	// dead-lettered; a charged payment 1 applied once and published.
	m1, m2, p1 := uuid.NewString(), uuid.NewString(), uuid.NewString()
	exec(`INSERT INTO demo_orders (id, customer, sku, qty, poison, message_id) VALUES (1, 'c1', 'sku-1', 2, false, $1), (2, 'c1', 'sku-2', 1, true, $2)`, m1, m2)
	exec(`UPDATE demo_inventory SET stock = stock - 2 WHERE sku = 'sku-1'`)
	exec(`INSERT INTO demo_effects (kind, ref) VALUES ('order', 1), ('payment', 1)`)
	exec(`INSERT INTO demo_payments (id, customer, amount, message_id, fate) VALUES (1, 'c1', 500, $1, 'commit')`, p1)
	exec(`INSERT INTO demo_charges (payment_id, customer, amount, status) VALUES (1, 'c1', 500, 'charged')`)
	exec(`INSERT INTO demo_points (customer, balance) VALUES ('c1', 50)`)
	exec(`INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state, producer_group, settled_by)
		VALUES ($1, 'payments.captured', 0, '', 'published', 'payments', 'producer')`, p1)
	publish(orderSubject, m1, nil)
	publish(orderSubject, m2, nil)
	publish(paymentSubject, p1, nil)
	publish(consumer.DefaultDeadLetterPrefix+durableName, uuid.NewString(), map[string]string{consumer.HeaderDeadMsgID: m2})
	if got := failing(); len(got) > 0 {
		t.Fatalf("a consistent state fails %q", got)
	}

	// Order 1 applied a second time.
	exec(`INSERT INTO demo_effects (kind, ref) VALUES ('order', 1)`)
	exec(`UPDATE demo_inventory SET stock = stock - 2 WHERE sku = 'sku-1'`)
	mustFail("double application", "every committed order was applied exactly once", "stock and points equal what the committed rows imply (no double application)")

	// An effect for an order that never committed.
	exec(`INSERT INTO demo_effects (kind, ref) VALUES ('order', 99)`)
	mustFail("phantom effect", "no effect without a committed business row")

	// A rolled back order whose message got out.
	m3 := uuid.NewString()
	exec(`INSERT INTO demo_order_rollbacks (id, message_id) VALUES (3, $1)`, m3)
	publish(orderSubject, m3, nil)
	mustFail("leaked rollback", "rolled back order transactions published nothing")

	// A committed order whose message never reached the stream, and a second dead letter for
	// a healthy message.
	m4 := uuid.NewString()
	exec(`INSERT INTO demo_orders (id, customer, sku, qty, poison, message_id) VALUES (4, 'c2', 'sku-2', 1, false, $1)`, m4)
	publish(consumer.DefaultDeadLetterPrefix+durableName, uuid.NewString(), map[string]string{consumer.HeaderDeadMsgID: m1})
	mustFail("lost message", "every committed message reached the stream", "dead letters are exactly the poisoned orders",
		"every committed order was applied exactly once")

	// Two messages of one key stored in the reverse of their commit (outbox id) order.
	k1, k2 := uuid.NewString(), uuid.NewString()
	exec(`INSERT INTO txoutbox_messages (message_id, subject, msg_key, partition_key, payload, state)
		VALUES ($1, 'orders.created', 'c9', 0, '', 'published'), ($2, 'orders.created', 'c9', 0, '', 'published')`, k1, k2)
	publish(orderSubject, k2, nil)
	publish(orderSubject, k1, nil)
	mustFail("key order", "every key's messages are in the stream in commit order")

	// A charged payment whose half message was rolled back, and a prepared row left over.
	exec(`UPDATE txoutbox_messages SET state = 'rolled_back' WHERE message_id = $1`, p1)
	exec(`INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state) VALUES ($1, 'orders.created', 0, '', 'ready')`, uuid.NewString())
	mustFail("half message disagreement", "half messages agree with the payment provider (charged = published, otherwise rolled back)",
		"the outbox is settled (nothing ready, prepared, exhausted or dead)")
}
