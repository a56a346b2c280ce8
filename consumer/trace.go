package consumer

import (
	"context"

	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/tracing"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Process spans. Each time the consumer handles a message (a per-message Handler, in either
// mode) it starts a span "process <subject>" (kind consumer) whose parent is the trace context
// the producer captured in the message's headers (its creation context), with a link to that
// context too, as the messaging conventions ask, so that the producer's, the relay's and the
// consumer's spans of one message share one trace id. The handler's ctx carries it. It ends
// with the message's outcome (txoutbox.outcome: applied, duplicate, retried, dead_lettered,
// or put_back and waiting, after which the message is handled again under a new span). With
// BatchSize above 1 the messages of a batch share one transaction, so each message's span
// starts when the batch starts and ends when the batch is settled. A consumer made with
// NewBatch starts one span per batch instead, with a link to each message's producer context,
// the counts of each outcome, and an event per message not applied.

// consumerTracer is the consumer's OpenTelemetry side.
type consumerTracer struct {
	tp   trace.TracerProvider // as configured (nil: the global one)
	t    trace.Tracer
	p    propagation.TextMapPropagator
	conn *nats.Conn // for server.address and server.port; nil leaves them out
}

func newConsumerTracer(c *Config, conn *nats.Conn) *consumerTracer {
	return &consumerTracer{tp: c.TracerProvider, t: tracing.Tracer(c.TracerProvider, "consumer"), p: tracing.Propagator(c.Propagator), conn: conn}
}

// outcomeName is the txoutbox.outcome of a result.
func outcomeName(o outcome) string {
	switch o {
	case outcomeProcessed:
		return tracing.OutcomeApplied
	case outcomeDuplicate:
		return tracing.OutcomeDup
	case outcomeRetry, outcomeRetryLocal:
		return tracing.OutcomeRetried
	case outcomeDeadLettered:
		return tracing.OutcomeDead
	case outcomeUnavailable, outcomeStopped:
		return tracing.OutcomePutBack
	case outcomeWaiting:
		return tracing.OutcomeWaiting
	}
	return o.String()
}

// errorType is the error.type of a result that failed: retried messages' handler failed
// ("handler"), dead-lettered messages' type is their DeadReason (failed, permanent, malformed,
// exhausted, out-of-order), put back messages met a database or broker failure
// ("unavailable").
func errorType(r result) string {
	switch r.outcome {
	case outcomeRetry, outcomeRetryLocal:
		return "handler"
	case outcomeDeadLettered:
		if r.reason != "" {
			return r.reason
		}
	case outcomeUnavailable, outcomeStopped:
		return "unavailable"
	}
	return ""
}

// spanCtx returns ctx carrying it's process span, if it has one.
func (it *item) spanCtx(ctx context.Context) context.Context {
	if it.span == nil {
		return ctx
	}
	return trace.ContextWithSpan(ctx, it.span)
}

// messageAttrs are the attributes of a process span about one message. Every text from the
// message (its subject, its Nats-Msg-Id, its stream) goes through tracing's sanitizer: any
// publisher may have sent it. A message without a Nats-Msg-Id (its idempotency key is its
// Txoutbox-Biz-Key) has no messaging.message.id.
func (c *Consumer) messageAttrs(it *item) []attribute.KeyValue {
	attrs := make([]attribute.KeyValue, 0, 10)
	attrs = append(attrs,
		tracing.SystemNATS,
		tracing.OperationProcess,
		tracing.OperationName.String("process"),
		tracing.String(tracing.Destination, it.msg.Subject),
		tracing.String(tracing.ConsumerGroup, c.cfg.Durable),
	)
	attrs = appendMessageID(attrs, it)
	return append(attrs,
		tracing.BodySize.Int(len(it.msg.Payload)),
		tracing.String(tracing.StreamName, it.msg.Stream),
		tracing.StreamSequence.Int64(int64(it.msg.StreamSeq)),
		tracing.Delivery.Int(it.attempt()),
	)
}

// appendMessageID appends it's messaging.message.id (its Nats-Msg-Id) to attrs, if it has one.
func appendMessageID(attrs []attribute.KeyValue, it *item) []attribute.KeyValue {
	if it.msg.ID == "" {
		return attrs
	}
	return append(attrs, tracing.String(tracing.MessageID, it.msg.ID))
}

// serverAttrs are server.address and server.port of the NATS server the consumer is
// connected to.
func (c *Consumer) serverAttrs() []attribute.KeyValue {
	if c.trace.conn == nil {
		return nil
	}
	return tracing.Server(c.trace.conn.ConnectedUrl())
}

// startSpans starts the spans of a batch about to be handled and returns the context to
// handle it in: per message (it.span), or, with a batch handler, one for the batch.
func (c *Consumer) startSpans(ctx context.Context, batch []*item) (context.Context, trace.Span) {
	if !tracing.Enabled(c.trace.tp) {
		return ctx, nil
	}
	if c.batchHandler == nil {
		for _, it := range batch {
			pctx := tracing.ExtractContext(ctx, c.trace.p, it.raw.Headers())
			opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer)}
			if sc := trace.SpanContextFromContext(pctx); sc.IsValid() && sc.IsRemote() {
				opts = append(opts, trace.WithLinks(tracing.CreationLink(sc)))
			}
			_, span := c.trace.t.Start(pctx, tracing.Name("process", it.msg.Subject), opts...)
			if span.IsRecording() {
				span.SetAttributes(c.messageAttrs(it)...)
				span.SetAttributes(c.serverAttrs()...)
			}
			it.span = span
		}
		if len(batch) == 1 {
			return batch[0].spanCtx(ctx), nil
		}
		return ctx, nil
	}
	links := make([]trace.Link, 0, len(batch))
	subject := batch[0].msg.Subject
	for _, it := range batch {
		if it.msg.Subject != subject {
			subject = ""
		}
		sc := tracing.Extract(c.trace.p, it.raw.Headers())
		if !sc.IsValid() {
			continue
		}
		la := appendMessageID(make([]attribute.KeyValue, 0, 2), it)
		links = append(links, trace.Link{SpanContext: sc, Attributes: append(la, tracing.StreamSequence.Int64(int64(it.msg.StreamSeq)))})
	}
	ctx, span := c.trace.t.Start(ctx, tracing.Name("process", subject), trace.WithSpanKind(trace.SpanKindConsumer), trace.WithLinks(links...))
	if span.IsRecording() {
		attrs := []attribute.KeyValue{
			tracing.SystemNATS,
			tracing.OperationProcess,
			tracing.OperationName.String("process"),
			tracing.String(tracing.ConsumerGroup, c.cfg.Durable),
			tracing.String(tracing.StreamName, c.cfg.Stream),
			tracing.BatchCount.Int(len(batch)),
		}
		if subject != "" {
			attrs = append(attrs, tracing.String(tracing.Destination, subject))
		}
		span.SetAttributes(attrs...)
		span.SetAttributes(c.serverAttrs()...)
	}
	return ctx, span
}

// endSpans ends the spans startSpans started, with each message's outcome.
func (c *Consumer) endSpans(batchSpan trace.Span, batch []*item, results []result) {
	if batchSpan == nil {
		for i, it := range batch {
			span := it.span
			it.span = nil
			if span == nil {
				continue
			}
			if span.IsRecording() {
				r := results[i]
				span.SetAttributes(tracing.Outcome.String(outcomeName(r.outcome)))
				if r.outcome != outcomeProcessed && r.outcome != outcomeDuplicate {
					tracing.Fail(span, r.err, errorType(r))
				}
			}
			span.End()
		}
		return
	}
	if batchSpan.IsRecording() {
		counts := map[string]int{}
		for i, it := range batch {
			name := outcomeName(results[i].outcome)
			counts[name]++
			if results[i].outcome == outcomeProcessed {
				continue
			}
			attrs := appendMessageID(make([]attribute.KeyValue, 0, 5), it)
			attrs = append(attrs, tracing.StreamSequence.Int64(int64(it.msg.StreamSeq)), tracing.Outcome.String(name))
			if err := results[i].err; err != nil {
				// The handler's text, as the exception event of a process span has it.
				attrs = append(attrs, tracing.ErrorTypeOf(err, errorType(results[i])), tracing.String(tracing.ErrorText, err.Error()))
			}
			batchSpan.AddEvent("message "+name, trace.WithAttributes(attrs...))
		}
		for name, n := range counts {
			batchSpan.SetAttributes(attribute.Int("txoutbox.outcome."+name, n))
		}
	}
	batchSpan.End()
}

// traceDeadLetter gives a dead letter a trace context when the original message carried no
// valid one: the context of the span that dead-lettered it, by the producer's rule
// (outbox.Client's capture). A valid trace context the original carried is copied with its
// other headers, as it was; so is every propagator field the original had (a baggage or a
// tracestate alone, a traceparent that is not valid): only the missing fields are added.
func (c *Consumer) traceDeadLetter(ctx context.Context, it *item, h map[string][]string) {
	ctx = it.spanCtx(ctx)
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.AddEvent("dead-lettered", trace.WithAttributes(tracing.String(tracing.Destination, c.cfg.DeadLetterSubject)))
	}
	p := c.trace.p
	if tracing.HasAny(h, p.Fields()) && tracing.Extract(p, h).IsValid() {
		return
	}
	add := tracing.Carrier{}
	p.Inject(ctx, add)
	for k, v := range add {
		if !tracing.HasAny(h, []string{k}) {
			h[k] = v
		}
	}
}
