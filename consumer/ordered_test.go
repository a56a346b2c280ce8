package consumer

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// orderedInstance is one consumer process of the ordered tests: its own NATS connection, so
// that closing it is a crash as JetStream sees it (nothing acked or nak'ed any more).
type orderedInstance struct {
	nc   *nats.Conn
	c    *Consumer
	stop func() error
}

func (e *env) startOrdered(t *testing.T, cfg *Config, h Handler, hk hooks) *orderedInstance {
	t.Helper()
	return e.startOrderedWith(t, hk, func(js jetstream.JetStream) *Consumer {
		cp := *cfg
		return e.newConsumer(js, &cp, h)
	})
}

// startOrderedSQL is startOrdered for a consumer made with NewSQL on the database/sql driver.
func (e *env) startOrderedSQL(t *testing.T, cfg *Config, driver string, h SQLHandler, hk hooks) *orderedInstance {
	t.Helper()
	sdb := e.openSQL(driver)
	return e.startOrderedWith(t, hk, func(js jetstream.JetStream) *Consumer {
		c, err := NewSQL(sdb, js, h, e.config(cfg))
		if err != nil {
			t.Fatal(err)
		}
		return c
	})
}

func (e *env) startOrderedWith(t *testing.T, hk hooks, build func(jetstream.JetStream) *Consumer) *orderedInstance {
	t.Helper()
	nc, err := testsvc.Connect(e.nats.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	c := build(js)
	c.hooks = hk
	return &orderedInstance{nc: nc, c: c, stop: e.run(c)}
}

// Ordered mode holds the order of applied effects per key across a consumer crash and several
// instances: the first instance dies (its connection closed, nothing acked or nak'ed) while it
// holds unacked messages of a key, one of them blocked in its handler; two fresh instances
// take over at once and are delivered the key's later messages long before JetStream
// redelivers the dead instance's ones (after AckWait). Every message's effect is applied
// exactly once, in stream order per key; a message dead-lettered as Permanent lets its key
// go on; unkeyed messages are applied exactly once too. One of the new instances runs in batch
// mode. The durable reads orders.created only: the keys' messages on orders.ignored, which it
// is never delivered, hold nothing back. TXOUTBOX_ORDERED_PER_KEY=N runs eight keys of N
// messages.
func TestOrderedAcrossCrashAndInstances(t *testing.T) {
	t.Parallel()
	testOrderedAcrossCrashAndInstances(t, false)
}

// The same with consumers made with NewSQL: the crashed instance on lib/pq, one of the two that
// take over on pgx's stdlib driver, beside the pgx batch-mode one (instances of one durable
// may mix the two kinds).
func TestSQLOrderedAcrossCrashAndInstances(t *testing.T) {
	t.Parallel()
	testOrderedAcrossCrashAndInstances(t, true)
}

func testOrderedAcrossCrashAndInstances(t *testing.T, viaSQL bool) {
	e := newEnv(t)
	e.exec(`CREATE TABLE applied (id bigserial PRIMARY KEY, k text NOT NULL, seq bigint NOT NULL, idem text NOT NULL, by_instance text NOT NULL)`)
	keys := []string{"k0", "k1", "k2", "k3"}
	per := 60
	if v := os.Getenv("TXOUTBOX_ORDERED_PER_KEY"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 10 {
			t.Fatalf("TXOUTBOX_ORDERED_PER_KEY=%q: want a number of at least 10", v)
		}
		keys = append(keys, "k4", "k5", "k6", "k7")
		per = n
	}
	const poison = "k1:7" // dead-lettered with Permanent: its key must go on

	// The stream: keys interleaved, as the relay publishes them.
	wantSeqs := map[string][]uint64{} // per key, the stream sequences to be applied, in stream order
	total := 0
	for n := range per {
		for _, k := range keys {
			data := fmt.Sprintf("%s:%d", k, n)
			ack := e.publish("orders.created", map[string][]string{
				outbox.HeaderMsgID: {newID()}, outbox.HeaderKey: {k},
			}, data)
			if data != poison {
				wantSeqs[k] = append(wantSeqs[k], ack.Sequence)
				total++
			}
			if n%3 == 0 {
				e.publish("orders.ignored", map[string][]string{
					outbox.HeaderMsgID: {newID()}, outbox.HeaderKey: {k},
				}, data)
			}
		}
		if n%4 == 0 { // unkeyed messages: not ordered, applied exactly once
			e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}}, fmt.Sprintf("unkeyed:%d", n))
			total++
		}
	}

	const insertApplied = `INSERT INTO applied (k, seq, idem, by_instance) VALUES ($1, $2, $3, $4)`
	apply := func(ctx context.Context, name string, block func(ctx context.Context, msg Message) error, msg Message,
		exec func(args ...any) error) error {
		if string(msg.Payload) == poison {
			return Permanent(errors.New("poison"))
		}
		if block != nil {
			if err := block(ctx, msg); err != nil {
				return err
			}
		}
		return exec(msg.Key, int64(msg.StreamSeq), msg.IdempotencyKey, name)
	}
	handler := func(name string, block func(ctx context.Context, msg Message) error) Handler {
		return func(ctx context.Context, tx pgx.Tx, msg Message) error {
			return apply(ctx, name, block, msg, func(args ...any) error {
				_, err := tx.Exec(ctx, insertApplied, args...)
				return err
			})
		}
	}
	sqlHandler := func(name string, block func(ctx context.Context, msg Message) error) SQLHandler {
		return func(ctx context.Context, tx *sql.Tx, msg Message) error {
			return apply(ctx, name, block, msg, func(args ...any) error {
				_, err := tx.ExecContext(ctx, insertApplied, args...)
				return err
			})
		}
	}
	start := func(cfg *Config, driver, name string, block func(ctx context.Context, msg Message) error, hk hooks) *orderedInstance {
		if viaSQL && driver != "" {
			return e.startOrderedSQL(t, cfg, driver, sqlHandler(name, block), hk)
		}
		return e.startOrdered(t, cfg, handler(name, block), hk)
	}
	cfg := &Config{
		Ordered:         true,
		FilterSubjects:  []string{"orders.created"},
		Concurrency:     3,
		PullMaxMessages: 8,
		AckWait:         700 * time.Millisecond,
		// MaxDeliveries is the default 10: waiting for an earlier message of the key is
		// not a delivery, however long it lasts.
	}

	// Instance A blocks in the handler of k0:2 and takes in k0's next messages (queued
	// behind it), then dies.
	blocked := make(chan struct{})
	release := make(chan struct{})
	var blockOnce sync.Once
	var heldK0 atomic.Int32
	a := start(cfg, "postgres", "a", func(ctx context.Context, msg Message) error {
		if string(msg.Payload) != "k0:2" {
			return nil
		}
		blockOnce.Do(func() { close(blocked) })
		<-release
		return errors.New("instance a died")
	}, hooks{admitted: func(msg Message) {
		if msg.Key == "k0" {
			heldK0.Add(1)
		}
	}})
	testsvc.Receive(t, blocked, 20*time.Second, "instance a in the handler of k0:2")
	testsvc.Eventually(t, 20*time.Second, "instance a holding k0's next messages", func() bool { return heldK0.Load() >= 6 })
	a.nc.Close() // the crash: from now on a acks, naks and keeps alive nothing
	close(release)
	_ = a.stop()
	appliedByA := e.count(`SELECT count(*) FROM applied`)

	// Two fresh instances take over at once.
	var waits atomic.Int64
	hk := hooks{waiting: func(Message) { waits.Add(1) }}
	b := start(cfg, "pgx", "b", nil, hk)
	batchCfg := *cfg
	batchCfg.BatchSize = 8 // keyed messages one transaction each, unkeyed ones batched
	c := start(&batchCfg, "", "c", nil, hk)

	testsvc.Eventually(t, 60*time.Second+time.Duration(total)*10*time.Millisecond, "every message applied", func() bool {
		return e.count(`SELECT count(*) FROM applied`) >= total
	})
	testsvc.Eventually(t, 20*time.Second, "the poison message dead-lettered", func() bool { return len(e.deadLetters()) >= 1 })
	testsvc.Eventually(t, 20*time.Second, "every message acked", func() bool {
		info := e.consumerInfo(testDurable)
		return info.NumAckPending == 0 && info.NumPending == 0
	})
	_ = b.stop()
	_ = c.stop()

	if n := e.count(`SELECT count(*) FROM applied`); n != total {
		t.Fatalf("applied %d effects, want %d", n, total)
	}
	if n := e.count(`SELECT count(*) FROM (SELECT idem FROM applied GROUP BY idem HAVING count(*) > 1) d`); n != 0 {
		t.Fatalf("%d messages applied more than once", n)
	}
	rows, err := e.db.Pool.Query(context.Background(), `SELECT k, seq FROM applied ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]uint64{}
	for rows.Next() {
		var k string
		var s int64
		if err := rows.Scan(&k, &s); err != nil {
			t.Fatal(err)
		}
		got[k] = append(got[k], uint64(s))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if fmt.Sprint(got[k]) != fmt.Sprint(wantSeqs[k]) {
			t.Errorf("key %s applied in stream order\n%v\nwant\n%v", k, got[k], wantSeqs[k])
		}
	}
	dead := e.deadLetters()
	if len(dead) != 1 || string(dead[0].Data) != poison || dead[0].Header.Get(HeaderDeadReason) != DeadReasonPermanent {
		t.Errorf("dead letters: %d, want only %s", len(dead), poison)
	}
	// The scenario did what it is about: a later message of a key reached a new instance
	// before the dead instance's earlier ones were redelivered, and waited for them.
	if waits.Load() == 0 {
		t.Errorf("no message ever waited for an earlier one of its key")
	}
	byB := e.count(`SELECT count(*) FROM applied WHERE by_instance = 'b'`)
	byC := e.count(`SELECT count(*) FROM applied WHERE by_instance = 'c'`)
	t.Logf("applied: %d by the crashed instance, %d and %d by the two others; %d waits; %d+%d stream messages read back",
		appliedByA, byB, byC, waits.Load(), b.c.order.scannedMessages(), c.c.order.scannedMessages())
}

// A single ordered instance reading the stream alone never reads it back: its own deliveries
// tell it everything before each message.
func TestOrderedSingleInstanceReadsNothingBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const n = 40
	for i := range n {
		e.publish("orders.created", map[string][]string{
			outbox.HeaderMsgID: {newID()}, outbox.HeaderKey: {"k" + strconv.Itoa(i%3)},
		}, strconv.Itoa(i))
	}
	c := e.newConsumer(nil, &Config{Ordered: true, Concurrency: 4}, recordEffect)
	e.run(c)
	e.waitEffects(n)
	if got := c.order.scannedMessages(); got != 0 {
		t.Fatalf("read %d messages back from the stream, want 0", got)
	}
}

// Ordered mode refuses to start on a schema without the key-order table.
func TestOrderedNeedsKeyOrderTable(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.exec(`DROP TABLE txoutbox_consumer_key_order`)
	c := e.newConsumer(nil, &Config{Ordered: true}, recordEffect)
	if _, err := c.Setup(context.Background()); !errors.Is(err, ErrKeyOrderTable) {
		t.Fatalf("Setup: %v, want ErrKeyOrderTable", err)
	}
	c = e.newSQLConsumer(e.openSQL("postgres"), &Config{Ordered: true}, recordEffectSQL)
	if _, err := c.Setup(context.Background()); !errors.Is(err, ErrKeyOrderTable) {
		t.Fatalf("Setup of a NewSQL consumer: %v, want ErrKeyOrderTable", err)
	}
	c = e.newConsumer(nil, &Config{}, recordEffect)
	if _, err := c.Setup(context.Background()); err != nil {
		t.Fatalf("Setup without Ordered: %v", err)
	}
}

// A keyed message that arrives after its key moved past it is a duplicate when its dedup row
// says it was applied, and a dead letter (out-of-order) otherwise: never applied, never dropped.
func TestOrderedKeyMovedPast(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"pgx", "NewSQL"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			testOrderedKeyMovedPast(t, mode == "NewSQL")
		})
	}
}

func testOrderedKeyMovedPast(t *testing.T, viaSQL bool) {
	e := newEnv(t)
	applied := e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {"m-applied"}, outbox.HeaderKey: {"k"}}, "applied")
	lost := e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {"m-lost"}, outbox.HeaderKey: {"k"}}, "lost")
	e.exec(`INSERT INTO txoutbox_consumer_key_order (consumer, stream, order_key, applied_seq) VALUES ($1, $2, 'k', $3)`,
		testDurable, testStream, int64(lost.Sequence)+10)
	e.exec(`INSERT INTO txoutbox_consumer_dedup (consumer, idempotency_key, message_id, stream_seq) VALUES ($1, 'm-applied', 'm-applied', $2)`,
		testDurable, int64(applied.Sequence))
	c := e.newConsumer(nil, &Config{Ordered: true}, recordEffect)
	if viaSQL {
		c = e.newSQLConsumer(e.openSQL("pgx"), &Config{Ordered: true}, recordEffectSQL)
	}
	e.run(c)
	testsvc.Eventually(t, 20*time.Second, "both settled", func() bool {
		return c.Stats().Duplicates == 1 && len(e.deadLetters()) == 1
	})
	if n := e.effects(); n != 0 {
		t.Fatalf("%d effects applied, want none", n)
	}
	dead := e.deadLetters()[0]
	if string(dead.Data) != "lost" || dead.Header.Get(HeaderDeadReason) != DeadReasonOutOfOrder {
		t.Fatalf("dead letter %q, reason %q", dead.Data, dead.Header.Get(HeaderDeadReason))
	}
	testsvc.Eventually(t, 10*time.Second, "both acked or terminated", func() bool {
		return e.consumerInfo(testDurable).NumAckPending == 0
	})
}

// What an instance reads back from the stream for the stretches it was not delivered: the
// keyed messages of its filter subjects, from the stream's leader, each once.
func TestOrderedReadsBackStretches(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	pub := func(subject, key string) uint64 {
		h := map[string][]string{outbox.HeaderMsgID: {newID()}}
		if key != "" {
			h[outbox.HeaderKey] = []string{key}
		}
		return e.publish(subject, h, "x").Sequence
	}
	a1 := pub("orders.a", "k1")                // 1
	pub("orders.a", "")                        // 2: unkeyed
	b1 := pub("orders.b", "k1")                // 3
	c1 := pub("orders.c", "k2")                // 4: another subject
	pub("orders.a", "")                        // 5
	e.publish("orders.a", map[string][]string{ // 6: malformed (no id): not ordered
		outbox.HeaderKey: {"k1"},
	}, "x")
	last := pub("orders.a", "k2") // 7

	for _, tc := range []struct {
		filters []string
		want    map[string][]uint64
		read    uint64
	}{
		{nil, map[string][]uint64{"k1": {a1, b1}, "k2": {c1}}, 6},
		{[]string{"orders.a", "orders.b"}, map[string][]uint64{"k1": {a1, b1}}, 5},
		{[]string{"orders.none"}, map[string][]uint64{}, 0},
	} {
		t.Run(fmt.Sprint(tc.filters), func(t *testing.T) {
			durable := fmt.Sprintf("scan%d", len(tc.filters))
			if len(tc.filters) > 0 && tc.filters[0] == "orders.none" {
				durable = "scannone"
			}
			c := e.newConsumer(nil, &Config{Ordered: true, Durable: durable, FilterSubjects: tc.filters}, recordEffect)
			cons, err := c.Setup(ctx)
			if err != nil {
				t.Fatal(err)
			}
			stream, err := e.nats.JS.Stream(ctx, testStream)
			if err != nil {
				t.Fatal(err)
			}
			o := newKeyOrder(e.nats.JS, stream, cons, tc.filters)
			if err := o.complete(ctx, last); err != nil {
				t.Fatal(err)
			}
			if fmt.Sprint(o.pending) != fmt.Sprint(tc.want) || o.scannedMessages() != tc.read {
				t.Fatalf("read back %d messages, keyed %v; want %d, %v", o.scannedMessages(), o.pending, tc.read, tc.want)
			}
			if len(tc.want["k1"]) > 0 {
				if !o.blocked("k1", a1, last) {
					t.Fatalf("k1 at %d not blocked with %d applied", last, a1)
				}
				if o.blocked("k1", b1, last) {
					t.Fatalf("k1 at %d blocked with %d applied", last, b1)
				}
			}
			// A stream leader that does not store what was delivered yet: an error, not
			// "nothing there".
			if err := o.complete(ctx, last+5); !errors.Is(err, errStreamBehind) {
				t.Fatalf("complete beyond the stream: %v, want errStreamBehind", err)
			}
		})
	}
}
