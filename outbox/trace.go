package outbox

import (
	"context"
	"errors"
	"maps"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/tracing"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// tracer is a client's OpenTelemetry side (see Config.TracerProvider and Config.Propagator).
type tracer struct {
	t     trace.Tracer
	p     propagation.TextMapPropagator
	spans bool // Config.EnqueueSpan
}

func newTracer(c *Config) *tracer {
	return &tracer{t: tracing.Tracer(c.TracerProvider, "outbox"), p: tracing.Propagator(c.Propagator), spans: c.EnqueueSpan}
}

// TraceHeaders returns the headers that carry the trace context of ctx, as EnqueueTx and
// Prepare capture them (through Config.Propagator, or the global propagator): with the W3C
// propagator, traceparent and, when set, tracestate. It returns nil when ctx carries nothing
// to propagate. Use it to give the SQL producer functions (txoutbox_enqueue and the like) the
// same trace context: pass these headers with the message.
func (c *Client) TraceHeaders(ctx context.Context) map[string][]string {
	h := tracing.Carrier{}
	c.trace.p.Inject(ctx, h)
	if len(h) == 0 {
		return nil
	}
	return h
}

// withTrace returns m with the trace context of ctx added to its headers, and whether
// anything was added. Nothing is added when m's headers carry a valid trace context of their
// own, as the propagator reads it (the caller's trace context is published as given), or when
// ctx carries nothing to propagate. Otherwise the propagator's fields are added, except those
// m already has (in any case): a caller's baggage or tracestate alone does not stop the
// capture, and is kept as given. A traceparent of the caller's that is not valid is not
// replaced: prepareRow refuses it (ErrInvalidTraceparent). m's own Headers map is never
// changed.
func (c *Client) withTrace(ctx context.Context, m *Message) (Message, bool) {
	p := c.trace.p
	fields := p.Fields()
	if len(fields) == 0 {
		return *m, false // nothing to capture: no propagator set
	}
	if tracing.HasAny(m.Headers, fields) && tracing.Extract(p, m.Headers).IsValid() {
		return *m, false // the caller's own
	}
	var h tracing.Carrier
	p.Inject(ctx, lazyCarrier{&h})
	if len(h) == 0 {
		return *m, false
	}
	var merged map[string][]string
	for k, v := range h {
		if tracing.HasAny(m.Headers, []string{k}) {
			continue // the caller's, as given
		}
		if merged == nil {
			merged = make(map[string][]string, len(m.Headers)+len(h))
			maps.Copy(merged, m.Headers)
		}
		merged[k] = v
	}
	if merged == nil {
		return *m, false
	}
	out := *m
	out.Headers = merged
	return out, true
}

// lazyCarrier allocates its map on the first Set: a propagator with nothing to inject costs
// nothing.
type lazyCarrier struct{ h *tracing.Carrier }

func (l lazyCarrier) Get(string) string { return "" }
func (l lazyCarrier) Keys() []string    { return nil }
func (l lazyCarrier) Set(k, v string) {
	if *l.h == nil {
		*l.h = tracing.Carrier{}
	}
	l.h.Set(k, v)
}

// startEnqueue starts the optional enqueue span (Config.EnqueueSpan) of a call with msgs, and
// returns the context the messages capture.
func (c *Client) startEnqueue(ctx context.Context, op string, msgs []Message) (context.Context, trace.Span) {
	if !c.trace.spans || len(msgs) == 0 {
		return ctx, nil
	}
	subject := msgs[0].Subject
	for i := range msgs[1:] {
		if msgs[i+1].Subject != subject {
			subject = ""
			break
		}
	}
	// "{operation name} {destination}", as the messaging conventions name spans: the name is
	// messaging.operation.name (enqueue, prepare), the type is create.
	name := op
	attrs := []attribute.KeyValue{tracing.SystemNATS, tracing.OperationCreate, tracing.OperationName.String(op)}
	if subject != "" {
		name += " " + subject
		attrs = append(attrs, tracing.Destination.String(subject))
	}
	if len(msgs) > 1 {
		attrs = append(attrs, tracing.BatchCount.Int(len(msgs)))
	}
	return c.trace.t.Start(ctx, name, trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attrs...))
}

// endEnqueue ends an enqueue span with the ids written or the error.
func endEnqueue(span trace.Span, ids []uuid.UUID, err error) {
	if span == nil {
		return
	}
	if span.IsRecording() {
		if len(ids) == 1 {
			span.SetAttributes(tracing.MessageID.String(ids[0].String()))
		}
		tracing.Fail(span, err, enqueueErrorType(err))
	}
	span.End()
}

// enqueueErrorType is the error.type of a failed enqueue or prepare: invalid_message for a
// message refused at the door (*MessageError), PostgreSQL's SQLSTATE for a database error
// (40001, 23505, ...), canceled and deadline_exceeded for the context's end; empty (the
// conventions' fallback, the error's type) for the rest.
func enqueueErrorType(err error) string {
	var me *MessageError
	var pe *pgconn.PgError
	switch {
	case errors.As(err, &me):
		return "invalid_message"
	case errors.As(err, &pe):
		return pe.Code
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, context.DeadlineExceeded):
		return "deadline_exceeded"
	}
	return ""
}

// traceNotCaptured records on the caller's span that a message was stored without the trace
// context the propagator gave: it would have made the message invalid (see EnqueueTx).
func traceNotCaptured(ctx context.Context, i int, err error) {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	span.AddEvent("txoutbox: trace context not captured", trace.WithAttributes(
		attribute.Int("txoutbox.message.index", i),
		attribute.String("txoutbox.reason", err.Error()),
	))
}

// traceRow is prepareRow for message i with the trace context of ctx captured into its
// headers. When the captured headers would make a message invalid that is valid without them
// (a header value the wire cannot carry exactly, or the header block or the message over its
// limit), the message is stored without them: tracing never fails an enqueue. The caller's
// span records it (event "txoutbox: trace context not captured").
func (c *Client) traceRow(ctx context.Context, i int, m *Message) (store.NewRow, error) {
	tm, added := c.withTrace(ctx, m)
	if !added {
		return c.prepareRow(i, m)
	}
	row, err := c.prepareRow(i, &tm)
	if err == nil {
		return row, nil
	}
	row, plainErr := c.prepareRow(i, m)
	if plainErr == nil {
		traceNotCaptured(ctx, i, err)
	}
	return row, plainErr
}
