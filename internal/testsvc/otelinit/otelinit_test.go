package otelinit_test

import (
	"testing"

	"github.com/txoutbox/txoutbox/internal/testsvc/otelinit"
	"github.com/txoutbox/txoutbox/internal/tracing"
)

// A global provider set in an init that ran before internal/tracing's counts as set: the hot
// paths' check says tracing is on, and a nil Config.TracerProvider gets that provider's tracer.
func TestGlobalProviderSetBeforeTracingInit(t *testing.T) {
	if !tracing.Enabled(nil) {
		t.Fatal("Enabled(nil) = false with a global provider set in an earlier package's init")
	}
	before := otelinit.Global.Tracers()
	tracing.Tracer(nil, "test")
	if n := otelinit.Global.Tracers() - before; n != 1 {
		t.Errorf("the global provider handed out %d tracers, want 1", n)
	}
}
