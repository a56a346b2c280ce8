package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// newTracing returns an always-sampling tracer provider recording into an in-memory exporter.
func newTracing(t *testing.T) (*sdktrace.TracerProvider, *tracetest.InMemoryExporter) {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(sdktrace.AlwaysSample()))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp, exp
}

func storedHeaders(t *testing.T, db *testsvc.DB, id uuid.UUID) map[string][]string {
	t.Helper()
	var raw []byte
	if err := db.Pool.QueryRow(context.Background(), "SELECT headers FROM txoutbox_messages WHERE message_id = $1", id).Scan(&raw); err != nil {
		t.Fatal(err)
	}
	var h map[string][]string
	if len(raw) > 0 {
		if err := json.Unmarshal(raw, &h); err != nil {
			t.Fatal(err)
		}
	}
	return h
}

// parentOf returns the span context a W3C traceparent in h names.
func parentOf(h map[string][]string) trace.SpanContext {
	ctx := propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier{"traceparent": first(h["traceparent"])})
	return trace.SpanContextFromContext(ctx)
}

func first(v []string) string {
	if len(v) == 0 {
		return ""
	}
	return v[0]
}

func TestEnqueueCapturesTheTraceContext(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	tp, _ := newTracing(t)
	c := newClient(t, db, &outbox.Config{TracerProvider: tp, Propagator: propagation.TraceContext{}})

	ts, err := trace.ParseTraceState("vendor=v1")
	if err != nil {
		t.Fatal(err)
	}
	rctx, req := tp.Tracer("test").Start(ctx, "request")
	rctx = trace.ContextWithSpanContext(rctx, req.SpanContext().WithTraceState(ts))
	defer req.End()

	callerOwn := "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	given := map[string][]string{"X-Other": {"1"}}
	var ids []uuid.UUID
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		ids, err = c.EnqueueTx(rctx, tx,
			outbox.Message{Subject: "orders.created", Payload: []byte("a"), Headers: given},
			outbox.Message{Subject: "orders.created", Payload: []byte("b"), Headers: map[string][]string{"Traceparent": {callerOwn}}},
		)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(given) != 1 {
		t.Fatalf("the caller's header map was changed: %v", given)
	}
	h := storedHeaders(t, db, ids[0])
	got := parentOf(h)
	if got.TraceID() != req.SpanContext().TraceID() || got.SpanID() != req.SpanContext().SpanID() || !got.IsSampled() {
		t.Fatalf("captured traceparent %q, want the request span %s/%s", first(h["traceparent"]), req.SpanContext().TraceID(), req.SpanContext().SpanID())
	}
	if first(h["tracestate"]) != "vendor=v1" || first(h["X-Other"]) != "1" {
		t.Fatalf("stored headers %v, want tracestate vendor=v1 and X-Other kept", h)
	}
	// A trace header of the caller's own (any case) is published as given: nothing is added.
	h2 := storedHeaders(t, db, ids[1])
	if len(h2) != 1 || first(h2["Traceparent"]) != callerOwn {
		t.Fatalf("stored headers %v, want only the caller's Traceparent", h2)
	}

	if th := c.TraceHeaders(rctx); first(th["traceparent"]) != first(h["traceparent"]) {
		t.Fatalf("TraceHeaders = %v, want the captured traceparent %q", th, first(h["traceparent"]))
	}
	if th := c.TraceHeaders(ctx); th != nil {
		t.Fatalf("TraceHeaders of a context without a span = %v, want nil", th)
	}
}

func TestEnqueueWithoutTracingCapturesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	tp, exp := newTracing(t)
	// No propagator configured: the global one, which this test binary never sets, is a no-op.
	c := newClient(t, db, &outbox.Config{TracerProvider: tp})
	rctx, req := tp.Tracer("test").Start(ctx, "request")
	var ids []uuid.UUID
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		var err error
		ids, err = c.EnqueueTx(rctx, tx, outbox.Message{Subject: "orders.created"})
		return err
	})
	req.End()
	if err != nil {
		t.Fatal(err)
	}
	if h := storedHeaders(t, db, ids[0]); h != nil {
		t.Fatalf("stored headers %v, want none", h)
	}
	if spans := exp.GetSpans(); len(spans) != 1 {
		t.Fatalf("%d spans, want the request span only (EnqueueSpan is off by default)", len(spans))
	}
}

func TestEnqueueSpan(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	tp, exp := newTracing(t)
	c := newClient(t, db, &outbox.Config{TracerProvider: tp, Propagator: propagation.TraceContext{}, EnqueueSpan: true})
	rctx, req := tp.Tracer("test").Start(ctx, "request")
	var ids []uuid.UUID
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		var err error
		ids, err = c.EnqueueTx(rctx, tx, outbox.Message{Subject: "orders.created", Payload: []byte("a")})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	half, err := c.Prepare(rctx, db.Pool, outbox.Message{Subject: "orders.paid"}, &outbox.PrepareOptions{Group: "g"})
	if err != nil {
		t.Fatal(err)
	}
	// A refused message ends its span with an error.
	_ = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := c.EnqueueTx(rctx, tx, outbox.Message{Subject: "bad subject"}, outbox.Message{Subject: "orders.x"})
		return err
	})
	// A database error ends it with its SQLSTATE as error.type: here a transaction already
	// aborted (25P02).
	_ = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, _ = tx.Exec(ctx, "SELECT 1/0")
		_, err := c.EnqueueTx(rctx, tx, outbox.Message{Subject: "orders.created"})
		return err
	})
	req.End()

	spans := exp.GetSpans()
	if len(spans) != 5 {
		t.Fatalf("%d spans, want request + 4 enqueue spans", len(spans))
	}
	enq, prep, bad, dbErr := spans[0], spans[1], spans[2], spans[3]
	if a := attrMap(dbErr.Attributes); dbErr.Name != "enqueue orders.created" || dbErr.Status.Code.String() != "Error" || a["error.type"] != "25P02" {
		t.Fatalf("span of an enqueue in an aborted transaction: %q status %v attributes %v, want error.type=25P02", dbErr.Name, dbErr.Status.Code, a)
	}
	// Named "{messaging.operation.name} {destination}".
	if enq.Name != "enqueue orders.created" || enq.SpanKind != trace.SpanKindProducer || enq.Parent.SpanID() != req.SpanContext().SpanID() {
		t.Fatalf("enqueue span %q kind %v parent %s, want \"enqueue orders.created\", producer, child of the request", enq.Name, enq.SpanKind, enq.Parent.SpanID())
	}
	attrs := attrMap(enq.Attributes)
	if attrs["messaging.system"] != "nats" || attrs["messaging.operation.type"] != "create" || attrs["messaging.destination.name"] != "orders.created" ||
		attrs["messaging.message.id"] != ids[0].String() || attrs["messaging.operation.name"] != "enqueue" {
		t.Fatalf("enqueue span attributes %v", attrs)
	}
	// The message captured the enqueue span, not the request.
	if p := parentOf(storedHeaders(t, db, ids[0])); p.SpanID() != enq.SpanContext.SpanID() {
		t.Fatalf("message captured span %s, want the enqueue span %s", p.SpanID(), enq.SpanContext.SpanID())
	}
	pa := attrMap(prep.Attributes)
	if prep.Name != "prepare orders.paid" || pa["messaging.operation.name"] != "prepare" || pa["messaging.message.id"] != half.ID.String() {
		t.Fatalf("prepare span %q %v", prep.Name, pa)
	}
	if p := parentOf(storedHeaders(t, db, half.ID)); p.SpanID() != prep.SpanContext.SpanID() {
		t.Fatalf("half message captured span %s, want the prepare span %s", p.SpanID(), prep.SpanContext.SpanID())
	}
	if bad.Name != "enqueue" || bad.Status.Code.String() != "Error" || !strings.Contains(bad.Status.Description, "invalid subject") ||
		attrMap(bad.Attributes)["messaging.batch.message_count"] != "2" || attrMap(bad.Attributes)["error.type"] != "invalid_message" {
		t.Fatalf("refused call's span %q status %v %q attrs %v", bad.Name, bad.Status.Code, bad.Status.Description, attrMap(bad.Attributes))
	}
}

// A message valid on its own that the captured trace headers would push over a limit is
// stored without them (tracing never fails an enqueue), and the caller's span says so; a
// message invalid on its own is refused as ever.
func TestTraceHeadersNeverMakeAMessageInvalid(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	tp, exp := newTracing(t)
	c := newClient(t, db, &outbox.Config{TracerProvider: tp, Propagator: propagation.TraceContext{}, MaxMessageBytes: 2048})
	rctx, req := tp.Tracer("test").Start(ctx, "request")

	full := outbox.Message{Subject: "orders.created"}
	full.Payload = make([]byte, 2048-outbox.EncodedSize(&full))
	over := full
	over.Payload = append(over.Payload, 0)
	var ids []uuid.UUID
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		var err error
		ids, err = c.EnqueueTx(rctx, tx, full)
		return err
	})
	if err != nil {
		t.Fatalf("a message of exactly the limit must be accepted with tracing on: %v", err)
	}
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { _, err := c.EnqueueTx(rctx, tx, over); return err })
	if !errors.Is(err, outbox.ErrMessageTooLarge) {
		t.Fatalf("one byte over: err = %v, want ErrMessageTooLarge", err)
	}
	req.End()
	if h := storedHeaders(t, db, ids[0]); h != nil {
		t.Fatalf("stored headers %v, want none: they would not fit", h)
	}
	spans := exp.GetSpans()
	if len(spans) != 1 || len(spans[0].Events) != 1 || spans[0].Events[0].Name != "txoutbox: trace context not captured" {
		t.Fatalf("spans %v: want the request span with one event saying the trace context was not captured", spans)
	}
}

func attrMap(kvs []attribute.KeyValue) map[string]string {
	out := map[string]string{}
	for _, kv := range kvs {
		out[string(kv.Key)] = kv.Value.String()
	}
	return out
}
