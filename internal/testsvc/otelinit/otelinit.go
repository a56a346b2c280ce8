// Package otelinit sets the global OpenTelemetry TracerProvider in its init, as an
// application's telemetry package may: importing it reproduces a provider set before
// internal/tracing is initialised. Go initialises a program's packages in the order of their
// import paths, each once its imports are: this path sorts before
// github.com/txoutbox/txoutbox/internal/tracing, and its imports are a subset of that
// package's, so it is initialised first.
package otelinit

import (
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Provider is the provider set in init: it hands out no-op tracers (it needs no SDK, whose
// packages would be initialised after internal/tracing) and counts them.
type Provider struct {
	noop.TracerProvider
	tracers atomic.Int64
}

// Tracer counts the call.
func (p *Provider) Tracer(name string, opts ...trace.TracerOption) trace.Tracer {
	p.tracers.Add(1)
	return p.TracerProvider.Tracer(name, opts...)
}

// Tracers is how many tracers the provider handed out.
func (p *Provider) Tracers() int64 { return p.tracers.Load() }

// Global is the provider set in init.
var Global = &Provider{}

func init() { otel.SetTracerProvider(Global) }
