package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

func TestMain(m *testing.M) { os.Exit(testsvc.ExampleMain(m)) }

// The examples read TXOUTBOX_SCHEMA as a service does; unset, they must work in the default
// schema too.
func TestExamplesInDefaultSchema(t *testing.T) { testsvc.RunExamplesInDefaultSchema(t) }

type env struct {
	t      *testing.T
	db     *testsvc.DB
	nats   *testsvc.NATS
	client *outbox.Client
}

func newEnv(t *testing.T) *env {
	t.Helper()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	n.Stream(t, "ORDERS", "orders.>")
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	return &env{t: t, db: db, nats: n, client: c}
}

func quietLogger() *slog.Logger { return testsvc.Logger() }

func (e *env) relay(cfg *Config) *Relay {
	e.t.Helper()
	if cfg == nil {
		cfg = &Config{}
	}
	cfg.Schema = e.db.Schema
	// Unique per relay: tests find their relay's backends by application_name.
	cfg.ID = uuid.NewString()[:8] + "/" + cfg.ID
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	if cfg.LeaseInterval == 0 {
		cfg.LeaseInterval = time.Second
	}
	r, err := New(e.db.Pool, e.nats.JS, cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	r.initTestSignals()
	e.t.Cleanup(r.Close)
	return r
}

// retryNow makes every failed ready row due for its retry now, instead of waiting out its
// backoff.
func (e *env) retryNow() {
	e.t.Helper()
	if _, err := e.db.Pool.Exec(context.Background(), "UPDATE txoutbox_messages SET next_attempt_at = now() - interval '1 second' WHERE state = 'ready' AND attempts > 0"); err != nil {
		e.t.Fatal(err)
	}
}

// enqueue commits msgs in one transaction.
func (e *env) enqueue(msgs ...outbox.Message) []uuid.UUID {
	e.t.Helper()
	var ids []uuid.UUID
	err := pgx.BeginFunc(context.Background(), e.db.Pool, func(tx pgx.Tx) error {
		var err error
		ids, err = e.client.EnqueueTx(context.Background(), tx, msgs...)
		return err
	})
	if err != nil {
		e.t.Fatal(err)
	}
	return ids
}

func (e *env) count(where string, args ...any) int {
	e.t.Helper()
	var n int
	if err := e.db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM txoutbox_messages WHERE "+where, args...).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

// drain calls runOnce until a claim finds nothing.
func drain(t *testing.T, r *Relay) {
	t.Helper()
	for i := 0; i < 1000; i++ {
		n, err := r.runOnce(context.Background())
		if errors.Is(err, errNoPartitions) {
			// A relay closed just before may not have released its leases yet: its backend
			// ends a moment after the client hangs up.
			testsvc.Eventually(t, 10*time.Second, "the partitions of a relay closed before to be free", func() bool {
				n, err = r.runOnce(context.Background())
				return !errors.Is(err, errNoPartitions)
			})
		}
		if err != nil {
			t.Fatalf("runOnce: %v", err)
		}
		if n == 0 {
			return
		}
	}
	t.Fatal("runOnce never ran dry")
}

func (e *env) streamMsgs(stream string) []*jetstream.RawStreamMsg {
	return testsvc.StreamMsgs(e.t, e.nats.JS, stream)
}

func TestCommittedPublishedExactlyOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	ids := e.enqueue(
		outbox.Message{Subject: "orders.created", Key: "o1", Payload: []byte("one"), Headers: map[string][]string{"traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}},
		outbox.Message{Subject: "orders.created", Payload: []byte("two"), BizKey: "order:2"},
		outbox.Message{Subject: "orders.paid", Key: "o1", Payload: []byte("three")},
	)
	// A rolled back transaction never publishes.
	tx, _ := e.db.Pool.Begin(ctx)
	if _, err := e.client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.created", Payload: []byte("rolled back")}); err != nil {
		t.Fatal(err)
	}
	_ = tx.Rollback(ctx)

	r := e.relay(nil)
	drain(t, r)
	msgs := e.streamMsgs("ORDERS")
	if len(msgs) != 3 {
		t.Fatalf("stream holds %d messages, want 3", len(msgs))
	}
	for i, m := range msgs {
		if got := m.Header.Get("Nats-Msg-Id"); got != ids[i].String() {
			t.Errorf("message %d: Nats-Msg-Id %q, want %q", i, got, ids[i])
		}
	}
	if string(msgs[0].Data) != "one" || msgs[0].Header.Get("Txoutbox-Key") != "o1" || msgs[0].Header.Get("traceparent") == "" {
		t.Errorf("first message = %q %v", msgs[0].Data, msgs[0].Header)
	}
	if msgs[1].Header.Get(outbox.HeaderBizKey) != "order:2" || msgs[1].Header.Get("Txoutbox-Key") != "" {
		t.Errorf("second message headers = %v", msgs[1].Header)
	}
	if n := e.count("true"); n != 0 {
		t.Fatalf("%d rows left, want 0 (published rows are deleted by default)", n)
	}
	// Nothing more to do: a second pass publishes nothing.
	if n, err := r.runOnce(ctx); n != 0 || err != nil {
		t.Fatalf("second pass: %d, %v", n, err)
	}
	if got := len(e.streamMsgs("ORDERS")); got != 3 {
		t.Fatalf("stream holds %d after a second pass, want 3", got)
	}
	if r.Stats().Published != 3 || r.Stats().Duplicates != 0 {
		t.Fatalf("stats published=%d duplicates=%d", r.Stats().Published, r.Stats().Duplicates)
	}
}

func TestRetentionKeepsPublishedRows(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.enqueue(outbox.Message{Subject: "orders.created"}, outbox.Message{Subject: "orders.created"})
	r := e.relay(&Config{PublishedRetention: time.Hour})
	drain(t, r)
	if n := e.count("state = 'published' AND published_at IS NOT NULL AND stream = 'ORDERS' AND stream_seq IN (1, 2)"); n != 2 {
		t.Fatalf("%d published rows kept, want 2", n)
	}
}

// The start line names the retention in words: "forever" for txoutbox.Forever (not "-1ns"),
// "none" for the default.
func TestStartLineNamesTheRetention(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, c := range []struct {
		retention time.Duration
		want      string
	}{{txoutbox.Forever, "retention=forever "}, {0, "retention=none "}, {time.Hour, "retention=1h0m0s "}} {
		logs := newEventLog()
		r := e.start(&Config{PublishedRetention: c.retention, Logger: slog.New(logs)})
		testsvc.Eventually(t, 10*time.Second, "the start line", func() bool { return logs.count(slog.LevelInfo, "relay started") == 1 })
		if got := logs.attrsOf("relay started"); !strings.Contains(got, c.want) {
			t.Errorf("PublishedRetention %d: start line %q, want %q", c.retention, got, c.want)
		}
		if err := r.stop(); err != nil {
			t.Fatal(err)
		}
	}
}

func TestCrashBetweenPublishAndSettle(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ids := e.enqueue(outbox.Message{Subject: "orders.created", Payload: []byte("a")}, outbox.Message{Subject: "orders.created", Key: "k", Payload: []byte("b")})

	crashed := e.relay(nil)
	errCrash := errors.New("crash")
	crashed.hooks.afterPublish = func(context.Context, int) error { return errCrash }
	if _, err := crashed.runOnce(context.Background()); !errors.Is(err, errCrash) {
		t.Fatalf("runOnce = %v, want the crash", err)
	}
	crashed.Close() // its connection and leases die with it
	if n := e.count("state = 'ready'"); n != 2 {
		t.Fatalf("%d ready rows after the crash, want 2 (nothing settled)", n)
	}
	if got := len(e.streamMsgs("ORDERS")); got != 2 {
		t.Fatalf("stream holds %d after the crash, want 2 (published, not settled)", got)
	}

	restarted := e.relay(nil)
	drain(t, restarted)
	msgs := e.streamMsgs("ORDERS")
	if len(msgs) != 2 {
		t.Fatalf("stream holds %d after the restart, want 2: the republish must be deduplicated", len(msgs))
	}
	for i, m := range msgs {
		if m.Header.Get("Nats-Msg-Id") != ids[i].String() {
			t.Fatalf("message %d has id %s", i, m.Header.Get("Nats-Msg-Id"))
		}
	}
	if d := restarted.Stats().Duplicates; d != 2 {
		t.Fatalf("duplicates reported = %d, want 2", d)
	}
	if n := e.count("true"); n != 0 {
		t.Fatalf("%d rows left", n)
	}
}

func TestDeadAfterMaxAttemptsHoldsBackItsKeyOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	// "nowhere.x" has no stream: every publish fails with no responders.
	ids := e.enqueue(
		outbox.Message{Subject: "nowhere.x", Key: "k1", Payload: []byte("poison")},
		outbox.Message{Subject: "orders.created", Key: "k1", Payload: []byte("after poison")},
		outbox.Message{Subject: "orders.created", Key: "k2", Payload: []byte("other key")},
		outbox.Message{Subject: "orders.created", Payload: []byte("no key")},
	)
	r := e.relay(&Config{MaxAttempts: 3, BackoffBase: time.Millisecond, BackoffMax: 5 * time.Millisecond})
	deadline := time.Now().Add(20 * time.Second)
	for e.count("state = 'dead'") == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the poison row never became dead")
		}
		if _, err := r.runOnce(context.Background()); err != nil {
			t.Fatal(err)
		}
		e.retryNow()
	}
	var attempts int
	var lastErr string
	if err := e.db.Pool.QueryRow(context.Background(), "SELECT attempts, last_error FROM txoutbox_messages WHERE message_id = $1 AND state = 'dead'", ids[0]).Scan(&attempts, &lastErr); err != nil {
		t.Fatal(err)
	}
	if attempts != 3 || !strings.Contains(lastErr, `no JetStream stream captures subject "nowhere.x"`) {
		t.Fatalf("dead row: attempts %d, last_error %q", attempts, lastErr)
	}
	// The later message of k1 is held back (still ready, never attempted); the others went out.
	drain(t, r)
	if n := e.count("message_id = $1 AND state = 'ready' AND attempts = 0", ids[1]); n != 1 {
		t.Fatal("the message after the dead one in its key must be held back")
	}
	msgs := e.streamMsgs("ORDERS")
	if len(msgs) != 2 || string(msgs[0].Data) != "other key" || string(msgs[1].Data) != "no key" {
		t.Fatalf("stream = %d messages, want the other key's and the unkeyed one", len(msgs))
	}
	if r.Stats().Dead != 1 {
		t.Fatalf("dead count = %d", r.Stats().Dead)
	}
}

// A key's failed message holds back its later messages; once it goes through, they follow in
// order.
func TestFailedKeyRecoversInOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.enqueue(
		outbox.Message{Subject: "later.a", Key: "k", Payload: []byte("1")},
		outbox.Message{Subject: "orders.b", Key: "k", Payload: []byte("2")},
		outbox.Message{Subject: "later.c", Key: "k", Payload: []byte("3")},
		outbox.Message{Subject: "orders.d", Key: "k", Payload: []byte("4")},
		outbox.Message{Subject: "orders.x", Key: "other", Payload: []byte("x")},
	)
	logs := &recordLog{}
	r := e.relay(&Config{BackoffBase: 20 * time.Millisecond, BackoffMax: 50 * time.Millisecond, Logger: slog.New(logs)})
	drain(t, r)
	if got := e.streamMsgs("ORDERS"); len(got) != 1 || string(got[0].Data) != "x" {
		t.Fatalf("before the stream exists only the other key may pass, got %d messages", len(got))
	}
	// Keep failing a while: one warning for the subject, however many retries.
	for range 5 {
		e.retryNow()
		if _, err := r.runOnce(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if n := e.count("attempts >= 2"); n == 0 {
		t.Fatal("the failing row was not retried")
	}
	if w := logs.count(slog.LevelWarn, "later.a"); w != 1 {
		t.Fatalf("%d warnings for subject later.a over several failed attempts, want 1", w)
	}
	// The operator adds the missing subjects to the stream; the key drains in order.
	ctx := context.Background()
	s, _ := e.nats.JS.Stream(ctx, "ORDERS")
	cfg := s.CachedInfo().Config
	cfg.Subjects = append(cfg.Subjects, "later.>")
	if _, err := e.nats.JS.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	testsvc.Eventually(t, 10*time.Second, "key k to drain", func() bool {
		if _, err := r.runOnce(ctx); err != nil {
			t.Fatal(err)
		}
		return e.count("true") == 0
	})
	var order []string
	for _, m := range e.streamMsgs("ORDERS") {
		order = append(order, string(m.Data))
	}
	if strings.Join(order, ",") != "x,1,2,3,4" {
		t.Fatalf("stream order %v, want x,1,2,3,4", order)
	}
	if w, i := logs.count(slog.LevelWarn, "later.a"), logs.count(slog.LevelInfo, "later.a"); w != 1 || i != 1 {
		t.Fatalf("subject later.a: %d warnings, %d recovery lines; want 1 and 1", w, i)
	}
}

// recordLog is a slog.Handler that counts records by level and "subject" attribute.
type recordLog struct {
	mu   sync.Mutex
	recs []struct {
		level        slog.Level
		subject, msg string
	}
}

func (h *recordLog) Enabled(context.Context, slog.Level) bool { return true }
func (h *recordLog) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *recordLog) WithGroup(string) slog.Handler            { return h }
func (h *recordLog) Handle(_ context.Context, r slog.Record) error {
	subject := ""
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "subject" {
			subject = a.Value.String()
		}
		return true
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	h.recs = append(h.recs, struct {
		level        slog.Level
		subject, msg string
	}{r.Level, subject, r.Message})
	return nil
}

// countMsg counts the records of level with message msg.
func (h *recordLog) countMsg(level slog.Level, msg string) int {
	return h.countWhere(func(l slog.Level, _, m string) bool { return l == level && m == msg })
}

// count counts the records of level with attribute subject=subject.
func (h *recordLog) count(level slog.Level, subject string) int {
	return h.countWhere(func(l slog.Level, s, _ string) bool { return l == level && s == subject })
}

func (h *recordLog) countWhere(match func(level slog.Level, subject, msg string) bool) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, r := range h.recs {
		if match(r.level, r.subject, r.msg) {
			n++
		}
	}
	return n
}

// The Postgres doorbell listener reconnects after each loss, and each loss is one warning.
func TestDoorbellListenerReconnects(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	logs := &recordLog{}
	channel := "txoutbox_bell_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	r := e.relay(&Config{DoorbellChannel: channel, Logger: slog.New(logs), BackoffBase: 50 * time.Millisecond, BackoffMax: 200 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() { cancel(); <-done }()
	listener := func() int {
		var pids []int
		rows, _ := e.db.Pool.Query(context.Background(), `SELECT pid FROM pg_stat_activity WHERE query = $1`, "LISTEN "+pgx.Identifier{channel}.Sanitize())
		pids, _ = pgx.CollectRows(rows, pgx.RowTo[int])
		if len(pids) != 1 {
			return 0
		}
		return pids[0]
	}
	for round := 1; round <= 2; round++ {
		var pid int
		testsvc.Eventually(t, 10*time.Second, "the doorbell listener", func() bool { pid = listener(); return pid != 0 })
		if _, err := e.db.Pool.Exec(context.Background(), `SELECT pg_terminate_backend($1)`, pid); err != nil {
			t.Fatal(err)
		}
		testsvc.Eventually(t, 10*time.Second, "the listener to come back", func() bool {
			return logs.countMsg(slog.LevelInfo, "doorbell listener back") == round
		})
		// A ring reaches the relay again.
		if _, err := e.db.Pool.Exec(context.Background(), `SELECT pg_notify($1, '')`, channel); err != nil {
			t.Fatal(err)
		}
	}
	if w := logs.countMsg(slog.LevelWarn, "doorbell listener lost; reconnecting"); w != 2 {
		t.Fatalf("%d loss warnings for 2 losses, want 2", w)
	}
}

func TestNATSRestartWhileRowsWait(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for i := 0; i < 5; i++ {
		msgs := make([]outbox.Message, 20)
		for j := range msgs {
			msgs[j] = outbox.Message{Subject: "orders.created", Key: fmt.Sprintf("k%d", j%4), Payload: []byte(strconv.Itoa(i*20 + j))}
		}
		e.enqueue(msgs...)
	}
	r := e.relay(&Config{PublishTimeout: 300 * time.Millisecond, BatchSize: 30})
	e.nats.Stop()
	// With NATS gone a batch fails as a broker outage: nothing settled, no attempt counted.
	_, err := r.runOnce(context.Background())
	if !errors.Is(err, errBrokerUnavailable) {
		t.Fatalf("runOnce with NATS down = %v, want errBrokerUnavailable", err)
	}
	if n := e.count("state = 'ready' AND attempts = 0"); n != 100 {
		t.Fatalf("%d untouched ready rows, want 100", n)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	waitBackoff(t, r, 10*time.Second, "the running relay to fail a pass and back off", nil)
	if err := e.nats.Start(); err != nil {
		t.Fatal(err)
	}
	testsvc.Eventually(t, 30*time.Second, "all rows published", func() bool { return e.count("true") == 0 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	msgs := e.streamMsgs("ORDERS")
	if len(msgs) != 100 {
		t.Fatalf("stream holds %d, want 100 (none lost, none twice)", len(msgs))
	}
	seen := map[string]bool{}
	for _, m := range msgs {
		if seen[string(m.Data)] {
			t.Fatalf("payload %s stored twice", m.Data)
		}
		seen[string(m.Data)] = true
	}
}

func TestPostgresBackendTerminated(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.relay(&Config{BackoffBase: 50 * time.Millisecond, BackoffMax: 200 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	e.enqueue(outbox.Message{Subject: "orders.created", Payload: []byte("before")})
	testsvc.Eventually(t, 10*time.Second, "first message published", func() bool { return e.count("true") == 0 })

	var killed int
	err := e.db.AdminPool.QueryRow(context.Background(),
		`SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1`, r.appName()).Scan(&killed)
	if err != nil || killed == 0 {
		t.Fatalf("terminated %d backends: %v", killed, err)
	}
	e.enqueue(outbox.Message{Subject: "orders.created", Payload: []byte("after")})
	testsvc.Eventually(t, 15*time.Second, "relay to recover and publish", func() bool { return e.count("true") == 0 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := len(e.streamMsgs("ORDERS")); got != 2 {
		t.Fatalf("stream holds %d, want 2", got)
	}
}

func TestGracefulShutdownSettlesInFlightBatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.enqueue(outbox.Message{Subject: "orders.created"}, outbox.Message{Subject: "orders.created"}, outbox.Message{Subject: "orders.created"})
	r := e.relay(nil)
	ctx, cancel := context.WithCancel(context.Background())
	// The signal arrives after the batch is published and before it is settled.
	r.hooks.afterPublish = func(context.Context, int) error { cancel(); return nil }
	if err := r.Run(ctx); err != nil {
		t.Fatalf("Run = %v, want nil on shutdown", err)
	}
	if n := e.count("true"); n != 0 {
		t.Fatalf("%d rows left after a graceful shutdown, want 0: the in-flight batch must be settled", n)
	}
	if got := len(e.streamMsgs("ORDERS")); got != 3 {
		t.Fatalf("stream holds %d, want 3", got)
	}
	if len(r.Partitions()) != 0 {
		t.Fatal("partitions must be released on shutdown")
	}
}

// Many producers, many keys, a relay running with small batches: per key, the stream holds
// the messages in commit order.
func TestPerKeyOrderUnderConcurrency(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.relay(&Config{BatchSize: 7, Partitions: 3})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()

	const keys, perKey = 12, 30
	var wg sync.WaitGroup
	for k := 0; k < keys; k++ {
		wg.Add(1)
		go func(k int) {
			defer wg.Done()
			for i := 0; i < perKey; i++ {
				key := fmt.Sprintf("key-%d", k)
				err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
					_, err := e.client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.seq", Key: key, Payload: []byte(fmt.Sprintf("%s:%d", key, i))})
					return err
				})
				if err != nil {
					t.Error(err)
					return
				}
			}
		}(k)
	}
	wg.Wait()
	testsvc.Eventually(t, 30*time.Second, "everything published", func() bool { return e.count("true") == 0 })
	cancel()
	<-done
	next := map[string]int{}
	msgs := e.streamMsgs("ORDERS")
	if len(msgs) != keys*perKey {
		t.Fatalf("stream holds %d, want %d", len(msgs), keys*perKey)
	}
	for _, m := range msgs {
		key, n, _ := strings.Cut(string(m.Data), ":")
		i, _ := strconv.Atoi(n)
		if i != next[key] {
			t.Fatalf("key %s: got message %d, want %d", key, i, next[key])
		}
		next[key]++
	}
}

// Many transactions enqueue on the same keys at once: the stream holds each key's messages in
// the order their transactions committed. The commit order is recorded by a sequence drawn in
// each transaction after EnqueueTx, while the key's lock is held (so for one key, sequence
// order is commit order).
func TestSameKeyConcurrentTransactionsPublishInCommitOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	if _, err := e.db.Pool.Exec(ctx, `CREATE TABLE commit_log (seq bigserial PRIMARY KEY, msg_key text NOT NULL, payload text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	r := e.relay(&Config{BatchSize: 5, Partitions: 2})
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()

	const writers, perWriter = 8, 15
	keys := []string{"hot-a", "hot-b"}
	var wg sync.WaitGroup
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; i < perWriter; i++ {
				key, payload := keys[(w+i)%len(keys)], fmt.Sprintf("w%d-%d", w, i)
				err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
					if _, err := e.client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.hot", Key: key, Payload: []byte(payload)}); err != nil {
						return err
					}
					time.Sleep(time.Duration(i%3) * time.Millisecond) // widen the window between enqueue and commit
					_, err := tx.Exec(ctx, `INSERT INTO commit_log (msg_key, payload) VALUES ($1, $2)`, key, payload)
					return err
				})
				if err != nil {
					t.Error(err)
					return
				}
			}
		}(w)
	}
	wg.Wait()
	testsvc.Eventually(t, 30*time.Second, "everything published", func() bool { return e.count("true") == 0 })
	cancel()
	<-done

	want := map[string][]string{}
	rows, _ := e.db.Pool.Query(ctx, `SELECT msg_key, payload FROM commit_log ORDER BY seq`)
	for rows.Next() {
		var k, p string
		if err := rows.Scan(&k, &p); err != nil {
			t.Fatal(err)
		}
		want[k] = append(want[k], p)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	got := map[string][]string{}
	for _, m := range e.streamMsgs("ORDERS") {
		got[m.Header.Get(outbox.HeaderKey)] = append(got[m.Header.Get(outbox.HeaderKey)], string(m.Data))
	}
	for _, k := range keys {
		if len(want[k]) == 0 || !slices.Equal(got[k], want[k]) {
			t.Fatalf("key %s: stream order %v, commit order %v", k, got[k], want[k])
		}
	}
}

func TestStandbyTakesOverPartitions(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.relay(&Config{ID: "a", Partitions: 4})
	b := e.relay(&Config{ID: "b", Partitions: 4})
	if _, err := a.runOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := len(a.Partitions()); got != 4 {
		t.Fatalf("a holds %d partitions, want 4", got)
	}
	if _, err := b.runOnce(context.Background()); !errors.Is(err, errNoPartitions) {
		t.Fatalf("b.runOnce = %v, want errNoPartitions while a holds everything", err)
	}
	e.enqueue(outbox.Message{Subject: "orders.created", Key: "x"}, outbox.Message{Subject: "orders.created", Key: "y"})
	a.Close() // a dies: its session, and its leases, end
	testsvc.Eventually(t, 5*time.Second, "b to take over", func() bool {
		_, err := b.runOnce(context.Background())
		return err == nil && len(b.Partitions()) == 4
	})
	drain(t, b)
	if got := len(e.streamMsgs("ORDERS")); got != 2 {
		t.Fatalf("stream holds %d, want 2", got)
	}
}

func TestCheckStreams(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	r := e.relay(&Config{Subjects: []string{"orders.>", "payments.>"}})
	var se *StreamError
	if err := r.CheckStreams(ctx); !errors.Is(err, ErrNoStream) || !errors.As(err, &se) || se.Subject != "payments.>" {
		t.Fatalf("CheckStreams = %v, want ErrNoStream for payments.>", err)
	}
	if _, err := e.nats.JS.CreateStream(ctx, jetstream.StreamConfig{Name: "PAY", Subjects: []string{"payments.>"}, Duplicates: 10 * time.Second}); err != nil {
		t.Fatal(err)
	}
	if err := r.CheckStreams(ctx); !errors.Is(err, ErrDuplicateWindow) || !strings.Contains(err.Error(), "PAY") {
		t.Fatalf("CheckStreams = %v, want ErrDuplicateWindow naming PAY", err)
	}
	// A stream that captures only part of a wildcard subject is not enough.
	if _, err := e.nats.JS.CreateStream(ctx, jetstream.StreamConfig{Name: "REFUNDS_CREATED", Subjects: []string{"refunds.created"}, Duplicates: time.Hour}); err != nil {
		t.Fatal(err)
	}
	refunds := e.relay(&Config{Subjects: []string{"refunds.>"}, CreateStream: "REFUNDS"})
	if err := refunds.CheckStreams(ctx); !errors.Is(err, ErrNoStream) || !errors.As(err, &se) ||
		!slices.Equal(se.Partial, []string{"REFUNDS_CREATED"}) || !strings.Contains(err.Error(), "only part") {
		t.Fatalf("CheckStreams = %v, want ErrNoStream naming the partial stream", err)
	}
	if err := e.relay(&Config{Subjects: []string{"refunds.created", "orders.eu.*"}}).CheckStreams(ctx); err != nil {
		t.Fatalf("CheckStreams = %v for subjects that ORDERS and REFUNDS_CREATED cover", err)
	}
	created := e.relay(&Config{Subjects: []string{"invoices.>"}, CreateStream: "INVOICES"})
	if err := created.CheckStreams(ctx); err != nil {
		t.Fatal(err)
	}
	s, err := e.nats.JS.Stream(ctx, "INVOICES")
	if err != nil {
		t.Fatal(err)
	}
	if c := s.CachedInfo().Config; c.Duplicates < created.cfg.RequiredDuplicateWindow() || c.Subjects[0] != "invoices.>" {
		t.Fatalf("created stream config = %+v", c)
	}
}

func TestConfigErrorsNameTheField(t *testing.T) {
	t.Parallel()
	for field, cfg := range map[string]*Config{
		"BatchSize":     {BatchSize: -1},
		"PollMax":       {PollMin: time.Second, PollMax: time.Millisecond},
		"BackoffJitter": {BackoffJitter: 1.5},
		"Partitions":    {Partitions: -3},
		"Subjects":      {Subjects: []string{"a..b"}},
		"Schema":        {Schema: strings.Repeat("x", 70)},
		"CreateStream":  {CreateStream: "my.stream"},
	} {
		err := cfg.WithDefaults().validate()
		var ce *txoutbox.ConfigError
		if !errors.As(err, &ce) || ce.Field != "Config."+field || !strings.Contains(err.Error(), "Config."+field) {
			t.Errorf("%s: err = %v", field, err)
		}
	}
	// CreateStream without Subjects would create nothing (it was silently ignored).
	err := (&Config{CreateStream: "ORDERS"}).WithDefaults().validate()
	var ce *txoutbox.ConfigError
	if !errors.As(err, &ce) || ce.Field != "Config.CreateStream" || !strings.Contains(err.Error(), "needs Subjects") {
		t.Errorf("CreateStream without Subjects: err = %v", err)
	}
	if err := (&Config{CreateStream: "ORDERS", Subjects: []string{"orders.>"}}).WithDefaults().validate(); err != nil {
		t.Errorf("CreateStream with Subjects: err = %v", err)
	}
}

func TestBackoff(t *testing.T) {
	t.Parallel()
	for n, want := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 10: time.Minute, 100: time.Minute} {
		if got := backoff(n, time.Second, time.Minute, 0); got != want {
			t.Errorf("backoff(%d) = %s, want %s", n, got, want)
		}
	}
	lo, hi := time.Hour, time.Duration(0)
	for i := 0; i < 1000; i++ {
		d := backoff(3, time.Second, time.Minute, 0.2)
		lo, hi = min(lo, d), max(hi, d)
	}
	if lo < 3200*time.Millisecond || hi > 4800*time.Millisecond || hi-lo < time.Second {
		t.Fatalf("jittered backoff(3) spans [%s, %s], want about [3.2s, 4.8s]", lo, hi)
	}
}

// Shutdown arriving while the next batch is being claimed — and the claim is slow, here held up
// by a lease round waiting on a lock — must not drop the lease connection under the batch in
// flight: that batch is still settled, so nothing in the stream is left ready to be published
// again.
func TestShutdownDuringPipelinedClaimSettlesBatchInFlight(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	for i := 0; i < 4; i++ {
		e.enqueue(outbox.Message{Subject: "orders.created"}, outbox.Message{Subject: "orders.created"})
	}
	// The lease round is made due by the hook; a lease of 10 s (not 100 ms) so that a loaded
	// machine cannot end it before the first batch is sent.
	r := e.relay(&Config{BatchSize: 2, LeaseInterval: time.Second})
	runCtx, cancel := context.WithCancel(ctx)
	var once sync.Once
	r.hooks.beforePipelinedClaim = func(claimCtx context.Context) {
		once.Do(func() {
			r.leaseRoundDueNow() // a lease round is due at this claim
			// Hold the relay's membership row: the round's heartbeat waits on it...
			tx, err := e.db.Pool.Begin(ctx)
			if err != nil {
				t.Error(err)
				return
			}
			if _, err := tx.Exec(ctx, "SELECT 1 FROM txoutbox_relays FOR UPDATE"); err != nil {
				t.Error(err)
			}
			// ...while the shutdown signal arrives; then let it go.
			go func() {
				if !waitingOnLock(ctx, e.db.AdminPool, r.appName(), 10*time.Second) {
					t.Error("the lease round's heartbeat never waited on the membership row")
				}
				cancel()
				// Shutdown reaches the claim only through its context: pgx would close the
				// connection of a cancelled query, and with it the leases and the settle of
				// the batch in flight. The claim's context must outlive the cancel.
				if err := claimCtx.Err(); err != nil {
					t.Errorf("the pipelined claim's context ended with the shutdown: %v", err)
				}
				_ = tx.Rollback(ctx)
			}()
		})
	}
	if err := r.Run(runCtx); err != nil {
		t.Fatal(err)
	}
	stored := map[string]bool{}
	for _, m := range e.streamMsgs("ORDERS") {
		stored[m.Header.Get("Nats-Msg-Id")] = true
	}
	if len(stored) == 0 {
		t.Fatal("nothing was published before the shutdown")
	}
	rows, err := e.db.Pool.Query(ctx, "SELECT message_id::text FROM txoutbox_messages WHERE state = 'ready'")
	if err != nil {
		t.Fatal(err)
	}
	ready, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ready {
		if stored[id] {
			t.Fatalf("message %s is in the stream but still ready: the batch in flight was not settled at shutdown", id)
		}
	}
	t.Logf("%d messages published and settled, %d left ready for the next relay", len(stored), len(ready))
}
