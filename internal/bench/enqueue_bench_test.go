package bench

// Producer hot-path benchmarks on a real PostgreSQL (fsync as configured there: the yardstick
// wants it on) and an embedded NATS. One op is one transaction: BEGIN, one business row, the
// variant's work, COMMIT (and, for _ring, the doorbell after commit). Besides ns/op each
// reports stmt-µs/op, the time of the variant's own statement inside the transaction, which
// the commit's fsync does not blur:
//
//	go test ./internal/bench -run '^$' -bench Enqueue -benchtime 2000x
//
// enqueue_N_keys gives each of the N messages a key of its own, never seen before (no waiting on
// another producer): the cost of the key locks.
//
// plain_insert_N inserts the same N rows (id, message id, subject, 512 B payload) into a plain
// table with only a primary key, in one statement: the cost of EnqueueTx is the difference.
// notify_in_tx adds a pg_notify inside the transaction, which the doorbell avoids: PostgreSQL
// serialises the commits of notifying transactions on a database-wide lock, which the
// parallel variants show.

import (
	"context"
	"crypto/rand"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

type enqueueBench struct {
	pool     *pgxpool.Pool
	client   *outbox.Client // no doorbell
	ringing  *outbox.Client // NATS doorbell
	business string
	plain    string
	payload  []byte
	keySeq   atomic.Int64 // distinct keys for the keyed variants
}

func newEnqueueBench(b *testing.B) *enqueueBench {
	b.Helper()
	ctx := context.Background()
	db := testsvc.NewDB(b)
	n := testsvc.NewNATS(b)
	cfg, err := pgxpool.ParseConfig(db.DSN)
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = 16
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	e := &enqueueBench{
		pool:     pool,
		business: businessTable(db.Schema),
		plain:    pgx.Identifier{db.Schema, "plain_events"}.Sanitize(),
		payload:  make([]byte, DefaultPayload),
	}
	_, _ = rand.Read(e.payload)
	for _, ddl := range []string{
		"CREATE TABLE " + e.business + ` (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, producer integer NOT NULL,
			seq bigint NOT NULL, note text NOT NULL, created_at timestamptz NOT NULL DEFAULT now())`,
		"CREATE TABLE " + e.plain + ` (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, message_id uuid NOT NULL,
			subject text NOT NULL, payload bytea NOT NULL)`,
	} {
		if _, err := pool.Exec(ctx, ddl); err != nil {
			b.Fatal(err)
		}
	}
	if e.client, err = outbox.NewClient(&outbox.Config{Schema: db.Schema}); err != nil {
		b.Fatal(err)
	}
	if e.ringing, err = outbox.NewClient(&outbox.Config{Schema: db.Schema, Doorbell: outbox.NewNATSDoorbell(n.Conn, "")}); err != nil {
		b.Fatal(err)
	}
	// Warm up: every pooled connection prepares every variant's statements once, so that no
	// sub-benchmark pays for the first use of a connection.
	errc := make(chan error, cfg.MaxConns)
	for p := range int(cfg.MaxConns) {
		go func() {
			for _, v := range e.variants() {
				if _, err := e.tx(ctx, v, -1-p, 0); err != nil {
					errc <- err
					return
				}
			}
			errc <- nil
		}()
	}
	for range cfg.MaxConns {
		if err := <-errc; err != nil {
			b.Fatal(err)
		}
	}
	return e
}

func (e *enqueueBench) messages(n int) []outbox.Message {
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = outbox.Message{Subject: "bench.enqueue", Payload: e.payload}
	}
	return msgs
}

// keyed returns a variant's statement enqueueing n messages with n keys never used before.
func (e *enqueueBench) keyed(n int) func(context.Context, pgx.Tx) error {
	return func(ctx context.Context, tx pgx.Tx) error {
		msgs := e.messages(n)
		for i := range msgs {
			msgs[i].Key = "k" + strconv.FormatInt(e.keySeq.Add(1), 10)
		}
		_, err := e.client.EnqueueTx(ctx, tx, msgs...)
		return err
	}
}

// plainInsert inserts n rows like the outbox's into the plain table in one statement.
func (e *enqueueBench) plainInsert(ctx context.Context, tx pgx.Tx, n int) error {
	if n == 1 {
		_, err := tx.Exec(ctx, "INSERT INTO "+e.plain+" (message_id, subject, payload) VALUES ($1, $2, $3)",
			uuid.Must(uuid.NewV7()), "bench.enqueue", e.payload)
		return err
	}
	ids := make([]uuid.UUID, n)
	subjects := make([]string, n)
	payloads := make([][]byte, n)
	for i := range ids {
		ids[i], subjects[i], payloads[i] = uuid.Must(uuid.NewV7()), "bench.enqueue", e.payload
	}
	_, err := tx.Exec(ctx, "INSERT INTO "+e.plain+" (message_id, subject, payload) SELECT * FROM unnest($1::uuid[], $2::text[], $3::bytea[])",
		ids, subjects, payloads)
	return err
}

// variant is the work done inside the transaction after the business row, and after commit.
type variant struct {
	name  string
	stmt  func(ctx context.Context, tx pgx.Tx) error
	after func()
}

func (e *enqueueBench) variants() []variant {
	one, hundred := e.messages(1), e.messages(100)
	enqueue := func(c *outbox.Client, msgs []outbox.Message) func(context.Context, pgx.Tx) error {
		return func(ctx context.Context, tx pgx.Tx) error {
			// Fresh ids each time: EnqueueTx draws them when Message.ID is zero.
			_, err := c.EnqueueTx(ctx, tx, msgs...)
			return err
		}
	}
	return []variant{
		{name: "business_only", stmt: func(context.Context, pgx.Tx) error { return nil }},
		{name: "plain_insert_1", stmt: func(ctx context.Context, tx pgx.Tx) error { return e.plainInsert(ctx, tx, 1) }},
		{name: "enqueue_1", stmt: enqueue(e.client, one)},
		{name: "enqueue_1_key", stmt: e.keyed(1)},
		{name: "enqueue_1_ring", stmt: enqueue(e.ringing, one), after: e.ringing.Ring},
		{name: "enqueue_1_notify_in_tx", stmt: func(ctx context.Context, tx pgx.Tx) error {
			if _, err := e.client.EnqueueTx(ctx, tx, one...); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "SELECT pg_notify('txoutbox_bench', '')")
			return err
		}},
		{name: "plain_insert_100", stmt: func(ctx context.Context, tx pgx.Tx) error { return e.plainInsert(ctx, tx, 100) }},
		{name: "enqueue_100", stmt: enqueue(e.client, hundred)},
		{name: "enqueue_100_keys", stmt: e.keyed(100)},
		{name: "enqueue_300_keys", stmt: e.keyed(300)},
	}
}

// tx runs one op and returns the time of the variant's statement.
func (e *enqueueBench) tx(ctx context.Context, v variant, producer int, seq int64) (time.Duration, error) {
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "INSERT INTO "+e.business+" (producer, seq, note) VALUES ($1, $2, 'bench')", producer, seq); err != nil {
		return 0, err
	}
	t0 := time.Now()
	if err := v.stmt(ctx, tx); err != nil {
		return 0, err
	}
	d := time.Since(t0)
	if err := tx.Commit(ctx); err != nil {
		return 0, err
	}
	if v.after != nil {
		v.after()
	}
	return d, nil
}

// BenchmarkEnqueue runs each variant from one goroutine (serial) and from 8 at once (parallel:
// 4 × GOMAXPROCS), where group commit helps every variant but notify_in_tx.
func BenchmarkEnqueue(b *testing.B) {
	e := newEnqueueBench(b)
	ctx := context.Background()
	for _, v := range e.variants() {
		b.Run("serial/"+v.name, func(b *testing.B) {
			var stmt time.Duration
			var seq int64
			for b.Loop() {
				seq++
				d, err := e.tx(ctx, v, 0, seq)
				if err != nil {
					b.Fatal(err)
				}
				stmt += d
			}
			b.ReportMetric(float64(stmt.Microseconds())/float64(seq), "stmt-µs/op")
		})
	}
	for _, v := range e.variants() {
		if v.name == "plain_insert_100" || v.name == "enqueue_100" || v.name == "plain_insert_1" ||
			v.name == "enqueue_100_keys" || v.name == "enqueue_300_keys" {
			continue
		}
		b.Run("parallel/"+v.name, func(b *testing.B) {
			var stmt, ops atomic.Int64
			var producers atomic.Int32
			b.SetParallelism(4)
			b.RunParallel(func(pb *testing.PB) {
				p := int(producers.Add(1))
				var seq int64
				for pb.Next() {
					seq++
					d, err := e.tx(ctx, v, p, seq)
					if err != nil {
						b.Error(err)
						return
					}
					stmt.Add(int64(d))
					ops.Add(1)
				}
			})
			if n := ops.Load(); n > 0 {
				b.ReportMetric(float64(stmt.Load())/1e3/float64(n), "stmt-µs/op")
				b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "tx/s")
			}
		})
	}
}
