package tracing

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// This test binary never sets a global provider: nil means off.
func TestEnabled(t *testing.T) {
	tp := sdktrace.NewTracerProvider()
	defer func() { _ = tp.Shutdown(context.Background()) }()
	if Enabled(nil) {
		t.Error("Enabled(nil) with no global provider set = true")
	}
	if Enabled(noop.NewTracerProvider()) {
		t.Error("Enabled(noop) = true")
	}
	if !Enabled(tp) {
		t.Error("Enabled(SDK provider) = false")
	}
	//lint:ignore SA1019 the deprecated no-op is still one
	if Enabled(trace.NewNoopTracerProvider()) {
		t.Error("Enabled(trace.NewNoopTracerProvider()) = true")
	}
	// The placeholder given explicitly may be given a delegate later: on.
	if !Enabled(otel.GetTracerProvider()) {
		t.Error("Enabled(the global placeholder given explicitly) = false")
	}
	// Each kind again, after the cache saw another type.
	for i := 0; i < 2; i++ {
		if Enabled(nil) || !Enabled(tp) || Enabled(noop.NewTracerProvider()) {
			t.Errorf("round %d: the cached verdicts differ", i)
		}
	}
}

// Whether tracing is on is the global provider's state now, not when the package started:
// see also internal/testsvc/otelinit, a provider set before this package's init.
func TestEnabledFollowsTheGlobalProvider(t *testing.T) {
	if Enabled(nil) {
		t.Fatal("Enabled(nil) before any global provider = true")
	}
	prev := otel.GetTracerProvider()
	tp := sdktrace.NewTracerProvider()
	defer func() { _ = tp.Shutdown(context.Background()) }()
	otel.SetTracerProvider(tp)
	defer otel.SetTracerProvider(prev) // the placeholder again: delegates, but Enabled(nil) judges the type
	if !Enabled(nil) {
		t.Error("Enabled(nil) after otel.SetTracerProvider = false")
	}
}

func TestCarrier(t *testing.T) {
	c := Carrier{"Traceparent": {"a", "b"}, "x": {}}
	if got := c.Get("traceparent"); got != "a" {
		t.Errorf("Get matches names without regard to case: got %q", got)
	}
	if got := c.Get("x"); got != "" {
		t.Errorf("Get of a name without values = %q", got)
	}
	c.Set("tracestate", "v=1")
	if c["tracestate"][0] != "v=1" || len(c.Keys()) != 3 {
		t.Errorf("after Set: %v", c)
	}
	if !HasAny(map[string][]string{"TRACEPARENT": {"x"}}, []string{"traceparent", "tracestate"}) || HasAny(nil, []string{"traceparent"}) {
		t.Error("HasAny")
	}
}

func TestServer(t *testing.T) {
	for _, tc := range []struct {
		url, addr, port string
	}{
		{"nats://127.0.0.1:4222", "127.0.0.1", "4222"},
		{"tls://nats.example.com:7422", "nats.example.com", "7422"},
		{"nats://[::1]:4222", "::1", "4222"},
		{"nats://127.0.0.1:4222", "127.0.0.1", "4222"}, // again: the cached answer
		{"nats://host", "host", ""},
		{"", "", ""},
	} {
		got := map[string]string{}
		for _, kv := range Server(tc.url) {
			got[string(kv.Key)] = kv.Value.String()
		}
		want := 0
		for _, v := range []string{tc.addr, tc.port} {
			if v != "" {
				want++
			}
		}
		if got["server.address"] != tc.addr || got["server.port"] != tc.port || len(got) != want {
			t.Errorf("Server(%q) = %v, want address %q port %q", tc.url, got, tc.addr, tc.port)
		}
	}
}
