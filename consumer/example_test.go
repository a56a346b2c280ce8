package consumer_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
)

// The whole chain against real services: a request retried by its client enqueues the same
// payment twice (two outbox messages, one business key), the relay publishes both, and the
// consumer books it once.
func Example() {
	svc := startExampleServices() // a fresh schema and an embedded JetStream; yours come from configuration
	defer svc.close()
	ctx := context.Background()
	quiet := slog.New(slog.DiscardHandler)

	pool, err := pgxpool.New(ctx, svc.databaseURL)
	check(err)
	defer pool.Close()
	nc, err := nats.Connect(svc.natsURL)
	check(err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	check(err)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}, Duplicates: 2 * time.Minute})
	check(err)
	// Dead letters land on txoutbox.dead.<durable> by default; a stream must keep them.
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "DEAD_LETTERS", Subjects: []string{consumer.DefaultDeadLetterPrefix + ">"}})
	check(err)
	_, err = pool.Exec(ctx, `CREATE TABLE ledger (order_id int NOT NULL, amount int NOT NULL)`)
	check(err)

	// Producer: the same payment, enqueued twice.
	client, err := outbox.NewClient(&outbox.Config{Schema: svc.schema})
	check(err)
	for range 2 {
		check(pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := client.EnqueueTx(ctx, tx, outbox.Message{
				Subject: "orders.paid",
				Key:     "order-42",
				BizKey:  "order:42:paid", // the consumer deduplicates on this
				Payload: []byte(`{"order_id":42,"amount":1999}`),
			})
			return err
		}))
	}

	// Relay (normally the `relay run` daemon).
	r, err := relay.New(pool, js, &relay.Config{Schema: svc.schema, Logger: quiet})
	check(err)
	defer r.Close()
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go func() { _ = r.Run(runCtx) }()

	// Consumer: the ledger row and the dedup row commit in one transaction.
	c, err := consumer.New(pool, js, func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		var p struct {
			OrderID int `json:"order_id"`
			Amount  int `json:"amount"`
		}
		if err := json.Unmarshal(msg.Data, &p); err != nil {
			return consumer.Permanent(err) // no retry can fix it: dead-letter it now
		}
		_, err := tx.Exec(ctx, `INSERT INTO ledger (order_id, amount) VALUES ($1, $2)`, p.OrderID, p.Amount)
		return err
	}, &consumer.Config{Stream: "ORDERS", Durable: "billing", Schema: svc.schema, Logger: quiet})
	check(err)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()

	s := c.Stats()
	for deadline := time.Now().Add(30 * time.Second); s.Processed+s.Duplicates < 2 && time.Now().Before(deadline); s = c.Stats() {
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	check(<-done)
	var rows, total int
	check(pool.QueryRow(ctx, `SELECT count(*), coalesce(sum(amount), 0) FROM ledger`).Scan(&rows, &total))
	fmt.Printf("processed %d, duplicates skipped %d\n", s.Processed, s.Duplicates)
	fmt.Printf("ledger: %d row, total %d\n", rows, total)
	// Output:
	// processed 1, duplicates skipped 1
	// ledger: 1 row, total 1999
}

func check(err error) {
	if err != nil {
		panic(err)
	}
}

type exampleServices struct {
	databaseURL, natsURL, schema string
	close                        func()
}

// startExampleServices finds PostgreSQL as the tests do (TEST_DATABASE_URL, DATABASE_URL,
// 127.0.0.1:5432, else a throwaway cluster), migrates a fresh schema into it and starts an
// embedded JetStream.
func startExampleServices() *exampleServices {
	ctx := context.Background()
	var closers []func()
	dsn := ""
	for _, v := range []string{os.Getenv("TEST_DATABASE_URL"), os.Getenv("DATABASE_URL"), testsvc.DefaultLocalDSN} {
		if v != "" && embedded.Ping(ctx, v, 2*time.Second) == nil {
			dsn = v
			break
		}
	}
	if dsn == "" {
		pg, err := embedded.StartPostgres(ctx, embedded.PostgresOptions{})
		check(err)
		closers = append(closers, pg.Stop)
		dsn = pg.DSN()
	}
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	schema := "example_consumer_" + hex.EncodeToString(rnd[:])
	admin, err := pgxpool.New(ctx, dsn)
	check(err)
	m, err := migrations.New(&migrations.Config{Schema: schema})
	check(err)
	_, err = m.Up(ctx, admin)
	check(err)
	closers = append(closers, func() {
		_, _ = admin.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		admin.Close()
	})
	srv, err := embedded.StartNATS(embedded.NATSOptions{})
	check(err)
	closers = append(closers, srv.Shutdown)
	return &exampleServices{
		databaseURL: testsvc.WithSearchPath(dsn, schema),
		natsURL:     srv.URL(),
		schema:      schema,
		close: func() {
			for i := len(closers) - 1; i >= 0; i-- {
				closers[i]()
			}
		},
	}
}
