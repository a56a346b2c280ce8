package consumer

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
)

// The same message stored twice in the stream (a relay republish after the stream's duplicate
// window) and the same business event under two message ids: one business effect each.
func TestDuplicateRepublishedOneEffect(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	// A stream with a short duplicate window, so that a republish lands as a new sequence.
	if _, err := e.nats.JS.UpdateStream(ctx, jetstream.StreamConfig{
		Name: testStream, Subjects: []string{"orders.>"}, Storage: jetstream.FileStorage,
		Duplicates: 100 * time.Millisecond,
	}); err != nil {
		t.Fatal(err)
	}
	id := newID()
	first := e.publishID("orders.created", id, "order 1")
	// Republish until the duplicate window has passed: within it a republish is dropped.
	var second *jetstream.PubAck
	testsvc.Eventually(t, 10*time.Second, "a republish past the duplicate window", func() bool {
		second = e.publishID("orders.created", id, "order 1")
		return !second.Duplicate
	})
	if second.Duplicate || second.Sequence == first.Sequence {
		t.Fatalf("republish was not stored as a new sequence: %+v %+v", first, second)
	}
	// The same business event enqueued twice under two message ids.
	biz := func() map[string][]string {
		return map[string][]string{outbox.HeaderMsgID: {newID()}, outbox.HeaderBizKey: {"order:2:created"}}
	}
	e.publish("orders.created", biz(), "order 2")
	e.publish("orders.created", biz(), "order 2")

	c := e.newConsumer(nil, &Config{Concurrency: 2}, recordEffect)
	e.run(c)
	testsvc.Eventually(t, 10*time.Second, "all four handled", func() bool {
		return c.Stats().Processed+c.Stats().Duplicates == 4
	})
	e.waitEffects(2)
	if n := e.effectsOf(id); n != 1 {
		t.Errorf("effects of the republished message: %d, want 1", n)
	}
	if n := e.effectsOf("order:2:created"); n != 1 {
		t.Errorf("effects of the business key: %d, want 1", n)
	}
	if got := c.Stats().Duplicates; got != 2 {
		t.Errorf("duplicates: %d, want 2", got)
	}
	if n := e.count(`SELECT count(*) FROM txoutbox_consumer_dedup WHERE consumer = $1`, testDurable); n != 2 {
		t.Errorf("dedup rows: %d, want 2", n)
	}
	testsvc.Eventually(t, 5*time.Second, "all acked", func() bool {
		info := e.consumerInfo(testDurable)
		return info.NumAckPending == 0 && info.NumPending == 0
	})
}

// A delivery whose ack never happened comes back after the ack wait and is skipped as a
// duplicate: one effect. Driven through handleOne.
func TestRedeliveryAfterMissingAck(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	c := e.newConsumer(nil, &Config{AckWait: 300 * time.Millisecond}, recordEffect)
	skipAck := true
	c.hooks.afterCommit = func(context.Context, []Message) error {
		if skipAck {
			return errors.New("crash before the ack")
		}
		return nil
	}
	id := newID()
	e.publishID("orders.created", id, "x")

	m := e.fetch(c, 1)[0]
	if r := c.handleOne(ctx, m); r.outcome != outcomeProcessed {
		t.Fatalf("first delivery: %v (%v)", r.outcome, r.err)
	}
	if n := e.effectsOf(id); n != 1 {
		t.Fatalf("effects after the first delivery: %d", n)
	}
	skipAck = false
	again := e.fetch(c, 1)[0] // redelivered after the ack wait
	md, _ := again.Metadata()
	if md.NumDelivered != 2 {
		t.Fatalf("redelivery count: %d, want 2", md.NumDelivered)
	}
	if r := c.handleOne(ctx, again); r.outcome != outcomeDuplicate {
		t.Fatalf("redelivery: %v (%v), want duplicate", r.outcome, r.err)
	}
	if n := e.effectsOf(id); n != 1 {
		t.Fatalf("effects: %d, want 1", n)
	}
	if info := e.consumerInfo(testDurable); info.NumAckPending != 0 {
		t.Fatalf("ack pending: %d, want 0 (the duplicate is acked)", info.NumAckPending)
	}
}

// A handler that fails twice and then succeeds: one effect, three runs, growing delays that
// JetStream honours.
func TestHandlerFailsTwiceThenSucceeds(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var mu sync.Mutex
	var runs []time.Time
	var deliveries []int
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		mu.Lock()
		runs = append(runs, time.Now())
		deliveries = append(deliveries, msg.Delivery)
		n := len(runs)
		mu.Unlock()
		if err := recordEffect(ctx, tx, msg); err != nil { // rolled back when we fail
			return err
		}
		if n <= 2 {
			return fmt.Errorf("transient failure %d", n)
		}
		return nil
	}
	base := 100 * time.Millisecond
	c := e.newConsumer(nil, &Config{BackoffBase: base, BackoffMax: time.Second}, h)
	var delays []time.Duration
	c.hooks.onRetry = func(_ Message, d time.Duration) { mu.Lock(); delays = append(delays, d); mu.Unlock() }
	id := newID()
	e.publishID("orders.created", id, "x")
	e.run(c)
	e.waitEffects(1)
	testsvc.Eventually(t, 5*time.Second, "acked", func() bool { return e.consumerInfo(testDurable).NumAckPending == 0 })

	mu.Lock()
	defer mu.Unlock()
	if len(runs) != 3 || fmt.Sprint(deliveries) != "[1 2 3]" {
		t.Fatalf("runs %d with deliveries %v, want 3 with [1 2 3]", len(runs), deliveries)
	}
	if len(delays) != 2 {
		t.Fatalf("retry delays: %v, want 2", delays)
	}
	for i, d := range delays {
		lo := time.Duration(float64(base<<i) * (1 - DefaultBackoffJitter))
		hi := time.Duration(float64(base<<i) * (1 + DefaultBackoffJitter))
		if d < lo || d > hi {
			t.Errorf("delay %d: %s, want within [%s, %s] (exponential, times 1±jitter)", i+1, d, lo, hi)
		}
		if gap := runs[i+1].Sub(runs[i]); gap < d-5*time.Millisecond {
			t.Errorf("redelivery %d came after %s, before its delay %s", i+1, gap, d)
		}
	}
	if delays[1] <= delays[0] {
		t.Errorf("delays do not grow: %v", delays)
	}
	if got := c.Stats().Retries; got != 2 {
		t.Errorf("retries: %d, want 2", got)
	}
	if got := c.Stats().Processed; got != 1 {
		t.Errorf("processed: %d, want 1", got)
	}
	if e.effectsOf(id) != 1 {
		t.Errorf("effects of the message: %d, want 1", e.effectsOf(id))
	}
}

// A poison message goes to the dead-letter subject after MaxDeliveries with its error and the
// original headers and payload, and the messages behind it keep flowing meanwhile.
func TestPoisonMessageDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var poisonRuns atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		if string(msg.Payload) == "poison" {
			poisonRuns.Add(1)
			return errors.New("cannot parse order: unexpected token\nat line 1")
		}
		return recordEffect(ctx, tx, msg)
	}
	poisonID := newID()
	ack := e.publish("orders.created", map[string][]string{
		outbox.HeaderMsgID: {poisonID}, "traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
	}, "poison")
	for i := range 20 {
		e.publishID("orders.created", newID(), "good "+strconv.Itoa(i))
	}
	reg := prometheus.NewRegistry()
	c := e.newConsumer(nil, &Config{MaxDeliveries: 3, Registerer: reg}, h)
	e.run(c)
	e.waitEffects(20)
	testsvc.Eventually(t, 10*time.Second, "dead letter", func() bool { return c.Stats().DeadLettered == 1 })

	if n := poisonRuns.Load(); n != 3 {
		t.Errorf("poison handler runs: %d, want 3", n)
	}
	dead := e.deadLetters()
	if len(dead) != 1 {
		t.Fatalf("dead letters: %d, want 1", len(dead))
	}
	d := dead[0]
	want := map[string]string{
		HeaderDeadConsumer:   testDurable,
		HeaderDeadReason:     DeadReasonFailed,
		HeaderDeadError:      "cannot parse order: unexpected token at line 1",
		HeaderDeadDeliveries: "3",
		HeaderDeadSubject:    "orders.created",
		HeaderDeadStream:     testStream,
		HeaderDeadStreamSeq:  strconv.FormatUint(ack.Sequence, 10),
		HeaderDeadMsgID:      poisonID,
		"traceparent":        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
	}
	for k, v := range want {
		if got := d.Header.Get(k); got != v {
			t.Errorf("dead letter header %s = %q, want %q", k, got, v)
		}
	}
	if d.Subject != DefaultDeadLetterPrefix+testDurable || string(d.Data) != "poison" {
		t.Errorf("dead letter: subject %q payload %q", d.Subject, d.Data)
	}
	testsvc.Eventually(t, 5*time.Second, "stream drained", func() bool {
		info := e.consumerInfo(testDurable)
		return info.NumAckPending == 0 && info.NumPending == 0
	})
	if got := gather(t, reg, "txoutbox_consumer_dead_lettered_total"); got != 1 {
		t.Errorf("dead_lettered_total metric: %g, want 1", got)
	}
	if got := gather(t, reg, "txoutbox_consumer_processed_total"); got != 20 {
		t.Errorf("processed_total metric: %g, want 20", got)
	}
	if got := gather(t, reg, "txoutbox_consumer_retries_total"); got != 2 {
		t.Errorf("retries_total metric: %g, want 2", got)
	}
	if got := gather(t, reg, "txoutbox_consumer_handler_seconds"); got != 23 {
		t.Errorf("handler_seconds sample count: %g, want 23", got)
	}
}

// gather returns a counter's value, or a histogram's sample count.
func gather(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		m := mf.GetMetric()[0]
		if m.GetLabel()[0].GetValue() != testDurable {
			t.Errorf("%s: consumer label %q", name, m.GetLabel()[0].GetValue())
		}
		if h := m.GetHistogram(); h != nil {
			return float64(h.GetSampleCount())
		}
		return m.GetCounter().GetValue()
	}
	t.Fatalf("metric %s not registered", name)
	return 0
}

// Messages that cannot be decoded go to the dead letters at once, without running the
// handler, and do not hold up the stream.
func TestMalformedMessagesDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		runs.Add(1)
		return recordEffect(ctx, tx, msg)
	}
	e.publish("orders.created", nil, "no headers at all")
	e.publish("orders.created", map[string][]string{outbox.HeaderBizKey: {strings.Repeat("k", 1500)}}, "key too long")
	e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}, outbox.HeaderBizKey: {"a", "b"}}, "ambiguous key")
	good := newID()
	e.publishID("orders.created", good, "good")

	c := e.newConsumer(nil, &Config{MaxDeliveries: 5}, h)
	e.run(c)
	e.waitEffects(1)
	testsvc.Eventually(t, 10*time.Second, "dead letters", func() bool { return c.Stats().DeadLettered == 3 })
	if e.effectsOf(good) != 1 || runs.Load() != 1 {
		t.Errorf("good message: %d effects, handler runs %d; want 1 and 1", e.effectsOf(good), runs.Load())
	}
	if got := c.Stats().Malformed; got != 3 {
		t.Errorf("malformed: %d, want 3", got)
	}
	dead := e.deadLetters()
	if len(dead) != 3 {
		t.Fatalf("dead letters: %d, want 3", len(dead))
	}
	for _, d := range dead {
		if d.Header.Get(HeaderDeadReason) != DeadReasonMalformed || d.Header.Get(HeaderDeadDeliveries) != "1" ||
			!strings.Contains(d.Header.Get(HeaderDeadError), "malformed") {
			t.Errorf("dead letter %q: reason %q deliveries %q error %q", d.Data,
				d.Header.Get(HeaderDeadReason), d.Header.Get(HeaderDeadDeliveries), d.Header.Get(HeaderDeadError))
		}
	}
	says := map[string]string{ // payload -> what its error must say
		"no headers at all": "neither",
		"key too long":      "1500 bytes",
		"ambiguous key":     "2 different values",
	}
	for _, d := range dead {
		if want := says[string(d.Data)]; want == "" || !strings.Contains(d.Header.Get(HeaderDeadError), want) {
			t.Errorf("dead letter %q: error %q does not say %q", d.Data, d.Header.Get(HeaderDeadError), want)
		}
	}
	testsvc.Eventually(t, 5*time.Second, "stream drained", func() bool {
		info := e.consumerInfo(testDurable)
		return info.NumAckPending == 0 && info.NumPending == 0
	})
}

// The consumer crashes between its commit and its ack (its NATS connection closes there):
// the message is redelivered to the next instance, skipped as a duplicate, one effect.
func TestCrashBetweenCommitAndAck(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	nc, err := testsvc.Connect(e.nats.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	cfg := func() *Config { return &Config{AckWait: 500 * time.Millisecond, Concurrency: 1} }
	crashing := e.newConsumer(js, cfg(), recordEffect)
	crashing.hooks.afterCommit = func(context.Context, []Message) error {
		nc.Close() // the process dies: its connection goes away before the ack
		return nil
	}
	id := newID()
	e.publishID("orders.created", id, "x")
	runErr := make(chan error, 1)
	go func() { runErr <- crashing.Run(context.Background()) }() // ends on its own: its connection is gone
	if err := testsvc.Receive(t, runErr, 20*time.Second, "the crashed consumer's Run to return"); !errors.Is(err, ErrConsumeStopped) {
		t.Fatalf("crashed consumer's Run: %v, want ErrConsumeStopped", err)
	}
	if n := e.effects(); n != 1 {
		t.Fatalf("effects after the crash: %d, want 1", n)
	}
	if got := crashing.Stats().AckFailures; got != 1 {
		t.Errorf("ack failures: %d, want 1", got)
	}

	next := e.newConsumer(nil, cfg(), recordEffect)
	e.run(next)
	testsvc.Eventually(t, 10*time.Second, "redelivery skipped", func() bool { return next.Stats().Duplicates == 1 })
	if n := e.effectsOf(id); n != 1 {
		t.Fatalf("effects: %d, want 1", n)
	}
	if got := next.Stats().Processed; got != 0 {
		t.Errorf("processed again: %d", got)
	}
	testsvc.Eventually(t, 5*time.Second, "acked", func() bool { return e.consumerInfo(testDurable).NumAckPending == 0 })
}

// Two instances on one durable, each message stored twice (same business key, two ids):
// every business effect happens once.
func TestTwoInstancesSameDurable(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const n = 150
	for i := range n {
		h := func() map[string][]string {
			return map[string][]string{outbox.HeaderMsgID: {newID()}, outbox.HeaderBizKey: {"order:" + strconv.Itoa(i)}}
		}
		e.publish("orders.created", h(), "a")
		e.publish("orders.created", h(), "b")
	}
	slow := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		time.Sleep(time.Millisecond) // slow work
		return recordEffect(ctx, tx, msg)
	}
	var cs []*Consumer
	for range 2 {
		nc, err := testsvc.Connect(e.nats.URL())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		c := e.newConsumer(js, &Config{Concurrency: 4}, slow)
		cs = append(cs, c)
		e.run(c)
	}
	total := func(f func(Stats) int64) int64 { return f(cs[0].Stats()) + f(cs[1].Stats()) }
	testsvc.Eventually(t, 20*time.Second, "all handled", func() bool {
		return total(func(s Stats) int64 { return s.Processed + s.Duplicates }) == 2*n
	})
	e.waitEffects(n)
	if d := e.count(`SELECT count(*) FROM (SELECT idem FROM effects GROUP BY idem HAVING count(*) > 1) x`); d != 0 {
		t.Fatalf("%d business keys applied more than once", d)
	}
	if got := total(func(s Stats) int64 { return s.Processed }); got != n {
		t.Errorf("processed: %d, want %d", got, n)
	}
	t.Logf("instance 1 processed %d, instance 2 processed %d", cs[0].Stats().Processed, cs[1].Stats().Processed)
}

// Batch mode through handleBatch: one failing message in the middle rolls back only its own
// savepoint; the others (and a duplicate inside the batch) commit once.
func TestBatchFailingMessageInTheMiddle(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	var failing atomic.Bool
	failing.Store(true)
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		if err := recordEffect(ctx, tx, msg); err != nil {
			return err
		}
		if string(msg.Payload) == "4" && failing.Load() {
			return errors.New("message 4 fails after writing") // its write must roll back
		}
		return nil
	}
	c := e.newConsumer(nil, &Config{BatchSize: 10}, h)
	keys := make([]string, 9)
	for i := range keys {
		keys[i] = "order:" + strconv.Itoa(i)
		e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}, outbox.HeaderBizKey: {keys[i]}}, strconv.Itoa(i))
	}
	// The same business event as message 1, inside the same batch.
	e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}, outbox.HeaderBizKey: {keys[1]}}, "1 again")

	var items []*item
	for _, m := range e.fetch(c, 10) {
		items = append(items, newItem(m, false))
	}
	results := c.handleBatch(ctx, items)
	for i, r := range results {
		want := outcomeProcessed
		switch i {
		case 4:
			want = outcomeRetry
		case 9:
			want = outcomeDuplicate
		}
		if r.outcome != want {
			t.Errorf("message %d: %v (%v), want %v", i, r.outcome, r.err, want)
		}
	}
	if n := e.effects(); n != 8 {
		t.Fatalf("effects after the batch: %d, want 8", n)
	}
	if n := e.effectsOf(keys[4]); n != 0 {
		t.Fatalf("the failed message's write survived its savepoint rollback")
	}
	if n := e.count(`SELECT count(*) FROM txoutbox_consumer_dedup WHERE idempotency_key = $1`, keys[4]); n != 0 {
		t.Fatalf("the failed message's dedup row survived")
	}
	if info := e.consumerInfo(testDurable); info.NumAckPending != 1 {
		t.Fatalf("ack pending after the batch: %d, want 1 (the nak'ed message)", info.NumAckPending)
	}

	failing.Store(false)
	again := e.fetch(c, 1) // message 4, after its nak delay
	results = c.handleBatch(ctx, []*item{newItem(again[0], false)})
	if results[0].outcome != outcomeProcessed || string(again[0].Data()) != "4" {
		t.Fatalf("retry: %v (%v) of %q", results[0].outcome, results[0].err, again[0].Data())
	}
	for _, k := range keys {
		if n := e.effectsOf(k); n != 1 {
			t.Errorf("effects of %s: %d, want 1", k, n)
		}
	}
	if info := e.consumerInfo(testDurable); info.NumAckPending != 0 || info.NumPending != 0 {
		t.Errorf("consumer not drained: %+v", info)
	}
}

// Batch mode through Run: a poison message among 100 is dead-lettered, the 99 others commit
// once each.
func TestBatchModeRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		if err := recordEffect(ctx, tx, msg); err != nil {
			return err
		}
		if string(msg.Payload) == "37" {
			return errors.New("poison")
		}
		return nil
	}
	for i := range 100 {
		e.publishID("orders.created", newID(), strconv.Itoa(i))
	}
	c := e.newConsumer(nil, &Config{BatchSize: 16, Concurrency: 2, MaxDeliveries: 3}, h)
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
}

// Ordered mode: one key at a time in delivery order, even across a failure and its in-place
// retry; different keys in parallel. Both modes.
func TestPerKeyOrdering(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{1, 8} {
		t.Run(fmt.Sprintf("batch=%d", batch), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			keys := []string{"a", "b", "c", "d"}
			const per = 15
			var mu sync.Mutex
			seen := map[string][]int{}
			active := map[string]int{}
			maxPerKey, total, maxTotal := 0, 0, 0
			var failedOnce atomic.Bool
			h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
				n, _ := strconv.Atoi(strings.TrimPrefix(string(msg.Payload), msg.Key+":"))
				mu.Lock()
				active[msg.Key]++
				total++
				maxPerKey = max(maxPerKey, active[msg.Key])
				maxTotal = max(maxTotal, total)
				mu.Unlock()
				time.Sleep(2 * time.Millisecond) // slow work: keys overlap in time
				mu.Lock()
				active[msg.Key]--
				total--
				mu.Unlock()
				if msg.Key == "a" && n == 5 && failedOnce.CompareAndSwap(false, true) {
					return errors.New("a:5 fails once")
				}
				if err := recordEffect(ctx, tx, msg); err != nil {
					return err
				}
				mu.Lock()
				seen[msg.Key] = append(seen[msg.Key], n)
				mu.Unlock()
				return nil
			}
			for n := range per {
				for _, k := range keys {
					e.publish("orders.created", map[string][]string{
						outbox.HeaderMsgID: {newID()}, outbox.HeaderKey: {k},
					}, fmt.Sprintf("%s:%d", k, n))
				}
			}
			c := e.newConsumer(nil, &Config{Ordered: true, Concurrency: 4, BatchSize: batch}, h)
			e.run(c)
			e.waitEffects(len(keys) * per)
			mu.Lock()
			defer mu.Unlock()
			for _, k := range keys {
				if got := fmt.Sprint(seen[k]); got != fmt.Sprint(seq(per)) {
					t.Errorf("key %s handled in order %s", k, got)
				}
			}
			if maxPerKey != 1 {
				t.Errorf("a key ran %d messages at once", maxPerKey)
			}
			if batch == 1 && maxTotal < 2 {
				t.Errorf("keys never ran in parallel (max %d at once)", maxTotal)
			}
			if !failedOnce.Load() || c.Stats().Retries != 1 {
				t.Errorf("retries: %d, want 1", c.Stats().Retries)
			}
		})
	}
}

func seq(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}

// A handler running for several ack waits is kept alive with in-progress acks: not
// redelivered, run once.
func TestLongHandlerKeptAlive(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int32
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		runs.Add(1)
		started <- struct{}{}
		<-release // slow work: until the test has seen it kept alive for three ack waits
		return recordEffect(ctx, tx, msg)
	}
	e.publishID("orders.created", newID(), "slow")
	const ackWait = 300 * time.Millisecond
	c := e.newConsumer(nil, &Config{AckWait: ackWait, Concurrency: 2}, h)
	c.testSignals.keptAlive.Init()
	e.run(c)
	testsvc.Receive(t, started, 10*time.Second, "the handler to start")
	waitKeptAlive(t, c, 3*ackWait)
	close(release)
	e.waitEffects(1)
	// Once the ack is in, no redelivery can come; one before it would be counted already.
	testsvc.Eventually(t, 10*time.Second, "the ack to reach JetStream", func() bool { return e.consumerInfo(testDurable).NumAckPending == 0 })
	if runs.Load() != 1 || c.Stats().Duplicates != 0 {
		t.Fatalf("handler runs %d, duplicates %d; want 1 and 0", runs.Load(), c.Stats().Duplicates)
	}
	if info := e.consumerInfo(testDurable); info.NumRedelivered != 0 || info.NumAckPending != 0 {
		t.Fatalf("redelivered %d, ack pending %d; want 0 and 0", info.NumRedelivered, info.NumAckPending)
	}
}

// waitKeptAlive waits for the in-progress acks c's keepalive sends (testSignals.keptAlive,
// initialised) until they span at least d: successive acks of a held message are at least
// InProgressInterval apart, so 1 + ⌈d/InProgressInterval⌉ of them span d.
func waitKeptAlive(t *testing.T, c *Consumer, d time.Duration) {
	t.Helper()
	every := c.cfg.InProgressInterval
	for range 1 + (d+every-1)/every {
		testsvc.Receive(t, c.testSignals.keptAlive.C(), 10*time.Second, "an in-progress ack")
	}
}

// Stopping waits for the running handler, commits and acks it, and hands the messages it
// had not started back to JetStream at once.
func TestGracefulStop(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	started := make(chan struct{}, 10)
	release := make(chan struct{})
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		started <- struct{}{}
		<-release
		return recordEffect(ctx, tx, msg)
	}
	for i := range 5 {
		e.publishID("orders.created", newID(), strconv.Itoa(i))
	}
	c := e.newConsumer(nil, &Config{Concurrency: 1, AckWait: 30 * time.Second}, h)
	c.testSignals.stopWaits.Init()
	stop := e.run(c)
	testsvc.Receive(t, started, 10*time.Second, "the handler to start")
	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	// The stop got as far as waiting for the handler, which has not returned: Run has not.
	testsvc.Receive(t, c.testSignals.stopWaits.C(), 10*time.Second, "the stop to wait for the handler")
	select {
	case err := <-stopped:
		t.Fatalf("Run returned while a handler was running: %v", err)
	default:
	}
	close(release)
	if err := <-stopped; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n := e.effects(); n != 1 {
		t.Fatalf("effects: %d, want 1 (the handler in flight)", n)
	}
	// The next instance gets the rest at once (they were nak'ed), not after the 30s ack wait.
	next := e.newConsumer(nil, &Config{Concurrency: 1, AckWait: 30 * time.Second}, recordEffect)
	e.run(next)
	testsvc.Eventually(t, 10*time.Second, "the rest, well before the ack wait", func() bool { return e.effects() >= 5 })
	if n := e.effects(); n != 5 || next.Stats().Duplicates != 0 {
		t.Fatalf("effects %d, duplicates %d; want 5 and 0", n, next.Stats().Duplicates)
	}
}

// Postgres failing under the handler (its backend terminated) is not a failed attempt: the
// message is not acked, not dead-lettered even with MaxDeliveries 1, and succeeds later.
func TestPostgresFailureNeverAcksNorCounts(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		if runs.Add(1) == 1 {
			_, err := tx.Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`)
			if err == nil {
				return errors.New("backend survived")
			}
			return err
		}
		return recordEffect(ctx, tx, msg)
	}
	id := newID()
	e.publishID("orders.created", id, "x")
	c := e.newConsumer(nil, &Config{MaxDeliveries: 1}, h)
	e.run(c)
	e.waitEffects(1)
	if got := c.Stats().Unavailable; got < 1 {
		t.Errorf("unavailable: %d, want at least 1", got)
	}
	if c.Stats().DeadLettered != 0 || c.Stats().Retries != 0 {
		t.Errorf("dead-lettered %d, retries %d; want 0 and 0", c.Stats().DeadLettered, c.Stats().Retries)
	}
	if n := e.effectsOf(id); n != 1 {
		t.Errorf("effects: %d, want 1", n)
	}
}

// A commit the server refuses (a deferred constraint) is a failed attempt: no ack, a retry,
// and the effect once the conflict is gone.
func TestRefusedCommitRetried(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.exec(`CREATE TABLE reservations (sku int UNIQUE DEFERRABLE INITIALLY DEFERRED)`)
	e.exec(`INSERT INTO reservations VALUES (7)`)
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		if _, err := tx.Exec(ctx, `INSERT INTO reservations VALUES (7)`); err != nil {
			return err
		}
		return recordEffect(ctx, tx, msg)
	}
	c := e.newConsumer(nil, &Config{MaxDeliveries: 100}, h)
	e.publishID("orders.created", newID(), "x")
	e.run(c)
	testsvc.Eventually(t, 10*time.Second, "refused commits", func() bool { return c.Stats().Retries >= 2 })
	if n := e.effects(); n != 0 {
		t.Fatalf("effects while the commit is refused: %d", n)
	}
	if info := e.consumerInfo(testDurable); info.NumAckPending != 1 {
		t.Fatalf("ack pending: %d, want 1 (never acked)", info.NumAckPending)
	}
	e.exec(`DELETE FROM reservations`)
	e.waitEffects(1)
	// The effect is committed before the message is acked and counted.
	testsvc.Eventually(t, 10*time.Second, "the message counted as processed", func() bool { return c.Stats().Processed >= 1 })
	if c.Stats().Processed != 1 || c.Stats().DeadLettered != 0 {
		t.Errorf("processed %d, dead-lettered %d", c.Stats().Processed, c.Stats().DeadLettered)
	}
}

// A Permanent error skips the retries; a handler that swallows a statement error, commits
// or rolls back by itself, or panics does not corrupt anything.
func TestHandlerMisbehaviour(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	c := e.newConsumer(nil, &Config{MaxDeliveries: 5}, recordEffect)
	cases := []struct {
		name    string
		handler Handler
		want    outcome
		err     error
	}{
		{"permanent", func(context.Context, pgx.Tx, Message) error {
			return Permanent(errors.New("order 9 does not exist"))
		}, outcomeDeadLettered, nil},
		{"swallowed", func(ctx context.Context, tx pgx.Tx, msg Message) error {
			_ = recordEffect(ctx, tx, msg)
			_, _ = tx.Exec(ctx, `SELECT 1/0`)
			return nil
		}, outcomeRetry, errTxAborted},
		{"commits", func(ctx context.Context, tx pgx.Tx, msg Message) error {
			if err := recordEffect(ctx, tx, msg); err != nil {
				return err
			}
			return tx.Commit(ctx)
		}, outcomeRetry, ErrTxControl},
		{"panics", func(context.Context, pgx.Tx, Message) error { panic("boom") }, outcomeRetry, errHandlerPanic},
	}
	for _, tc := range cases {
		e.publishID("orders.created", newID(), tc.name)
	}
	msgs := e.fetch(c, len(cases))
	for i, tc := range cases {
		c.handler = tc.handler
		r := c.handleOne(ctx, msgs[i])
		if r.outcome != tc.want || (tc.err != nil && !errors.Is(r.err, tc.err)) {
			t.Errorf("%s: %v (%v), want %v (%v)", tc.name, r.outcome, r.err, tc.want, tc.err)
		}
	}
	if n := e.effects(); n != 0 {
		t.Errorf("effects: %d, want 0", n)
	}
	dead := e.deadLetters()
	if len(dead) != 1 || dead[0].Header.Get(HeaderDeadReason) != DeadReasonPermanent ||
		!strings.Contains(dead[0].Header.Get(HeaderDeadError), "order 9 does not exist") {
		t.Fatalf("dead letters: %d", len(dead))
	}
}

// End to end: enqueued in a producer transaction, published by the relay, consumed once; the
// producer's traceparent reaches the handler, and the business key catches the same event
// enqueued twice.
func TestThroughOutboxAndRelay(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	client, err := outbox.NewClient(&outbox.Config{Schema: e.db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	const trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	for range 2 { // the same event, enqueued twice (two message ids, one business key)
		err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
			_, err := client.EnqueueTx(ctx, tx, outbox.Message{
				Subject: "orders.created", Key: "order-42", BizKey: "order:42:created",
				Headers: map[string][]string{"traceparent": {trace}},
				Payload: []byte(`{"id":42}`),
			})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	r, err := relay.New(e.db.Pool, e.nats.JS, &relay.Config{Schema: e.db.Schema, Logger: quietLogger(), PollMax: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- r.Run(rctx) }()
	defer func() { cancel(); <-relayDone; r.Close() }()

	var mu sync.Mutex
	var seen []Message
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		mu.Lock()
		seen = append(seen, msg)
		mu.Unlock()
		_, err := tx.Exec(ctx, `INSERT INTO effects (idem, subject, payload, delivery, note) VALUES ($1, $2, $3, $4, $5)`,
			msg.IdempotencyKey, msg.Subject, string(msg.Payload), msg.Delivery, msg.Headers.Get("traceparent"))
		return err
	}
	c := e.newConsumer(nil, &Config{Ordered: true}, h)
	e.run(c)
	testsvc.Eventually(t, 10*time.Second, "both handled", func() bool {
		return c.Stats().Processed+c.Stats().Duplicates == 2
	})
	e.waitEffects(1)
	if n := e.count(`SELECT count(*) FROM effects WHERE idem = 'order:42:created' AND note = $1`, trace); n != 1 {
		t.Fatalf("effect with the producer's traceparent: %d, want 1", n)
	}
	mu.Lock()
	defer mu.Unlock()
	m := seen[0]
	if m.Key != "order-42" || m.BizKey != "order:42:created" || m.ID == "" || m.Stream != testStream || m.StreamSeq == 0 {
		t.Fatalf("message as the handler saw it: %+v", m)
	}
	var dedupMsgID string
	if err := e.db.Pool.QueryRow(ctx, `SELECT message_id FROM txoutbox_consumer_dedup WHERE consumer = $1`, testDurable).Scan(&dedupMsgID); err != nil {
		t.Fatal(err)
	}
	if dedupMsgID != m.ID {
		t.Fatalf("dedup row message id %q, want %q", dedupMsgID, m.ID)
	}
}

// Setup refuses a dead-letter subject no stream captures, or one that loops back.
func TestSetupChecksDeadLetterSubject(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	c := e.newConsumer(nil, &Config{DeadLetterSubject: "nowhere.dead"}, recordEffect)
	if _, err := c.Setup(ctx); !errors.Is(err, ErrNoDeadLetterStream) {
		t.Fatalf("no dead-letter stream: %v", err)
	}
	c = e.newConsumer(nil, &Config{DeadLetterSubject: "orders.dead"}, recordEffect)
	if _, err := c.Setup(ctx); !errors.Is(err, ErrDeadLetterLoop) {
		t.Fatalf("dead letters into the consumed stream: %v", err)
	}
	if err := c.Run(ctx); !errors.Is(err, ErrDeadLetterLoop) {
		t.Fatalf("Run: %v", err)
	}
	// Filtered away from the consumer, the same stream is fine.
	c = e.newConsumer(nil, &Config{Durable: "filtered", DeadLetterSubject: "orders.dead", FilterSubjects: []string{"orders.created"}}, recordEffect)
	if _, err := c.Setup(ctx); err != nil {
		t.Fatalf("filtered consumer: %v", err)
	}
}

// The connection dies at the commit (its backend terminated just before): the outcome is not
// known to be a refusal, so the message is neither acked nor counted as an attempt (even with
// MaxDeliveries 1), and it is applied once on the retry. Both modes.
func TestConnectionLostAtCommit(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{1, 4} {
		t.Run(fmt.Sprintf("batch=%d", batch), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			var pid atomic.Int32
			h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
				var p int32
				if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&p); err != nil {
					return err
				}
				pid.Store(p)
				return recordEffect(ctx, tx, msg)
			}
			c := e.newConsumer(nil, &Config{MaxDeliveries: 1, BatchSize: batch, Concurrency: 1}, h)
			var killed atomic.Bool
			c.hooks.beforeCommit = func(ctx context.Context) {
				if !killed.CompareAndSwap(false, true) {
					return
				}
				p := pid.Load()
				if _, err := e.db.AdminPool.Exec(ctx, `SELECT pg_terminate_backend($1)`, p); err != nil {
					t.Error(err)
				}
				testsvc.Eventually(t, 5*time.Second, "backend gone", func() bool {
					return e.count(`SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, p) == 0
				})
			}
			for i := range batch {
				e.publishID("orders.created", newID(), strconv.Itoa(i))
			}
			e.run(c)
			e.waitEffects(batch)
			// The effects are committed before the messages are acked and counted.
			testsvc.Eventually(t, 10*time.Second, "every message counted as processed", func() bool { return c.Stats().Processed >= int64(batch) })
			if !killed.Load() || c.Stats().Unavailable < 1 {
				t.Fatalf("killed %v, unavailable %d", killed.Load(), c.Stats().Unavailable)
			}
			if c.Stats().DeadLettered != 0 || c.Stats().Retries != 0 || c.Stats().Processed != int64(batch) {
				t.Fatalf("dead-lettered %d, retries %d, processed %d", c.Stats().DeadLettered,
					c.Stats().Retries, c.Stats().Processed)
			}
			if d := e.count(`SELECT count(*) FROM (SELECT idem FROM effects GROUP BY idem HAVING count(*) > 1) x`); d != 0 {
				t.Fatalf("%d messages applied twice", d)
			}
		})
	}
}

// A message whose business key is fine but whose Nats-Msg-Id PostgreSQL cannot store (it goes
// into the dedup row too) is malformed: dead-lettered at once, not retried forever.
func TestUnstorableMessageIDDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error { return recordEffect(ctx, tx, msg) }
	e.publish("orders.created", map[string][]string{outbox.HeaderBizKey: {"order:1"}, outbox.HeaderMsgID: {"id-\xff"}}, "bad id")
	e.publish("orders.created", map[string][]string{outbox.HeaderBizKey: {"order:2"}, outbox.HeaderMsgID: {"id\x00nul"}}, "nul id")
	c := e.newConsumer(nil, &Config{MaxDeliveries: 5}, h)
	e.run(c)
	testsvc.Eventually(t, 10*time.Second, "dead letters", func() bool { return c.Stats().DeadLettered == 2 })
	for _, d := range e.deadLetters() {
		// The error names the header, written Nats-Msg-ID in the dead letter (see escapeMsgIDText).
		if d.Header.Get(HeaderDeadReason) != DeadReasonMalformed || !strings.Contains(d.Header.Get(HeaderDeadError), "Nats-Msg-ID is not valid UTF-8") {
			t.Errorf("dead letter %q: reason %q error %q", d.Data, d.Header.Get(HeaderDeadReason), d.Header.Get(HeaderDeadError))
		}
	}
	if got := c.Stats().Unavailable; got != 0 {
		t.Errorf("unavailable: %d, want 0 (the message is bad, the database is fine)", got)
	}
}

// A message too big for the dead-letter stream (its max_msg_size, not the connection's
// limit) is dead-lettered without its payload instead of being retried forever.
func TestDeadLetterTooBigForItsStream(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	s, err := e.nats.JS.Stream(ctx, deadStream)
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	cfg.MaxMsgSize = 1024
	if _, err := e.nats.JS.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	h := func(context.Context, pgx.Tx, Message) error { return Permanent(errors.New("poison")) }
	e.publishID("orders.created", newID(), strings.Repeat("p", 4096))
	c := e.newConsumer(nil, &Config{MaxDeliveries: 3}, h)
	e.run(c)
	testsvc.Eventually(t, 10*time.Second, "the dead letter", func() bool { return c.Stats().DeadLettered == 1 })
	dead := e.deadLetters()
	if len(dead) != 1 || len(dead[0].Data) != 0 || dead[0].Header.Get(HeaderDeadPayloadDropped) != "true" {
		t.Fatalf("dead letters: %d, want one without its payload", len(dead))
	}
}

// A handler's error text, whatever it holds, becomes a dead letter's Txoutbox-Dead-Error that
// arrives as sent: valid UTF-8, one line, within the limit, cut on a character boundary.
func TestDeadLetterErrorTextIsAlwaysSendable(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	texts := map[string]string{
		"nul":     "bad \x00 value",
		"invalid": "bad \xff\xfe bytes",
		"crlf":    "line 1\r\nline 2\ttabbed",
		"long":    "x" + strings.Repeat("é", 2000),
	}
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		return Permanent(errors.New(texts[string(msg.Payload)]))
	}
	for name := range texts {
		e.publishID("orders.created", newID(), name)
	}
	c := e.newConsumer(nil, nil, h)
	e.run(c)
	testsvc.Eventually(t, 10*time.Second, "dead letters", func() bool { return c.Stats().DeadLettered == int64(len(texts)) })
	dead := e.deadLetters()
	if len(dead) != len(texts) {
		t.Fatalf("dead letters: %d, want %d", len(dead), len(texts))
	}
	for _, d := range dead {
		v := d.Header.Get(HeaderDeadError)
		if v == "" || len(v) > maxErrorHeader || !utf8.ValidString(v) || strings.ContainsAny(v, "\x00\r\n\t") {
			t.Errorf("dead letter %q: error header %d bytes %q", d.Data, len(v), v[:min(len(v), 60)])
		}
	}
}

// A dead letter carries what it copies from outside (the original's headers from any
// publisher, the handler's error, the subject) with the text Nats-Msg-Id written as
// Nats-Msg-ID: nats-server finds a message's id by searching the header block for that text
// and could miss the dead letter's own id behind it (then a dead letter published twice is
// stored twice). Its own Nats-Msg-Id is the one occurrence left.
func TestDeadLetterHoldsNoOtherMsgIDText(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		return errors.New("refused: the order's Nats-Msg-Id was reused")
	}
	e.publish("orders.Nats-Msg-Id", map[string][]string{
		outbox.HeaderMsgID:   {newID()},
		"X-Orig-Nats-Msg-Id": {"abc"},
		"X-Note":             {"copy of Nats-Msg-IdNats-Msg-Id"},
	}, "poison")
	c := e.newConsumer(nil, &Config{MaxDeliveries: 1}, h)
	e.run(c)
	testsvc.Eventually(t, 10*time.Second, "the dead letter", func() bool { return c.Stats().DeadLettered == 1 })
	dead := e.deadLetters()
	if len(dead) != 1 {
		t.Fatalf("dead letters: %d, want 1", len(dead))
	}
	d := dead[0]
	for k, vs := range d.Header {
		if k != outbox.HeaderMsgID && strings.Contains(k, outbox.HeaderMsgID) {
			t.Errorf("header name %q holds the text %s", k, outbox.HeaderMsgID)
		}
		for _, v := range vs {
			if k != outbox.HeaderMsgID && strings.Contains(v, outbox.HeaderMsgID) {
				t.Errorf("header %s: value %q holds the text %s", k, v, outbox.HeaderMsgID)
			}
		}
	}
	want := map[string]string{
		"X-Orig-Nats-Msg-ID": "abc",
		"X-Note":             "copy of Nats-Msg-IDNats-Msg-ID",
		HeaderDeadSubject:    "orders.Nats-Msg-ID",
		HeaderDeadError:      "refused: the order's Nats-Msg-ID was reused",
	}
	for k, v := range want {
		if got := d.Header.Get(k); got != v {
			t.Errorf("%s = %q, want %q", k, got, v)
		}
	}
	if d.Header.Get(outbox.HeaderMsgID) == "" {
		t.Error("the dead letter has no Nats-Msg-Id of its own")
	}
}
