package relay

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/internal/tracing/tracingtest"
	"github.com/txoutbox/txoutbox/outbox"
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

// One message's life in one trace: the producer's request span, the publish spans of a
// relay that crashed between publish and settle and of the relay that republished the row
// (JetStream deduplicated it), and the consumer's process span all share one trace id; the
// publish and process spans are children of the request span the message captured.
func TestOneTraceFromProducerToConsumerAcrossARelayCrash(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.nats.Stream(t, "DEAD", consumer.DefaultDeadLetterPrefix+">")
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(sdktrace.AlwaysSample()))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	prop := propagation.TraceContext{}
	ctx := context.Background()

	client, err := outbox.NewClient(&outbox.Config{Schema: e.db.Schema, TracerProvider: tp, Propagator: prop})
	if err != nil {
		t.Fatal(err)
	}
	rctx, req := tp.Tracer("app").Start(ctx, "POST /orders")
	var id string
	err = pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
		ids, err := client.EnqueueTx(rctx, tx, outbox.Message{Subject: "orders.created", Key: "order-1", Payload: []byte("order 1")})
		if err == nil {
			id = ids[0].String()
		}
		return err
	})
	req.End()
	if err != nil {
		t.Fatal(err)
	}

	crashed := e.relay(&Config{TracerProvider: tp, Propagator: prop})
	errCrash := errors.New("crash")
	crashed.hooks.afterPublish = func(_ context.Context, published int) error {
		if published == 0 {
			return nil // not sent this time (a lease that lapsed on a loaded machine): again
		}
		return errCrash
	}
	testsvc.Eventually(t, 30*time.Second, "the crash between publish and settle", func() bool {
		_, err := crashed.runOnce(ctx)
		return errors.Is(err, errCrash)
	})
	crashed.Close()
	restarted := e.relay(&Config{TracerProvider: tp, Propagator: prop})
	drain(t, restarted)
	if d := restarted.Stats().Duplicates; d != 1 {
		t.Fatalf("the republish was not deduplicated: duplicates = %d (stream holds %d)", d, len(e.streamMsgs("ORDERS")))
	}

	handled := make(chan trace.SpanContext, 4)
	cons, err := consumer.New(e.db.Pool, e.nats.JS, func(ctx context.Context, _ pgx.Tx, _ consumer.Message) error {
		handled <- trace.SpanContextFromContext(ctx)
		return nil
	}, &consumer.Config{Stream: "ORDERS", Durable: "traced", Schema: e.db.Schema, Logger: quietLogger(), TracerProvider: tp, Propagator: prop})
	if err != nil {
		t.Fatal(err)
	}
	cctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- cons.Run(cctx) }()
	handlerSpan := testsvc.Receive(t, handled, 30*time.Second, "the handler call")
	testsvc.Eventually(t, 30*time.Second, "the consumer's process span", func() bool {
		for _, s := range exp.GetSpans() {
			if s.InstrumentationScope.Name == "github.com/txoutbox/txoutbox/consumer" {
				return true
			}
		}
		return false
	})
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	var publishes, processes []tracetest.SpanStub
	for _, s := range exp.GetSpans() {
		switch s.InstrumentationScope.Name {
		case "github.com/txoutbox/txoutbox/relay":
			publishes = append(publishes, s)
		case "github.com/txoutbox/txoutbox/consumer":
			processes = append(processes, s)
		}
	}
	want := req.SpanContext()
	natsURL, err := url.Parse(e.nats.URL())
	if err != nil {
		t.Fatal(err)
	}
	if len(publishes) != 2 {
		t.Fatalf("%d publish spans, want 2 (the crashed relay's and the republish)", len(publishes))
	}
	for i, s := range publishes {
		a := traceAttrs(s.Attributes)
		if s.SpanContext.TraceID() != want.TraceID() || s.Parent.SpanID() != want.SpanID() {
			t.Errorf("publish span %d: trace %s parent %s, want a child of the request %s/%s", i, s.SpanContext.TraceID(), s.Parent.SpanID(), want.TraceID(), want.SpanID())
		}
		// Kind client: the relay does not inject its context into the message, so the send
		// span is not the creation context. txoutbox.attempt is 1 both times: it counts the
		// publishes that failed (the row's attempts column), and the crash failed none. Nothing
		// in the row tells a republish apart (the claim marks no row); JetStream's duplicate
		// flag does, within the stream's Duplicates window.
		if s.Name != "publish orders.created" || s.SpanKind != trace.SpanKindClient || a["messaging.system"] != "nats" ||
			a["messaging.destination.name"] != "orders.created" || a["messaging.message.id"] != id || a["messaging.operation.type"] != "send" ||
			a["messaging.operation.name"] != "publish" || a["server.address"] != natsURL.Hostname() || a["server.port"] != natsURL.Port() ||
			a["txoutbox.stream.name"] != "ORDERS" || a["txoutbox.stream.sequence"] != "1" || a["txoutbox.attempt"] != "1" {
			t.Errorf("publish span %d: %q kind %v attributes %v", i, s.Name, s.SpanKind, a)
		}
		if len(s.Links) != 1 || s.Links[0].SpanContext.SpanID() != want.SpanID() || s.Links[0].SpanContext.TraceID() != want.TraceID() {
			t.Errorf("publish span %d: links %v, want one to the creation context %s", i, s.Links, want.SpanID())
		}
		if dup := a["txoutbox.duplicate"]; dup != map[int]string{0: "false", 1: "true"}[i] {
			t.Errorf("publish span %d: txoutbox.duplicate = %s", i, dup)
		}
	}
	if len(processes) != 1 {
		t.Fatalf("%d process spans, want 1", len(processes))
	}
	p := processes[0]
	pa := traceAttrs(p.Attributes)
	if p.SpanContext.TraceID() != want.TraceID() || p.Parent.SpanID() != want.SpanID() {
		t.Errorf("process span: trace %s parent %s, want a child of the request", p.SpanContext.TraceID(), p.Parent.SpanID())
	}
	if pa["txoutbox.outcome"] != "applied" || pa["messaging.message.id"] != id || pa["txoutbox.stream.sequence"] != "1" {
		t.Errorf("process span attributes %v", pa)
	}
	if handlerSpan.SpanID() != p.SpanContext.SpanID() {
		t.Errorf("the handler's ctx carried span %s, want the process span %s", handlerSpan.SpanID(), p.SpanContext.SpanID())
	}
}

// A message without a trace context (the SQL producer functions without TraceHeaders, a row
// enqueued before tracing was on) gets no publish span, whatever the sampler: it would be the
// root of a trace nothing else joins. A message with one gets its span as before, in the same
// batch.
func TestNoPublishSpanWithoutATraceContext(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		sampler sdktrace.Sampler
	}{
		{"always_on", sdktrace.AlwaysSample()},
		{"parentbased_always_on", sdktrace.ParentBased(sdktrace.AlwaysSample())},
	} {
		exp := tracetest.NewInMemoryExporter()
		tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(tc.sampler))
		t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
		prop := propagation.TraceContext{}
		client, err := outbox.NewClient(&outbox.Config{Schema: e.db.Schema, TracerProvider: tp, Propagator: prop})
		if err != nil {
			t.Fatal(err)
		}
		rctx, req := tp.Tracer("app").Start(ctx, "POST /orders")
		req.End()
		var traced, untraced string
		err = pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
			// ctx without a span: nothing to capture, as from the SQL producer functions.
			ids, err := client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.untraced", Payload: []byte("a")})
			if err != nil {
				return err
			}
			untraced = ids[0].String()
			ids, err = client.EnqueueTx(rctx, tx, outbox.Message{Subject: "orders.traced", Payload: []byte("b")})
			if err == nil {
				traced = ids[0].String()
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		r := e.relay(&Config{TracerProvider: tp, Propagator: prop})
		drain(t, r)
		r.Close()
		if got := r.Stats().Published; got != 2 {
			t.Fatalf("%s: published %d, want 2", tc.name, got)
		}
		var spans []string
		for _, s := range exp.GetSpans() {
			if s.InstrumentationScope.Name == "github.com/txoutbox/txoutbox/relay" {
				spans = append(spans, traceAttrs(s.Attributes)["messaging.message.id"])
				if s.SpanContext.TraceID() != req.SpanContext().TraceID() {
					t.Errorf("%s: a publish span in trace %s, not the request's", tc.name, s.SpanContext.TraceID())
				}
			}
		}
		if len(spans) != 1 || spans[0] != traced {
			t.Errorf("%s: publish spans for messages %v, want one for the traced message %s (not %s)", tc.name, spans, traced, untraced)
		}
	}
}

// A publish span's texts from outside the process (the subject, in its name and destination,
// and the stream the PubAck names) obey the tracing rules like the consumer's and the
// check-back's: valid UTF-8, no NUL, at most tracing.MaxText bytes. A subject longer than that
// (the producer allows 1,024 bytes) made the span name exceed the cap.
func TestPublishSpanTextsAreBounded(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	prop := propagation.TraceContext{}
	client, err := outbox.NewClient(&outbox.Config{Schema: e.db.Schema, TracerProvider: tp, Propagator: prop})
	if err != nil {
		t.Fatal(err)
	}
	subject := "orders." + strings.TrimSuffix(strings.Repeat("ééééé.", 92), ".") // 1,018 bytes: "publish " and it are over the cap
	rctx, req := tp.Tracer("app").Start(ctx, "POST /orders")
	req.End()
	if err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
		_, err := client.EnqueueTx(rctx, tx, outbox.Message{Subject: subject, Payload: []byte("a")})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	r := e.relay(&Config{TracerProvider: tp, Propagator: prop})
	drain(t, r)
	r.Close()
	if got := r.Stats().Published; got != 1 {
		t.Fatalf("published %d, want 1", got)
	}
	var publish tracetest.SpanStubs
	for _, s := range exp.GetSpans() {
		if s.InstrumentationScope.Name == "github.com/txoutbox/txoutbox/relay" {
			publish = append(publish, s)
		}
	}
	if len(publish) != 1 {
		t.Fatalf("%d publish spans, want 1", len(publish))
	}
	for _, p := range tracingtest.Problems(publish) {
		t.Error(p)
	}
	if name := publish[0].Name; !strings.HasPrefix(name, "publish orders.éé") {
		t.Errorf("span name %.40q…, want it to start with the subject", name)
	}
}
