package checkback

import (
	"context"
	"encoding/json"

	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/tracing"
	"github.com/txoutbox/txoutbox/outbox/checker"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Check spans. Each check request gets a span "check <group>" (kind client), a child of the
// trace context the half message captured when it was prepared, so that its checks appear in
// the producer's trace; its context travels in the request's headers, and the checker
// (checker.Serve) continues it with a span of its own.

// checkTracer is the check-back's OpenTelemetry side.
type checkTracer struct {
	t trace.Tracer
	p propagation.TextMapPropagator
}

func newCheckTracer(c *Config) *checkTracer {
	return &checkTracer{t: tracing.Tracer(c.TracerProvider, "checkback"), p: tracing.Propagator(c.Propagator)}
}

// startCheck starts the span of a check of row r.
func (ct *checkTracer) startCheck(ctx context.Context, r store.HalfRow, prefix string) (context.Context, trace.Span) {
	if len(r.Headers) > 0 {
		var h map[string][]string
		if json.Unmarshal(r.Headers, &h) == nil {
			ctx = tracing.ExtractContext(ctx, ct.p, h)
		}
	}
	ctx, span := ct.t.Start(ctx, tracing.Name("check", r.Group), trace.WithSpanKind(trace.SpanKindClient))
	if span.IsRecording() {
		span.SetAttributes(
			tracing.SystemNATS,
			tracing.OperationSend,
			tracing.OperationName.String("check"),
			tracing.String(tracing.Destination, checker.Subject(prefix, r.Group)),
			tracing.MessageID.String(r.MessageID.String()),
			tracing.String(tracing.Group, r.Group),
			tracing.CheckNumber.Int(int(r.CheckCount)+1),
		)
	}
	return ctx, span
}

// endCheck ends a check span with its outcome ("" when the check was abandoned: nothing is
// counted). detail may quote the checker's reply (its Nats-Service-Error header), written by
// a program in any language: tracing.Fail makes it safe for the span.
func endCheck(span trace.Span, outcome, detail string) {
	if span.IsRecording() {
		name := outcome
		if name == "" {
			name = "abandoned"
		}
		span.SetAttributes(tracing.Outcome.String(name))
		switch outcome {
		case OutcomeCommit, OutcomeRollback, OutcomeUnknown, "":
		default:
			tracing.Fail(span, checkError(detail), outcome)
		}
	}
	span.End()
}

type checkError string

func (e checkError) Error() string { return string(e) }
