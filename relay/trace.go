package relay

import (
	"context"

	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/tracing"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Publish spans. The relay starts one span per message it hands to NATS that carries a trace
// context (the producer's, captured in its headers at enqueue), a child of that context with a
// link to it, and ends it when the message's PubAck (or error) is in. A message without one
// (written by the SQL producer functions without TraceHeaders, or before tracing was on) gets
// no span: it would be the root of a trace of its own, which nothing else joins — cost with
// nothing to follow, and with the binary's default sampler (parentbased_always_on) every
// such message would be sampled.
//
// Per message rather than one per batch with a link per message: a message's producer,
// publish and consumer spans then share one trace id, so one trace shows an event's whole
// life, its republishes included (each a span of its own, with txoutbox.duplicate set when
// JetStream recognised it). What it costs (README, Traces; BenchmarkPublishSpans): nothing
// but a check while tracing is off; for a message whose producer's span was not sampled,
// about what one batch span with a link per message costs (reading its traceparent dominates
// both); a full span only for sampled messages.
//
// Kind client, not producer: in the messaging conventions a send span is a producer span
// when its context is the message's creation context, injected into the message; the relay
// publishes the message's headers byte for byte, so the creation context stays the
// producer's, and the consumer's process span is the publish span's sibling.

// relayTracer is the relay's OpenTelemetry side.
type relayTracer struct {
	tp   trace.TracerProvider // as configured (nil: the global one)
	t    trace.Tracer
	p    propagation.TextMapPropagator
	conn *nats.Conn // for server.address and server.port; nil leaves them out
}

func newRelayTracer(c *Config) *relayTracer {
	return &relayTracer{tp: c.TracerProvider, t: tracing.Tracer(c.TracerProvider, "relay"), p: tracing.Propagator(c.Propagator)}
}

// startPublish starts the publish span of row, about to be sent as msg; nil when tracing is
// off or msg carries no trace context.
func (rt *relayTracer) startPublish(ctx context.Context, row *store.Claimed, msg *nats.Msg) trace.Span {
	if !tracing.Enabled(rt.tp) || len(msg.Header) == 0 {
		return nil
	}
	ctx = tracing.ExtractContext(ctx, rt.p, msg.Header)
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() || !sc.IsRemote() {
		return nil // no creation context: no trace to join
	}
	_, span := rt.t.Start(ctx, tracing.Name("publish", row.Subject), trace.WithSpanKind(trace.SpanKindClient), trace.WithLinks(tracing.CreationLink(sc)))
	if span.IsRecording() {
		span.SetAttributes(
			tracing.SystemNATS,
			tracing.OperationSend,
			tracing.OperationName.String("publish"),
			tracing.String(tracing.Destination, row.Subject),
			tracing.MessageID.String(row.MessageID.String()),
			tracing.BodySize.Int(len(row.Payload)),
			tracing.Attempt.Int(int(row.Attempts)+1),
		)
		span.SetAttributes(tracing.Server(rt.conn.ConnectedUrl())...)
	}
	return span
}

// endPublish ends a publish span with the message's outcome.
func endPublish(span trace.Span, o outcome) {
	if span == nil {
		return
	}
	if span.IsRecording() {
		switch {
		case o.err != nil:
			typ := "message"
			switch {
			case isBrokerError(o.err):
				typ = "broker"
			case isPermanent(o.err):
				typ = "permanent"
			}
			tracing.Fail(span, o.err, typ)
		case o.ack != nil:
			span.SetAttributes(
				tracing.String(tracing.StreamName, o.ack.Stream),
				tracing.StreamSequence.Int64(int64(o.ack.Sequence)),
				tracing.Duplicate.Bool(o.ack.Duplicate),
			)
		}
	}
	span.End()
}
