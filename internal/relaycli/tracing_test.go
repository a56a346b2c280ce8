package relaycli

import (
	"context"
	"encoding/hex"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// otlpReceiver is an OTLP/HTTP trace receiver: it records the spans exported to it.
type otlpReceiver struct {
	mu    sync.Mutex
	spans []receivedSpan
	srv   *httptest.Server
}

type receivedSpan struct {
	Service, Name, TraceID, ParentID string
	Attrs                            map[string]string
}

func newOTLPReceiver(t *testing.T) *otlpReceiver {
	r := &otlpReceiver{}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path != "/v1/traces" {
			http.NotFound(w, req)
			return
		}
		body, err := io.ReadAll(req.Body)
		var msg collectortrace.ExportTraceServiceRequest
		if err == nil {
			err = proto.Unmarshal(body, &msg)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		r.mu.Lock()
		for _, rs := range msg.ResourceSpans {
			service := ""
			for _, a := range rs.Resource.GetAttributes() {
				if a.Key == "service.name" {
					service = a.Value.GetStringValue()
				}
			}
			for _, ss := range rs.ScopeSpans {
				for _, s := range ss.Spans {
					attrs := map[string]string{}
					for _, a := range s.Attributes {
						attrs[a.Key] = a.Value.GetStringValue()
					}
					r.spans = append(r.spans, receivedSpan{Service: service, Name: s.Name, TraceID: hex.EncodeToString(s.TraceId),
						ParentID: hex.EncodeToString(s.ParentSpanId), Attrs: attrs})
				}
			}
		}
		r.mu.Unlock()
		w.Header().Set("Content-Type", "application/x-protobuf")
		out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
		_, _ = w.Write(out)
	}))
	t.Cleanup(r.srv.Close)
	return r
}

func (r *otlpReceiver) received() []receivedSpan {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]receivedSpan(nil), r.spans...)
}

// `relay run` with OTEL_EXPORTER_OTLP_ENDPOINT set exports a publish span per message to the
// collector, a child of the producer's span the message captured, under the service name
// OTEL_SERVICE_NAME gives; the spans still buffered are flushed when it stops.
func TestRunExportsPublishSpansOverOTLP(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	n.Stream(t, "ORDERS", "orders.>")
	recv := newOTLPReceiver(t)

	ctx := context.Background()
	tp := sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = tp.Shutdown(ctx) })
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema, Propagator: propagation.TraceContext{}})
	if err != nil {
		t.Fatal(err)
	}
	rctx, req := tp.Tracer("app").Start(ctx, "POST /orders")
	req.End()
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := client.EnqueueTx(rctx, tx, outbox.Message{Subject: "orders.created", Payload: []byte("x")})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}

	p := startRelayEnv(t, "relay-traced", []string{
		"OTEL_EXPORTER_OTLP_ENDPOINT=" + recv.srv.URL, "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf",
		"OTEL_SERVICE_NAME=relay-under-test", "OTEL_TRACES_EXPORTER=", "OTEL_SDK_DISABLED=",
		"OTEL_TRACES_SAMPLER=parentbased_always_on", "OTEL_BSP_SCHEDULE_DELAY=60000", // exported at exit, not before
	}, "run", "--database-url", db.DSN, "--nats-url", n.URL(), "--schema", db.Schema, "--no-checkback", "--log-format", "json")
	on := p.waitLog(t, "tracing on", 10*time.Second)
	if on.Fields["exporter"] != "otlp" || on.Fields["protocol"] != "http/protobuf" || on.Fields["endpoint"] != recv.srv.URL {
		t.Errorf("tracing on line: %v", on.Fields)
	}
	testsvc.Eventually(t, 20*time.Second, "the message published", func() bool {
		return len(testsvc.StreamMsgs(t, n.JS, "ORDERS")) == 1
	})
	if code := p.stop(t, syscall.SIGTERM); code != 0 {
		t.Fatalf("relay exited %d, want 0:\n%s", code, p.output())
	}
	var publish *receivedSpan
	for _, s := range recv.received() {
		if s.Name == "publish orders.created" {
			publish = &s
		}
	}
	if publish == nil {
		t.Fatalf("the collector got no publish span; got %v", recv.received())
	}
	want := req.SpanContext()
	if publish.TraceID != want.TraceID().String() || publish.ParentID != want.SpanID().String() || publish.Service != "relay-under-test" ||
		publish.Attrs["messaging.system"] != "nats" || publish.Attrs["txoutbox.stream.name"] != "ORDERS" {
		t.Errorf("publish span %+v, want a child of %s/%s from service relay-under-test", *publish, want.TraceID(), want.SpanID())
	}
}

// Tracing is off unless the OTEL_* variables turn it on, and a value the relay cannot honour
// fails the command, naming the variable.
func TestTracingSettings(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		vars map[string]string
		on   bool
		bad  string
	}{
		{vars: nil},
		{vars: map[string]string{"OTEL_SERVICE_NAME": "x"}},
		{vars: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_TRACES_EXPORTER": "none"}},
		{vars: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_SDK_DISABLED": "true"}},
		{vars: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}, on: true},
		{vars: map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1/v1/traces"}, on: true},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, on: true},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console"}, on: true},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, bad: "OTEL_TRACES_EXPORTER"},
		// The specification's comma-separated list.
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "otlp,console"}, on: true},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": " Console , console,"}, on: true},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "none,none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": ",", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}, on: true},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": ","}},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "otlp,zipkin"}, bad: "zipkin"},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "otlp,none"}, bad: "OTEL_TRACES_EXPORTER"},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console,otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, bad: "OTEL_EXPORTER_OTLP_PROTOCOL"},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, bad: "OTEL_EXPORTER_OTLP_PROTOCOL"},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_PROPAGATORS": "b3"}, bad: "OTEL_PROPAGATORS"},
		// The sampler and the batch span processor: the SDK would ignore a bad value.
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "sometimes"}, bad: "OTEL_TRACES_SAMPLER"},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "jaeger_remote"}, bad: "OTEL_TRACES_SAMPLER"},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"}, bad: "OTEL_TRACES_SAMPLER_ARG"},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "-0.1"}, bad: "OTEL_TRACES_SAMPLER_ARG"},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "ten%"}, bad: "OTEL_TRACES_SAMPLER_ARG"},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "NaN"}, bad: "OTEL_TRACES_SAMPLER_ARG"},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "5s"}, bad: "OTEL_BSP_SCHEDULE_DELAY"},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_EXPORT_TIMEOUT": "-1"}, bad: "OTEL_BSP_EXPORT_TIMEOUT"},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_MAX_QUEUE_SIZE": "0"}, bad: "OTEL_BSP_MAX_QUEUE_SIZE"},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "lots"}, bad: "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_MAX_QUEUE_SIZE": "100", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "200"}, bad: "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "PARENTBASED_TRACEIDRATIO", "OTEL_TRACES_SAMPLER_ARG": "1",
			"OTEL_BSP_SCHEDULE_DELAY": "0", "OTEL_BSP_EXPORT_TIMEOUT": "1000", "OTEL_BSP_MAX_QUEUE_SIZE": "100", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "100"}, on: true},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "always_on", "OTEL_TRACES_SAMPLER_ARG": "ignored"}, on: true},
	} {
		var out strings.Builder
		env := &Env{Stdout: &out, Stderr: &out, Getenv: func(k string) string { return tc.vars[k] }}
		tr, err := setupTracing(context.Background(), env, testsvc.Logger(), defaultServiceName)
		switch {
		case tc.bad != "":
			if err == nil || !strings.Contains(err.Error(), tc.bad) {
				t.Errorf("%v: err = %v, want a usage error naming %s", tc.vars, err, tc.bad)
			}
			continue
		case err != nil:
			t.Errorf("%v: %v", tc.vars, err)
			continue
		}
		if on := tr.tp != nil; on != tc.on {
			t.Errorf("%v: tracing on = %v, want %v", tc.vars, on, tc.on)
		}
		if !tc.on {
			continue
		}
		if !strings.Contains(strings.ToLower(tc.vars["OTEL_TRACES_EXPORTER"]), "console") {
			// Nothing was traced: the shutdown has nothing to send to the absent collector.
			if err := tr.shutdown(context.Background()); err != nil {
				t.Errorf("%v: shutdown: %v", tc.vars, err)
			}
			continue
		}
		_, span := tr.tp.Tracer("t").Start(context.Background(), "s")
		if !span.SpanContext().IsSampled() {
			t.Errorf("%v: root span not sampled", tc.vars)
		}
		span.End()
		if err := tr.shutdown(context.Background()); err != nil || !strings.Contains(out.String(), `"Name":"s"`) {
			t.Errorf("console exporter: %v, wrote %q", err, out.String())
		}
	}
}

// OTEL_TRACES_EXPORTER=otlp,console sends every span to both: the collector and stdout. Not
// parallel: the OTLP exporter reads its endpoint from the process environment.
func TestTracesExporterList(t *testing.T) {
	recv := newOTLPReceiver(t)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", recv.srv.URL)
	vars := map[string]string{"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_EXPORTER_OTLP_ENDPOINT": recv.srv.URL}
	var out, logs strings.Builder
	env := &Env{Stdout: &out, Stderr: &out, Getenv: func(k string) string { return vars[k] }}
	tr, err := setupTracing(context.Background(), env, slog.New(slog.NewJSONHandler(&logs, nil)), defaultServiceName)
	if err != nil {
		t.Fatal(err)
	}
	_, span := tr.tp.Tracer("t").Start(context.Background(), "both")
	span.End()
	if err := tr.shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), `"Name":"both"`) {
		t.Errorf("console exporter wrote %q", out.String())
	}
	got := recv.received()
	if len(got) != 1 || got[0].Name != "both" {
		t.Errorf("the collector got %+v, want the span", got)
	}
	if !strings.Contains(logs.String(), `"exporter":"otlp,console"`) || !strings.Contains(logs.String(), `"protocol":"http/protobuf"`) {
		t.Errorf("tracing on line: %s", logs.String())
	}
}

// OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG decide what the relay samples: the relay
// passes the sampler it parsed to the SDK (a root span, and a span whose remote parent was
// sampled or not).
func TestTracingSampler(t *testing.T) {
	t.Parallel()
	sampledParent := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{1}, TraceFlags: trace.FlagsSampled, Remote: true})
	unsampledParent := sampledParent.WithTraceFlags(0)
	for _, tc := range []struct {
		sampler, arg             string
		root, sampled, unsampled bool
	}{
		{"", "", true, true, false}, // parentbased_always_on
		{"parentbased_always_on", "", true, true, false},
		{"always_on", "", true, true, true},
		{"always_off", "", false, false, false},
		{"parentbased_always_off", "", false, true, false},
		{"traceidratio", "0", false, false, false},
		{"traceidratio", "", true, true, true}, // the argument defaults to 1.0
		{"parentbased_traceidratio", "0", false, true, false},
		{"Parentbased_TraceIDRatio", "1", true, true, false},
	} {
		var out strings.Builder
		vars := map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": tc.sampler, "OTEL_TRACES_SAMPLER_ARG": tc.arg}
		env := &Env{Stdout: &out, Stderr: &out, Getenv: func(k string) string { return vars[k] }}
		tr, err := setupTracing(context.Background(), env, testsvc.Logger(), defaultServiceName)
		if err != nil {
			t.Fatalf("%s %q: %v", tc.sampler, tc.arg, err)
		}
		sampled := func(parent trace.SpanContext) bool {
			ctx := context.Background()
			if parent.IsValid() {
				ctx = trace.ContextWithRemoteSpanContext(ctx, parent)
			}
			_, span := tr.tp.Tracer("t").Start(ctx, "s")
			defer span.End()
			return span.SpanContext().IsSampled()
		}
		if got := [3]bool{sampled(trace.SpanContext{}), sampled(sampledParent), sampled(unsampledParent)}; got != [3]bool{tc.root, tc.sampled, tc.unsampled} {
			t.Errorf("%s %q: root, sampled parent, unsampled parent sampled = %v, want %v", tc.sampler, tc.arg, got, [3]bool{tc.root, tc.sampled, tc.unsampled})
		}
		if err := tr.shutdown(context.Background()); err != nil {
			t.Errorf("%s: shutdown: %v", tc.sampler, err)
		}
	}
}
