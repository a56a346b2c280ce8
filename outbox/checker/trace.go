package checker

import (
	"context"

	"github.com/nats-io/nats.go/micro"
	"github.com/txoutbox/txoutbox/internal/tracing"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// checkerTracer is a checker's OpenTelemetry side: a span per check answered, continuing the
// check-back's check span whose context the request's headers carry.
type checkerTracer struct {
	t     trace.Tracer
	p     propagation.TextMapPropagator
	group string
}

// start starts the span of answering req; ctx is the server's.
func (ct *checkerTracer) start(ctx context.Context, req micro.Request) (context.Context, trace.Span) {
	ctx = tracing.ExtractContext(ctx, ct.p, req.Headers())
	ctx, span := ct.t.Start(ctx, tracing.Name("check", ct.group), trace.WithSpanKind(trace.SpanKindServer))
	if span.IsRecording() {
		span.SetAttributes(
			tracing.SystemNATS,
			tracing.OperationProcess,
			tracing.OperationName.String("check"),
			tracing.String(tracing.Destination, req.Subject()), // any requester's
			tracing.String(tracing.Group, ct.group),
		)
	}
	return ctx, span
}
