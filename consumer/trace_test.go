package consumer

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

func newTracing(t *testing.T) (*sdktrace.TracerProvider, *tracetest.InMemoryExporter) {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(sdktrace.AlwaysSample()))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp, exp
}

func attrs(kvs []attribute.KeyValue) map[string]string {
	out := map[string]string{}
	for _, kv := range kvs {
		out[string(kv.Key)] = kv.Value.String()
	}
	return out
}

// produced publishes a message as the relay would, with the W3C trace context of a producer
// span of its own (or none when traced is false); it returns the producer span's context.
func (e *env) produced(tp trace.TracerProvider, subject, id, bizKey, data string, traced bool) trace.SpanContext {
	e.t.Helper()
	h := map[string][]string{outbox.HeaderMsgID: {id}}
	if bizKey != "" {
		h[outbox.HeaderBizKey] = []string{bizKey}
	}
	var sc trace.SpanContext
	if traced {
		ctx, span := tp.Tracer("producer").Start(context.Background(), "request "+data)
		span.End()
		sc = span.SpanContext()
		carrier := propagation.MapCarrier{}
		propagation.TraceContext{}.Inject(ctx, carrier)
		for k, v := range carrier {
			h[k] = []string{v}
		}
	}
	e.publish(subject, h, data)
	return sc
}

// handlerSpans records the span context each handler call's ctx carries, by payload.
type handlerSpans struct {
	mu   sync.Mutex
	seen map[string][]trace.SpanContext
}

func (h *handlerSpans) add(ctx context.Context, payload string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.seen == nil {
		h.seen = map[string][]trace.SpanContext{}
	}
	h.seen[payload] = append(h.seen[payload], trace.SpanContextFromContext(ctx))
}

func (h *handlerSpans) of(payload string) []trace.SpanContext {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]trace.SpanContext(nil), h.seen[payload]...)
}

// processSpans returns the ended process spans by the message id they are about.
func processSpans(exp *tracetest.InMemoryExporter) map[string][]tracetest.SpanStub {
	out := map[string][]tracetest.SpanStub{}
	for _, s := range exp.GetSpans() {
		if s.InstrumentationScope.Name != "github.com/txoutbox/txoutbox/consumer" {
			continue
		}
		id := attrs(s.Attributes)["messaging.message.id"]
		out[id] = append(out[id], s)
	}
	return out
}

func outcomes(spans []tracetest.SpanStub) []string {
	var out []string
	for _, s := range spans {
		out = append(out, attrs(s.Attributes)["txoutbox.outcome"])
	}
	return out
}

func has(list []string, v string) bool {
	for _, x := range list {
		if x == v {
			return true
		}
	}
	return false
}

// Every message handled gets a process span, a child of its producer's span, carried by the
// handler's ctx and ended with the outcome: applied, retried, duplicate (a redelivery after a
// lost ack) and dead-lettered; a dead letter carries the trace context. In per-message mode
// and in batch mode.
func TestProcessSpans(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{1, 4} {
		t.Run(fmt.Sprintf("BatchSize=%d", batch), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			tp, exp := newTracing(t)
			var hs handlerSpans
			var mu sync.Mutex
			failedOnce := false
			h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
				p := string(msg.Payload)
				hs.add(ctx, p)
				switch p {
				case "flaky":
					mu.Lock()
					first := !failedOnce
					failedOnce = true
					mu.Unlock()
					if first {
						return errors.New("flaky failure")
					}
				case "poison", "untraced poison":
					return Permanent(errors.New("never"))
				}
				return recordEffect(ctx, tx, msg)
			}
			ids := map[string]string{"ok": newID(), "flaky": newID(), "poison": newID(), "untraced poison": newID()}
			producers := map[string]trace.SpanContext{}
			for _, p := range []string{"ok", "flaky", "poison", "untraced poison"} {
				producers[p] = e.produced(tp, "orders.created", ids[p], "", p, p != "untraced poison")
			}
			c := e.newConsumer(nil, &Config{BatchSize: batch, TracerProvider: tp, Propagator: propagation.TraceContext{}}, h)
			var lostOnce sync.Once
			c.hooks.afterCommit = func(_ context.Context, msgs []Message) error {
				var err error
				for _, m := range msgs {
					if string(m.Payload) == "ok" {
						lostOnce.Do(func() { err = errors.New("crash before the ack") })
					}
				}
				return err
			}
			e.run(c)
			testsvc.Eventually(t, 30*time.Second, "process spans of every outcome", func() bool {
				ps := processSpans(exp)
				return has(outcomes(ps[ids["ok"]]), "applied") && has(outcomes(ps[ids["ok"]]), "duplicate") &&
					has(outcomes(ps[ids["flaky"]]), "retried") && has(outcomes(ps[ids["flaky"]]), "applied") &&
					has(outcomes(ps[ids["poison"]]), "dead_lettered") && has(outcomes(ps[ids["untraced poison"]]), "dead_lettered")
			})
			ps := processSpans(exp)
			natsURL, err := url.Parse(e.nats.URL())
			if err != nil {
				t.Fatal(err)
			}
			for p, id := range ids {
				runs := hs.of(p)
				for _, s := range ps[id] {
					a := attrs(s.Attributes)
					if s.Name != "process orders.created" || s.SpanKind != trace.SpanKindConsumer || a["messaging.system"] != "nats" ||
						a["messaging.consumer.group.name"] != testDurable || a["messaging.destination.name"] != "orders.created" ||
						a["txoutbox.stream.name"] != testStream || a["messaging.operation.type"] != "process" {
						t.Errorf("%s: span %q kind %v attributes %v", p, s.Name, s.SpanKind, a)
					}
					if a["server.address"] != natsURL.Hostname() || a["server.port"] != natsURL.Port() {
						t.Errorf("%s: server.address %q server.port %q, want the NATS server's %s", p, a["server.address"], a["server.port"], natsURL.Host)
					}
					// The creation context is the parent and a link.
					if want := producers[p]; want.IsValid() {
						if s.Parent.SpanID() != want.SpanID() || s.SpanContext.TraceID() != want.TraceID() {
							t.Errorf("%s: process span's parent %s/%s, want the producer's %s/%s", p, s.SpanContext.TraceID(), s.Parent.SpanID(), want.TraceID(), want.SpanID())
						}
						if len(s.Links) != 1 || s.Links[0].SpanContext.SpanID() != want.SpanID() || s.Links[0].SpanContext.TraceID() != want.TraceID() {
							t.Errorf("%s: process span's links %v, want one to the producer's span", p, s.Links)
						}
					} else if s.Parent.IsValid() || len(s.Links) > 0 {
						t.Errorf("%s: untraced message's process span has a parent %s or links %v", p, s.Parent.SpanID(), s.Links)
					}
					o := a["txoutbox.outcome"]
					if (o == "retried" || o == "dead_lettered") != (s.Status.Code.String() == "Error") {
						t.Errorf("%s: outcome %s with status %v", p, o, s.Status.Code)
					}
					// error.type: the handler failed (retried), or the dead reason.
					if want := map[string]string{"retried": "handler", "dead_lettered": "permanent"}[o]; a["error.type"] != want {
						t.Errorf("%s: outcome %s with error.type %q, want %q", p, o, a["error.type"], want)
					}
				}
				// Each handler call ran under one of its message's process spans.
				for _, r := range runs {
					found := false
					for _, s := range ps[id] {
						found = found || s.SpanContext.SpanID() == r.SpanID()
					}
					if !found {
						t.Errorf("%s: handler ctx carried span %s, not one of the message's process spans", p, r.SpanID())
					}
				}
				if len(runs) == 0 && p != "ok" {
					t.Errorf("%s: handler never ran", p)
				}
			}
			// The dead letters carry the trace context: the producer's, as it was, or the
			// process span's when the message had none.
			dead := map[string]string{}
			for _, m := range e.deadLetters() {
				dead[m.Header.Get(HeaderDeadMsgID)] = m.Header.Get("traceparent")
			}
			if got, want := parentOf(dead[ids["poison"]]), producers["poison"]; got.SpanID() != want.SpanID() || got.TraceID() != want.TraceID() {
				t.Errorf("dead letter of poison has traceparent %q, want the producer's", dead[ids["poison"]])
			}
			untraced := parentOf(dead[ids["untraced poison"]])
			var inSpans bool
			for _, s := range ps[ids["untraced poison"]] {
				inSpans = inSpans || (s.SpanContext.SpanID() == untraced.SpanID() && attrs(s.Attributes)["txoutbox.outcome"] == "dead_lettered")
			}
			if !inSpans {
				t.Errorf("dead letter of an untraced message has traceparent %q, want its dead-lettering process span", dead[ids["untraced poison"]])
			}
		})
	}
}

func parentOf(traceparent string) trace.SpanContext {
	ctx := propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier{"traceparent": traceparent})
	return trace.SpanContextFromContext(ctx)
}

// A batch handler runs under one span per batch, linked to every message's producer span,
// with the count of each outcome and an event per message not applied.
func TestBatchHandlerSpan(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tp, exp := newTracing(t)
	var hs handlerSpans
	h := func(ctx context.Context, tx pgx.Tx, msgs []Message) error {
		for _, m := range msgs {
			hs.add(ctx, string(m.Payload))
		}
		return recordEffects(ctx, tx, msgs)
	}
	producers := map[string]trace.SpanContext{}
	ids := map[string]string{}
	for _, p := range []string{"a", "b", "c"} {
		ids[p] = newID()
		producers[ids[p]] = e.produced(tp, "orders.created", ids[p], "biz-"+p, p, true)
	}
	c := e.newBatchConsumer(&Config{BatchSize: 10, TracerProvider: tp, Propagator: propagation.TraceContext{}}, h)
	e.run(c)
	e.waitEffects(3)
	// The same business event again, under another message id: a duplicate.
	dupID := newID()
	e.produced(tp, "orders.created", dupID, "biz-a", "a again", true)
	testsvc.Eventually(t, 20*time.Second, "the duplicate", func() bool { return c.Stats().Duplicates == 1 })
	// A malformed message (two message ids): dead-lettered without the handler.
	e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID(), newID()}}, "malformed")
	testsvc.Eventually(t, 20*time.Second, "the malformed message's event", func() bool {
		for _, s := range exp.GetSpans() {
			for _, ev := range s.Events {
				if ev.Name == "message dead_lettered" {
					return true
				}
			}
		}
		return false
	})
	testsvc.Eventually(t, 20*time.Second, "the duplicate's batch span", func() bool {
		for _, s := range exp.GetSpans() {
			if attrs(s.Attributes)["txoutbox.outcome.duplicate"] == "1" {
				return true
			}
		}
		return false
	})

	linked := map[string]bool{}
	var dupEvent, deadEvent bool
	batchSpans := map[trace.SpanID]bool{}
	for _, s := range exp.GetSpans() {
		if s.InstrumentationScope.Name != "github.com/txoutbox/txoutbox/consumer" {
			continue
		}
		batchSpans[s.SpanContext.SpanID()] = true
		a := attrs(s.Attributes)
		if s.Name != "process orders.created" || s.SpanKind != trace.SpanKindConsumer || a["messaging.consumer.group.name"] != testDurable || a["messaging.batch.message_count"] == "" {
			t.Errorf("batch span %q kind %v attributes %v", s.Name, s.SpanKind, a)
		}
		for _, l := range s.Links {
			id := attrs(l.Attributes)["messaging.message.id"]
			if want, ok := producers[id]; ok && l.SpanContext.SpanID() == want.SpanID() && l.SpanContext.TraceID() == want.TraceID() {
				linked[id] = true
			}
		}
		for _, ev := range s.Events {
			ea := attrs(ev.Attributes)
			dupEvent = dupEvent || (ev.Name == "message duplicate" && ea["messaging.message.id"] == dupID && ea["txoutbox.outcome"] == "duplicate")
			if ev.Name == "message dead_lettered" {
				deadEvent = ea["error.type"] == "malformed" && strings.Contains(ea["txoutbox.error.message"], "malformed")
				if _, ok := ea["error.message"]; ok || !deadEvent {
					t.Errorf("dead-lettered event attributes %v: want error.type=malformed and txoutbox.error.message, no error.message", ea)
				}
			}
		}
	}
	for _, p := range []string{"a", "b", "c"} {
		if !linked[ids[p]] {
			t.Errorf("no batch span links to the producer span of %s", p)
		}
		for _, r := range hs.of(p) {
			if !batchSpans[r.SpanID()] {
				t.Errorf("the batch handler's ctx carried span %s, not a batch span", r.SpanID())
			}
		}
	}
	if !dupEvent {
		t.Error("no batch span records the duplicate with an event")
	}
	if !deadEvent {
		t.Error("no batch span records the malformed message's dead letter with its error.type")
	}
}

// A dead letter of a message that carried no valid trace context gets its dead-lettering
// process span's, by the producer's rule: the fields the message had (a baggage or a
// tracestate alone, a traceparent that is not valid) are copied as they were, and only the
// missing ones are added; a valid one is kept as it was.
func TestDeadLetterTraceContextFromPartialHeaders(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tp, exp := newTracing(t)
	const (
		invalid = "00-00000000000000000000000000000000-00f067aa0ba902b7-01"
		valid   = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	)
	msgs := map[string]map[string][]string{
		"baggage only":    {"baggage": {"tenant=acme"}},
		"tracestate only": {"tracestate": {"vendor=opaque"}},
		"invalid":         {"traceparent": {invalid}},
		"valid":           {"traceparent": {valid}, "baggage": {"tenant=acme"}},
	}
	ids := map[string]string{}
	for data, h := range msgs {
		ids[data] = newID()
		h[outbox.HeaderMsgID] = []string{ids[data]}
		e.publish("orders.created", h, data)
	}
	c := e.newConsumer(nil, &Config{TracerProvider: tp,
		Propagator: propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})},
		func(context.Context, pgx.Tx, Message) error { return Permanent(errors.New("never")) })
	e.run(c)
	testsvc.Eventually(t, 30*time.Second, "every message dead-lettered", func() bool { return len(e.deadLetters()) == len(msgs) })
	dead := map[string]*nats.Header{}
	for _, m := range e.deadLetters() {
		dead[string(m.Data)] = &m.Header
	}
	ps := processSpans(exp)
	spanOf := func(data string) trace.SpanContext {
		for _, s := range ps[ids[data]] {
			if attrs(s.Attributes)["txoutbox.outcome"] == "dead_lettered" {
				return s.SpanContext
			}
		}
		t.Fatalf("%s: no dead-lettering process span", data)
		return trace.SpanContext{}
	}
	for data, h := range msgs {
		got := *dead[data]
		for k, v := range h { // every field the message had, as it was
			if k != outbox.HeaderMsgID && fmt.Sprint(got.Values(k)) != fmt.Sprint(v) {
				t.Errorf("%s: dead letter's %s is %q, want %q as given", data, k, got.Values(k), v)
			}
		}
		switch data {
		case "baggage only", "tracestate only":
			if sc := parentOf(got.Get("traceparent")); sc.SpanID() != spanOf(data).SpanID() {
				t.Errorf("%s: dead letter's traceparent %q, want its dead-lettering span %s", data, got.Get("traceparent"), spanOf(data).SpanID())
			}
		}
	}
}
