package relaycli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/txoutbox/txoutbox/internal/redact"
)

// tracing is what setupTracing configured: the tracer provider and propagator to give the
// relay and the check-back (nil when tracing is off), and how to flush and stop it.
type tracing struct {
	tp       trace.TracerProvider
	prop     propagation.TextMapPropagator
	shutdown func(context.Context) error
}

// tracingShutdownTimeout bounds the flush of the spans still buffered at exit.
const tracingShutdownTimeout = 5 * time.Second

// The environment variables setupTracing reads itself; the exporter and the SDK read the rest
// of the standard OTEL_* variables (OTEL_EXPORTER_OTLP_HEADERS, _CERTIFICATE, _TIMEOUT,
// _COMPRESSION, OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG, OTEL_BSP_*,
// OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME) from the process environment.
const (
	envSDKDisabled      = "OTEL_SDK_DISABLED"
	envTracesExporter   = "OTEL_TRACES_EXPORTER"
	envEndpoint         = "OTEL_EXPORTER_OTLP_ENDPOINT"
	envTracesEndpoint   = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
	envProtocol         = "OTEL_EXPORTER_OTLP_PROTOCOL"
	envTracesProtocol   = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	envPropagators      = "OTEL_PROPAGATORS"
	defaultServiceName  = "txoutbox-relay"
	defaultOTLPProtocol = "http/protobuf"
)

// setupTracing configures OpenTelemetry tracing from the standard OTEL_* environment
// variables. It is off (a zero tracing, no-op shutdown) unless OTEL_TRACES_EXPORTER names an
// exporter (otlp or console) or an OTLP endpoint is set (OTEL_EXPORTER_OTLP_ENDPOINT or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, with OTEL_TRACES_EXPORTER unset or otlp), and always off
// with OTEL_SDK_DISABLED=true. A value it cannot honour is a usage error naming the variable.
func setupTracing(ctx context.Context, env *Env, log *slog.Logger, service string) (*tracing, error) {
	off := &tracing{shutdown: func(context.Context) error { return nil }}
	get := func(k string) string { return strings.TrimSpace(env.Getenv(k)) }
	if strings.EqualFold(get(envSDKDisabled), "true") {
		return off, nil
	}
	exporter := strings.ToLower(get(envTracesExporter))
	endpoint := get(envTracesEndpoint)
	if endpoint == "" {
		endpoint = get(envEndpoint)
	}
	switch exporter {
	case "":
		if endpoint == "" {
			return off, nil
		}
		exporter = "otlp"
	case "none":
		return off, nil
	case "otlp", "console":
	default:
		return nil, usageErr("invalid %s %q: the relay exports traces with otlp or console (or none)", envTracesExporter, exporter)
	}
	prop, err := propagators(get(envPropagators))
	if err != nil {
		return nil, err
	}

	var exp sdktrace.SpanExporter
	protocol := ""
	switch exporter {
	case "console":
		exp, err = stdouttrace.New(stdouttrace.WithWriter(env.Stdout))
	case "otlp":
		protocol = strings.ToLower(get(envTracesProtocol))
		if protocol == "" {
			protocol = strings.ToLower(get(envProtocol))
		}
		if protocol == "" {
			protocol = defaultOTLPProtocol
		}
		switch protocol {
		case "http/protobuf":
			// The exporter reads the endpoint, headers, TLS settings, timeout and compression
			// from the OTEL_EXPORTER_OTLP_* variables itself.
			exp, err = otlptracehttp.New(ctx)
		case "grpc":
			exp, err = otlptracegrpc.New(ctx)
		default:
			name := envProtocol
			if get(envTracesProtocol) != "" {
				name = envTracesProtocol
			}
			return nil, usageErr("invalid %s %q: use http/protobuf or grpc", name, protocol)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("tracing: %s exporter: %w", exporter, err)
	}
	// OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (WithFromEnv, applied last) override the
	// defaults. No process detector: its command line would carry --database-url.
	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName(service), semconv.ServiceVersion(ReadBuildInfo().Version)),
		resource.WithTelemetrySDK(),
		resource.WithHost(),
		resource.WithFromEnv(),
	)
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		_ = exp.Shutdown(ctx)
		return nil, usageErr("invalid OTEL_RESOURCE_ATTRIBUTES or OTEL_SERVICE_NAME: %v", err)
	}
	// The sampler comes from OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG (the SDK reads
	// them), by default parentbased_always_on: a message whose producer's span was sampled
	// is traced through the relay.
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetErrorHandler(exportErrors(log))
	attrs := []any{"exporter", exporter}
	if exporter == "otlp" {
		shown := endpoint
		if shown == "" {
			shown = "(the exporter's default)"
		}
		attrs = append(attrs, "protocol", protocol, "endpoint", redact.DSN(shown))
	}
	log.Info("tracing on", attrs...)
	return &tracing{tp: tp, prop: prop, shutdown: func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), tracingShutdownTimeout)
		defer cancel()
		return tp.Shutdown(ctx)
	}}, nil
}

// propagators parses OTEL_PROPAGATORS: tracecontext, baggage and none, comma-separated;
// empty means tracecontext,baggage.
func propagators(v string) (propagation.TextMapPropagator, error) {
	if v == "" {
		v = "tracecontext,baggage"
	}
	var ps []propagation.TextMapPropagator
	for _, name := range strings.Split(v, ",") {
		switch strings.ToLower(strings.TrimSpace(name)) {
		case "tracecontext":
			ps = append(ps, propagation.TraceContext{})
		case "baggage":
			ps = append(ps, propagation.Baggage{})
		case "none", "":
		default:
			return nil, usageErr("invalid %s: %q is not supported (use tracecontext, baggage or none)", envPropagators, strings.TrimSpace(name))
		}
	}
	return propagation.NewCompositeTextMapPropagator(ps...), nil
}

// exportErrors logs OpenTelemetry's errors (a collector that cannot be reached): the first
// one as a warning, the others at debug level, so that an unreachable collector does not
// flood the log.
func exportErrors(log *slog.Logger) otel.ErrorHandler {
	var warned atomic.Bool
	return otel.ErrorHandlerFunc(func(err error) {
		if !warned.Swap(true) {
			log.Warn("tracing: spans could not be exported (later failures are logged at debug level)", "err", err)
			return
		}
		log.Debug("tracing: spans could not be exported", "err", err)
	})
}

// closeTracing flushes and stops tracing at exit, logging a failure.
func closeTracing(ctx context.Context, t *tracing, log *slog.Logger) {
	if err := t.shutdown(ctx); err != nil {
		log.Warn("tracing: could not flush the last spans", "err", err)
	}
}
