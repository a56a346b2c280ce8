package relaycli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
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
// variables. It is off (a zero tracing, no-op shutdown) unless OTEL_TRACES_EXPORTER names
// exporters (a comma-separated list of otlp and console: each gets the spans) or an OTLP
// endpoint is set (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, with
// OTEL_TRACES_EXPORTER unset), and always off with OTEL_TRACES_EXPORTER=none or
// OTEL_SDK_DISABLED=true. A value it cannot honour is a usage error naming the variable.
func setupTracing(ctx context.Context, env *Env, log *slog.Logger, service string) (*tracing, error) {
	off := &tracing{shutdown: func(context.Context) error { return nil }}
	get := func(k string) string { return strings.TrimSpace(env.Getenv(k)) }
	if strings.EqualFold(get(envSDKDisabled), "true") {
		return off, nil
	}
	endpoint := get(envTracesEndpoint)
	if endpoint == "" {
		endpoint = get(envEndpoint)
	}
	exporters, err := tracesExporters(get(envTracesExporter))
	if err != nil {
		return nil, err
	}
	if exporters == nil {
		if endpoint == "" {
			return off, nil
		}
		exporters = []string{"otlp"}
	}
	if len(exporters) == 0 {
		return off, nil // none
	}
	prop, err := propagators(get(envPropagators))
	if err != nil {
		return nil, err
	}

	var exps []sdktrace.SpanExporter
	stopAll := func() {
		for _, e := range exps {
			_ = e.Shutdown(ctx)
		}
	}
	protocol := ""
	for _, exporter := range exporters {
		var exp sdktrace.SpanExporter
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
				// The exporter reads the endpoint, headers, TLS settings, timeout and
				// compression from the OTEL_EXPORTER_OTLP_* variables itself.
				exp, err = otlptracehttp.New(ctx)
			case "grpc":
				exp, err = otlptracegrpc.New(ctx)
			default:
				stopAll()
				name := envProtocol
				if get(envTracesProtocol) != "" {
					name = envTracesProtocol
				}
				return nil, usageErr("invalid %s %q: use http/protobuf or grpc", name, protocol)
			}
		}
		if err != nil {
			stopAll()
			return nil, fmt.Errorf("tracing: %s exporter: %w", exporter, err)
		}
		exps = append(exps, exp)
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
		stopAll()
		return nil, usageErr("invalid OTEL_RESOURCE_ATTRIBUTES or OTEL_SERVICE_NAME: %v", err)
	}
	// The sampler comes from OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG (the SDK reads
	// them), by default parentbased_always_on: a message whose producer's span was sampled
	// is traced through the relay.
	opts := []sdktrace.TracerProviderOption{sdktrace.WithResource(res)}
	for _, exp := range exps {
		opts = append(opts, sdktrace.WithBatcher(exp))
	}
	tp := sdktrace.NewTracerProvider(opts...)
	otel.SetErrorHandler(exportErrors(log))
	attrs := []any{"exporter", strings.Join(exporters, ",")}
	if protocol != "" {
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

// tracesExporters parses OTEL_TRACES_EXPORTER, a comma-separated list (the specification's
// form): otlp and console, each at most once, in the order given; none alone means no
// exporter (an empty list). Unset, it returns nil. Empty items are skipped; none with another
// exporter, or an exporter the relay does not have, is a usage error.
func tracesExporters(v string) ([]string, error) {
	if v == "" {
		return nil, nil
	}
	out := []string{}
	none := false
	for _, item := range strings.Split(v, ",") {
		name := strings.ToLower(strings.TrimSpace(item))
		switch name {
		case "":
		case "none":
			none = true
		case "otlp", "console":
			if !slices.Contains(out, name) {
				out = append(out, name)
			}
		default:
			return nil, usageErr("invalid %s %q: the relay exports traces with otlp and console (a comma-separated list), or none", envTracesExporter, strings.TrimSpace(item))
		}
	}
	if none && len(out) > 0 {
		return nil, usageErr("invalid %s %q: none turns tracing off and cannot be listed with exporters", envTracesExporter, v)
	}
	if len(out) == 0 && !none {
		return nil, nil // only commas and spaces: as if unset
	}
	return out, nil
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
