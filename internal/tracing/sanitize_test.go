package tracing_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"
	"unsafe"

	"github.com/txoutbox/txoutbox/internal/tracing"
	"github.com/txoutbox/txoutbox/internal/tracing/tracingtest"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

func recorder(t *testing.T) (trace.Tracer, *tracetest.InMemoryExporter) {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp.Tracer("test"), exp
}

// typedError has an ErrorType method, whose text semconv.ErrorType puts in error.type.
type typedError struct{ typ, text string }

func (e typedError) Error() string     { return e.text }
func (e typedError) ErrorType() string { return e.typ }

// hostile are error texts from outside the process that a span cannot carry as they are.
var hostile = map[string]string{
	"invalid UTF-8":      "checker says \xff\xfe",
	"NUL":                "a\x00b",
	"huge":               strings.Repeat("é", 100_000),
	"all of them":        tracingtest.HostileText(),
	"cut inside a rune":  strings.Repeat("x", tracing.MaxText-1) + "é",
	"truncated sequence": "ends in half a character \xe2\x82",
}

// The texts the auditor found raw in spans: the class of them. Whatever an error, a checker
// or a publisher writes, what Fail, String and Name put in a span is valid UTF-8 without NUL
// and at most MaxText bytes, and the OTLP exporter sends it.
func TestSpanTextsFromOutsideAreSafe(t *testing.T) {
	tr, exp := recorder(t)
	for name, text := range hostile {
		_, span := tr.Start(context.Background(), tracing.Name("process", "orders."+text))
		span.SetAttributes(tracing.String(tracing.Destination, text), tracing.String(tracing.MessageID, text))
		span.AddEvent("message", trace.WithAttributes(tracing.String(tracing.ErrorText, text)))
		tracing.Fail(span, errors.New(text), "")
		span.End()
		_, span = tr.Start(context.Background(), "typed "+name)
		tracing.Fail(span, typedError{typ: text, text: text}, "")
		span.End()
		_, span = tr.Start(context.Background(), "given type "+name)
		tracing.Fail(span, fmt.Errorf("wrapped: %w", errors.New(text)), text)
		span.End()
	}
	spans := exp.GetSpans()
	if len(spans) != 3*len(hostile) {
		t.Fatalf("%d spans, want %d", len(spans), 3*len(hostile))
	}
	tracingtest.RequireExportable(t, spans)
}

// The same texts set raw (span.RecordError, attribute.String), as before the fix: the check
// sees every one, and the OTLP exporter refuses the whole batch, the healthy span exported with
// them included. (What the test above rules out.)
func TestRawTextsBreakTheExport(t *testing.T) {
	tr, exp := recorder(t)
	_, healthy := tr.Start(context.Background(), "healthy")
	healthy.End()
	_, span := tr.Start(context.Background(), "raw")
	span.RecordError(errors.New(tracingtest.HostileText()))
	span.SetStatus(codes.Error, tracingtest.HostileText())
	span.SetAttributes(attribute.String("messaging.destination.name", "a\xffb"))
	span.End()
	spans := exp.GetSpans()
	if p := tracingtest.Problems(spans); len(p) != 3 {
		t.Errorf("problems found: %q, want the exception message, the status and the attribute", p)
	}
	col := tracingtest.NewCollector(t)
	err := col.Export(t, spans)
	if err == nil || !strings.Contains(err.Error(), "UTF-8") {
		t.Fatalf("export of raw texts: %v, want the exporter's invalid UTF-8 refusal", err)
	}
	if col.Spans() != 0 {
		t.Fatalf("the collector got %d spans of a refused batch", col.Spans())
	}
}

// Fail records what span.RecordError records (an "exception" event with exception.type named
// as RecordError names it, and exception.message), status error and error.type; a text that is
// safe already arrives unchanged.
func TestFailAsRecordError(t *testing.T) {
	tr, exp := recorder(t)
	errs := []error{errors.New("plain"), fmt.Errorf("wrapped: %w", errors.New("x")), typedError{"custom", "typed\nline two"}, &strconvLike{}}
	for _, err := range errs {
		_, want := tr.Start(context.Background(), "want")
		want.RecordError(err)
		want.SetStatus(codes.Error, err.Error())
		want.End()
		_, got := tr.Start(context.Background(), "got")
		tracing.Fail(got, err, "")
		got.End()
	}
	spans := exp.GetSpans()
	for i := 0; i < len(spans); i += 2 {
		want, got := spans[i], spans[i+1]
		if len(got.Events) != 1 || got.Events[0].Name != semconv.ExceptionEventName {
			t.Fatalf("%v: events %+v, want one exception event", errs[i/2], got.Events)
		}
		if w, g := attribute.NewSet(want.Events[0].Attributes...), attribute.NewSet(got.Events[0].Attributes...); !w.Equals(&g) {
			t.Errorf("%v: exception attributes %v, RecordError's %v", errs[i/2], g.ToSlice(), w.ToSlice())
		}
		if got.Status != want.Status {
			t.Errorf("%v: status %+v, want %+v", errs[i/2], got.Status, want.Status)
		}
		gs := attribute.NewSet(got.Attributes...)
		if v, ok := gs.Value(tracing.ErrorType); !ok || v != semconv.ErrorType(errs[i/2]).Value {
			t.Errorf("%v: error.type %v, want %v", errs[i/2], v, semconv.ErrorType(errs[i/2]).Value)
		}
	}
}

type strconvLike struct{}

func (*strconvLike) Error() string { return "pointer receiver" }

// Text leaves safe text alone (the same string, not a copy) and makes the rest safe.
func TestText(t *testing.T) {
	for _, s := range []string{"", "orders.created", "é€😀", strings.Repeat("x", tracing.MaxText)} {
		got := tracing.Text(s)
		if got != s {
			t.Errorf("Text(%.40q) = %.40q, want it unchanged", s, got)
		} else if unsafe.StringData(got) != unsafe.StringData(s) {
			t.Errorf("Text(%.40q) copied a safe text", s)
		}
	}
	for name, s := range hostile {
		got := tracing.Text(s)
		if !utf8.ValidString(got) || strings.IndexByte(got, 0) >= 0 || len(got) > tracing.MaxText {
			t.Errorf("%s: Text = %.60q, not safe", name, got)
		}
	}
	if got := tracing.Text("a\xffb\x00c"); got != "a\uFFFDb\uFFFDc" {
		t.Errorf("Text replaced the bad bytes with %q", got)
	}
	if got := tracing.Text(strings.Repeat("é", tracing.MaxText)); !strings.HasSuffix(got, "…") || !utf8.ValidString(got) {
		t.Errorf("a cut text ends %q", got[len(got)-8:])
	}
	if got := tracing.Name("process", ""); got != "process" {
		t.Errorf(`Name("process", "") = %q`, got)
	}
	if got := tracing.Name("process", "orders.created"); got != "process orders.created" {
		t.Errorf(`Name("process", "orders.created") = %q`, got)
	}
}
