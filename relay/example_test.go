package relay_test

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
)

// The whole producer side: enqueue in a transaction, ring the doorbell after commit, and let
// the relay publish to JetStream. Settings come from the environment, as in a service:
// DATABASE_URL, NATS_URL and TXOUTBOX_SCHEMA.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	schema := cmp.Or(os.Getenv("TXOUTBOX_SCHEMA"), txoutbox.DefaultSchema)
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	// At deploy time: the outbox's tables (relay migrate up does the same).
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := m.Up(ctx, pool); err != nil {
		fmt.Println(err)
		return
	}
	nc, err := nats.Connect(os.Getenv("NATS_URL"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		fmt.Println(err)
		return
	}

	// The relay creates the stream for its subjects when told to.
	r, err := relay.New(pool, js, &relay.Config{
		Schema:       schema,
		Subjects:     []string{"orders.>"},
		CreateStream: "ORDERS",
		Logger:       slog.New(slog.DiscardHandler),
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer r.Close()
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()

	// Watch the subject: the relay's publish arrives here once the stream stored it.
	sub, err := nc.SubscribeSync("orders.>")
	if err != nil {
		fmt.Println(err)
		return
	}
	client, err := outbox.NewClient(&outbox.Config{Schema: schema, Doorbell: outbox.NewNATSDoorbell(nc, "")})
	if err != nil {
		fmt.Println(err)
		return
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.created", Key: "order-42", Payload: []byte("hello")})
		return err
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	client.Ring() // after commit: the relay publishes now instead of at its next poll

	msg, err := sub.NextMsg(20 * time.Second)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(msg.Subject, string(msg.Data), msg.Header.Get("Txoutbox-Key"))
	stop()
	if err := <-done; err != nil { // Run returns nil once cancelled
		fmt.Println("relay:", err)
		return
	}
	fmt.Println("relay stopped")
	// Output:
	// orders.created hello order-42
	// relay stopped
}
