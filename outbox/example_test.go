package outbox_test

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
)

// A business change and its event, in one transaction: both commit or neither does.
func ExampleClient_EnqueueTx() {
	ctx := context.Background()
	schema := cmp.Or(os.Getenv("TXOUTBOX_SCHEMA"), txoutbox.DefaultSchema) // the outbox's schema, as relay run reads it
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	// At deploy time: the outbox's tables (relay migrate up does the same) and yours.
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := m.Up(ctx, pool); err != nil {
		fmt.Println(err)
		return
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+pgx.Identifier{schema, "orders"}.Sanitize()+` (id text PRIMARY KEY, total_cents int)`); err != nil {
		fmt.Println(err)
		return
	}

	client, err := outbox.NewClient(&outbox.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	orderID := uuid.NewString()
	var ids []uuid.UUID
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "orders"}.Sanitize()+` VALUES ($1, 1200)`, orderID); err != nil {
			return err
		}
		ids, err = client.EnqueueTx(ctx, tx, outbox.Message{
			Subject: "orders.created",
			Key:     orderID,
			Payload: []byte(`{"total_cents":1200}`),
		})
		return err
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	client.Ring() // wakes the relay when a doorbell is configured; here none is: a no-op

	var subject, state string
	if err := pool.QueryRow(ctx, `SELECT subject, state FROM `+pgx.Identifier{schema, "txoutbox_messages"}.Sanitize()+` WHERE message_id = $1`, ids[0]).Scan(&subject, &state); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(subject, state)
	// Output: orders.created ready
}

// Invalid messages are refused before anything is written, with an error that says which
// message and what is wrong.
func ExampleMessageError() {
	ctx := context.Background()
	schema := cmp.Or(os.Getenv("TXOUTBOX_SCHEMA"), txoutbox.DefaultSchema)
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	client, err := outbox.NewClient(&outbox.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	// The error rolls the transaction back: nothing of it is written.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := client.EnqueueTx(ctx, tx,
			outbox.Message{Subject: "orders.created"},
			outbox.Message{Subject: "orders.*.created"},
		)
		return err
	})
	var me *outbox.MessageError
	fmt.Println(errors.Is(err, outbox.ErrInvalidSubject), errors.As(err, &me) && me.Index == 1)
	fmt.Println(err)
	// Output:
	// true true
	// outbox: message 1 (new id, subject "orders.*.created"): invalid subject: token 2 is the wildcard "*"; publish subjects must be literal
}
