package consumer_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"; lib/pq works the same
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
)

// A service whose data layer is database/sql, end to end: it enqueues with EnqueueSQLTx, and
// its consumer, made with NewSQL, books each payment once in a *sql.Tx.
func ExampleNewSQL() {
	svc := startExampleServices() // a fresh schema and an embedded JetStream; yours come from configuration
	defer svc.close()
	ctx := context.Background()
	quiet := slog.New(slog.DiscardHandler)

	db, err := sql.Open("pgx", svc.databaseURL)
	check(err)
	defer func() { check(db.Close()) }()
	nc, err := nats.Connect(svc.natsURL)
	check(err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	check(err)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}, Duplicates: 2 * time.Minute})
	check(err)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "DEAD_LETTERS", Subjects: []string{consumer.DefaultDeadLetterPrefix + ">"}})
	check(err)
	_, err = db.ExecContext(ctx, `CREATE TABLE ledger (order_id int NOT NULL, amount int NOT NULL)`)
	check(err)

	// Producer: the same payment, enqueued twice (a retried request).
	client, err := outbox.NewClient(&outbox.Config{Schema: svc.schema})
	check(err)
	for range 2 {
		tx, err := db.BeginTx(ctx, nil)
		check(err)
		_, err = client.EnqueueSQLTx(ctx, tx, outbox.Message{
			Subject: "orders.paid",
			Key:     "order-42",
			BizKey:  "order:42:paid", // the consumer deduplicates on this
			Payload: []byte(`{"order_id":42,"amount":1999}`),
		})
		if err != nil {
			check(tx.Rollback())
			check(err)
		}
		check(tx.Commit())
	}

	// Relay (normally the `relay run` daemon; it runs on pgx).
	pool, err := pgxpool.New(ctx, svc.databaseURL)
	check(err)
	defer pool.Close()
	r, err := relay.New(pool, js, &relay.Config{Schema: svc.schema, Logger: quiet})
	check(err)
	defer r.Close()
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go func() { _ = r.Run(runCtx) }()

	// Consumer on the *sql.DB: the ledger row and the dedup row commit in one *sql.Tx.
	c, err := consumer.NewSQL(db, js, func(ctx context.Context, tx *sql.Tx, msg consumer.Message) error {
		var p struct {
			OrderID int `json:"order_id"`
			Amount  int `json:"amount"`
		}
		if err := json.Unmarshal(msg.Data, &p); err != nil {
			return consumer.Permanent(err)
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO ledger (order_id, amount) VALUES ($1, $2)`, p.OrderID, p.Amount)
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
	check(db.QueryRowContext(ctx, `SELECT count(*), coalesce(sum(amount), 0) FROM ledger`).Scan(&rows, &total))
	fmt.Printf("processed %d, duplicates skipped %d\n", s.Processed, s.Duplicates)
	fmt.Printf("ledger: %d row, total %d\n", rows, total)
	// Output:
	// processed 1, duplicates skipped 1
	// ledger: 1 row, total 1999
}
