package consumer_test

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"; lib/pq works the same
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
)

// A service whose data layer is database/sql, end to end: it enqueues with EnqueueSQLTx, and
// its consumer, made with NewSQL, books each refund once in a *sql.Tx.
func ExampleNewSQL() {
	// check stops the example on an error (a service would return it).
	check := func(err error) {
		if err != nil {
			panic(err)
		}
	}
	// Settings come from the environment, as in a service.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	schema := cmp.Or(os.Getenv("TXOUTBOX_SCHEMA"), txoutbox.DefaultSchema)
	quiet := slog.New(slog.DiscardHandler)

	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	check(err)
	defer func() { check(db.Close()) }()
	nc, err := nats.Connect(os.Getenv("NATS_URL"))
	check(err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	check(err)

	// At deploy time: the outbox's tables (relay migrate up does the same; it runs on pgx),
	// yours, the streams.
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	check(err)
	defer pool.Close()
	m, err := migrations.New(&migrations.Config{Schema: schema})
	check(err)
	_, err = m.Up(ctx, pool)
	check(err)
	refunds := pgx.Identifier{schema, "refunds"}.Sanitize()
	_, err = db.ExecContext(ctx, `CREATE TABLE `+refunds+` (order_id int NOT NULL, amount int NOT NULL)`)
	check(err)
	_, err = js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: "REFUNDS", Subjects: []string{"refunds.>"}, Duplicates: 2 * time.Minute})
	check(err)
	_, err = js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: "DEAD_LETTERS", Subjects: []string{consumer.DefaultDeadLetterPrefix + ">"}})
	check(err)

	// Producer: the same refund, enqueued twice (a retried request), each in a *sql.Tx.
	client, err := outbox.NewClient(&outbox.Config{Schema: schema})
	check(err)
	for range 2 {
		tx, err := db.BeginTx(ctx, nil)
		check(err)
		_, err = client.EnqueueSQLTx(ctx, tx, outbox.Message{
			Subject: "refunds.issued",
			Key:     "order-42",
			BizKey:  "order:42:refunded", // the consumer deduplicates on this
			Payload: []byte(`{"order_id":42,"amount":500}`),
		})
		if err != nil {
			check(errors.Join(err, tx.Rollback()))
		}
		check(tx.Commit())
	}

	// Relay (normally the `relay run` daemon; it runs on pgx).
	r, err := relay.New(pool, js, &relay.Config{Schema: schema, Logger: quiet})
	check(err)
	defer r.Close()
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	relayDone := make(chan error, 1)
	go func() { relayDone <- r.Run(runCtx) }()

	// Consumer on the *sql.DB: the refund row and the dedup row commit in one *sql.Tx.
	c, err := consumer.NewSQL(db, js, func(ctx context.Context, tx *sql.Tx, msg consumer.Message) error {
		var p struct {
			OrderID int `json:"order_id"`
			Amount  int `json:"amount"`
		}
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return consumer.Permanent(err) // no retry can fix it: dead-letter it now
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO `+refunds+` (order_id, amount) VALUES ($1, $2)`, p.OrderID, p.Amount)
		return err
	}, &consumer.Config{Stream: "REFUNDS", Durable: "refunds", Schema: schema, Logger: quiet})
	check(err)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()

	// Both deliveries are settled once one was applied and the other skipped.
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	s := c.Stats()
	for ; s.Processed+s.Duplicates < 2; s = c.Stats() {
		select {
		case <-ctx.Done():
			check(ctx.Err())
		case <-tick.C:
		}
	}
	stop()
	check(<-done)
	check(<-relayDone)
	var rows, total int
	check(db.QueryRowContext(ctx, `SELECT count(*), coalesce(sum(amount), 0) FROM `+refunds).Scan(&rows, &total))
	fmt.Printf("processed %d, duplicates skipped %d\n", s.Processed, s.Duplicates)
	fmt.Printf("refunds: %d row, total %d\n", rows, total)
	// Output:
	// processed 1, duplicates skipped 1
	// refunds: 1 row, total 500
}
