package outbox_test

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/google/uuid"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// PrepareSQL traces as Prepare does, with each driver: with Config.EnqueueSpan, the same
// "prepare" span (name, kind, parent, attributes, status; for a message accepted and for one
// refused), and the stored trace headers name that span as Prepare's name its own; without
// it, no span and the same headers as Prepare (the caller's span).
func TestPrepareSQLTracesAsPrepare(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	ts, err := trace.ParseTraceState("vendor=v1")
	if err != nil {
		t.Fatal(err)
	}
	msg := outbox.Message{Subject: "orders.paid", Key: "order-1", Payload: []byte("p"), Headers: map[string][]string{"X-Other": {"1"}}}
	bad := outbox.Message{Subject: "orders..paid"}
	opts := &outbox.PrepareOptions{Group: "orders"}

	for _, spans := range []bool{true, false} {
		t.Run(fmt.Sprintf("EnqueueSpan=%v", spans), func(t *testing.T) {
			tp, exp := newTracing(t)
			c := newClient(t, db, &outbox.Config{TracerProvider: tp, Propagator: propagation.TraceContext{}, EnqueueSpan: spans})
			rctx, req := tp.Tracer("test").Start(ctx, "request")
			rctx = trace.ContextWithSpanContext(rctx, req.SpanContext().WithTraceState(ts))
			defer req.End()

			// prepare runs one call and returns the message's stored headers (nil when
			// refused) and the spans it ended.
			prepare := func(f func() (outbox.Half, error), wantErr bool) (uuid.UUID, map[string][]string, []sdktrace.ReadOnlySpan) {
				t.Helper()
				exp.Reset()
				h, err := f()
				if (err != nil) != wantErr {
					t.Fatalf("err = %v, want an error: %v", err, wantErr)
				}
				var hdr map[string][]string
				if err == nil {
					hdr = storedHeaders(t, db, h.ID)
				}
				return h.ID, hdr, exp.GetSpans().Snapshots()
			}
			wantID, wantHdr, wantSpans := prepare(func() (outbox.Half, error) { return c.Prepare(rctx, db.Pool, msg, opts) }, false)
			_, _, wantBadSpans := prepare(func() (outbox.Half, error) { return c.Prepare(rctx, db.Pool, bad, opts) }, true)
			n := 0
			if spans {
				n = 1
			}
			if len(wantSpans) != n || len(wantBadSpans) != n {
				t.Fatalf("Prepare ended %d and %d spans, want %d each", len(wantSpans), len(wantBadSpans), n)
			}
			for _, driver := range sqlDrivers {
				sdb := openSQL(t, db, driver)
				id, hdr, got := prepare(func() (outbox.Half, error) { return c.PrepareSQL(rctx, sdb, msg, opts) }, false)
				_, _, gotBad := prepare(func() (outbox.Half, error) { return c.PrepareSQL(rctx, sdb, bad, opts) }, true)
				if len(got) != n || len(gotBad) != n {
					t.Fatalf("%s: PrepareSQL ended %d and %d spans, want %d each, as Prepare", driver, len(got), len(gotBad), n)
				}
				if spans {
					sameSpan(t, driver+": accepted", got[0], wantSpans[0], id, wantID)
					sameSpan(t, driver+": refused", gotBad[0], wantBadSpans[0], uuid.Nil, uuid.Nil)
					// Each message names its own prepare span, as Prepare's does (same
					// flags), and the rest of the headers is the same: the tracestate, the
					// caller's own.
					if got, want := first(hdr["traceparent"]), traceparentOf(got[0].SpanContext()); got != want {
						t.Fatalf("%s: PrepareSQL's message captured traceparent %q, want its prepare span's %q", driver, got, want)
					}
					if got, want := first(wantHdr["traceparent"]), traceparentOf(wantSpans[0].SpanContext()); got != want {
						t.Fatalf("Prepare's message captured traceparent %q, want its prepare span's %q", got, want)
					}
					if fmt.Sprint(withoutTraceparent(hdr)) != fmt.Sprint(withoutTraceparent(wantHdr)) || first(hdr["tracestate"]) != "vendor=v1" {
						t.Fatalf("%s: PrepareSQL stored %v, Prepare %v", driver, hdr, wantHdr)
					}
				} else if fmt.Sprint(hdr) != fmt.Sprint(wantHdr) || parentOf(hdr).SpanID() != req.SpanContext().SpanID() {
					t.Fatalf("%s: PrepareSQL stored %v, Prepare %v; want the request span's trace context in both", driver, hdr, wantHdr)
				}
			}
		})
	}
}

// traceparentOf is the W3C traceparent of sc.
func traceparentOf(sc trace.SpanContext) string {
	c := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(trace.ContextWithSpanContext(context.Background(), sc), c)
	return c["traceparent"]
}

func withoutTraceparent(h map[string][]string) map[string][]string {
	out := map[string][]string{}
	for k, v := range h {
		if k != "traceparent" {
			out[k] = v
		}
	}
	return out
}

// sameSpan fails unless got and want agree in everything but their ids: name, kind, parent,
// attributes (the message id attribute naming gotID and wantID), status, events.
func sameSpan(t *testing.T, what string, got, want sdktrace.ReadOnlySpan, gotID, wantID uuid.UUID) {
	t.Helper()
	if got.Name() != want.Name() || got.SpanKind() != want.SpanKind() || got.Parent().SpanID() != want.Parent().SpanID() ||
		got.SpanContext().TraceID() != want.SpanContext().TraceID() {
		t.Fatalf("%s: PrepareSQL's span %q kind %v parent %s, Prepare's %q kind %v parent %s",
			what, got.Name(), got.SpanKind(), got.Parent().SpanID(), want.Name(), want.SpanKind(), want.Parent().SpanID())
	}
	ga, wa := attrMap(got.Attributes()), attrMap(want.Attributes())
	if gotID != uuid.Nil || wantID != uuid.Nil {
		if ga["messaging.message.id"] != gotID.String() || wa["messaging.message.id"] != wantID.String() {
			t.Fatalf("%s: message id attributes %q and %q, want %s and %s", what, ga["messaging.message.id"], wa["messaging.message.id"], gotID, wantID)
		}
		delete(ga, "messaging.message.id")
		delete(wa, "messaging.message.id")
	}
	if fmt.Sprint(ga) != fmt.Sprint(wa) || ga["messaging.operation.name"] != "prepare" {
		t.Fatalf("%s: PrepareSQL's span attributes %v, Prepare's %v", what, ga, wa)
	}
	if got.Status() != want.Status() {
		t.Fatalf("%s: PrepareSQL's span status %v, Prepare's %v", what, got.Status(), want.Status())
	}
	eventNames := func(s sdktrace.ReadOnlySpan) []string {
		var out []string
		for _, e := range s.Events() {
			out = append(out, e.Name)
		}
		return out
	}
	if !slices.Equal(eventNames(got), eventNames(want)) {
		t.Fatalf("%s: PrepareSQL's span events %v, Prepare's %v", what, eventNames(got), eventNames(want))
	}
}
