package relaycli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strconv"
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

// The environment variables setupTracing reads itself (the sampler and the batch span
// processor's too: the SDK ignores a bad value of those without a word, and a relay told to
// sample 10% that samples everything, or the reverse, should not start); the exporter and the
// SDK read the rest of the standard OTEL_* variables (OTEL_EXPORTER_OTLP_HEADERS,
// _CERTIFICATE, _TIMEOUT, _COMPRESSION, OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME) from the
// process environment.
const (
	envSDKDisabled      = "OTEL_SDK_DISABLED"
	envTracesExporter   = "OTEL_TRACES_EXPORTER"
	envEndpoint         = "OTEL_EXPORTER_OTLP_ENDPOINT"
	envTracesEndpoint   = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
	envProtocol         = "OTEL_EXPORTER_OTLP_PROTOCOL"
	envTracesProtocol   = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	envPropagators      = "OTEL_PROPAGATORS"
	envSampler          = "OTEL_TRACES_SAMPLER"
	envSamplerArg       = "OTEL_TRACES_SAMPLER_ARG"
	envBSPDelay         = "OTEL_BSP_SCHEDULE_DELAY"
	envBSPTimeout       = "OTEL_BSP_EXPORT_TIMEOUT"
	envBSPQueue         = "OTEL_BSP_MAX_QUEUE_SIZE"
	envBSPBatch         = "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"
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
	sampler, err := samplerOf(get(envSampler), get(envSamplerArg))
	if err != nil {
		return nil, err
	}
	batch, err := batchOptions(get)
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
	// The sampler comes from OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG (samplerOf), by
	// default parentbased_always_on: a message whose producer's span was sampled is traced
	// through the relay.
	opts := []sdktrace.TracerProviderOption{sdktrace.WithResource(res), sdktrace.WithSampler(sampler)}
	for _, exp := range exps {
		opts = append(opts, sdktrace.WithBatcher(exp, batch...))
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

// samplerOf parses OTEL_TRACES_SAMPLER (the specification's names the SDK has: always_on,
// always_off, traceidratio, parentbased_always_on, parentbased_always_off,
// parentbased_traceidratio, in any case; unset: parentbased_always_on) and, for the ratio
// samplers, OTEL_TRACES_SAMPLER_ARG (a number in [0, 1]; unset: 1.0). The other samplers take
// no argument and ignore it. Where the specification says to log a bad value and go on with
// the default, the relay refuses to start: a usage error naming the variable.
func samplerOf(name, arg string) (sdktrace.Sampler, error) {
	ratio := func() (float64, error) {
		if arg == "" {
			return 1, nil
		}
		v, err := strconv.ParseFloat(arg, 64)
		if err != nil || math.IsNaN(v) || v < 0 || v > 1 {
			return 0, usageErr("invalid %s %q: the ratio of traces %s samples is a number from 0 to 1", envSamplerArg, arg, name)
		}
		return v, nil
	}
	switch strings.ToLower(name) {
	case "", "parentbased_always_on":
		return sdktrace.ParentBased(sdktrace.AlwaysSample()), nil
	case "always_on":
		return sdktrace.AlwaysSample(), nil
	case "always_off":
		return sdktrace.NeverSample(), nil
	case "parentbased_always_off":
		return sdktrace.ParentBased(sdktrace.NeverSample()), nil
	case "traceidratio":
		r, err := ratio()
		if err != nil {
			return nil, err
		}
		return sdktrace.TraceIDRatioBased(r), nil
	case "parentbased_traceidratio":
		r, err := ratio()
		if err != nil {
			return nil, err
		}
		return sdktrace.ParentBased(sdktrace.TraceIDRatioBased(r)), nil
	}
	return nil, usageErr("invalid %s %q: use always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off or parentbased_traceidratio", envSampler, name)
}

// batchOptions parses the batch span processor's OTEL_BSP_* variables (the SDK would ignore
// a bad value): OTEL_BSP_SCHEDULE_DELAY and OTEL_BSP_EXPORT_TIMEOUT in milliseconds (0 or
// more), OTEL_BSP_MAX_QUEUE_SIZE and OTEL_BSP_MAX_EXPORT_BATCH_SIZE (1 or more, the batch no
// larger than the queue, whose default is 2048). Unset ones keep the SDK's defaults.
func batchOptions(get func(string) string) ([]sdktrace.BatchSpanProcessorOption, error) {
	var opts []sdktrace.BatchSpanProcessorOption
	num := func(key string, least int) (int, bool, error) {
		v := get(key)
		if v == "" {
			return 0, false, nil
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < least {
			return 0, false, usageErr("invalid %s %q: want a whole number, %d or more", key, v, least)
		}
		return n, true, nil
	}
	for _, d := range []struct {
		key string
		opt func(time.Duration) sdktrace.BatchSpanProcessorOption
	}{{envBSPDelay, sdktrace.WithBatchTimeout}, {envBSPTimeout, sdktrace.WithExportTimeout}} {
		ms, set, err := num(d.key, 0)
		if err != nil {
			return nil, err
		}
		if set {
			opts = append(opts, d.opt(time.Duration(ms)*time.Millisecond))
		}
	}
	queue, queueSet, err := num(envBSPQueue, 1)
	if err != nil {
		return nil, err
	}
	batch, batchSet, err := num(envBSPBatch, 1)
	if err != nil {
		return nil, err
	}
	if queueSet {
		opts = append(opts, sdktrace.WithMaxQueueSize(queue))
	} else {
		queue = sdktrace.DefaultMaxQueueSize
	}
	switch {
	case batchSet && batch > queue:
		return nil, usageErr("invalid %s %d: more than the queue holds (%s, %d)", envBSPBatch, batch, envBSPQueue, queue)
	case batchSet:
		opts = append(opts, sdktrace.WithMaxExportBatchSize(batch))
	case queue < sdktrace.DefaultMaxExportBatchSize:
		opts = append(opts, sdktrace.WithMaxExportBatchSize(queue))
	}
	return opts, nil
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
