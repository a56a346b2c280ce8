package relaycli

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"io"
	"log/slog"
	"maps"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"
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
	// The URL the exporter posts to: the base URL's with the traces path.
	if on.Fields["exporter"] != "otlp" || on.Fields["protocol"] != "http/protobuf" || on.Fields["endpoint"] != recv.srv.URL+"/v1/traces" ||
		on.Fields["tls"] != false {
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

// `relay run` starts with the OTEL_* variables a platform sets for every process, which the
// specification accepts: OTEL_SDK_DISABLED=1 with tracing off (no variable is read then); and
// with tracing on, an OTEL_EXPORTER_OTLP_INSECURE=false and a CA certificate with an http://
// endpoint (the scheme decides; the exporter, which reads the certificate itself, is given no
// TLS configuration), a general protocol its _TRACES_ form overrides, trailing commas in the
// headers and resource attributes. Each variable not used is one warning.
func TestRunTracingPlatformVariables(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	n.Stream(t, "ORDERS", "orders.>")
	recv := newOTLPReceiver(t)
	cert, _, _ := tlsFiles(t)
	args := []string{"run", "--database-url", db.DSN, "--nats-url", n.URL(), "--schema", db.Schema, "--no-checkback", "--log-format", "json"}
	const unused = "tracing: variable not used"

	off := startRelayEnv(t, "relay-tracing-off", []string{
		"OTEL_SDK_DISABLED=1", "OTEL_TRACES_EXPORTER=", "OTEL_EXPORTER_OTLP_ENDPOINT=", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=",
		"OTEL_EXPORTER_OTLP_INSECURE=maybe", "OTEL_EXPORTER_OTLP_HEADERS=garbage", "OTEL_RESOURCE_ATTRIBUTES=a",
	}, args...)
	off.waitLog(t, "relay started", 20*time.Second)
	if code := off.stop(t, syscall.SIGTERM); code != 0 || len(off.find("tracing on")) != 0 || len(off.find(unused)) != 0 {
		t.Fatalf("OTEL_SDK_DISABLED=1, tracing off: exit %d, want 0, no tracing and no warning:\n%s", code, off.output())
	}

	on := startRelayEnv(t, "relay-tracing-platform", []string{
		"OTEL_SDK_DISABLED=false", "OTEL_TRACES_EXPORTER=", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=",
		"OTEL_EXPORTER_OTLP_ENDPOINT=" + recv.srv.URL, "OTEL_EXPORTER_OTLP_INSECURE=false", "OTEL_EXPORTER_OTLP_CERTIFICATE=" + cert,
		"OTEL_EXPORTER_OTLP_PROTOCOL=http/json", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf",
		"OTEL_EXPORTER_OTLP_HEADERS=X-Tenant=acme,", "OTEL_RESOURCE_ATTRIBUTES=team=a,",
	}, args...)
	line := on.waitLog(t, "tracing on", 20*time.Second)
	if line.Fields["endpoint"] != recv.srv.URL+"/v1/traces" || line.Fields["tls"] != false || line.Fields["protocol"] != "http/protobuf" {
		t.Errorf("tracing on line: %v", line.Fields)
	}
	on.waitLog(t, "relay started", 20*time.Second)
	warned := map[string]int{}
	for _, l := range on.find(unused) {
		v, _ := l.Fields["variable"].(string)
		warned[v]++
	}
	want := map[string]int{"OTEL_EXPORTER_OTLP_INSECURE": 1, "OTEL_EXPORTER_OTLP_CERTIFICATE": 1, "OTEL_EXPORTER_OTLP_PROTOCOL": 1}
	if !maps.Equal(warned, want) {
		t.Errorf("warnings per variable %v, want %v:\n%s", warned, want, on.output())
	}
	if code := on.stop(t, syscall.SIGTERM); code != 0 {
		t.Fatalf("relay exited %d, want 0:\n%s", code, on.output())
	}
}

// Tracing is off unless the OTEL_* variables turn it on, and a value the relay cannot honour
// fails the command, naming the variable. With tracing off, no variable is read: none stops
// the relay, none is logged.
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
		// OTEL_SDK_DISABLED is a boolean: true or false in any case, nothing else.
		{vars: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_SDK_DISABLED": " TRUE "}},
		{vars: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_SDK_DISABLED": "False"}, on: true},
		// Another value is refused only when tracing would be on (the SDK takes it for false):
		// a platform's OTEL_SDK_DISABLED=1 does not stop a relay without tracing.
		{vars: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_SDK_DISABLED": "yes"}, bad: `OTEL_SDK_DISABLED "yes": only true and false are understood`},
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "1"}, bad: `OTEL_SDK_DISABLED "1": only true and false are understood`},
		{vars: map[string]string{"OTEL_SDK_DISABLED": "1"}},
		{vars: map[string]string{"OTEL_SDK_DISABLED": "yes", "OTEL_TRACES_EXPORTER": ","}},
		{vars: map[string]string{"OTEL_SDK_DISABLED": "1", "OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}},
		{vars: map[string]string{"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "zipkin"}},
		// Off, nothing is checked: not the exporter's variables, nor the sampler's, the
		// resource's or the span limits.
		{vars: map[string]string{"OTEL_SDK_DISABLED": "1", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json", "OTEL_EXPORTER_OTLP_INSECURE": "maybe",
			"OTEL_EXPORTER_OTLP_HEADERS": "garbage", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent.pem", "OTEL_RESOURCE_ATTRIBUTES": "a",
			"OTEL_TRACES_SAMPLER": "sometimes", "OTEL_BSP_MAX_QUEUE_SIZE": "0", "OTEL_SPAN_LINK_COUNT_LIMIT": "many", "OTEL_PROPAGATORS": "b3"}},
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
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_PROPAGATORS": "b3"}, on: true}, // the specification's, not the relay's: a warning
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_PROPAGATORS": "b4"}, bad: "OTEL_PROPAGATORS"},
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
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "99999999999999999"}, bad: "OTEL_BSP_SCHEDULE_DELAY"}, // overflows a time.Duration
		// The OTLP exporter's variables are not read without it.
		{vars: map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4319",
			"OTEL_EXPORTER_OTLP_HEADERS": "garbage", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent.pem"}, on: true},
	} {
		var out, logs strings.Builder
		env := &Env{Stdout: &out, Stderr: &out, Getenv: func(k string) string { return tc.vars[k] }}
		tr, err := setupTracing(context.Background(), env, slog.New(slog.NewJSONHandler(&logs, nil)), defaultServiceName)
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
			if logs.Len() > 0 {
				t.Errorf("%v: tracing off, logged %s", tc.vars, logs.String())
			}
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

// OTEL_TRACES_EXPORTER=otlp,console sends every span to both: the collector and stdout. The
// OTLP exporter gets its endpoint from the relay (the variable is not in the process
// environment).
func TestTracesExporterList(t *testing.T) {
	t.Parallel()
	recv := newOTLPReceiver(t)
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
	if !strings.Contains(logs.String(), `"exporter":"otlp,console"`) || !strings.Contains(logs.String(), `"protocol":"http/protobuf"`) ||
		!strings.Contains(logs.String(), `"endpoint":"`+recv.srv.URL+`/v1/traces"`) {
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

// tlsFiles writes a self-signed certificate, its key and a key that is not its as PEM files.
func tlsFiles(t *testing.T) (cert, key, otherKey string) {
	t.Helper()
	dir := t.TempDir()
	write := func(name, typ string, der []byte) string {
		file := filepath.Join(dir, name)
		if err := os.WriteFile(file, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		return file
	}
	newKey := func(name string) (*ecdsa.PrivateKey, string) {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		der, err := x509.MarshalECPrivateKey(k)
		if err != nil {
			t.Fatal(err)
		}
		return k, write(name, "EC PRIVATE KEY", der)
	}
	k, key := newKey("key.pem")
	_, otherKey = newKey("other-key.pem")
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "relay"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	return write("cert.pem", "CERTIFICATE", der), key, otherKey
}

// Every variable of the OTLP exporter is checked the way the exporter parses it, and a value
// it would drop, ignore or misuse is a usage error naming the variable, never showing a
// header's value (nor a URL's password or query); a good one is honoured, and the "tracing
// on" line names the endpoint the exporter was given. Also the resource and span limit
// variables the SDK reads. A variable that is set but not used (a general one its _TRACES_
// form overrides, an _INSECURE one where the endpoint's scheme decides, the certificates
// without TLS) never fails: a value that would be refused, or that contradicts, is one
// warning naming it, and tracing is on.
func TestTracingOTLPVariables(t *testing.T) {
	t.Parallel()
	cert, key, otherKey := tlsFiles(t)
	garbage := filepath.Join(t.TempDir(), "garbage.pem")
	if err := os.WriteFile(garbage, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	const (
		secret = "s3cr3t-t0ken"
		E, TE  = "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
		P, TP  = "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
		I, TI  = "OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_TRACES_INSECURE"
		H, TH  = "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
		T, TT  = "OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
		C, TC  = "OTEL_EXPORTER_OTLP_COMPRESSION", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION"
		CA     = "OTEL_EXPORTER_OTLP_CERTIFICATE"
		TCA    = "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE"
		CC, CK = "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "OTEL_EXPORTER_OTLP_CLIENT_KEY"
		TCC    = "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE"
		TCK    = "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY"
		R      = "OTEL_RESOURCE_ATTRIBUTES"
		LL     = "OTEL_SPAN_LINK_COUNT_LIMIT"
		AVL    = "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"
	)
	const httpDefault, grpcDefault = "https://localhost:4318/v1/traces", "localhost:4317"
	const unused = "tracing: variable not used"
	for _, tc := range []struct {
		vars     []string // name, value, ...; OTEL_TRACES_EXPORTER is otlp
		endpoint string   // logged, when good
		tls      bool
		bad      string // the variable the usage error names
		warn     string // the variable (or variables) the one warning names, when good
		why      string // part of the warning's reason
	}{
		// Endpoints, http/protobuf: a URL with scheme http or https; the general one a base
		// URL, the traces one the URL itself.
		{vars: []string{E, "http://127.0.0.1:4319"}, endpoint: "http://127.0.0.1:4319/v1/traces"},
		{vars: []string{E, "https://collector:4318/base/"}, endpoint: "https://collector:4318/base/v1/traces", tls: true},
		{vars: []string{E, " HTTP://collector:4318 "}, endpoint: "http://collector:4318/v1/traces"},
		{vars: []string{TE, "http://127.0.0.1:4319"}, endpoint: "http://127.0.0.1:4319/"},
		{vars: []string{TE, "https://collector/custom/traces"}, endpoint: "https://collector/custom/traces", tls: true},
		{vars: []string{E, "http://a:1", TE, "http://b:2/t"}, endpoint: "http://b:2/t"},
		{vars: nil, endpoint: httpDefault, tls: true},
		{vars: []string{E, "127.0.0.1:4319"}, bad: E}, // was logged as the endpoint, sent to the default
		{vars: []string{TE, "127.0.0.1:4319"}, bad: TE},
		{vars: []string{E, "localhost:4319"}, bad: E},
		{vars: []string{E, "collector"}, bad: E},
		{vars: []string{E, "ftp://collector:21"}, bad: E},
		{vars: []string{E, "http://"}, bad: E},
		{vars: []string{E, "http://:4318"}, bad: E},
		{vars: []string{E, "http:collector"}, bad: E},
		{vars: []string{E, "http://user:" + secret + "@collector:4318"}, bad: E}, // the exporter drops credentials
		{vars: []string{E, "http://collector:4318/?token=" + secret}, bad: E},    // and a query
		{vars: []string{E, "http://collector:4318/#part"}, bad: E},
		{vars: []string{E, "http://collector:99999"}, bad: E},
		{vars: []string{E, "http://collector:0"}, bad: E},
		{vars: []string{E, "unix:///tmp/otel.sock"}, bad: E},
		// The general one that the traces one overrides is not used: a warning.
		{vars: []string{E, "collector:4318", TE, "http://collector:4318/v1/traces"}, endpoint: "http://collector:4318/v1/traces", warn: E, why: TE + " overrides it"},
		{vars: []string{E, "http://collector:4318", TE, "collector:4318"}, bad: TE},
		// Endpoints, grpc: also host:port and unix sockets; no path.
		{vars: []string{P, "grpc"}, endpoint: grpcDefault, tls: true},
		{vars: []string{P, "grpc", I, "true"}, endpoint: grpcDefault},
		{vars: []string{P, "grpc", E, "http://collector:4317"}, endpoint: "collector:4317"},
		{vars: []string{P, "grpc", E, "https://collector:4317/"}, endpoint: "collector:4317", tls: true},
		{vars: []string{P, "grpc", E, "collector:4317"}, endpoint: "collector:4317", tls: true},
		{vars: []string{P, "grpc", E, "collector:4317", TI, "true"}, endpoint: "collector:4317"},
		{vars: []string{P, "GRPC", TE, "unix:///tmp/otel.sock"}, endpoint: "unix:///tmp/otel.sock"},
		{vars: []string{TP, "grpc", E, "https://[::1]:4317"}, endpoint: "[::1]:4317", tls: true},
		{vars: []string{P, "grpc", E, "127.0.0.1:4317"}, bad: E}, // the exporter cannot read it: write http://127.0.0.1:4317
		{vars: []string{P, "grpc", E, "collector"}, bad: E},
		{vars: []string{P, "grpc", E, "collector:port"}, bad: E},
		{vars: []string{P, "grpc", E, "http://collector:4317/v1/traces"}, bad: E},
		{vars: []string{P, "grpc", TE, "unix://host/otel.sock"}, bad: TE},
		{vars: []string{P, "grpc", E, "dns:///collector:4317"}, bad: E},
		// Protocols: the one used is checked, the general one it overrides a warning.
		{vars: []string{P, "http/json", TP, "grpc"}, endpoint: grpcDefault, tls: true, warn: P, why: TP + " overrides it; on its own it would be refused"},
		{vars: []string{P, "http/json", TP, "http/protobuf"}, endpoint: httpDefault, tls: true, warn: P},
		{vars: []string{P, "grpc", TP, "HTTP/PROTOBUF"}, endpoint: httpDefault, tls: true},
		{vars: []string{P, "grpc", TP, "http/json"}, bad: TP},
		{vars: []string{TP, "thrift"}, bad: TP},
		// INSECURE: true or false where it decides (an endpoint without a scheme); where the
		// scheme decides, one that says otherwise, or is not a boolean, is a warning.
		{vars: []string{I, "true"}, endpoint: "http://localhost:4318/v1/traces"},
		{vars: []string{I, "false", TI, "TRUE"}, endpoint: "http://localhost:4318/v1/traces"},
		{vars: []string{E, "http://collector:4318", I, "true"}, endpoint: "http://collector:4318/v1/traces"},
		{vars: []string{E, "https://collector:4318", TI, "False"}, endpoint: "https://collector:4318/v1/traces", tls: true},
		{vars: []string{I, "maybe"}, bad: I},
		{vars: []string{TI, "1"}, bad: TI},
		{vars: []string{P, "grpc", E, "collector:4317", I, "yes"}, bad: I},
		{vars: []string{I, "maybe", TI, "true"}, endpoint: "http://localhost:4318/v1/traces", warn: I, why: TI + " overrides it"},
		{vars: []string{E, "https://collector:4318", I, "true"}, endpoint: "https://collector:4318/v1/traces", tls: true,
			warn: I, why: E + " has scheme https, which decides: TLS"},
		{vars: []string{E, "http://collector:4318", TI, "false"}, endpoint: "http://collector:4318/v1/traces", warn: TI, why: "which decides: no TLS"},
		{vars: []string{E, "http://collector:4318", I, "false", TI, "false"}, endpoint: "http://collector:4318/v1/traces", warn: TI},
		{vars: []string{E, "http://collector:4318", I, "yes"}, endpoint: "http://collector:4318/v1/traces", warn: I},
		{vars: []string{P, "grpc", E, "unix:/tmp/otel.sock", I, "false"}, endpoint: "unix:/tmp/otel.sock", warn: I, why: "scheme unix"},
		// Headers: key=value pairs, the value percent-encoded; errors never show a value.
		{vars: []string{H, "Authorization=Bearer%20" + secret + ", X-Tenant = acme "}, endpoint: httpDefault, tls: true},
		{vars: []string{TH, "x!y=1,k=%C3%A9"}, endpoint: httpDefault, tls: true},
		{vars: []string{P, "grpc", H, "x-api-key=" + secret + ",trace-bin=%C3%A9"}, endpoint: grpcDefault, tls: true},
		{vars: []string{H, "garbage"}, bad: H},
		{vars: []string{H, secret}, bad: H},
		{vars: []string{TH, "a=b," + secret}, bad: TH},
		{vars: []string{H, "a=b,"}, endpoint: httpDefault, tls: true}, // empty items are skipped, as the exporter drops them
		{vars: []string{H, " , a=b,, c=d , "}, endpoint: httpDefault, tls: true},
		{vars: []string{TH, ","}, endpoint: httpDefault, tls: true},
		{vars: []string{H, secret, TH, "a=b"}, endpoint: httpDefault, tls: true, warn: H, why: TH + " overrides it"},
		{vars: []string{H, "a=b", TH, ",a=b," + secret}, bad: TH},
		{vars: []string{H, "Bad Key=" + secret}, bad: H},
		{vars: []string{H, secret + " x=1"}, bad: H},
		{vars: []string{H, "k=%zz" + secret}, bad: H},
		{vars: []string{H, "k=" + secret + "%0Ax"}, bad: H}, // a line break inside (spaces around are trimmed)
		{vars: []string{P, "grpc", H, "x!y=1"}, bad: H},
		{vars: []string{P, "grpc", TH, "k=%C3%A9" + secret}, bad: TH},
		// Timeouts: whole milliseconds, 0 or more.
		{vars: []string{T, "5000"}, endpoint: httpDefault, tls: true},
		{vars: []string{T, "abc", TT, "0"}, endpoint: httpDefault, tls: true, warn: T},
		{vars: []string{T, "0", TT, "abc"}, bad: TT},
		{vars: []string{TT, "0"}, endpoint: httpDefault, tls: true},
		{vars: []string{T, "abc"}, bad: T},
		{vars: []string{T, "-1"}, bad: T},
		{vars: []string{TT, "1.5"}, bad: TT},
		{vars: []string{TT, "10s"}, bad: TT},
		{vars: []string{T, "99999999999999999"}, bad: T},
		// Compression: gzip or none, in any case.
		{vars: []string{C, "GZIP"}, endpoint: httpDefault, tls: true},
		{vars: []string{C, "gzip", TC, "none"}, endpoint: httpDefault, tls: true},
		{vars: []string{P, "grpc", TC, "gzip"}, endpoint: grpcDefault, tls: true},
		{vars: []string{C, "zstd"}, bad: C},
		{vars: []string{TC, "deflate"}, bad: TC},
		{vars: []string{C, "zstd", TC, "gzip"}, endpoint: httpDefault, tls: true, warn: C},
		// CA certificates: a file with a PEM certificate when TLS uses it; without TLS, not
		// used (the exporter is given no TLS configuration): a warning, the file unread.
		{vars: []string{CA, cert}, endpoint: httpDefault, tls: true},
		{vars: []string{P, "grpc", TCA, cert, E, "https://collector:4317"}, endpoint: "collector:4317", tls: true},
		{vars: []string{CA, "/nonexistent.pem"}, bad: CA},
		{vars: []string{TCA, garbage}, bad: TCA},
		{vars: []string{CA, key}, bad: CA},
		{vars: []string{CA, "/nonexistent.pem", TCA, cert}, endpoint: httpDefault, tls: true, warn: CA, why: TCA + " overrides it"},
		{vars: []string{CA, cert, TCA, garbage}, bad: TCA},
		{vars: []string{CA, cert, E, "http://collector:4318"}, endpoint: "http://collector:4318/v1/traces", warn: CA,
			why: "without TLS (" + E + "'s scheme http), so the certificates are not used"},
		{vars: []string{CA, "/nonexistent.pem", E, "http://collector:4318"}, endpoint: "http://collector:4318/v1/traces", warn: CA},
		{vars: []string{TCA, cert, I, "true"}, endpoint: "http://localhost:4318/v1/traces", warn: TCA, why: I + "=true"},
		{vars: []string{P, "grpc", CA, cert, E, "http://collector:4317"}, endpoint: "collector:4317", warn: CA},
		{vars: []string{P, "grpc", CA, cert, TCA, cert, E, "collector:4317", TI, "true"}, endpoint: "collector:4317", warn: CA + "," + TCA},
		// Client certificates: with their key, a pair that loads, and TLS.
		{vars: []string{CC, cert, CK, key}, endpoint: httpDefault, tls: true},
		{vars: []string{TCC, cert, TCK, key, P, "grpc"}, endpoint: grpcDefault, tls: true},
		{vars: []string{CC, cert}, bad: CC},
		{vars: []string{CK, key}, bad: CK},
		{vars: []string{TCK, key, CC, cert, CK, key}, bad: TCK},
		{vars: []string{CC, cert, CK, otherKey}, bad: CC},
		{vars: []string{TCC, garbage, TCK, key}, bad: TCC},
		{vars: []string{CC, cert, CK, "/nonexistent.pem"}, bad: CK},
		{vars: []string{CC, cert, CK, otherKey, TCC, cert, TCK, key}, endpoint: httpDefault, tls: true, warn: CC + "," + CK},
		{vars: []string{CK, key, TCC, cert, TCK, key}, endpoint: httpDefault, tls: true, warn: CC + "," + CK},
		{vars: []string{CC, cert, CK, key, E, "http://collector:4318"}, endpoint: "http://collector:4318/v1/traces", warn: CC + "," + CK},
		{vars: []string{CC, cert, CK, key, TCC, cert, TCK, key, CA, cert, E, "http://collector:4318"}, endpoint: "http://collector:4318/v1/traces",
			warn: CA + "," + CC + "," + CK + "," + TCC + "," + TCK},
		{vars: []string{CC, cert, E, "http://collector:4318"}, endpoint: "http://collector:4318/v1/traces", warn: CC},
		// The resource: key=value pairs, the value percent-encoded.
		{vars: []string{R, "deployment.environment=prod,team=hello%20world"}, endpoint: httpDefault, tls: true},
		{vars: []string{R, "a"}, bad: R}, // was accepted: the SDK's error is a partial-resource one
		{vars: []string{R, "=b"}, bad: R},
		{vars: []string{R, "a=%zz"}, bad: R},
		{vars: []string{R, "a=b,"}, endpoint: httpDefault, tls: true}, // the SDK drops an empty item
		{vars: []string{R, " , a=b,,c=d "}, endpoint: httpDefault, tls: true},
		// Span limits: whole numbers, negative for no limit; untrimmed, as the SDK reads them.
		{vars: []string{LL, "-1", AVL, "4096"}, endpoint: httpDefault, tls: true},
		{vars: []string{LL, "abc"}, bad: LL},
		{vars: []string{LL, " 5"}, bad: LL},
		{vars: []string{AVL, "4k"}, bad: AVL},
		// The general attribute limits are not read when the span ones are set.
		{vars: []string{AVL, "4k", "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "4096"}, endpoint: httpDefault, tls: true, warn: AVL},
		{vars: []string{"OTEL_ATTRIBUTE_COUNT_LIMIT", "64", "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "x"}, bad: "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT"},
	} {
		vars := map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}
		for i := 0; i < len(tc.vars); i += 2 {
			vars[tc.vars[i]] = tc.vars[i+1]
		}
		var logs strings.Builder
		env := &Env{Stdout: io.Discard, Stderr: io.Discard, Getenv: func(k string) string { return vars[k] }}
		tr, err := setupTracing(context.Background(), env, slog.New(slog.NewJSONHandler(&logs, nil)), defaultServiceName)
		if err != nil && strings.Contains(err.Error(), secret) || strings.Contains(logs.String(), secret) {
			t.Errorf("%v: a header's value, a password or a query shown: %v; log %s", tc.vars, err, logs.String())
		}
		if tc.bad != "" {
			if err == nil || !errors.Is(err, ErrUsage) || !strings.Contains(err.Error(), tc.bad) {
				t.Errorf("%v: err = %v, want a usage error naming %s", tc.vars, err, tc.bad)
			}
			if tr != nil {
				_ = tr.shutdown(context.Background())
			}
			continue
		}
		if err != nil {
			t.Errorf("%v: %v", tc.vars, err)
			continue
		}
		type line struct {
			Msg, Level, Endpoint, Variable, Why string
			TLS                                 bool
		}
		var lines []line
		for _, l := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
			var ll line
			if err := json.Unmarshal([]byte(l), &ll); err != nil {
				t.Errorf("%v: log line %q: %v", tc.vars, l, err)
			}
			lines = append(lines, ll)
		}
		// The warning, if any, once, then the tracing on line.
		var warnings []line
		for _, l := range lines[:len(lines)-1] {
			if l.Msg != unused || l.Level != "WARN" {
				t.Errorf("%v: log line %+v, want only %q warnings before tracing on", tc.vars, l, unused)
			}
			warnings = append(warnings, l)
		}
		switch {
		case tc.warn == "" && len(warnings) > 0:
			t.Errorf("%v: warnings %+v, want none", tc.vars, warnings)
		case tc.warn != "" && (len(warnings) != 1 || warnings[0].Variable != tc.warn || !strings.Contains(warnings[0].Why, tc.why)):
			t.Errorf("%v: warnings %+v, want one naming %s, saying %q", tc.vars, warnings, tc.warn, tc.why)
		}
		if on := lines[len(lines)-1]; on.Msg != "tracing on" || on.Endpoint != tc.endpoint || on.TLS != tc.tls {
			t.Errorf("%v: tracing on line %+v, want endpoint %s, tls %v", tc.vars, on, tc.endpoint, tc.tls)
		}
		if err := tr.shutdown(context.Background()); err != nil {
			t.Errorf("%v: shutdown: %v", tc.vars, err)
		}
	}
}

// The OTLP exporter sends to the URL the relay resolved, with the headers decoded and the
// compression asked for (GZIP, which the exporter alone reads as none), and the headers are
// not logged.
func TestTracingOTLPExportUsesSettings(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3t-t0ken"
	type request struct {
		path, auth, tenant, encoding string
	}
	got := make(chan request, 10)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- request{r.URL.Path, r.Header.Get("Authorization"), r.Header.Get("X-Tenant"), r.Header.Get("Content-Encoding")}
		w.Header().Set("Content-Type", "application/x-protobuf")
		out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
		_, _ = w.Write(out)
	}))
	t.Cleanup(srv.Close)
	vars := map[string]string{
		"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": srv.URL + "/collector/traces",
		"OTEL_EXPORTER_OTLP_HEADERS":         "Authorization=Bearer%20" + secret + ",X-Tenant=acme",
		"OTEL_EXPORTER_OTLP_COMPRESSION":     "GZIP",
		"OTEL_EXPORTER_OTLP_TIMEOUT":         "5000",
	}
	var logs strings.Builder
	env := &Env{Stdout: io.Discard, Stderr: io.Discard, Getenv: func(k string) string { return vars[k] }}
	tr, err := setupTracing(context.Background(), env, slog.New(slog.NewJSONHandler(&logs, nil)), defaultServiceName)
	if err != nil {
		t.Fatal(err)
	}
	_, span := tr.tp.Tracer("t").Start(context.Background(), "s")
	span.End()
	if err := tr.shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-got:
		if want := (request{"/collector/traces", "Bearer " + secret, "acme", "gzip"}); r != want {
			t.Errorf("the collector got %+v, want %+v", r, want)
		}
	default:
		t.Fatal("the collector got nothing")
	}
	if strings.Contains(logs.String(), secret) || !strings.Contains(logs.String(), `"endpoint":"`+srv.URL+`/collector/traces"`) {
		t.Errorf("tracing on line: %s", logs.String())
	}
}

// A CA certificate in OTEL_EXPORTER_OTLP_CERTIFICATE is still honoured: the exporter, which
// reads the file itself, exports to a collector whose certificate it signs. Not parallel: the
// exporter reads the variable from the process environment.
func TestTracingOTLPCertificate(t *testing.T) {
	got := make(chan string, 10)
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- r.URL.Path
		w.Header().Set("Content-Type", "application/x-protobuf")
		out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
		_, _ = w.Write(out)
	}))
	t.Cleanup(srv.Close)
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", ca)
	vars := map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": srv.URL, "OTEL_EXPORTER_OTLP_CERTIFICATE": ca}
	var logs strings.Builder
	env := &Env{Stdout: io.Discard, Stderr: io.Discard, Getenv: func(k string) string { return vars[k] }}
	tr, err := setupTracing(context.Background(), env, slog.New(slog.NewJSONHandler(&logs, nil)), defaultServiceName)
	if err != nil {
		t.Fatal(err)
	}
	_, span := tr.tp.Tracer("t").Start(context.Background(), "s")
	span.End()
	if err := tr.shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case p := <-got:
		if p != "/v1/traces" {
			t.Errorf("the collector got a request for %s", p)
		}
	default:
		t.Fatal("the collector got nothing")
	}
	if !strings.Contains(logs.String(), `"endpoint":"`+srv.URL+`/v1/traces","tls":true`) {
		t.Errorf("tracing on line: %s", logs.String())
	}
}

// With an endpoint without TLS, the certificate variables, which the exporter reads from the
// process environment itself, are not used (a warning): the http exporter, which with them
// would not start ("insecure HTTP endpoint cannot use TLS client configuration"), exports in
// plain text, and the grpc one, which with them would speak TLS to an http:// endpoint, speaks
// HTTP/2 in plain text. Not parallel: the exporter reads the variables from the process
// environment.
func TestTracingOTLPCertificateWithoutTLS(t *testing.T) {
	cert, key, _ := tlsFiles(t)
	tlsVars := map[string]string{
		"OTEL_EXPORTER_OTLP_CERTIFICATE":        cert,
		"OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": cert,
		"OTEL_EXPORTER_OTLP_CLIENT_KEY":         key,
	}
	for k, v := range tlsVars {
		t.Setenv(k, v)
	}
	const warned = `"variable":"OTEL_EXPORTER_OTLP_CERTIFICATE,OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE,OTEL_EXPORTER_OTLP_CLIENT_KEY"`
	setup := func(t *testing.T, vars map[string]string) (*tracing, *strings.Builder) {
		t.Helper()
		for k, v := range tlsVars {
			vars[k] = v
		}
		var logs strings.Builder
		env := &Env{Stdout: io.Discard, Stderr: io.Discard, Getenv: func(k string) string { return vars[k] }}
		tr, err := setupTracing(context.Background(), env, slog.New(slog.NewJSONHandler(&logs, nil)), defaultServiceName)
		if err != nil {
			t.Fatal(err)
		}
		if n := strings.Count(logs.String(), `"msg":"tracing: variable not used"`); n != 1 || !strings.Contains(logs.String(), warned) ||
			!strings.Contains(logs.String(), `"tls":false`) {
			t.Errorf("%d warnings, want one naming the three variables, and tls false: %s", n, logs.String())
		}
		return tr, &logs
	}

	t.Run("http", func(t *testing.T) {
		recv := newOTLPReceiver(t)
		tr, _ := setup(t, map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": recv.srv.URL})
		_, span := tr.tp.Tracer("t").Start(context.Background(), "plain")
		span.End()
		if err := tr.shutdown(context.Background()); err != nil {
			t.Fatal(err)
		}
		if got := recv.received(); len(got) != 1 || got[0].Name != "plain" {
			t.Errorf("the collector got %+v, want the span", got)
		}
	})

	t.Run("grpc", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ln.Close() })
		first := make(chan []byte, 1)
		go func() {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
			b := make([]byte, 24)
			n, _ := io.ReadFull(c, b)
			first <- b[:n]
		}()
		tr, _ := setup(t, map[string]string{"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://" + ln.Addr().String(),
			"OTEL_EXPORTER_OTLP_TIMEOUT": "1000"})
		_, span := tr.tp.Tracer("t").Start(context.Background(), "plain")
		span.End()
		_ = tr.shutdown(context.Background()) // the listener is no collector
		select {
		case b := <-first:
			if !bytes.HasPrefix(b, []byte("PRI * HTTP/2.0")) {
				t.Errorf("the grpc exporter sent %q, want the HTTP/2 preface in plain text (0x16 starts a TLS handshake)", b)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the grpc exporter never connected")
		}
	})
}

// OTEL_PROPAGATORS: the relay's propagators (tracecontext, baggage) in any case and order; the
// specification's others (b3, b3multi, jaeger, xray, ottrace), which platforms may set for
// every process, left out with one warning each; a name the specification does not know
// refused.
func TestTracingPropagators(t *testing.T) {
	t.Parallel()
	var warned []string
	warn := func(variable, why string) { warned = append(warned, variable+": "+why) }
	p, err := propagators(" TraceContext ,b3, Baggage,xray", warn)
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(slices.Sorted(slices.Values(p.Fields())), ","); got != "baggage,traceparent,tracestate" {
		t.Errorf("fields %q, want baggage, traceparent and tracestate", got)
	}
	if len(warned) != 2 || !strings.Contains(warned[0], "OTEL_PROPAGATORS: the relay has no b3 propagator") || !strings.Contains(warned[1], "no xray propagator") {
		t.Errorf("warnings %q, want one for b3 and one for xray", warned)
	}
	warned = nil
	if _, err := propagators("b3", warn); err != nil || len(warned) != 1 || !strings.Contains(warned[0], "no trace context is read or written") {
		t.Errorf("b3 alone: %v, warnings %q; want one saying no trace context is propagated", err, warned)
	}
	if _, err := propagators("tracecontext,b4", warn); err == nil || !strings.Contains(err.Error(), `invalid OTEL_PROPAGATORS: "b4" is not a propagator`) {
		t.Errorf("b4: %v, want a usage error naming the variable", err)
	}
}
