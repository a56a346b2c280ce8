package demo

import (
	"context"
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
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
	mustFail("key order", KeyOrderInvariant)
	exec(`UPDATE txoutbox_messages SET state = 'rolled_back' WHERE message_id IN ($1, $2)`, k1, k2)

	// A message stored a second time, right after its first copy (a republish after an outage
	// longer than the duplicate window), keeps its key's order; a copy stored after a later
	// message of its key (a stale send) does not.
	k3, k4 := uuid.NewString(), uuid.NewString()
	exec(`INSERT INTO txoutbox_messages (message_id, subject, msg_key, partition_key, payload, state)
		VALUES ($1, 'orders.created', 'c8', 0, '', 'published'), ($2, 'orders.created', 'c8', 0, '', 'published')`, k3, k4)
	// The stream's duplicate window shrinks to its minimum, and a copy is sent until the
	// stream stores it (its window passed). Twice: nats-server fires its purge of message ids
	// at once on an update, and that purge can run before the update has set the new window,
	// keep the old one (minutes) and schedule the next purge by it; the second update's purge
	// then runs with a small window either way.
	for _, w := range []time.Duration{101 * time.Millisecond, 100 * time.Millisecond} {
		if _, err := n.JS.UpdateStream(ctx, jetstream.StreamConfig{Name: streamName, Subjects: streamSubjects,
			Storage: jetstream.FileStorage, Duplicates: w}); err != nil {
			t.Fatal(err)
		}
	}
	storeCopy := func(id string) {
		t.Helper()
		testsvc.Eventually(t, 10*time.Second, "a copy of "+id+" stored past the duplicate window", func() bool {
			m := nats.NewMsg(orderSubject)
			m.Header.Set(outbox.HeaderMsgID, id)
			ack, err := n.JS.PublishMsg(ctx, m)
			if err != nil {
				t.Fatal(err)
			}
			return !ack.Duplicate
		})
	}
	publish(orderSubject, k3, nil)
	storeCopy(k3)
	publish(orderSubject, k4, nil)
	if slices.Contains(failing(), KeyOrderInvariant) {
		t.Fatal("a second copy right after the first: the key order check fails")
	}
	storeCopy(k3)
	mustFail("stale copy", KeyOrderInvariant)

	// A charged payment whose half message was rolled back, and a prepared row left over.
	exec(`UPDATE txoutbox_messages SET state = 'rolled_back' WHERE message_id = $1`, p1)
	exec(`INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state) VALUES ($1, 'orders.created', 0, '', 'ready')`, uuid.NewString())
	mustFail("half message disagreement", "half messages agree with the payment provider (charged = published, otherwise rolled back)",
		"the outbox is settled (nothing ready, prepared, exhausted or dead)")
}

// The applied-order check of the ordered chaos consumer can fail: per key, an effect applied
// out of commit order, a published message never applied and one applied twice each fail it;
// the handler's key_pos is the key's commit order.
func TestVerifyAppliedOrderDetectsViolations(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
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
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	// publish adds a published outbox row of key c1 and returns its message id.
	publish := func() string {
		t.Helper()
		id := uuid.NewString()
		exec(`INSERT INTO txoutbox_messages (message_id, subject, msg_key, partition_key, payload, state)
			VALUES ($1, 'orders.created', 'c1', 0, '', 'published')`, id)
		return id
	}
	// apply runs the consumer's handler for order ref (message id) in a transaction of its own.
	apply := func(ref int64, id string) {
		t.Helper()
		data, _ := json.Marshal(orderEvent{OrderID: ref, Customer: "c1", SKU: "sku-1", Qty: 1})
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			return (&inventory{}).handle(ctx, tx, consumer.Message{Subject: orderSubject, ID: id, Key: "c1", Payload: data})
		}); err != nil {
			t.Fatal(err)
		}
	}
	holds := func() bool {
		t.Helper()
		tally := &Tally{}
		if err := verifyAppliedOrder(ctx, db.Pool, tally); err != nil {
			t.Fatal(err)
		}
		if len(tally.Invariants) != 1 || tally.Invariants[0].Name != AppliedOrderInvariant {
			t.Fatalf("invariants %+v, want only %q", tally.Invariants, AppliedOrderInvariant)
		}
		t.Log(tally.Invariants[0].Detail)
		return tally.Invariants[0].OK
	}

	// A consistent state: two messages of c1 applied in commit order, a poisoned one never.
	m1, m2, poison := publish(), publish(), publish()
	exec(`INSERT INTO demo_orders (id, customer, sku, qty, poison, message_id) VALUES (3, 'c1', 'sku-1', 1, true, $1)`, poison)
	apply(1, m1)
	apply(2, m2)
	var pos []int64
	if err := db.Pool.QueryRow(ctx, `SELECT array_agg(key_pos ORDER BY ref) FROM demo_effects WHERE msg_key = 'c1'`).Scan(&pos); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(pos, []int64{1, 2}) {
		t.Fatalf("key_pos of orders 1 and 2: %v, want [1 2]", pos)
	}
	if !holds() {
		t.Fatal("a consistent state fails")
	}

	// A later message of the key applied before an earlier one.
	m3, m4 := publish(), publish()
	apply(4, m4)
	apply(3, m3)
	if holds() {
		t.Error("an effect applied after a later one of its key: the check holds")
	}
	exec(`DELETE FROM demo_effects WHERE ref IN (3, 4)`)
	exec(`UPDATE demo_key_applied SET applied = 2`)

	// A published message of the key never applied (a gap).
	if holds() {
		t.Error("a gap in the key's effects: the check holds")
	}
	apply(3, m3)
	apply(4, m4)
	if !holds() {
		t.Fatal("the key's effects in order again: the check fails")
	}

	// A message applied twice.
	apply(4, m4)
	if holds() {
		t.Error("an effect applied twice: the check holds")
	}

}
