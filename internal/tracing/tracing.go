// Package tracing holds what txoutbox's packages share for OpenTelemetry traces: the tracer
// and propagator a Config resolves to, a carrier over NATS-style headers, and the span
// attributes (the messaging semantic conventions plus txoutbox's own).
//
// The libraries depend on the OpenTelemetry API only: with no TracerProvider or propagator
// configured they use the global ones (otel.GetTracerProvider, otel.GetTextMapPropagator),
// which do nothing until the application sets them.
//
// Every text a span gets from outside the process (an error's text, a checker's reply, a
// subject, a header value) goes through Text first, by String, Name, Fail and ErrorTypeOf:
// OTLP encodes span names, attribute values and status descriptions as protobuf strings,
// which must be valid UTF-8, and an exporter that meets one that is not fails the whole batch
// it belongs to, the healthy spans exported with it included.
package tracing

import (
	"context"
	"fmt"
	"net/url"
	"reflect"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/txoutbox/txoutbox/internal/safetext"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// ScopePrefix prefixes the instrumentation scope of each package's tracer
// ("github.com/txoutbox/txoutbox/relay", …).
const ScopePrefix = "github.com/txoutbox/txoutbox/"

// Tracer returns the tracer package pkg uses: tp's, or the global provider's when tp is nil.
func Tracer(tp trace.TracerProvider, pkg string) trace.Tracer {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(ScopePrefix+pkg, trace.WithSchemaURL(semconv.SchemaURL))
}

// Enabled reports whether tp (nil: the global provider) can record spans: false for nil
// while the application has set no global provider, and for a noop provider. The hot paths
// (a span per message) check it first, so that tracing off costs them nothing but this check.
//
// The global provider is judged by its type, not against a value captured at start: before
// the application sets one, otel.GetTracerProvider returns OpenTelemetry's delegating
// placeholder (a *tracerProvider of go.opentelemetry.io/otel/internal/global), which records
// nothing; once one is set, it returns that one. So a provider set in another package's init,
// before this package's, counts as set.
//
// A placeholder given explicitly (a Config.TracerProvider set to otel.GetTracerProvider()
// before the application set one) counts as enabled: it starts recording once a provider is
// set, and only the global lookup can tell that it has not been.
func Enabled(tp trace.TracerProvider) bool {
	global := tp == nil
	if global {
		tp = otel.GetTracerProvider()
	}
	if _, isNoop := tp.(noop.TracerProvider); isNoop {
		return false
	}
	k := kindOf(reflect.TypeOf(tp))
	return k == kindOther || (k == kindPlaceholder && !global)
}

// Provider kinds, by type.
const (
	kindOther       = iota // a provider that may record (the SDK's, another implementation)
	kindPlaceholder        // the global placeholder: records nothing until a provider is set
	kindNoop               // the trace package's own no-op (trace.NewNoopTracerProvider)
)

const (
	globalPkg = "go.opentelemetry.io/otel/internal/global"
	tracePkg  = "go.opentelemetry.io/otel/trace"
)

// kindVerdict caches kindOf's last answer: a process sees one or two provider types, and the
// answer for a type never changes.
type kindVerdict struct {
	t    reflect.Type
	kind int
}

var lastKind atomic.Pointer[kindVerdict]

// kindOf tells the placeholder and the no-op apart from the providers that may record.
func kindOf(t reflect.Type) int {
	if v := lastKind.Load(); v != nil && v.t == t {
		return v.kind
	}
	e := t
	if e.Kind() == reflect.Pointer {
		e = e.Elem()
	}
	k := kindOther
	switch {
	case e.PkgPath() == globalPkg && e.Name() == "tracerProvider":
		k = kindPlaceholder
	case e.PkgPath() == tracePkg && e.Name() == "noopTracerProvider":
		k = kindNoop
	}
	lastKind.Store(&kindVerdict{t: t, kind: k})
	return k
}

// Propagator returns p, or the global propagator when p is nil.
func Propagator(p propagation.TextMapPropagator) propagation.TextMapPropagator {
	if p == nil {
		return otel.GetTextMapPropagator()
	}
	return p
}

// Carrier adapts headers (nats.Header, micro.Headers, outbox.Message.Headers: all
// map[string][]string, names case-sensitive) to a propagation.TextMapCarrier. Get looks a
// name up as it is, then without regard to case (W3C field names are case-insensitive); Set
// sets the name as the propagator gives it (lower case for W3C).
type Carrier map[string][]string

// Get returns the first value of key.
func (c Carrier) Get(key string) string {
	if v, ok := c[key]; ok {
		if len(v) > 0 {
			return v[0]
		}
		return ""
	}
	for k, v := range c {
		if len(v) > 0 && strings.EqualFold(k, key) {
			return v[0]
		}
	}
	return ""
}

// Set sets key to value.
func (c Carrier) Set(key, value string) { c[key] = []string{value} }

// Keys lists the header names.
func (c Carrier) Keys() []string {
	out := make([]string, 0, len(c))
	for k := range c {
		out = append(out, k)
	}
	return out
}

// HasAny reports whether h has a header named like one of fields, without regard to case.
func HasAny(h map[string][]string, fields []string) bool {
	for k := range h {
		for _, f := range fields {
			if strings.EqualFold(k, f) {
				return true
			}
		}
	}
	return false
}

// Extract returns the span context p finds in headers h (invalid when there is none).
func Extract(p propagation.TextMapPropagator, h map[string][]string) trace.SpanContext {
	if len(h) == 0 {
		return trace.SpanContext{}
	}
	return trace.SpanContextFromContext(p.Extract(context.Background(), Carrier(h)))
}

// ExtractContext returns ctx with what p finds in headers h (the remote span context, and
// whatever else p carries, such as baggage).
func ExtractContext(ctx context.Context, p propagation.TextMapPropagator, h map[string][]string) context.Context {
	if len(h) == 0 {
		return ctx
	}
	return p.Extract(ctx, Carrier(h))
}

// Server returns the server.address and server.port attributes of the NATS server at rawURL
// (nats.Conn.ConnectedUrl), or nil when there is none (not connected). The last answer is
// cached: a connection's server changes only when it reconnects elsewhere.
func Server(rawURL string) []attribute.KeyValue {
	if rawURL == "" {
		return nil
	}
	if v := lastServer.Load(); v != nil && v.url == rawURL {
		return v.attrs
	}
	var attrs []attribute.KeyValue
	if u, err := url.Parse(rawURL); err == nil && u.Hostname() != "" {
		attrs = append(attrs, String(ServerAddress, u.Hostname()))
		if p, err := strconv.Atoi(u.Port()); err == nil {
			attrs = append(attrs, ServerPort.Int(p))
		}
	}
	lastServer.Store(&serverAttrs{url: rawURL, attrs: attrs})
	return attrs
}

type serverAttrs struct {
	url   string
	attrs []attribute.KeyValue
}

var lastServer atomic.Pointer[serverAttrs]

// CreationLink is the link a send or process span has to the message's creation context
// (the producer's span it captured), as the messaging conventions ask besides the parent.
func CreationLink(sc trace.SpanContext) trace.Link {
	return trace.Link{SpanContext: sc}
}

// Attributes. messaging.* are OpenTelemetry's messaging semantic conventions; txoutbox.* are
// this project's.
var (
	// SystemNATS is messaging.system=nats.
	SystemNATS = semconv.MessagingSystemKey.String("nats")

	OperationCreate  = semconv.MessagingOperationTypeCreate
	OperationSend    = semconv.MessagingOperationTypeSend
	OperationProcess = semconv.MessagingOperationTypeProcess

	OperationName  = semconv.MessagingOperationNameKey
	Destination    = semconv.MessagingDestinationNameKey
	MessageID      = semconv.MessagingMessageIDKey
	BodySize       = semconv.MessagingMessageBodySizeKey
	BatchCount     = semconv.MessagingBatchMessageCountKey
	ConsumerGroup  = semconv.MessagingConsumerGroupNameKey
	ErrorType      = semconv.ErrorTypeKey
	ServerAddress  = semconv.ServerAddressKey
	ServerPort     = semconv.ServerPortKey
	StreamName     = attribute.Key("txoutbox.stream.name")
	StreamSequence = attribute.Key("txoutbox.stream.sequence")
	Duplicate      = attribute.Key("txoutbox.duplicate")
	Attempt        = attribute.Key("txoutbox.attempt")
	Delivery       = attribute.Key("txoutbox.delivery")
	Outcome        = attribute.Key("txoutbox.outcome")
	// ErrorText is an error's text where no exception event carries it (an event about one
	// message of a batch span).
	ErrorText      = attribute.Key("txoutbox.error.message")
	Group          = attribute.Key("txoutbox.group")
	CheckNumber    = attribute.Key("txoutbox.check")
	OutcomeApplied = "applied"
	OutcomeDup     = "duplicate"
	OutcomeRetried = "retried"
	OutcomeDead    = "dead_lettered"
	OutcomePutBack = "put_back"
	OutcomeWaiting = "waiting"
)

// MaxText bounds, in bytes, every text a span gets from outside the process: an attribute
// value, a status description, an event attribute, a span name. It is the bound of the
// error texts the database stores (last_error), so a span says what the row says.
const MaxText = 1024

// Text returns s, which may come from outside the process, as a span can carry it and OTLP
// can encode it: valid UTF-8 (invalid bytes become U+FFFD), no NUL byte (U+FFFD too), at most
// MaxText bytes, cut on a character boundary and ending with "…" when cut. Text that already
// is so comes back as it is, without a copy.
func Text(s string) string { return safetext.Text(s, MaxText) }

// String is the attribute k=v with v, which may come from outside the process, made safe by
// Text.
func String(k attribute.Key, v string) attribute.KeyValue { return k.String(Text(v)) }

// Name is the span name "{operation} {destination}" (destination may come from outside the
// process: it is made safe by Text), or operation alone when destination is empty.
func Name(operation, destination string) string {
	if destination == "" {
		return operation
	}
	return Text(operation + " " + destination)
}

// Fail marks span as failed with err, when err is not nil: an exception event (err's type and
// text), status error with err's text, and error.type typ, a low-cardinality class of the
// failure; with typ empty, what the conventions fall back to (semconv.ErrorType: err's
// ErrorType method, else its concrete type). err's text goes through Text: it may quote a
// handler, a checker, the database or the broker.
//
// The exception event is the one span.RecordError would add (same name and attributes), made
// here so that its exception.message is the safe text too.
func Fail(span trace.Span, err error, typ string) {
	if err == nil || !span.IsRecording() {
		return
	}
	msg := Text(err.Error())
	span.AddEvent(semconv.ExceptionEventName, trace.WithAttributes(
		semconv.ExceptionType(Text(typeName(err))),
		semconv.ExceptionMessage(msg),
	))
	span.SetStatus(codes.Error, msg)
	span.SetAttributes(ErrorTypeOf(err, typ))
}

// typeName is err's type as span.RecordError names it in exception.type.
func typeName(err error) string {
	t := reflect.TypeOf(err)
	if t.PkgPath() == "" && t.Name() == "" {
		return t.String()
	}
	return fmt.Sprintf("%s.%s", t.PkgPath(), t.Name())
}

// ErrorTypeOf is the error.type attribute of err: typ, or with typ empty semconv.ErrorType's
// fallback (err's ErrorType method, else its concrete type), made safe by Text (an ErrorType
// method may return anything).
func ErrorTypeOf(err error, typ string) attribute.KeyValue {
	if typ != "" {
		return String(ErrorType, typ)
	}
	return String(ErrorType, semconv.ErrorType(err).Value.AsString())
}
