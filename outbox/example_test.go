package outbox_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// A business change and its event, in one transaction: both commit or neither does.
func ExampleClient_EnqueueTx() {
	ctx := context.Background()
	db, cleanup, err := testsvc.OpenDB(ctx, "example_enqueue")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cleanup()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE orders (id text PRIMARY KEY, total_cents int)`); err != nil {
		fmt.Println(err)
		return
	}

	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		fmt.Println(err)
		return
	}

	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `INSERT INTO orders VALUES ('order-42', 1200)`); err != nil {
		fmt.Println(err)
		return
	}
	if _, err := client.EnqueueTx(ctx, tx, outbox.Message{
		Subject: "orders.created",
		Key:     "order-42",
		Payload: []byte(`{"id":"order-42","total_cents":1200}`),
	}); err != nil {
		fmt.Println(err)
		return
	}
	if err := tx.Commit(ctx); err != nil {
		fmt.Println(err)
		return
	}
	client.Ring() // no doorbell configured: a no-op

	var subject, state string
	if err := db.Pool.QueryRow(ctx, `SELECT subject, state FROM txoutbox_messages`).Scan(&subject, &state); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(subject, state)
	// Output: orders.created ready
}

// Invalid messages are refused before anything is written, with an error that says which
// message and what is wrong.
func ExampleMessageError() {
	client, _ := outbox.NewClient(nil)
	_, err := client.EnqueueTx(context.Background(), nil,
		outbox.Message{Subject: "orders.created"},
		outbox.Message{Subject: "orders.*.created"},
	)
	var me *outbox.MessageError
	fmt.Println(errors.Is(err, outbox.ErrInvalidSubject), errors.As(err, &me) && me.Index == 1)
	fmt.Println(err)
	// Output:
	// true true
	// outbox: message 1 (new id, subject "orders.*.created"): invalid subject: token 2 is the wildcard "*"; publish subjects must be literal
}
