package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/internal/tracing"
	"github.com/txoutbox/txoutbox/outbox"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
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

// A traceparent header that is not a W3C trace context is refused at the door, by EnqueueTx,
// Prepare and EnqueueSQLTx alike, with or without a propagator: it would be published as given
// and dropped by the consumer's propagator, and the trace would end at the producer without a
// word. The error names the message and wraps ErrInvalidTraceparent (and ErrInvalidHeader).
func TestInvalidTraceparentRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	tp, _ := newTracing(t)
	traced := newClient(t, db, &outbox.Config{TracerProvider: tp, Propagator: propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})})
	plain := newClient(t, db, nil)
	rctx, req := tp.Tracer("test").Start(ctx, "request")
	defer req.End()
	const valid = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	bad := map[string][]string{
		"garbage":          {"garbage"},
		"empty":            {""},
		"upper-case hex":   {"00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01"},
		"all-zero trace":   {"00-00000000000000000000000000000000-b7ad6b7169203331-01"},
		"all-zero span":    {"00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01"},
		"version ff":       {"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		"00 too long":      {valid + "-00"},
		"short ids":        {"00-abc-def-01"},
		"two values":       {valid, valid},
		"later version no": {"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01x"},
		// Flags above 03 in version 00: OpenTelemetry's propagator drops it. With the traced
		// client the caller's traceparent is not replaced by ctx's either: it is refused.
		"00 flags 04": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-04"},
		"00 flags ff": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-ff"},
	}
	sdb := openSQL(t, db, "pgx")
	for name, v := range bad {
		m := outbox.Message{Subject: "orders.created", Payload: []byte(name), Headers: map[string][]string{"traceparent": v}}
		for _, c := range []*outbox.Client{traced, plain} {
			err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
				_, err := c.EnqueueTx(rctx, tx, outbox.Message{Subject: "orders.created"}, m)
				return err
			})
			var me *outbox.MessageError
			if !errors.Is(err, outbox.ErrInvalidTraceparent) || !errors.Is(err, outbox.ErrInvalidHeader) || !errors.As(err, &me) || me.Index != 1 {
				t.Fatalf("%s: EnqueueTx: %v, want a *MessageError for message 1 wrapping ErrInvalidTraceparent", name, err)
			}
			if _, err := c.Prepare(rctx, db.Pool, m, &outbox.PrepareOptions{Group: "payments"}); !errors.Is(err, outbox.ErrInvalidTraceparent) {
				t.Fatalf("%s: Prepare: %v, want ErrInvalidTraceparent", name, err)
			}
		}
		tx := beginSQL(t, sdb)
		if _, err := traced.EnqueueSQLTx(rctx, tx, m); !errors.Is(err, outbox.ErrInvalidTraceparent) {
			t.Fatalf("%s: EnqueueSQLTx: %v, want ErrInvalidTraceparent", name, err)
		}
		_ = tx.Rollback()
	}
	// Valid ones, in any case of the name, travel as given; so does a later version with more
	// fields after the flags.
	for _, h := range []map[string][]string{
		{"traceparent": {valid}},
		{"TraceParent": {valid}},
		{"traceparent": {"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future"}},
	} {
		var ids []uuid.UUID
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			var err error
			ids, err = plain.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.created", Headers: h})
			return err
		})
		if err != nil {
			t.Fatalf("%v: %v", h, err)
		}
		if got := storedHeaders(t, db, ids[0]); len(got) != 1 {
			t.Fatalf("stored %v, want %v as given", got, h)
		}
	}
	if n, err := db.Pool.Exec(ctx, `SELECT 1 FROM txoutbox_messages WHERE payload = ANY($1)`, [][]byte{[]byte("garbage")}); err != nil || n.RowsAffected() != 0 {
		t.Fatalf("a refused message was stored (%v, %v)", n, err)
	}
}

// Trace headers of the caller's that do not make a trace context (baggage alone, tracestate
// alone) do not stop the capture: the message gets the traceparent of its ctx, and the
// caller's baggage and tracestate are kept as given.
func TestPartialTraceHeadersStillCaptured(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	tp, _ := newTracing(t)
	c := newClient(t, db, &outbox.Config{TracerProvider: tp, Propagator: propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})})
	ts, err := trace.ParseTraceState("ctx=1")
	if err != nil {
		t.Fatal(err)
	}
	rctx, req := tp.Tracer("test").Start(ctx, "request")
	defer req.End()
	rctx = trace.ContextWithSpanContext(rctx, req.SpanContext().WithTraceState(ts))
	var ids []uuid.UUID
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		ids, err = c.EnqueueTx(rctx, tx,
			outbox.Message{Subject: "orders.created", Payload: []byte("b"), Headers: map[string][]string{"baggage": {"tenant=7"}}},
			outbox.Message{Subject: "orders.created", Payload: []byte("c"), Headers: map[string][]string{"Tracestate": {"v=1"}}},
		)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []map[string]string{
		{"baggage": "tenant=7", "tracestate": "ctx=1"},
		{"Tracestate": "v=1"},
	} {
		h := storedHeaders(t, db, ids[i])
		if sc := parentOf(h); sc.TraceID() != req.SpanContext().TraceID() || sc.SpanID() != req.SpanContext().SpanID() {
			t.Fatalf("message %d: stored %v, want the traceparent of the request span captured", i, h)
		}
		for k, v := range want {
			if first(h[k]) != v {
				t.Fatalf("message %d: stored %v, want %s %q", i, h, k, v)
			}
		}
		if len(h) != len(want)+1 {
			t.Fatalf("message %d: stored %v, want %v and the traceparent only", i, h, want)
		}
	}
}

// ValidateTraceparent and OpenTelemetry's W3C propagator, extracting through the carrier
// consumers use (names in any case), agree: every traceparent the agreement table accepts is
// extracted as a valid remote span context, and so is every value of a generated set (versions,
// ids, all 256 flags, what follows the flags) that ValidateTraceparent accepts; a value it
// refuses is dropped by the propagator, but for a version 00 value with a "-" and nothing after
// its flags, which the W3C format does not allow and the propagator lets pass.
func TestValidTraceparentsAreExtracted(t *testing.T) {
	t.Parallel()
	p := propagation.TraceContext{}
	n := 0
	for _, row := range agreementRows() {
		for name, v := range row.m.Headers {
			if row.want != "ok" || !strings.EqualFold(name, outbox.HeaderTraceparent) {
				continue
			}
			n++
			if sc := tracing.Extract(p, row.m.Headers); !sc.IsValid() || !sc.IsRemote() {
				t.Errorf("%s: %q accepted, and the propagator extracts no valid span context from it", row.name, v)
			}
		}
	}
	if n < 10 {
		t.Fatalf("%d accepted agreement rows carry a traceparent, want at least 10", n)
	}
	const traceID, spanID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	flags := []string{"FF", "0g", "1", "000"}
	for f := range 256 {
		flags = append(flags, fmt.Sprintf("%02x", f))
	}
	accepted, refused := 0, 0
	for _, version := range []string{"00", "01", "7f", "fe", "ff", "0A", "0g", "0"} {
		for _, tid := range []string{traceID, strings.Repeat("0", 32), strings.ToUpper(traceID), traceID[1:]} {
			for _, sid := range []string{spanID, strings.Repeat("0", 16), spanID + "0"} {
				for _, fl := range flags {
					for _, rest := range []string{"", "-", "-x", "x", "-x-y", "--"} {
						v := version + "-" + tid + "-" + sid + "-" + fl + rest
						ok := outbox.ValidateTraceparent(v) == nil
						extracted := tracing.Extract(p, map[string][]string{"Traceparent": {v}}).IsValid()
						switch {
						case ok && !extracted:
							t.Errorf("ValidateTraceparent accepts %q, which the propagator drops", v)
						case !ok && extracted && !(version == "00" && rest == "-"):
							t.Errorf("ValidateTraceparent refuses %q, which the propagator extracts", v)
						case ok:
							accepted++
						default:
							refused++
						}
					}
				}
			}
		}
	}
	if accepted == 0 || refused == 0 {
		t.Fatalf("%d values accepted, %d refused: the set must hold both", accepted, refused)
	}
}
