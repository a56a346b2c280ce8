package consumer

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/internal/tracing"
	"github.com/txoutbox/txoutbox/internal/tracing/tracingtest"
	"github.com/txoutbox/txoutbox/outbox"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// Whatever a handler's error or a publisher's message holds (an invalid UTF-8 byte, a NUL,
// 200 KB), every span the consumer records carries only text an OTLP exporter can send: valid
// UTF-8, no NUL, at most tracing.MaxText bytes, in span names, statuses, and span, event and
// link attributes. Per-message mode, batch mode (savepoints) and a batch handler (a batch span
// with an event per message), each with a retried message, a dead-lettered one (its subject
// not UTF-8) and a malformed one (its Nats-Msg-Id neither UTF-8 nor free of NUL); the spans of
// all of them then go out through the OTLP/HTTP exporter in one batch.
func TestSpanTextsFromOutsideAreExportable(t *testing.T) {
	t.Parallel()
	hostile := tracingtest.HostileText()
	for _, mode := range []string{"per-message", "batch", "batch handler"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			tp, exp := newTracing(t)
			var mu sync.Mutex
			failed := false
			// flakyFirst reports whether this is the flaky message's first run (it fails).
			flakyFirst := func() bool {
				mu.Lock()
				defer mu.Unlock()
				first := !failed
				failed = true
				return first
			}
			fail := func(msg Message) error {
				switch string(msg.Payload) {
				case "poison":
					return Permanent(errors.New(hostile))
				case "flaky":
					if flakyFirst() {
						return errors.New(hostile)
					}
				}
				return nil
			}
			cfg := &Config{TracerProvider: tp, Propagator: propagation.TraceContext{}}
			var c *Consumer
			switch mode {
			case "per-message", "batch":
				if mode == "batch" {
					cfg.BatchSize = 4
				}
				c = e.newConsumer(nil, cfg, func(ctx context.Context, tx pgx.Tx, msg Message) error {
					if err := fail(msg); err != nil {
						return err
					}
					return recordEffect(ctx, tx, msg)
				})
			case "batch handler":
				cfg.BatchSize = 10
				c = e.newBatchConsumer(cfg, func(ctx context.Context, tx pgx.Tx, msgs []Message) error {
					for i, m := range msgs {
						if err := fail(m); err != nil {
							if len(msgs) > 1 && i%2 == 0 {
								return &BatchError{Index: i, Err: err} // named: an event on the batch span
							}
							return err // not named: the batch is split
						}
					}
					return recordEffects(ctx, tx, msgs)
				})
			}
			e.publishID("orders.created", newID(), "ok")
			e.publishID("orders.created", newID(), "flaky")
			e.publishID("orders.bad\xffsubject", newID(), "poison")
			e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {"id \xff with NUL \x00"}}, "malformed")
			stop := e.run(c)
			e.waitEffects(2)
			testsvc.Eventually(t, 20*time.Second, "both dead letters", func() bool { return len(e.deadLetters()) == 2 })
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			spans := exp.GetSpans()
			tracingtest.RequireExportable(t, spans)

			// The error texts are there, made safe, not dropped.
			want := tracing.Text("permanent: " + hostile)
			if !hasText(spans, want) {
				t.Errorf("no span carries the poison message's error as %.60q…", want)
			}
			if !hasText(spans, tracing.Text(hostile)) {
				t.Errorf("no span carries the flaky message's error as %.60q…", tracing.Text(hostile))
			}
		})
	}
}

// hasText reports whether a span's status, or an attribute of one of its events, is text.
func hasText(spans tracetest.SpanStubs, text string) bool {
	for _, s := range spans {
		if s.Status.Description == text {
			return true
		}
		for _, ev := range s.Events {
			for _, kv := range ev.Attributes {
				if kv.Value.AsString() == text {
					return true
				}
			}
		}
	}
	return false
}

// A message whose idempotency key is its Txoutbox-Biz-Key and that has no Nats-Msg-Id has no
// messaging.message.id attribute (it had an empty one), on its process span, and on the batch
// span's link and event about it; a message with one has it.
func TestSpanMessageIDOnlyWhenSet(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"per-message", "batch handler"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			tp, exp := newTracing(t)
			prop := propagation.TraceContext{}
			withID := newID()
			e.produced(tp, "orders.created", withID, "", "with id", true)
			ctx, span := tp.Tracer("producer").Start(context.Background(), "request")
			span.End()
			h := map[string][]string{outbox.HeaderBizKey: {"biz-" + newID()}}
			prop.Inject(ctx, propagation.HeaderCarrier(h))
			e.publish("orders.created", h, "biz key only")
			cfg := &Config{TracerProvider: tp, Propagator: prop}
			var c *Consumer
			if mode == "per-message" {
				c = e.newConsumer(nil, cfg, func(ctx context.Context, tx pgx.Tx, msg Message) error {
					return Permanent(errors.New("dead-lettered: an event on a batch span"))
				})
			} else {
				cfg.BatchSize = 10
				c = e.newBatchConsumer(cfg, func(ctx context.Context, tx pgx.Tx, msgs []Message) error {
					return Permanent(errors.New("dead-lettered: an event on a batch span"))
				})
			}
			stop := e.run(c)
			testsvc.Eventually(t, 20*time.Second, "both dead letters", func() bool { return len(e.deadLetters()) == 2 })
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			ids := map[string]int{}
			count := func(where string, a map[string]string) {
				id, ok := a["messaging.message.id"]
				if ok && id == "" {
					t.Errorf("%s: messaging.message.id is set and empty", where)
				}
				if ok {
					ids[id]++
				}
			}
			for _, s := range exp.GetSpans() {
				if s.InstrumentationScope.Name != tracing.ScopePrefix+"consumer" {
					continue
				}
				count("span "+s.Name, attrs(s.Attributes))
				for _, l := range s.Links {
					count("link", attrs(l.Attributes))
				}
				for _, ev := range s.Events {
					count("event "+ev.Name, attrs(ev.Attributes))
				}
			}
			if ids[withID] == 0 {
				t.Errorf("no span, link or event has the message id %s: %v", withID, ids)
			}
		})
	}
}
