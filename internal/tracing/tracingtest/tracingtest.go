// Package tracingtest checks, for the tests of the packages that record spans, that every text
// a span carries can be exported: valid UTF-8, no NUL byte, at most tracing.MaxText bytes.
// Only tests import it (it depends on the OpenTelemetry SDK and the OTLP exporter, which the
// libraries do not).
package tracingtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"github.com/txoutbox/txoutbox/internal/tracing"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"
)

// HostileText is an error text as any outside party may write it: an invalid UTF-8 byte, a
// NUL byte, and 200 KB of two-byte characters.
func HostileText() string {
	return "bad \xff byte, NUL \x00 here; " + strings.Repeat("é", 100_000)
}

// Problems lists every text of spans that an OTLP exporter could not encode (invalid UTF-8)
// or that breaks tracing's rules (a NUL byte, more than tracing.MaxText bytes): span names,
// status descriptions, attribute values (strings and string slices) of the spans, of their
// events and of their links, and event names. None: nil.
func Problems(spans tracetest.SpanStubs) []string {
	var out []string
	check := func(span, where, s string) {
		var bad []string
		if !utf8.ValidString(s) {
			bad = append(bad, "invalid UTF-8")
		}
		if strings.IndexByte(s, 0) >= 0 {
			bad = append(bad, "a NUL byte")
		}
		if len(s) > tracing.MaxText {
			bad = append(bad, fmt.Sprintf("%d bytes, over %d", len(s), tracing.MaxText))
		}
		if len(bad) > 0 {
			out = append(out, fmt.Sprintf("span %.60q: %s: %s", span, where, strings.Join(bad, ", ")))
		}
	}
	attrs := func(span, where string, kvs []attribute.KeyValue) {
		for _, kv := range kvs {
			switch kv.Value.Type() {
			case attribute.STRING:
				check(span, where+" attribute "+string(kv.Key), kv.Value.AsString())
			case attribute.STRINGSLICE:
				for i, v := range kv.Value.AsStringSlice() {
					check(span, fmt.Sprintf("%s attribute %s[%d]", where, kv.Key, i), v)
				}
			}
		}
	}
	for _, s := range spans {
		check(s.Name, "name", s.Name)
		check(s.Name, "status description", s.Status.Description)
		attrs(s.Name, "span", s.Attributes)
		for _, e := range s.Events {
			check(s.Name, "event name", e.Name)
			attrs(s.Name, "event "+e.Name, e.Attributes)
		}
		for _, l := range s.Links {
			attrs(s.Name, "link", l.Attributes)
		}
	}
	return out
}

// Collector is a local OTLP/HTTP endpoint that decodes every request it receives.
type Collector struct {
	URL string // the traces endpoint (…/v1/traces)

	mu    sync.Mutex
	spans int // decoded so far
}

// NewCollector starts a collector, stopped by t's cleanup.
func NewCollector(t testing.TB) *Collector {
	t.Helper()
	c := &Collector{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		var req coltracepb.ExportTraceServiceRequest
		if err == nil {
			err = proto.Unmarshal(body, &req)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		n := 0
		for _, rs := range req.ResourceSpans {
			for _, ss := range rs.ScopeSpans {
				n += len(ss.Spans)
			}
		}
		c.mu.Lock()
		c.spans += n
		c.mu.Unlock()
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(srv.Close)
	c.URL = srv.URL + "/v1/traces"
	return c
}

// Spans returns how many spans the collector decoded.
func (c *Collector) Spans() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.spans
}

// Export sends spans in one batch with the OTLP/HTTP exporter (protobuf, as a service
// configured with OTEL_EXPORTER_OTLP_ENDPOINT sends them), without retries, and returns its
// error: the exporter refuses the whole batch when one text in it is not valid UTF-8.
func (c *Collector) Export(t testing.TB, spans tracetest.SpanStubs) error {
	t.Helper()
	ctx := context.Background()
	exp, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(c.URL),
		otlptracehttp.WithRetry(otlptracehttp.RetryConfig{Enabled: false}))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = exp.Shutdown(ctx) }()
	if len(spans) == 0 {
		return errors.New("tracingtest: no spans to export")
	}
	return exp.ExportSpans(ctx, spans.Snapshots())
}

// RequireExportable fails t unless every text of spans follows tracing's rules and the OTLP
// exporter sends them all in one batch, each decoded by a collector.
func RequireExportable(t testing.TB, spans tracetest.SpanStubs) {
	t.Helper()
	if len(spans) == 0 {
		t.Fatal("no spans recorded")
	}
	for _, p := range Problems(spans) {
		t.Error(p)
	}
	col := NewCollector(t)
	if err := col.Export(t, spans); err != nil {
		t.Fatalf("OTLP export of %d spans: %v", len(spans), err)
	}
	if got := col.Spans(); got != len(spans) {
		t.Fatalf("the collector decoded %d spans of %d", got, len(spans))
	}
}
