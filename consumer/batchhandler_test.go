package consumer

import (
	"context"
	"errors"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// recordEffects is the set-based standard handler: one business row per message, all of the
// batch in one statement.
func recordEffects(ctx context.Context, tx pgx.Tx, msgs []Message) error {
	idem, subj, payload := make([]string, len(msgs)), make([]string, len(msgs)), make([]string, len(msgs))
	delivery := make([]int32, len(msgs))
	for i, m := range msgs {
		idem[i], subj[i], payload[i], delivery[i] = m.IdempotencyKey, m.Subject, string(m.Payload), int32(m.Delivery)
	}
	_, err := tx.Exec(ctx, `INSERT INTO effects (idem, subject, payload, delivery)
		SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int[])`, idem, subj, payload, delivery)
	return err
}

// calls records the batches a batch handler was called with, by payload.
type calls struct {
	mu      sync.Mutex
	batches [][]string
}

func (c *calls) add(msgs []Message) {
	b := make([]string, len(msgs))
	for i, m := range msgs {
		b[i] = string(m.Payload)
	}
	c.mu.Lock()
	c.batches = append(c.batches, b)
	c.mu.Unlock()
}

// runsOf counts the batches that held payload.
func (c *calls) runsOf(payload string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, b := range c.batches {
		if slices.Contains(b, payload) {
			n++
		}
	}
	return n
}

func (c *calls) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.batches)
}

func (e *env) newBatchConsumer(cfg *Config, h BatchHandler) *Consumer {
	e.t.Helper()
	c, err := NewBatch(e.db.Pool, e.nats.JS, h, e.config(cfg))
	if err != nil {
		e.t.Fatal(err)
	}
	return c
}

// items fetches n messages from c's durable as a dispatcher would hand them over.
func (e *env) items(c *Consumer, n int) []*item {
	e.t.Helper()
	var items []*item
	for _, m := range e.fetch(c, n) {
		items = append(items, newItem(m, false))
	}
	return items
}

// checkOnce fails unless every one of keys has exactly one effect.
func (e *env) checkOnce(keys ...string) {
	e.t.Helper()
	for _, k := range keys {
		if n := e.effectsOf(k); n != 1 {
			e.t.Errorf("effects of %s: %d, want 1", k, n)
		}
	}
}

func TestNewBatchDefaults(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c := e.newBatchConsumer(nil, recordEffects)
	if got := c.Config().BatchSize; got != DefaultBatchHandlerSize {
		t.Errorf("BatchSize %d, want %d", got, DefaultBatchHandlerSize)
	}
	c = e.newBatchConsumer(&Config{BatchSize: 7}, recordEffects)
	if got := c.Config().BatchSize; got != 7 {
		t.Errorf("BatchSize %d, want 7", got)
	}
	_, err := NewBatch(e.db.Pool, e.nats.JS, recordEffects, e.config(&Config{BatchSize: MaxBatchSize + 1}))
	if cerr := (*txoutbox.ConfigError)(nil); !errors.As(err, &cerr) {
		t.Errorf("BatchSize %d: %v, want a ConfigError", MaxBatchSize+1, err)
	}
	if _, err := NewBatch(e.db.Pool, e.nats.JS, nil, e.config(nil)); err == nil {
		t.Error("a nil batch handler was accepted")
	}
}

// The handler gets the batch with its dedup rows already in the transaction, without the
// messages already processed nor a second message with the same idempotency key; those are
// acked as duplicates.
func TestBatchHandlerDuplicatesRemoved(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	var seen calls
	var dedupRows atomic.Int64
	h := func(ctx context.Context, tx pgx.Tx, msgs []Message) error {
		seen.add(msgs)
		keys := make([]string, len(msgs))
		for i, m := range msgs {
			keys[i] = m.IdempotencyKey
		}
		var n int64
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM txoutbox_consumer_dedup WHERE consumer = $1 AND idempotency_key = ANY($2)`,
			testDurable, keys).Scan(&n); err != nil {
			return err
		}
		dedupRows.Store(n)
		return recordEffects(ctx, tx, msgs)
	}
	c := e.newBatchConsumer(&Config{BatchSize: 10}, h)
	e.exec(`INSERT INTO txoutbox_consumer_dedup (consumer, idempotency_key) VALUES ($1, 'order:done')`, testDurable)
	pub := func(biz, data string) {
		e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}, outbox.HeaderBizKey: {biz}}, data)
	}
	pub("order:1", "a")
	pub("order:done", "already processed")
	pub("order:2", "b")
	pub("order:1", "a again") // the same business event, in the same batch
	pub("order:3", "c")

	results := c.handleBatch(ctx, e.items(c, 5))
	want := []outcome{outcomeProcessed, outcomeDuplicate, outcomeProcessed, outcomeDuplicate, outcomeProcessed}
	for i, r := range results {
		if r.outcome != want[i] {
			t.Errorf("message %d: %v (%v), want %v", i, r.outcome, r.err, want[i])
		}
	}
	if seen.count() != 1 || !slices.Equal(seen.batches[0], []string{"a", "b", "c"}) {
		t.Fatalf("handler calls %v, want one with [a b c]", seen.batches)
	}
	if n := dedupRows.Load(); n != 3 {
		t.Errorf("dedup rows the handler saw in its transaction: %d, want 3", n)
	}
	e.checkOnce("order:1", "order:2", "order:3")
	if n := e.effects(); n != 3 {
		t.Errorf("effects: %d, want 3", n)
	}
	if st := c.Stats(); st.Processed != 3 || st.Duplicates != 2 || st.HandlerCalls != 1 || st.HandlerTime <= 0 {
		t.Errorf("stats %+v, want 3 processed, 2 duplicates, 1 handler call and its time", st)
	}
	if info := e.consumerInfo(testDurable); info.NumAckPending != 0 || info.NumPending != 0 {
		t.Errorf("consumer not drained: %d ack pending, %d pending", info.NumAckPending, info.NumPending)
	}
}

// Through Run, across redeliveries: the acks of the first committed batch are lost (as in a
// crash between commit and ack), so JetStream redelivers its messages after AckWait; the same
// business events are then republished under new message ids. Every message's set-based
// effect is applied exactly once, and the redeliveries never reach the handler.
func TestBatchHandlerAppliedOnceAcrossRedeliveries(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var seen calls
	h := func(ctx context.Context, tx pgx.Tx, msgs []Message) error {
		seen.add(msgs)
		return recordEffects(ctx, tx, msgs)
	}
	const n = 40
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "order:" + strconv.Itoa(i)
		e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}, outbox.HeaderBizKey: {keys[i]}}, strconv.Itoa(i))
	}
	c := e.newBatchConsumer(&Config{BatchSize: 8, Concurrency: 2}, h)
	var lost atomic.Int64
	var once sync.Once
	c.hooks.afterCommit = func(_ context.Context, msgs []Message) error {
		err := error(nil)
		once.Do(func() { lost.Store(int64(len(msgs))); err = errors.New("crash before the acks") })
		return err
	}
	e.run(c)
	e.waitEffects(n)
	testsvc.Eventually(t, 20*time.Second, "redelivered duplicates", func() bool {
		return lost.Load() > 0 && c.Stats().Duplicates >= lost.Load()
	})
	for i := range 5 { // the same business events again, under new message ids
		e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}, outbox.HeaderBizKey: {keys[i]}}, "again")
	}
	testsvc.Eventually(t, 20*time.Second, "republished duplicates", func() bool { return c.Stats().Duplicates >= lost.Load()+5 })
	e.checkOnce(keys...)
	if got := e.effects(); got != n {
		t.Fatalf("effects: %d, want %d", got, n)
	}
	for i := range n {
		if r := seen.runsOf(strconv.Itoa(i)); r != 1 {
			t.Errorf("message %d reached the handler %d times, want 1", i, r)
		}
	}
	if r := seen.runsOf("again"); r != 0 {
		t.Errorf("republished duplicates reached the handler %d times", r)
	}
	if st := c.Stats(); st.Processed != n || st.Retries != 0 || st.DeadLettered != 0 {
		t.Errorf("stats %+v", st)
	}
	testsvc.Eventually(t, 10*time.Second, "drained", func() bool {
		info := e.consumerInfo(testDurable)
		return info.NumAckPending == 0 && info.NumPending == 0
	})
}

// A poison message (the handler fails the whole batch without naming it) is found by
// splitting the batch: it alone counts attempts and is dead-lettered after MaxDeliveries, the
// others commit once, and no message runs more often than the documented bound.
func TestBatchHandlerPoisonIsolated(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	var seen calls
	h := func(ctx context.Context, tx pgx.Tx, msgs []Message) error {
		seen.add(msgs)
		if err := recordEffects(ctx, tx, msgs); err != nil { // its writes must roll back
			return err
		}
		for _, m := range msgs {
			if string(m.Payload) == "6" {
				return errors.New("some message of the batch is bad")
			}
		}
		return nil
	}
	c := e.newBatchConsumer(&Config{BatchSize: 10, MaxDeliveries: 2}, h)
	for i := range 10 {
		e.publishID("orders.created", "id-"+strconv.Itoa(i), strconv.Itoa(i))
	}
	results := c.handleBatch(ctx, e.items(c, 10))
	for i, r := range results {
		want := outcomeProcessed
		if i == 6 {
			want = outcomeRetry
		}
		if r.outcome != want {
			t.Errorf("message %d: %v (%v), want %v", i, r.outcome, r.err, want)
		}
	}
	bound := 1 + int(math.Ceil(math.Log2(10)))
	for i := range 10 {
		if r := seen.runsOf(strconv.Itoa(i)); r > bound {
			t.Errorf("message %d ran %d times, more than 1 + ⌈log₂ 10⌉ = %d", i, r, bound)
		}
	}
	if n := e.effects(); n != 9 {
		t.Fatalf("effects: %d, want 9", n)
	}
	for i := range 10 {
		if want := map[bool]int{true: 0, false: 1}[i == 6]; e.effectsOf("id-"+strconv.Itoa(i)) != want {
			t.Errorf("effects of message %d: %d, want %d", i, e.effectsOf("id-"+strconv.Itoa(i)), want)
		}
	}
	if n := e.count(`SELECT count(*) FROM txoutbox_consumer_dedup WHERE idempotency_key = 'id-6'`); n != 0 {
		t.Fatalf("the poison message's dedup row survived")
	}
	if st := c.Stats(); st.Retries != 1 || st.Processed != 9 {
		t.Errorf("stats %+v, want 1 retry and 9 processed", st)
	}

	// Its second delivery, alone: the last one, so it is dead-lettered.
	results = c.handleBatch(ctx, e.items(c, 1))
	if results[0].outcome != outcomeDeadLettered {
		t.Fatalf("second delivery: %v (%v), want dead-lettered", results[0].outcome, results[0].err)
	}
	dead := e.deadLetters()
	if len(dead) != 1 || string(dead[0].Data) != "6" || dead[0].Header.Get(HeaderDeadReason) != DeadReasonFailed ||
		dead[0].Header.Get(HeaderDeadDeliveries) != "2" {
		t.Fatalf("dead letters: %d %v", len(dead), dead)
	}
	if n := e.effects(); n != 9 {
		t.Fatalf("effects after the dead letter: %d, want 9", n)
	}
	if info := e.consumerInfo(testDurable); info.NumAckPending != 0 || info.NumPending != 0 {
		t.Errorf("consumer not drained: %d ack pending, %d pending", info.NumAckPending, info.NumPending)
	}
}

// Through Run: a poison message among 100 is dead-lettered alone, the 99 others commit once.
func TestBatchHandlerPoisonRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	h := func(ctx context.Context, tx pgx.Tx, msgs []Message) error {
		if err := recordEffects(ctx, tx, msgs); err != nil {
			return err
		}
		for _, m := range msgs {
			if string(m.Payload) == "37" {
				return errors.New("poison")
			}
		}
		return nil
	}
	for i := range 100 {
		e.publishID("orders.created", newID(), strconv.Itoa(i))
	}
	c := e.newBatchConsumer(&Config{BatchSize: 32, Concurrency: 2, MaxDeliveries: 3}, h)
	e.run(c)
	e.waitEffects(99)
	testsvc.Eventually(t, 10*time.Second, "dead letter", func() bool { return c.Stats().DeadLettered == 1 })
	if d := e.count(`SELECT count(*) FROM (SELECT idem FROM effects GROUP BY idem HAVING count(*) > 1) x`); d != 0 {
		t.Fatalf("%d messages applied more than once", d)
	}
	if n := e.count(`SELECT count(*) FROM effects WHERE payload = '37'`); n != 0 {
		t.Fatalf("the poison message's effect committed")
	}
	if dead := e.deadLetters(); len(dead) != 1 || string(dead[0].Data) != "37" || dead[0].Header.Get(HeaderDeadDeliveries) != "3" {
		t.Fatalf("dead letters: %d", len(dead))
	}
	if st := c.Stats(); st.Processed != 99 || st.Retries != 2 {
		t.Errorf("stats %+v, want 99 processed and 2 retries", st)
	}
}

// A commit the server refuses (a deferred unique constraint) sends each message of the batch
// through its own transaction: the others commit once, the culprit is retried and applies
// once the conflict is gone.
func TestBatchHandlerRefusedCommit(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	e.exec(`CREATE TABLE reservations (sku int UNIQUE DEFERRABLE INITIALLY DEFERRED)`)
	e.exec(`INSERT INTO reservations VALUES (7)`)
	var seen calls
	h := func(ctx context.Context, tx pgx.Tx, msgs []Message) error {
		seen.add(msgs)
		skus := make([]int32, len(msgs))
		for i, m := range msgs {
			sku, err := strconv.Atoi(strings.TrimPrefix(string(m.Payload), "sku:"))
			if err != nil {
				return &BatchError{Index: i, Err: Permanent(err)}
			}
			skus[i] = int32(sku)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO reservations SELECT unnest($1::int[])`, skus); err != nil {
			return err
		}
		return recordEffects(ctx, tx, msgs)
	}
	c := e.newBatchConsumer(&Config{BatchSize: 10, MaxDeliveries: 100}, h)
	for _, s := range []string{"sku:1", "sku:2", "sku:7", "sku:3", "sku:4"} {
		e.publishID("orders.created", s, s)
	}
	results := c.handleBatch(ctx, e.items(c, 5))
	for i, r := range results {
		want := outcomeProcessed
		if i == 2 {
			want = outcomeRetry
		}
		if r.outcome != want {
			t.Errorf("message %d: %v (%v), want %v", i, r.outcome, r.err, want)
		}
	}
	if seen.count() != 6 || seen.runsOf("sku:1") != 2 {
		t.Errorf("handler calls %v, want the batch and then each message alone", seen.batches)
	}
	e.checkOnce("sku:1", "sku:2", "sku:3", "sku:4")
	if n := e.effects(); n != 4 {
		t.Fatalf("effects: %d, want 4", n)
	}
	if info := e.consumerInfo(testDurable); info.NumAckPending != 1 {
		t.Fatalf("ack pending: %d, want 1 (the refused message, nak'ed)", info.NumAckPending)
	}
	e.exec(`DELETE FROM reservations WHERE sku = 7`)
	if r := c.handleBatch(ctx, e.items(c, 1)); r[0].outcome != outcomeProcessed {
		t.Fatalf("retry: %v (%v)", r[0].outcome, r[0].err)
	}
	e.checkOnce("sku:1", "sku:2", "sku:3", "sku:4", "sku:7")
	if st := c.Stats(); st.Processed != 5 || st.Retries != 1 || st.DeadLettered != 0 {
		t.Errorf("stats %+v", st)
	}
}

// How a handler names the poison message: a *BatchError with a Permanent error dead-letters
// that message at once and reruns the others once, without it; a Permanent error for the whole
// batch (no message named) splits the batch, and only the message that fails alone is
// dead-lettered. A BatchError whose index is out of range names no message.
func TestBatchHandlerPermanent(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		fail      func(i int) error
		wantCalls func(n int) bool
	}{
		{"named", func(i int) error { return &BatchError{Index: i, Err: Permanent(errors.New("bad payload"))} },
			func(n int) bool { return n == 2 }},
		{"whole batch", func(int) error { return Permanent(errors.New("a message of the batch is bad")) },
			func(n int) bool { return n > 2 }},
		{"index out of range", func(int) error { return &BatchError{Index: 99, Err: Permanent(errors.New("bad payload"))} },
			func(n int) bool { return n > 2 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ctx := context.Background()
			var seen calls
			h := func(ctx context.Context, tx pgx.Tx, msgs []Message) error {
				seen.add(msgs)
				if err := recordEffects(ctx, tx, msgs); err != nil {
					return err
				}
				for i, m := range msgs {
					if string(m.Payload) == "bad" {
						return tc.fail(i)
					}
				}
				return nil
			}
			c := e.newBatchConsumer(&Config{BatchSize: 10}, h)
			payloads := []string{"0", "1", "2", "bad", "4", "5", "6", "7"}
			for i, p := range payloads {
				e.publishID("orders.created", "id-"+strconv.Itoa(i), p)
			}
			results := c.handleBatch(ctx, e.items(c, len(payloads)))
			for i, r := range results {
				want := outcomeProcessed
				if payloads[i] == "bad" {
					want = outcomeDeadLettered
				}
				if r.outcome != want {
					t.Errorf("message %d: %v (%v), want %v", i, r.outcome, r.err, want)
				}
			}
			if !tc.wantCalls(seen.count()) {
				t.Errorf("handler calls: %v", seen.batches)
			}
			if r := seen.runsOf("0"); r != 2 && tc.name == "named" {
				t.Errorf("message 0 ran %d times, want 2", r)
			}
			dead := e.deadLetters()
			if len(dead) != 1 || string(dead[0].Data) != "bad" || dead[0].Header.Get(HeaderDeadReason) != DeadReasonPermanent ||
				dead[0].Header.Get(HeaderDeadDeliveries) != "1" {
				t.Fatalf("dead letters: %d %v", len(dead), dead)
			}
			if tc.name == "index out of range" && !strings.Contains(dead[0].Header.Get(HeaderDeadError), "names no message") {
				t.Errorf("dead letter error %q does not say the index named no message", dead[0].Header.Get(HeaderDeadError))
			}
			if n := e.effects(); n != 7 {
				t.Fatalf("effects: %d, want 7", n)
			}
			for i, p := range payloads {
				if p != "bad" {
					e.checkOnce("id-" + strconv.Itoa(i))
				}
			}
			if st := c.Stats(); st.Processed != 7 || st.DeadLettered != 1 || st.Retries != 0 {
				t.Errorf("stats %+v", st)
			}
		})
	}
}

// Ordered mode: keyed messages reach the batch handler one per call, in their key's stream
// order; unkeyed messages are batched.
func TestBatchHandlerOrdered(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var seen calls
	var mu sync.Mutex
	var keyedBatches []int
	h := func(ctx context.Context, tx pgx.Tx, msgs []Message) error {
		seen.add(msgs)
		for _, m := range msgs {
			if m.Key != "" {
				mu.Lock()
				keyedBatches = append(keyedBatches, len(msgs))
				mu.Unlock()
			}
		}
		return recordEffects(ctx, tx, msgs)
	}
	for i := range 30 {
		if i%2 == 0 {
			e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}, outbox.HeaderKey: {"k" + strconv.Itoa(i%3)}}, strconv.Itoa(i))
		} else {
			e.publishID("orders.created", newID(), strconv.Itoa(i))
		}
	}
	c := e.newBatchConsumer(&Config{Ordered: true, BatchSize: 10, Concurrency: 3}, h)
	e.run(c)
	e.waitEffects(30)
	mu.Lock()
	defer mu.Unlock()
	if len(keyedBatches) != 15 {
		t.Fatalf("keyed messages handled %d times, want 15", len(keyedBatches))
	}
	for _, n := range keyedBatches {
		if n != 1 {
			t.Fatalf("a keyed message reached the handler in a batch of %d", n)
		}
	}
	for k := range 3 {
		var got []int
		rows, err := e.db.Pool.Query(context.Background(), `SELECT payload::int FROM effects WHERE payload::int % 2 = 0 AND payload::int % 3 = $1 ORDER BY id`, k)
		if err != nil {
			t.Fatal(err)
		}
		got, err = pgx.CollectRows(rows, pgx.RowTo[int])
		if err != nil {
			t.Fatal(err)
		}
		if !slices.IsSorted(got) || len(got) != 5 {
			t.Errorf("key k%d applied in order %v", k, got)
		}
	}
}

// Through Run, a committed batch's acks are sent while the next batch runs; a graceful stop
// returns only once they are confirmed: nothing is left unacked.
func TestBatchHandlerStopWaitsForAcks(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for i := range 200 {
		e.publishID("orders.created", newID(), strconv.Itoa(i))
	}
	c := e.newBatchConsumer(&Config{BatchSize: 50, Concurrency: 2}, recordEffects)
	stop := e.run(c)
	e.waitEffects(200)
	testsvc.Eventually(t, 10*time.Second, "processed", func() bool { return c.Stats().Processed == 200 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if info := e.consumerInfo(testDurable); info.NumAckPending != 0 || info.NumPending != 0 {
		t.Errorf("after Run returned: %d ack pending, %d pending", info.NumAckPending, info.NumPending)
	}
	if st := c.Stats(); st.AckFailures != 0 || st.Duplicates != 0 {
		t.Errorf("stats %+v", st)
	}
}
