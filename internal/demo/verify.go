package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/outbox"
)

// Invariant is one property of the end state, checked from the database and the streams.
type Invariant struct {
	Name   string
	OK     bool
	Detail string // what was found when it does not hold (or a count when it does)
}

// Tally is what the end state holds.
type Tally struct {
	Orders, Poisoned, RolledBackOrders, OrderCopies int64
	Payments                                        int64
	PaymentsByFate                                  map[string]int64
	Charged, Declined, Refunded                     int64

	// Half messages of the payments group, by outcome and by who settled them.
	HalfCommittedByProducer, HalfCommittedByCheckback   int64
	HalfRolledBackByProducer, HalfRolledBackByCheckback int64
	HalfUnsettled                                       int64

	Effects, OrderEffects, PaymentEffects int64

	StreamMsgs, StreamDistinctIDs int64
	DeadLetters, DeadDistinct     int64

	Invariants []Invariant
}

// OK reports whether every invariant held.
func (t *Tally) OK() bool {
	for _, inv := range t.Invariants {
		if !inv.OK {
			return false
		}
	}
	return len(t.Invariants) > 0
}

// streamMsg is what the checks need from a stored message: its headers.
type streamMsg struct {
	Subject   string
	MsgID     string
	BizKey    string
	DeadMsgID string
}

// readStream reads the headers of every message in a stream with an ordered consumer.
func readStream(ctx context.Context, js jetstream.JetStream, name string) ([]streamMsg, error) {
	s, err := js.Stream(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", name, err)
	}
	want := int(info.State.Msgs)
	out := make([]streamMsg, 0, want)
	if want == 0 {
		return out, nil
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{HeadersOnly: true})
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", name, err)
	}
	for len(out) < want {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("stream %s: read %d of %d messages: %w", name, len(out), want, ctx.Err())
		}
		batch, err := cons.Fetch(min(want-len(out), 1000), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			return nil, fmt.Errorf("stream %s: %w", name, err)
		}
		for m := range batch.Messages() {
			h := m.Headers()
			out = append(out, streamMsg{Subject: m.Subject(), MsgID: h.Get(outbox.HeaderMsgID), BizKey: h.Get(outbox.HeaderBizKey),
				DeadMsgID: h.Get(consumer.HeaderDeadMsgID)})
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) {
			return nil, fmt.Errorf("stream %s: %w", name, err)
		}
	}
	return out, nil
}

// verify checks the end state. It reads the business tables and the outbox through db (whose
// search_path is the demo's schema) and the two streams through js.
func verify(ctx context.Context, db *pgxpool.Pool, js jetstream.JetStream) (*Tally, error) {
	t := &Tally{PaymentsByFate: map[string]int64{}}
	scalar := func(dst *int64, sql string, args ...any) error {
		return db.QueryRow(ctx, sql, args...).Scan(dst)
	}
	for _, q := range []struct {
		dst *int64
		sql string
	}{
		{&t.Orders, `SELECT count(*) FROM demo_orders WHERE NOT poison`},
		{&t.Poisoned, `SELECT count(*) FROM demo_orders WHERE poison`},
		{&t.RolledBackOrders, `SELECT count(*) FROM demo_order_rollbacks`},
		{&t.OrderCopies, `SELECT count(*) FROM demo_order_copies`},
		{&t.Payments, `SELECT count(*) FROM demo_payments`},
		{&t.Charged, `SELECT count(*) FROM demo_charges WHERE status = 'charged'`},
		{&t.Declined, `SELECT count(*) FROM demo_charges WHERE status = 'declined'`},
		{&t.Refunded, `SELECT count(*) FROM demo_charges WHERE status = 'refunded'`},
		{&t.Effects, `SELECT count(*) FROM demo_effects`},
		{&t.OrderEffects, `SELECT count(*) FROM demo_effects WHERE kind = 'order'`},
		{&t.PaymentEffects, `SELECT count(*) FROM demo_effects WHERE kind = 'payment'`},
		{&t.HalfCommittedByProducer, `SELECT count(*) FROM txoutbox_messages WHERE producer_group = $1 AND state IN ('ready', 'published') AND settled_by = 'producer'`},
		{&t.HalfCommittedByCheckback, `SELECT count(*) FROM txoutbox_messages WHERE producer_group = $1 AND state IN ('ready', 'published') AND settled_by LIKE 'checkback:%'`},
		{&t.HalfRolledBackByProducer, `SELECT count(*) FROM txoutbox_messages WHERE producer_group = $1 AND state = 'rolled_back' AND settled_by = 'producer'`},
		{&t.HalfRolledBackByCheckback, `SELECT count(*) FROM txoutbox_messages WHERE producer_group = $1 AND state = 'rolled_back' AND settled_by LIKE 'checkback:%'`},
		{&t.HalfUnsettled, `SELECT count(*) FROM txoutbox_messages WHERE producer_group = $1 AND state IN ('prepared', 'check_exhausted')`},
	} {
		var args []any
		if strings.Contains(q.sql, "$1") {
			args = append(args, paymentsGroup)
		}
		if err := scalar(q.dst, q.sql, args...); err != nil {
			return nil, fmt.Errorf("verify: %s: %w", q.sql, err)
		}
	}
	rows, err := db.Query(ctx, `SELECT fate, count(*) FROM demo_payments GROUP BY fate`)
	if err != nil {
		return nil, fmt.Errorf("verify: %w", err)
	}
	for rows.Next() {
		var f string
		var n int64
		if err := rows.Scan(&f, &n); err != nil {
			return nil, err
		}
		t.PaymentsByFate[f] = n
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("verify: %w", err)
	}

	stored, err := readStream(ctx, js, streamName)
	if err != nil {
		return nil, fmt.Errorf("verify: %w", err)
	}
	dead, err := readStream(ctx, js, deadStreamName)
	if err != nil {
		return nil, fmt.Errorf("verify: %w", err)
	}
	inStream := map[string]int{}
	for _, m := range stored {
		inStream[m.MsgID]++
	}
	t.StreamMsgs, t.StreamDistinctIDs = int64(len(stored)), int64(len(inStream))
	deadIDs := map[string]int{}
	for _, m := range dead {
		deadIDs[m.DeadMsgID]++
	}
	t.DeadLetters, t.DeadDistinct = int64(len(dead)), int64(len(deadIDs))

	add := func(name string, bad int64, detail string) {
		inv := Invariant{Name: name, OK: bad == 0}
		if bad != 0 {
			inv.Detail = detail
		}
		t.Invariants = append(t.Invariants, inv)
	}
	// listing runs a query returning (count, sample) for an invariant.
	listing := func(name, sql string, args ...any) error {
		var n int64
		var sample []string
		if err := db.QueryRow(ctx, `SELECT count(*), coalesce((array_agg(x))[1:5], '{}') FROM (`+sql+`) AS bad(x)`, args...).Scan(&n, &sample); err != nil {
			return fmt.Errorf("verify: %s: %w", name, err)
		}
		add(name, n, fmt.Sprintf("%d found, e.g. %s", n, strings.Join(sample, "; ")))
		return nil
	}

	if err := listing("every committed order was applied exactly once",
		`SELECT format('order %s applied %s times', o.id, count(e.ref)) FROM demo_orders o
		   LEFT JOIN demo_effects e ON e.kind = 'order' AND e.ref = o.id
		  WHERE NOT o.poison GROUP BY o.id HAVING count(e.ref) <> 1`); err != nil {
		return nil, err
	}
	if err := listing("every charged payment earned its points exactly once",
		`SELECT format('payment %s applied %s times', c.payment_id, count(e.ref)) FROM demo_charges c
		   LEFT JOIN demo_effects e ON e.kind = 'payment' AND e.ref = c.payment_id
		  WHERE c.status = 'charged' GROUP BY c.payment_id HAVING count(e.ref) <> 1`); err != nil {
		return nil, err
	}
	if err := listing("no effect without a committed business row",
		`SELECT format('%s %s', e.kind, e.ref) FROM demo_effects e
		  WHERE (e.kind = 'order' AND NOT EXISTS (SELECT 1 FROM demo_orders o WHERE o.id = e.ref AND NOT o.poison))
		     OR (e.kind = 'payment' AND NOT EXISTS (SELECT 1 FROM demo_charges c WHERE c.payment_id = e.ref AND c.status = 'charged'))
		     OR e.kind NOT IN ('order', 'payment')`); err != nil {
		return nil, err
	}
	if err := listing("stock and points equal what the committed rows imply (no double application)",
		`SELECT format('%s: stock %s, expected %s', i.sku, i.stock, i.initial - coalesce(o.q, 0)) FROM demo_inventory i
		   LEFT JOIN (SELECT sku, sum(qty) AS q FROM demo_orders WHERE NOT poison GROUP BY sku) o USING (sku)
		  WHERE i.stock <> i.initial - coalesce(o.q, 0)
		 UNION ALL
		 SELECT format('%s: %s points, expected %s', coalesce(p.customer, c.customer), coalesce(p.balance, 0), coalesce(c.pts, 0))
		   FROM demo_points p FULL JOIN (SELECT customer, sum(amount / 10) AS pts FROM demo_charges WHERE status = 'charged' GROUP BY customer) c
		     ON c.customer = p.customer
		  WHERE coalesce(p.balance, 0) <> coalesce(c.pts, 0)`); err != nil {
		return nil, err
	}

	// Rolled back order transactions: nothing in the tables, the outbox or the stream.
	var rbIDs []string
	if err := listing("rolled back order transactions left no row, no message, no effect",
		`SELECT format('order %s: %s', r.id, concat_ws(', ',
		        CASE WHEN EXISTS (SELECT 1 FROM demo_orders o WHERE o.id = r.id) THEN 'order row' END,
		        CASE WHEN EXISTS (SELECT 1 FROM txoutbox_messages m WHERE m.message_id = r.message_id) THEN 'outbox row' END,
		        CASE WHEN EXISTS (SELECT 1 FROM demo_effects e WHERE e.kind = 'order' AND e.ref = r.id) THEN 'effect' END))
		   FROM demo_order_rollbacks r
		  WHERE EXISTS (SELECT 1 FROM demo_orders o WHERE o.id = r.id)
		     OR EXISTS (SELECT 1 FROM txoutbox_messages m WHERE m.message_id = r.message_id)
		     OR EXISTS (SELECT 1 FROM demo_effects e WHERE e.kind = 'order' AND e.ref = r.id)`); err != nil {
		return nil, err
	}
	if err := collect(ctx, db, &rbIDs, `SELECT message_id::text FROM demo_order_rollbacks`); err != nil {
		return nil, err
	}
	var leaked []string
	for _, id := range rbIDs {
		if inStream[id] > 0 {
			leaked = append(leaked, id)
		}
	}
	add("rolled back order transactions published nothing", int64(len(leaked)),
		fmt.Sprintf("%d of their message ids are in stream %s, e.g. %s", len(leaked), streamName, strings.Join(first(leaked, 3), ", ")))

	if err := listing("half messages agree with the payment provider (charged = published, otherwise rolled back)",
		`SELECT format('payment %s (%s): charge %s, message %s', p.id, p.fate, coalesce(c.status, 'none'), coalesce(m.state, 'gone'))
		   FROM demo_payments p
		   LEFT JOIN demo_charges c ON c.payment_id = p.id
		   LEFT JOIN txoutbox_messages m ON m.message_id = p.message_id
		  WHERE (coalesce(c.status, '') = 'charged' AND coalesce(m.state, '') <> 'published')
		     OR (coalesce(c.status, '') <> 'charged' AND coalesce(m.state, '') <> 'rolled_back')`); err != nil {
		return nil, err
	}

	// Nothing lost: every committed message is in the stream.
	var committedIDs []string
	if err := collect(ctx, db, &committedIDs, `
		SELECT message_id::text FROM demo_orders
		UNION ALL SELECT message_id::text FROM demo_order_copies
		UNION ALL SELECT p.message_id::text FROM demo_payments p JOIN demo_charges c ON c.payment_id = p.id AND c.status = 'charged'`); err != nil {
		return nil, err
	}
	var missing []string
	for _, id := range committedIDs {
		if inStream[id] == 0 {
			missing = append(missing, id)
		}
	}
	add("every committed message reached the stream", int64(len(missing)),
		fmt.Sprintf("%d of %d missing from stream %s, e.g. %s", len(missing), len(committedIDs), streamName, strings.Join(first(missing, 3), ", ")))

	// Per-key order: the stream holds each key's messages in commit order, which is the
	// outbox's id order for one key (a committed half message draws a new id), every copy
	// included. A message is republished only while it is unsettled, and a key's next message
	// is sent only after the previous one's PubAck, so a second copy (a republish the
	// duplicate window did not absorb: after an outage longer than the window) comes before
	// any later message of its key. A copy stored after a later message of its key is a stale
	// send (a relay that lost its lease and published what it had claimed). Rows no longer in
	// the outbox are not checked.
	type keyedRow struct {
		key string
		id  int64
	}
	rowOf := map[string]keyedRow{}
	krows, err := db.Query(ctx, `SELECT message_id::text, msg_key, id FROM txoutbox_messages WHERE msg_key IS NOT NULL AND state = 'published'`)
	if err != nil {
		return nil, fmt.Errorf("verify: %w", err)
	}
	for krows.Next() {
		var msgID string
		var r keyedRow
		if err := krows.Scan(&msgID, &r.key, &r.id); err != nil {
			krows.Close()
			return nil, fmt.Errorf("verify: %w", err)
		}
		rowOf[msgID] = r
	}
	if err := krows.Err(); err != nil {
		return nil, fmt.Errorf("verify: %w", err)
	}
	lastOfKey := map[string]int64{}
	seenID := map[string]bool{}
	var outOfOrder []string
	for _, m := range stored {
		r, ok := rowOf[m.MsgID]
		if !ok {
			continue
		}
		again := seenID[m.MsgID]
		seenID[m.MsgID] = true
		if prev, ok := lastOfKey[r.key]; ok && r.id < prev {
			what := "stored after"
			if again {
				what = "stored again after"
			}
			outOfOrder = append(outOfOrder, fmt.Sprintf("key %s: outbox row %d %s row %d", r.key, r.id, what, prev))
			continue
		}
		lastOfKey[r.key] = r.id
	}
	add(KeyOrderInvariant, int64(len(outOfOrder)),
		fmt.Sprintf("%d copies stored after a later message of their key, e.g. %s", len(outOfOrder), strings.Join(first(outOfOrder, 3), "; ")))

	// Dead letters: exactly the poisoned orders.
	var poisonIDs []string
	if err := collect(ctx, db, &poisonIDs, `SELECT message_id::text FROM demo_orders WHERE poison`); err != nil {
		return nil, err
	}
	var notDead, unexpected []string
	for _, id := range poisonIDs {
		if deadIDs[id] == 0 {
			notDead = append(notDead, id)
		}
	}
	for id := range deadIDs {
		if !slices.Contains(poisonIDs, id) {
			unexpected = append(unexpected, id)
		}
	}
	slices.Sort(unexpected)
	add("dead letters are exactly the poisoned orders", int64(len(notDead)+len(unexpected)),
		fmt.Sprintf("%d poisoned orders not dead-lettered (%s); %d dead letters for other messages (%s)",
			len(notDead), strings.Join(first(notDead, 3), ", "), len(unexpected), strings.Join(first(unexpected, 3), ", ")))

	if err := listing("the outbox is settled (nothing ready, prepared, exhausted or dead)",
		`SELECT format('%s rows %s', count(*), state) FROM txoutbox_messages
		  WHERE state IN ('ready', 'prepared', 'check_exhausted', 'dead') GROUP BY state`); err != nil {
		return nil, err
	}
	return t, nil
}

func collect(ctx context.Context, db *pgxpool.Pool, dst *[]string, sql string) error {
	rows, err := db.Query(ctx, sql)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	v, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	*dst = v
	return nil
}

func first(s []string, n int) []string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// printInvariants prints one line per invariant and returns whether all held.
func printInvariants(w io.Writer, t *Tally) bool {
	fmt.Fprintln(w, "Invariants (checked from PostgreSQL and the JetStream streams):")
	for _, inv := range t.Invariants {
		if inv.OK {
			fmt.Fprintf(w, "  [ok]   %s\n", inv.Name)
		} else {
			fmt.Fprintf(w, "  [FAIL] %s: %s\n", inv.Name, inv.Detail)
		}
	}
	if t.OK() {
		fmt.Fprintln(w, "All invariants held.")
	} else {
		fmt.Fprintln(w, "SOME INVARIANTS DID NOT HOLD.")
	}
	return t.OK()
}

// KeyOrderInvariant is verify's check of the stream's per-key order.
const KeyOrderInvariant = "every key's messages are in the stream in commit order, every copy included (nothing stale stored)"

// AppliedOrderInvariant is the invariant verifyAppliedOrder adds.
const AppliedOrderInvariant = "every key's effects were applied in commit order, none missing, none twice"

// verifyAppliedOrder adds to t the invariant of an ordered consumer (consumer.Config.Ordered):
// per ordering key, the effects were applied (committed) in the producer's commit order, which
// is the outbox's id order for one key, with no gap and no duplicate. The applied order is the
// ledger's key_pos (see demo_key_applied); the expected sequence is every published keyed
// message of the outbox but the poisoned orders (dead-lettered, never applied). It needs the
// published rows kept (a retention longer than the run).
func verifyAppliedOrder(ctx context.Context, db *pgxpool.Pool, t *Tally) error {
	expected := map[string][]int64{}
	rows, err := db.Query(ctx, `SELECT m.msg_key, m.id FROM txoutbox_messages m
		WHERE m.msg_key IS NOT NULL AND m.state = 'published'
		  AND NOT EXISTS (SELECT 1 FROM demo_orders o WHERE o.message_id = m.message_id AND o.poison)
		ORDER BY m.msg_key, m.id`)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	for rows.Next() {
		var key string
		var id int64
		if err := rows.Scan(&key, &id); err != nil {
			rows.Close()
			return fmt.Errorf("verify: %w", err)
		}
		expected[key] = append(expected[key], id)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	type applied struct {
		pos   int64
		id    int64 // 0: no published outbox row has the effect's message id
		msgID string
	}
	got := map[string][]applied{}
	var unkeyed int64
	rows, err = db.Query(ctx, `SELECT e.msg_key, coalesce(e.key_pos, 0), coalesce(m.id, 0), coalesce(e.message_id, '')
		FROM demo_effects e
		LEFT JOIN txoutbox_messages m ON m.message_id::text = e.message_id AND m.state = 'published'
		ORDER BY e.msg_key, e.key_pos`)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	for rows.Next() {
		var key *string
		var a applied
		if err := rows.Scan(&key, &a.pos, &a.id, &a.msgID); err != nil {
			rows.Close()
			return fmt.Errorf("verify: %w", err)
		}
		if key == nil {
			unkeyed++
			continue
		}
		got[*key] = append(got[*key], a)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("verify: %w", err)
	}

	var bad []string
	var badKeys int64
	for key, want := range expected {
		if _, ok := got[key]; !ok {
			badKeys++
			bad = append(bad, fmt.Sprintf("key %s: none of its %d messages applied", key, len(want)))
		}
	}
	for key, as := range got {
		want := expected[key]
		var problems []string
		seen := map[int64]bool{}
		var last int64
		for i, a := range as {
			switch {
			case a.pos != int64(i+1):
				problems = append(problems, fmt.Sprintf("applied position %d where %d was due (a gap or a repeat in the key's count)", a.pos, i+1))
			case a.id == 0:
				problems = append(problems, fmt.Sprintf("effect %d is of message %q, no published message of the outbox", a.pos, a.msgID))
			case seen[a.id]:
				problems = append(problems, fmt.Sprintf("outbox row %d applied twice (again as effect %d)", a.id, a.pos))
			case a.id < last:
				problems = append(problems, fmt.Sprintf("outbox row %d applied after row %d (effect %d)", a.id, last, a.pos))
			}
			if a.id != 0 {
				seen[a.id] = true
				last = max(last, a.id)
			}
		}
		for _, id := range want {
			if !seen[id] {
				problems = append(problems, fmt.Sprintf("outbox row %d never applied", id))
			}
		}
		if len(problems) > 0 {
			badKeys++
			bad = append(bad, fmt.Sprintf("key %s: %s", key, strings.Join(first(problems, 3), ", ")))
		}
	}
	slices.Sort(bad)
	n := badKeys + unkeyed
	inv := Invariant{Name: AppliedOrderInvariant, OK: n == 0}
	if n != 0 {
		inv.Detail = fmt.Sprintf("%d keys out of order or incomplete, %d effects without a key; e.g. %s", badKeys, unkeyed, strings.Join(first(bad, 3), "; "))
	}
	t.Invariants = append(t.Invariants, inv)
	return nil
}
