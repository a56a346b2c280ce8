package tracing

import (
	"context"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
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
