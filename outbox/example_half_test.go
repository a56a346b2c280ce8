package outbox_test

import (
	"cmp"
	"context"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
)

// Work outside the database — charging a card — and its event: prepare the message (stored,
// not yet published), do the work, then commit the message so that the relay publishes it (or
// roll it back if the work failed). If the process dies in between, the check-back asks the
// group's checker (see package outbox/checker) what happened.
func ExampleClient_Prepare() {
	ctx := context.Background()
	schema := cmp.Or(os.Getenv("TXOUTBOX_SCHEMA"), txoutbox.DefaultSchema) // the outbox's schema, as relay run reads it
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	// At deploy time (relay migrate up does the same).
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := m.Up(ctx, pool); err != nil {
		fmt.Println(err)
		return
	}

	client, err := outbox.NewClient(&outbox.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	// chargeCard stands for the work outside the database (here it always succeeds).
	chargeCard := func(ctx context.Context, idempotencyKey string) bool {
		return ctx.Err() == nil && idempotencyKey != ""
	}
	half, err := client.Prepare(ctx, pool, outbox.Message{
		Subject: "payments.charged",
		Key:     "order-42",
		Payload: []byte(`{"order":"order-42","cents":1200}`),
	}, &outbox.PrepareOptions{Group: "payments"})
	if err != nil {
		fmt.Println(err)
		return
	}

	charged := chargeCard(ctx, half.ID.String()) // the provider's idempotency key
	if charged {
		err = client.Commit(ctx, pool, half.ID) // published by the relay from now on
	} else {
		err = client.Rollback(ctx, pool, half.ID) // never published
	}
	if err != nil {
		fmt.Println(err)
		return
	}

	var state string
	if err := pool.QueryRow(ctx, `SELECT state FROM `+pgx.Identifier{schema, "txoutbox_messages"}.Sanitize()+` WHERE message_id = $1`, half.ID).Scan(&state); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("charged:", charged, "message:", state)
	// Output: charged: true message: ready
}

// The same in one call: SendInTransaction prepares the message, runs the local work and
// settles the message by the work's answer.
func ExampleClient_SendInTransaction() {
	ctx := context.Background()
	schema := cmp.Or(os.Getenv("TXOUTBOX_SCHEMA"), txoutbox.DefaultSchema) // the outbox's schema, as relay run reads it
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := m.Up(ctx, pool); err != nil {
		fmt.Println(err)
		return
	}
	client, err := outbox.NewClient(&outbox.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}

	// chargeCard stands for the work outside the database (here it always succeeds).
	chargeCard := func(ctx context.Context, idempotencyKey string) bool {
		return ctx.Err() == nil && idempotencyKey != ""
	}
	msg := outbox.Message{Subject: "payments.charged", Key: "order-43", Payload: []byte(`{"order":"order-43"}`)}
	_, state, err := client.SendInTransaction(ctx, pool, msg, &outbox.PrepareOptions{Group: "payments"},
		func(ctx context.Context, h outbox.Half) (outbox.LocalState, error) {
			if !chargeCard(ctx, h.ID.String()) {
				return outbox.StateRollback, nil
			}
			return outbox.StateCommit, nil
		})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("local transaction:", state) // the message is committed: the relay publishes it
	// Output: local transaction: COMMIT
}
