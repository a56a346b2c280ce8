package relay_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
)

// The whole producer side: enqueue in a transaction, ring the doorbell after commit, and let
// the relay publish to JetStream.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	db, cleanup, err := testsvc.OpenDB(ctx, "example_relay")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cleanup()
	srv, err := embedded.StartNATS(embedded.NATSOptions{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer srv.Shutdown()
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)

	// The relay creates the stream for its subjects when told to.
	r, err := relay.New(db.Pool, js, &relay.Config{
		Schema:       db.Schema,
		Subjects:     []string{"orders.>"},
		CreateStream: "ORDERS",
		Logger:       slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		fmt.Println(err)
		return
	}
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
	client, _ := outbox.NewClient(&outbox.Config{Schema: db.Schema, Doorbell: outbox.NewNATSDoorbell(nc, "")})
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.created", Key: "order-42", Payload: []byte("hello")})
		return err
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	client.Ring()

	m, err := sub.NextMsg(20 * time.Second)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(m.Subject, string(m.Data), m.Header.Get("Txoutbox-Key"))
	stop()
	fmt.Println("relay stopped:", <-done)
	// Output:
	// orders.created hello order-42
	// relay stopped: <nil>
}
