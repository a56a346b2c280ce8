package checkback

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/tracing"
	"github.com/txoutbox/txoutbox/internal/tracing/tracingtest"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

func traceAttrs(kvs []attribute.KeyValue) map[string]string {
	out := map[string]string{}
	for _, kv := range kvs {
		out[string(kv.Key)] = kv.Value.String()
	}
	return out
}

// Each check request has a span, a child of the producer's span the half message captured
// at Prepare; the checker continues it (its span is the check span's child, and the ctx its
// Func gets carries it). An inconclusive check's span says so.
func TestCheckSpans(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(sdktrace.AlwaysSample()))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	prop := propagation.TraceContext{}
	client, err := outbox.NewClient(&outbox.Config{Schema: e.db.Schema, TracerProvider: tp, Propagator: prop})
	if err != nil {
		t.Fatal(err)
	}
	ctx, req := tp.Tracer("app").Start(context.Background(), "POST /payments")
	half, err := client.Prepare(ctx, e.db.Pool, outbox.Message{Subject: "orders.paid"}, &outbox.PrepareOptions{Group: "payments"})
	req.End()
	if err != nil {
		t.Fatal(err)
	}

	seen := make(chan trace.SpanContext, 4)
	answers := make(chan error, 2)
	answers <- errors.New("ledger unreachable")
	answers <- nil
	srv, err := checker.Serve(e.nats.Conn, "payments", func(ctx context.Context, _ checker.Request) (outbox.LocalState, error) {
		seen <- trace.SpanContextFromContext(ctx)
		if err := <-answers; err != nil {
			return outbox.StateUnknown, err
		}
		return outbox.StateCommit, nil
	}, &checker.Config{Logger: testLogger(), Outbox: e.outbox(), TracerProvider: tp, Propagator: prop})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Stop() })

	cfg := fastConfig()
	cfg.TransactionTimeout = time.Hour // passed by back-dating the row
	cfg.TracerProvider, cfg.Propagator = tp, prop
	cb := e.checkback(cfg)
	e.backdate(cfg.TransactionTimeout)
	if res := mustResolve(t, cb); res.Checks[OutcomeError] != 1 {
		t.Fatalf("first check: %+v, want an error reply", res)
	}
	e.due()
	if res := mustResolve(t, cb); res.Committed != 1 {
		t.Fatalf("second check: %+v, want a commit", res)
	}
	funcSpans := []trace.SpanContext{<-seen, <-seen}

	var checks, served []tracetest.SpanStub
	for _, s := range exp.GetSpans() {
		switch s.InstrumentationScope.Name {
		case "github.com/txoutbox/txoutbox/checkback":
			checks = append(checks, s)
		case "github.com/txoutbox/txoutbox/checker":
			served = append(served, s)
		}
	}
	if len(checks) != 2 || len(served) != 2 {
		t.Fatalf("%d check spans and %d checker spans, want 2 and 2", len(checks), len(served))
	}
	want := req.SpanContext()
	for i, s := range checks {
		a := traceAttrs(s.Attributes)
		if s.Name != "check payments" || s.SpanKind != trace.SpanKindClient || s.SpanContext.TraceID() != want.TraceID() || s.Parent.SpanID() != want.SpanID() {
			t.Errorf("check span %d: %q kind %v parent %s/%s, want a client span child of the producer's", i, s.Name, s.SpanKind, s.SpanContext.TraceID(), s.Parent.SpanID())
		}
		if a["messaging.message.id"] != half.ID.String() || a["txoutbox.group"] != "payments" || a["messaging.destination.name"] != "txoutbox.check.payments" ||
			a["messaging.operation.type"] != "send" || a["messaging.operation.name"] != "check" || a["messaging.system"] != "nats" {
			t.Errorf("check span %d attributes %v", i, a)
		}
		if a := traceAttrs(served[i].Attributes); a["messaging.operation.type"] != "process" || a["messaging.operation.name"] != "check" ||
			a["messaging.destination.name"] != "txoutbox.check.payments" {
			t.Errorf("checker span %d attributes %v", i, a)
		}
		// The checker's span continues this check's span, and the Func's ctx carries it.
		srvSpan := served[i]
		if srvSpan.Parent.SpanID() != s.SpanContext.SpanID() || srvSpan.SpanContext.TraceID() != want.TraceID() || srvSpan.SpanKind != trace.SpanKindServer {
			t.Errorf("checker span %d: parent %s, want the check span %s", i, srvSpan.Parent.SpanID(), s.SpanContext.SpanID())
		}
		if funcSpans[i].SpanID() != srvSpan.SpanContext.SpanID() {
			t.Errorf("the checker Func's ctx %d carried span %s, want the checker span %s", i, funcSpans[i].SpanID(), srvSpan.SpanContext.SpanID())
		}
	}
	if a := traceAttrs(checks[0].Attributes); a["txoutbox.check"] != "1" || a["txoutbox.outcome"] != OutcomeError || checks[0].Status.Code.String() != "Error" {
		t.Errorf("first check span: %v status %v", a, checks[0].Status.Code)
	}
	if a := traceAttrs(checks[1].Attributes); a["txoutbox.check"] != "2" || a["txoutbox.outcome"] != OutcomeCommit {
		t.Errorf("second check span: %v", a)
	}
	if a := traceAttrs(served[0].Attributes); served[0].Status.Code.String() != "Error" || a["txoutbox.check"] != "1" {
		t.Errorf("first checker span: %v status %v", a, served[0].Status.Code)
	}
	if a := traceAttrs(served[1].Attributes); a["txoutbox.outcome"] != "commit" || a["messaging.message.id"] != half.ID.String() {
		t.Errorf("second checker span: %v", a)
	}
}

// Whatever a checker answers — written in any language: an error header with an invalid UTF-8
// byte, a NUL or 200 KB, a reply that is none of the states — and whatever error a checker
// made with checker.Serve returns, every check span (and the checker's own span) carries only
// text an OTLP exporter can send: valid UTF-8, no NUL, at most tracing.MaxText bytes; all of
// them go out through the OTLP/HTTP exporter in one batch.
func TestCheckSpanTextsFromCheckersAreExportable(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(sdktrace.AlwaysSample()))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	hostile := tracingtest.HostileText()
	answers := map[string]func(m *nats.Msg){
		"errnul":   func(m *nats.Msg) { respondError(m, "db \x00 down") },
		"errutf":   func(m *nats.Msg) { respondError(m, "bad \xff\xfe bytes") },
		"errall":   func(m *nats.Msg) { respondError(m, hostile) },
		"replyutf": func(m *nats.Msg) { _ = m.Respond([]byte("\xffMAYBE\x00")) },
	}
	var halves []outbox.Half
	for group, f := range answers {
		sub, err := e.nats.Conn.Subscribe(checker.Subject(DefaultSubjectPrefix, group), f)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sub.Unsubscribe() })
		halves = append(halves, e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: group}))
	}
	srv, err := checker.Serve(e.nats.Conn, "served", func(context.Context, checker.Request) (outbox.LocalState, error) {
		return outbox.StateUnknown, errors.New(hostile)
	}, &checker.Config{Logger: testLogger(), Outbox: e.outbox(), TracerProvider: tp, Propagator: propagation.TraceContext{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Stop() })
	halves = append(halves, e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "served"}))

	cfg := fastConfig()
	cfg.TransactionTimeout = time.Hour // passed by back-dating the rows
	cfg.TracerProvider, cfg.Propagator = tp, propagation.TraceContext{}
	cb := e.checkback(cfg)
	e.backdate(cfg.TransactionTimeout)
	res := mustResolve(t, cb)
	if n := res.Checks[OutcomeError] + res.Checks[OutcomeMalformed]; n != len(halves) {
		t.Fatalf("checks %+v, want %d errors or malformed replies", res.Checks, len(halves))
	}
	var checks, served int
	for _, s := range exp.GetSpans() {
		switch s.InstrumentationScope.Name {
		case tracing.ScopePrefix + "checkback":
			checks++
			if s.Status.Code.String() != "Error" || s.Status.Description == "" {
				t.Errorf("check span %q: status %+v, want the error", s.Name, s.Status)
			}
		case tracing.ScopePrefix + "checker":
			served++
		}
	}
	if checks != len(halves) || served != 1 {
		t.Fatalf("%d check spans and %d checker spans, want %d and 1", checks, served, len(halves))
	}
	tracingtest.RequireExportable(t, exp.GetSpans())
}
