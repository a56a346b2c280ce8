package consumer

import (
	"context"
	"crypto/rand"
	"fmt"
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

// BenchmarkConsume measures consumer throughput, b.N messages drained from a backlog, each
// with its dedup row and a one-row business update (UPDATE accounts … WHERE id = $1 over
// 1,000 accounts), in per-message mode (one transaction and commit per message) and in batch
// mode (one transaction per batch, a savepoint per message), at concurrency 1 and 4. Payloads
// are 512 random bytes. The keyed cases give the messages 100 ordering keys, consumed without
// and with Ordered (the per-key applied-order check). Run the cases in one invocation and
// compare them, e.g.
//
//	go test ./consumer -run '^$' -bench BenchmarkConsume -benchtime 5000x -count 1
func BenchmarkConsume(b *testing.B) {
	for _, bc := range []struct {
		name        string
		batch, conc int
		keys        int
		ordered     bool
	}{
		{"per-message/c=1", 1, 1, 0, false},
		{"batch=50/c=1", 50, 1, 0, false},
		{"per-message/c=4", 1, 4, 0, false},
		{"batch=50/c=4", 50, 4, 0, false},
		{"keyed/per-message/c=4", 1, 4, 100, false},
		{"keyed/ordered/per-message/c=4", 1, 4, 100, true},
	} {
		b.Run(bc.name, func(b *testing.B) { benchConsume(b, bc.batch, bc.conc, bc.keys, bc.ordered) })
	}
}

func benchConsume(b *testing.B, batch, conc, keys int, ordered bool) {
	ctx := context.Background()
	db := testsvc.NewDB(b)
	n := testsvc.NewNATS(b)
	n.Stream(b, testStream, "orders.>")
	n.Stream(b, deadStream, DefaultDeadLetterPrefix+">")
	const accounts = 1000
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL);
		INSERT INTO accounts SELECT g, 0 FROM generate_series(1, 1000) g`); err != nil {
		b.Fatal(err)
	}

	// The backlog.
	pub, err := jetstream.New(n.Conn, jetstream.WithPublishAsyncMaxPending(1000))
	if err != nil {
		b.Fatal(err)
	}
	payload := make([]byte, 512)
	_, _ = rand.Read(payload)
	for i := range b.N {
		m := nats.NewMsg("orders.created")
		m.Header[outbox.HeaderMsgID] = []string{newID()}
		if keys > 0 {
			m.Header[outbox.HeaderKey] = []string{fmt.Sprintf("acct-%d", i%keys)}
		}
		m.Data = payload
		if _, err := pub.PublishMsgAsync(m); err != nil {
			b.Fatalf("publish %d: %v", i, err)
		}
	}
	select {
	case <-pub.PublishAsyncComplete():
	case <-time.After(time.Minute):
		b.Fatal("backlog not stored within a minute")
	}

	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		_, err := tx.Exec(ctx, `UPDATE accounts SET balance = balance + 1 WHERE id = $1`, int(msg.StreamSeq%accounts)+1)
		return err
	}
	c, err := New(db.Pool, n.JS, h, &Config{
		Stream: testStream, Durable: testDurable, Schema: db.Schema,
		BatchSize: batch, Concurrency: conc, Ordered: ordered, Logger: quietLogger(),
	})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := c.Setup(ctx); err != nil {
		b.Fatal(err)
	}
	// The clock stops when the last message's transaction has committed (its effect is
	// durable; only its ack is left), signalled by the consumer itself rather than polled.
	var committed atomic.Int64
	allCommitted := make(chan struct{})
	var once sync.Once
	c.hooks.afterCommit = func(_ context.Context, msgs []Message) error {
		if committed.Add(int64(len(msgs))) >= int64(b.N) {
			once.Do(func() { close(allCommitted) })
		}
		return nil
	}
	b.ResetTimer()
	start := time.Now()
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	select {
	case <-allCommitted:
	case err := <-done:
		b.Fatalf("the consumer stopped before processing the backlog: %v", err)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	cancel()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	var sum int64
	if err := db.Pool.QueryRow(ctx, `SELECT sum(balance) FROM accounts`).Scan(&sum); err != nil {
		b.Fatal(err)
	}
	if sum != int64(b.N) || c.Stats().Duplicates != 0 || c.Stats().DeadLettered != 0 {
		b.Fatalf("effects %d for %d messages (duplicates %d, dead letters %d)", sum, b.N,
			c.Stats().Duplicates, c.Stats().DeadLettered)
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
	b.ReportMetric(float64(c.Stats().Retries), "retries")
	if testing.Verbose() {
		fmt.Printf("%s: %d messages in %s\n", b.Name(), b.N, elapsed.Round(time.Millisecond))
	}
}

// BenchmarkHandlerCopy measures the copy each handler call gets (Message.handlerCopy) of a
// message as the relay publishes it: a 512-byte payload and five headers (Nats-Msg-Id,
// Txoutbox-Key, Txoutbox-Biz-Key, traceparent, tracestate).
func BenchmarkHandlerCopy(b *testing.B) {
	payload := make([]byte, 512)
	_, _ = rand.Read(payload)
	m := Message{Payload: payload, Headers: nats.Header{
		outbox.HeaderMsgID:  {newID()},
		outbox.HeaderKey:    {"acct-42"},
		outbox.HeaderBizKey: {"order-42-paid"},
		"traceparent":       {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
		"tracestate":        {"vendor=opaque"},
	}}
	b.ReportAllocs()
	var sink Message
	for b.Loop() {
		sink = m.handlerCopy()
	}
	_ = sink
}
