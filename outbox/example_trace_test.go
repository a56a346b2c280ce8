package outbox_test

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// Tracing: with a tracer provider and the W3C propagator set (here on the client; setting
// them globally with otel.SetTracerProvider and otel.SetTextMapPropagator works too), each
// message captures the trace context of the ctx it is enqueued with. The relay's publish span
// and the consumer's process span of the message become children of that span.
func ExampleConfig_tracing() {
	ctx := context.Background()
	schema := cmp.Or(os.Getenv("TXOUTBOX_SCHEMA"), txoutbox.DefaultSchema)
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

	tp := sdktrace.NewTracerProvider() // in a service: with sdktrace.WithBatcher(an OTLP exporter)
	defer func() {
		// Shutdown flushes the spans still buffered: an error means some were not exported.
		if err := tp.Shutdown(ctx); err != nil {
			fmt.Println("tracer provider shutdown:", err)
		}
	}()
	client, err := outbox.NewClient(&outbox.Config{Schema: schema, TracerProvider: tp, Propagator: propagation.TraceContext{}})
	if err != nil {
		fmt.Println(err)
		return
	}

	// The request's span, as an HTTP middleware would start it.
	rctx, span := tp.Tracer("orders-api").Start(ctx, "POST /orders")
	var traceparent []string
	err = pgx.BeginFunc(rctx, pool, func(tx pgx.Tx) error {
		ids, err := client.EnqueueTx(rctx, tx, outbox.Message{Subject: "orders.created", Payload: []byte(`{"id":1}`)})
		if err != nil {
			return err
		}
		var raw []byte
		if err := tx.QueryRow(rctx, `SELECT headers FROM `+pgx.Identifier{schema, "txoutbox_messages"}.Sanitize()+` WHERE message_id = $1`, ids[0]).Scan(&raw); err != nil {
			return err
		}
		var h map[string][]string
		if err := json.Unmarshal(raw, &h); err != nil {
			return err
		}
		traceparent = h["traceparent"]
		return nil
	})
	span.End()
	if err != nil {
		fmt.Println(err)
		return
	}
	sc := span.SpanContext()
	fmt.Println(len(traceparent) == 1 && strings.Contains(traceparent[0], sc.TraceID().String()+"-"+sc.SpanID().String()))
	// Output: true
}
