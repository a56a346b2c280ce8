package checker_test

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/checkback"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
)

// A producer that prepared a half message and died before settling it: its group's checker,
// served by every process of the group, tells the check-back (here run once in-process; in
// production `relay run` runs it) whether the local transaction committed.
func ExampleServe() {
	ctx := context.Background()
	schema := cmp.Or(os.Getenv("TXOUTBOX_SCHEMA"), txoutbox.DefaultSchema) // the outbox's schema, as relay run reads it
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	nc, err := nats.Connect(os.Getenv("NATS_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer nc.Close()
	m, err := migrations.New(&migrations.Config{Schema: schema}) // at deploy time
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := m.Up(ctx, pool); err != nil {
		fmt.Println(err)
		return
	}

	// The payments the producer charged, by message id (in a real service: a table, or the
	// payment provider, looked up by the idempotency key it was given).
	var mu sync.Mutex
	charged := map[string]bool{}

	// The checker answers only for this outbox (this database and schema).
	outboxID, err := checker.OutboxIdentity(ctx, pool, schema)
	if err != nil {
		fmt.Println(err)
		return
	}
	srv, err := checker.Serve(nc, "payments", func(ctx context.Context, req checker.Request) (outbox.LocalState, error) {
		mu.Lock()
		defer mu.Unlock()
		if charged[req.MessageID.String()] {
			return outbox.StateCommit, nil
		}
		return outbox.StateUnknown, nil // not charged yet, or lost: ask again later
	}, &checker.Config{Outbox: outboxID})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer func() {
		if err := srv.Stop(); err != nil {
			fmt.Println(err)
		}
	}()

	// The producer prepares, charges, and dies before Commit.
	client, err := outbox.NewClient(&outbox.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	half, err := client.Prepare(ctx, pool, outbox.Message{Subject: "payments.charged", Payload: []byte(`{"cents":1200}`)},
		&outbox.PrepareOptions{Group: "payments"})
	if err != nil {
		fmt.Println(err)
		return
	}
	mu.Lock()
	charged[half.ID.String()] = true
	mu.Unlock()

	// The check-back asks the checker about half messages still prepared after the
	// transaction timeout (off here, so that it asks at once).
	cb, err := checkback.New(pool, nc, &checkback.Config{
		Schema: schema, TransactionTimeout: txoutbox.Off,
		StaleSchedule: checkback.ScheduleOff, PurgeSchedule: checkback.ScheduleOff,
		Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := cb.RunOnce(ctx); err != nil {
		fmt.Println(err)
		return
	}
	var state string
	if err := pool.QueryRow(ctx, `SELECT state FROM `+pgx.Identifier{schema, "txoutbox_messages"}.Sanitize()+` WHERE message_id = $1`, half.ID).Scan(&state); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("after the check:", state)
	// Output: after the check: ready
}
