package consumer_test

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
)

// The whole chain against real services: a request retried by its client enqueues the same
// payment twice (two outbox messages, one business key), the relay publishes both, and the
// consumer books it once.
func Example() {
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

	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	check(err)
	defer pool.Close()
	nc, err := nats.Connect(os.Getenv("NATS_URL"))
	check(err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	check(err)
	// At deploy time: the outbox's tables (relay migrate up does the same), yours, the streams.
	m, err := migrations.New(&migrations.Config{Schema: schema})
	check(err)
	_, err = m.Up(ctx, pool)
	check(err)
	ledger := pgx.Identifier{schema, "ledger"}.Sanitize()
	_, err = pool.Exec(ctx, `CREATE TABLE `+ledger+` (order_id int NOT NULL, amount int NOT NULL)`)
	check(err)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}, Duplicates: 2 * time.Minute})
	check(err)
	// Dead letters land on txoutbox.dead.<durable> by default; a stream must keep them.
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "DEAD_LETTERS", Subjects: []string{consumer.DefaultDeadLetterPrefix + ">"}})
	check(err)

	// Producer: the same payment, enqueued twice.
	client, err := outbox.NewClient(&outbox.Config{Schema: schema})
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
	r, err := relay.New(pool, js, &relay.Config{Schema: schema, Logger: quiet})
	check(err)
	defer r.Close()
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	relayDone := make(chan error, 1)
	go func() { relayDone <- r.Run(runCtx) }()

	// Consumer: the ledger row and the dedup row commit in one transaction.
	c, err := consumer.New(pool, js, func(ctx context.Context, tx pgx.Tx, msg consumer.Message) error {
		var p struct {
			OrderID int `json:"order_id"`
			Amount  int `json:"amount"`
		}
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return consumer.Permanent(err) // no retry can fix it: dead-letter it now
		}
		_, err := tx.Exec(ctx, `INSERT INTO `+ledger+` (order_id, amount) VALUES ($1, $2)`, p.OrderID, p.Amount)
		return err
	}, &consumer.Config{Stream: "ORDERS", Durable: "billing", Schema: schema, Logger: quiet})
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
	check(pool.QueryRow(ctx, `SELECT count(*), coalesce(sum(amount), 0) FROM `+ledger).Scan(&rows, &total))
	fmt.Printf("processed %d, duplicates skipped %d\n", s.Processed, s.Duplicates)
	fmt.Printf("ledger: %d row, total %d\n", rows, total)
	// Output:
	// processed 1, duplicates skipped 1
	// ledger: 1 row, total 1999
}
