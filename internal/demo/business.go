package demo

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
)

// The demo's business: a shop. Orders take stock from the inventory; captured payments earn
// the customer loyalty points. The consumer ("inventory/points") applies both effects.
//
// demo_effects is the consumer's ledger: one row per application of an effect. It has no
// unique constraint on purpose, so that an effect applied twice shows up as two rows (and in
// the stock and points totals) instead of being masked.
const businessDDL = `
CREATE TABLE demo_inventory (
    sku     text PRIMARY KEY,
    initial bigint NOT NULL,
    stock   bigint NOT NULL
);
CREATE TABLE demo_points (
    customer text PRIMARY KEY,
    balance  bigint NOT NULL
);
-- Committed orders (the business rows of the transactional outbox).
CREATE TABLE demo_orders (
    id         bigint PRIMARY KEY,
    customer   text    NOT NULL,
    sku        text    NOT NULL,
    qty        integer NOT NULL,
    poison     boolean NOT NULL,
    message_id uuid    NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
-- Orders whose transaction the producer rolled back on purpose, recorded outside that
-- transaction, so that the checks can prove it left nothing behind.
CREATE TABLE demo_order_rollbacks (
    id         bigint PRIMARY KEY,
    message_id uuid NOT NULL
);
-- Second copies of an order event (a retrying producer): a new message id, the same business key.
CREATE TABLE demo_order_copies (
    order_id   bigint NOT NULL,
    message_id uuid   NOT NULL
);
-- The payments producer's log: one row per half message it prepared, and what it meant to do.
CREATE TABLE demo_payments (
    id         bigint PRIMARY KEY,
    customer   text    NOT NULL,
    amount     integer NOT NULL,
    message_id uuid    NOT NULL,
    fate       text    NOT NULL
);
-- The payment provider, an external system as far as the producer is concerned.
CREATE TABLE demo_charges (
    payment_id bigint PRIMARY KEY,
    customer   text    NOT NULL,
    amount     integer NOT NULL,
    status     text    NOT NULL CHECK (status IN ('charged', 'declined', 'refunded'))
);
-- The consumer's ledger: one row per applied effect, no unique constraint (see above).
-- msg_key and key_pos record the order of application per ordering key: key_pos is n for
-- the n-th effect of its key to commit (see demo_key_applied).
CREATE TABLE demo_effects (
    kind       text   NOT NULL,
    ref        bigint NOT NULL,
    message_id text,
    stream_seq bigint,
    msg_key    text,
    key_pos    bigint,
    applied_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX demo_effects_ref_idx ON demo_effects (kind, ref);
-- How many effects of each ordering key were applied. The consumer's transaction bumps the
-- key's row and stores the new count as the effect's key_pos: the row lock serialises the
-- transactions of one key, so key_pos is the key's commit order of effects, whatever order
-- the consumer chose (it enforces nothing).
CREATE TABLE demo_key_applied (
    msg_key text PRIMARY KEY,
    applied bigint NOT NULL
);
`

// Subjects, stream names and the producer group of the demo.
const (
	orderSubject    = "orders.created"
	paymentSubject  = "payments.captured"
	streamName      = "DEMO"
	deadStreamName  = "DEMO_DEAD"
	durableName     = "inventory"
	paymentsGroup   = "payments"
	headerPaymentID = "Demo-Payment-Id"
	initialStock    = 1_000_000_000
)

var streamSubjects = []string{"orders.>", "payments.>"}

// Payment fates: what the payments producer does with a half message.
const (
	fateCommit          = "commit"            // charge, then commit
	fateDecline         = "decline"           // the provider declines: roll back
	fateDieAfterCharge  = "die-after-charge"  // charged, then the producer dies: the checker says COMMIT
	fateDieBeforeCharge = "die-before-charge" // dies before charging: the checker says ROLLBACK
)

// businessSetup sizes the seed data.
type businessSetup struct {
	SKUs, Customers int
}

func (b *businessSetup) seed(ctx context.Context, tx pgx.Tx) error {
	_, err := tx.Exec(ctx, `INSERT INTO demo_inventory (sku, initial, stock)
		SELECT 'sku-' || i, $2, $2 FROM generate_series(1, $1) AS i`, b.SKUs, initialStock)
	return err
}

type orderEvent struct {
	OrderID  int64  `json:"order_id"`
	Customer string `json:"customer"`
	SKU      string `json:"sku"`
	Qty      int    `json:"qty"`
	Poison   bool   `json:"poison,omitempty"`
}

type paymentEvent struct {
	PaymentID int64  `json:"payment_id"`
	Customer  string `json:"customer"`
	Amount    int    `json:"amount"`
}

// errPoison is what the consumer's handler fails a poisoned order with.
var errPoison = errors.New("poisoned order: the inventory service cannot handle it")

// points is what a payment earns.
func points(amount int) int64 { return int64(amount / 10) }

// inventory is the consumer's handler: it applies an order (stock) or a payment (points) and
// writes a ledger row, in the consumer's transaction.
type inventory struct {
	// poisonPermanent dead-letters poisoned orders at once instead of after MaxDeliveries
	// failed attempts (the chaos run uses it: its kills inflate delivery counts).
	poisonPermanent bool
}

func (inv *inventory) handle(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
	b := &pgx.Batch{}
	switch {
	case strings.HasPrefix(msg.Subject, "orders."):
		var o orderEvent
		if err := json.Unmarshal(msg.Payload, &o); err != nil {
			return consumer.Permanent(fmt.Errorf("decode order: %w", err))
		}
		if o.Poison {
			if inv.poisonPermanent {
				return consumer.Permanent(errPoison)
			}
			return errPoison
		}
		b.Queue(`UPDATE demo_inventory SET stock = stock - $2 WHERE sku = $1`, o.SKU, o.Qty)
		queueEffect(b, "order", o.OrderID, msg)
	case strings.HasPrefix(msg.Subject, "payments."):
		var p paymentEvent
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return consumer.Permanent(fmt.Errorf("decode payment: %w", err))
		}
		b.Queue(`INSERT INTO demo_points (customer, balance) VALUES ($1, $2)
			ON CONFLICT (customer) DO UPDATE SET balance = demo_points.balance + EXCLUDED.balance`, p.Customer, points(p.Amount))
		queueEffect(b, "payment", p.PaymentID, msg)
	default:
		return consumer.Permanent(fmt.Errorf("unexpected subject %q", msg.Subject))
	}
	return tx.SendBatch(ctx, b).Close()
}

// queueEffect queues the ledger row of an effect; for a keyed message it also bumps the key's
// count of applied effects and records the new count as the row's key_pos.
func queueEffect(b *pgx.Batch, kind string, ref int64, msg consumer.Message) {
	if msg.Key == "" {
		b.Queue(`INSERT INTO demo_effects (kind, ref, message_id, stream_seq) VALUES ($1, $2, $3, $4)`,
			kind, ref, msg.ID, int64(msg.StreamSeq))
		return
	}
	b.Queue(`WITH k AS (
			INSERT INTO demo_key_applied (msg_key, applied) VALUES ($5, 1)
			ON CONFLICT (msg_key) DO UPDATE SET applied = demo_key_applied.applied + 1
			RETURNING applied)
		INSERT INTO demo_effects (kind, ref, message_id, stream_seq, msg_key, key_pos)
		SELECT $1, $2, $3, $4, $5, k.applied FROM k`,
		kind, ref, msg.ID, int64(msg.StreamSeq), msg.Key)
}

// producer runs the orders and payments producers.
type producer struct {
	pool      *pgxpool.Pool
	client    *outbox.Client
	customers int
	skus      int

	ordersCommitted  atomic.Int64
	ordersPoisoned   atomic.Int64
	ordersRolledBack atomic.Int64
	orderCopies      atomic.Int64
	paymentsPrepared atomic.Int64
	charged          atomic.Int64 // payments charged for good: their message will be published
}

type orderFate int

const (
	orderNormal orderFate = iota
	orderPoison
	orderRollback
	orderWithCopy
)

func (p *producer) customer(r *rand.Rand) string {
	return "customer-" + strconv.Itoa(1+r.IntN(p.customers))
}

// order creates an order: the order row and its outbox message in one transaction
// (EnqueueTx). A rollback fate rolls the transaction back after both were written; a copy fate
// enqueues the event a second time in a later transaction, as a retrying producer would.
func (p *producer) order(ctx context.Context, r *rand.Rand, id int64, fate orderFate) error {
	ev := orderEvent{OrderID: id, Customer: p.customer(r), SKU: "sku-" + strconv.Itoa(1+r.IntN(p.skus)), Qty: 1 + r.IntN(5), Poison: fate == orderPoison}
	body, _ := json.Marshal(ev)
	msg := outbox.Message{Subject: orderSubject, Key: ev.Customer, BizKey: "order:" + strconv.FormatInt(id, 10), Payload: body}
	tx, err := p.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("order %d: %w", id, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	ids, err := p.client.EnqueueTx(ctx, tx, msg)
	if err != nil {
		return fmt.Errorf("order %d: enqueue: %w", id, err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO demo_orders (id, customer, sku, qty, poison, message_id) VALUES ($1, $2, $3, $4, $5, $6)`,
		id, ev.Customer, ev.SKU, ev.Qty, ev.Poison, ids[0]); err != nil {
		return fmt.Errorf("order %d: %w", id, err)
	}
	if fate == orderRollback {
		// The customer cancelled at checkout: the order and its message vanish together.
		if _, err := p.pool.Exec(ctx, `INSERT INTO demo_order_rollbacks (id, message_id) VALUES ($1, $2)`, id, ids[0]); err != nil {
			return fmt.Errorf("order %d: %w", id, err)
		}
		if err := tx.Rollback(ctx); err != nil {
			return fmt.Errorf("order %d: rollback: %w", id, err)
		}
		p.ordersRolledBack.Add(1)
		return nil
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("order %d: commit: %w", id, err)
	}
	p.client.Ring()
	if fate == orderPoison {
		p.ordersPoisoned.Add(1)
	} else {
		p.ordersCommitted.Add(1)
	}
	if fate == orderWithCopy {
		// A retry enqueues the same event again: a new message id (so JetStream stores both,
		// as it would a republish after its duplicate window), the same business key.
		err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
			ids, err := p.client.EnqueueTx(ctx, tx, msg)
			if err != nil {
				return err
			}
			_, err = tx.Exec(ctx, `INSERT INTO demo_order_copies (order_id, message_id) VALUES ($1, $2)`, id, ids[0])
			return err
		})
		if err != nil {
			return fmt.Errorf("order %d: copy: %w", id, err)
		}
		p.client.Ring()
		p.orderCopies.Add(1)
	}
	return nil
}

// payment captures a payment at the provider with a half message: prepare, call the provider,
// then commit or roll back, or die before settling and leave it to the check-back.
func (p *producer) payment(ctx context.Context, r *rand.Rand, id int64, fate string) error {
	ev := paymentEvent{PaymentID: id, Customer: p.customer(r), Amount: 100 * (1 + r.IntN(50))}
	body, _ := json.Marshal(ev)
	msg := outbox.Message{
		Subject: paymentSubject, Key: ev.Customer, BizKey: "payment:" + strconv.FormatInt(id, 10), Payload: body,
		Headers: map[string][]string{headerPaymentID: {strconv.FormatInt(id, 10)}},
	}
	opts := &outbox.PrepareOptions{Group: paymentsGroup}
	logIt := func(h outbox.Half) error {
		_, err := p.pool.Exec(ctx, `INSERT INTO demo_payments (id, customer, amount, message_id, fate) VALUES ($1, $2, $3, $4, $5)`,
			id, ev.Customer, ev.Amount, h.ID, fate)
		return err
	}
	charge := func(status string) error {
		_, err := p.pool.Exec(ctx, `INSERT INTO demo_charges (payment_id, customer, amount, status) VALUES ($1, $2, $3, $4)`,
			id, ev.Customer, ev.Amount, status)
		return err
	}
	switch fate {
	case fateCommit, fateDecline:
		// The common case in one call: prepare, run the local transaction, settle by its answer.
		_, _, err := p.client.SendInTransaction(ctx, p.pool, msg, opts, func(ctx context.Context, h outbox.Half) (outbox.LocalState, error) {
			p.paymentsPrepared.Add(1)
			if err := logIt(h); err != nil {
				return outbox.StateUnknown, err
			}
			if fate == fateDecline {
				if err := charge("declined"); err != nil {
					return outbox.StateUnknown, err
				}
				return outbox.StateRollback, nil
			}
			if err := charge("charged"); err != nil {
				return outbox.StateUnknown, err
			}
			return outbox.StateCommit, nil
		})
		if errors.Is(err, outbox.ErrRolledBack) && fate == fateCommit {
			// The check-back asked before the charge was visible and got ROLLBACK (the checker
			// gave up on it): the message will never be published, so undo the charge.
			if _, err := p.pool.Exec(ctx, `UPDATE demo_charges SET status = 'refunded' WHERE payment_id = $1`, id); err != nil {
				return fmt.Errorf("payment %d: refund: %w", id, err)
			}
			return nil
		}
		if errors.Is(err, outbox.ErrRolledBack) {
			return nil // declined and rolled back, by us or by the check-back: the same outcome
		}
		if err != nil {
			return fmt.Errorf("payment %d: %w", id, err)
		}
		if fate == fateCommit {
			p.charged.Add(1)
		}
		return nil
	default:
		h, err := p.client.Prepare(ctx, p.pool, msg, opts)
		if err != nil {
			return fmt.Errorf("payment %d: prepare: %w", id, err)
		}
		p.paymentsPrepared.Add(1)
		if err := logIt(h); err != nil {
			return fmt.Errorf("payment %d: %w", id, err)
		}
		if fate == fateDieAfterCharge {
			if err := charge("charged"); err != nil {
				return fmt.Errorf("payment %d: charge: %w", id, err)
			}
			p.charged.Add(1)
		}
		return nil // the producer "dies": the half message stays prepared
	}
}

// payChecker answers the check-back for the payments group by asking the provider whether the
// payment was charged. A payment the provider has never heard of is UNKNOWN while it is young
// (the producer may be about to charge it) and ROLLBACK after giveUp.
type payChecker struct {
	pool   *pgxpool.Pool
	giveUp time.Duration

	commit, rollback, unknown atomic.Int64
}

func (c *payChecker) check(ctx context.Context, req checker.Request) (outbox.LocalState, error) {
	st, err := c.answer(ctx, req)
	switch {
	case err != nil || st == outbox.StateUnknown:
		c.unknown.Add(1)
	case st == outbox.StateCommit:
		c.commit.Add(1)
	default:
		c.rollback.Add(1)
	}
	return st, err
}

func (c *payChecker) answer(ctx context.Context, req checker.Request) (outbox.LocalState, error) {
	var id int64
	if vs := req.Headers[headerPaymentID]; len(vs) == 1 {
		id, _ = strconv.ParseInt(vs[0], 10, 64)
	}
	if id == 0 {
		return outbox.StateUnknown, fmt.Errorf("message %s has no %s header", req.MessageID, headerPaymentID)
	}
	var status string
	err := c.pool.QueryRow(ctx, `SELECT status FROM demo_charges WHERE payment_id = $1`, id).Scan(&status)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		if time.Since(req.PreparedAt) > c.giveUp {
			return outbox.StateRollback, nil
		}
		return outbox.StateUnknown, nil
	case err != nil:
		return outbox.StateUnknown, err
	case status == "charged":
		return outbox.StateCommit, nil
	}
	return outbox.StateRollback, nil
}
