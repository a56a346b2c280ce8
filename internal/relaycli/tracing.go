package relaycli

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/url"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/txoutbox/txoutbox/internal/redact"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
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

// The environment variables setupTracing reads. Every one the relay or the SDK uses is
// checked here the way the SDK parses it, and a value it cannot honour is a usage error naming
// the variable: where the SDK meets a bad value it logs it (a header's value included) or not
// at all, and goes on with its default, so a relay told to sample 10% that samples everything,
// or to export to a collector it never reaches, would start as if all were well. A variable
// that is set but not used, as the OpenTelemetry specification has it, never stops the relay:
// none at all while tracing is off; a general variable its _TRACES_ form (a general attribute
// limit its span form) overrides; an _INSECURE one where the endpoint's scheme decides; the
// TLS files with an endpoint without TLS. Such a one is logged once as a warning ("tracing:
// variable not used", naming it): the TLS files whenever set, the others when their value
// would be refused, or contradicts the one that decides. The relay passes the sampler, the
// batch span processor's settings and the OTLP exporter's endpoint, TLS switch, headers,
// timeout and compression to the SDK itself; the exporter reads the TLS files (_CERTIFICATE,
// _CLIENT_CERTIFICATE, _CLIENT_KEY) and the SDK OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
// and the span limits from the process environment, once checked here. Not checked: the
// SDK's experimental OTEL_GO_X_* switches, whose self-observability metrics go to the global
// meter provider, which the relay never sets.
const (
	envSDKDisabled      = "OTEL_SDK_DISABLED"
	envTracesExporter   = "OTEL_TRACES_EXPORTER"
	envEndpoint         = "OTEL_EXPORTER_OTLP_ENDPOINT"
	envTracesEndpoint   = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
	envProtocol         = "OTEL_EXPORTER_OTLP_PROTOCOL"
	envTracesProtocol   = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	envInsecure         = "OTEL_EXPORTER_OTLP_INSECURE"
	envTracesInsecure   = "OTEL_EXPORTER_OTLP_TRACES_INSECURE"
	envHeaders          = "OTEL_EXPORTER_OTLP_HEADERS"
	envTracesHeaders    = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
	envTimeout          = "OTEL_EXPORTER_OTLP_TIMEOUT"
	envTracesTimeout    = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
	envCompression      = "OTEL_EXPORTER_OTLP_COMPRESSION"
	envTracesCompress   = "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION"
	envCertificate      = "OTEL_EXPORTER_OTLP_CERTIFICATE"
	envTracesCert       = "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE"
	envClientCert       = "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"
	envClientKey        = "OTEL_EXPORTER_OTLP_CLIENT_KEY"
	envTracesClientCert = "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE"
	envTracesClientKey  = "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY"
	envResourceAttrs    = "OTEL_RESOURCE_ATTRIBUTES"
	envPropagators      = "OTEL_PROPAGATORS"
	envSampler          = "OTEL_TRACES_SAMPLER"
	envSamplerArg       = "OTEL_TRACES_SAMPLER_ARG"
	envBSPDelay         = "OTEL_BSP_SCHEDULE_DELAY"
	envBSPTimeout       = "OTEL_BSP_EXPORT_TIMEOUT"
	envBSPQueue         = "OTEL_BSP_MAX_QUEUE_SIZE"
	envBSPBatch         = "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"
	defaultServiceName  = "txoutbox-relay"
	defaultOTLPProtocol = "http/protobuf"
	// The exporters' defaults (otlptracehttp's and otlptracegrpc's documentation).
	defaultHTTPEndpoint = "localhost:4318"
	defaultGRPCEndpoint = "localhost:4317"
	defaultTracesPath   = "/v1/traces"
)

// spanLimitVars are the SDK's span limits (sdktrace.NewSpanLimits reads them): whole numbers,
// a negative one meaning no limit. The SDK reads them untrimmed and ignores one that is not a
// number.
var spanLimitVars = []string{
	"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_ATTRIBUTE_COUNT_LIMIT",
	"OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
	"OTEL_SPAN_EVENT_COUNT_LIMIT", "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT",
	"OTEL_SPAN_LINK_COUNT_LIMIT", "OTEL_LINK_ATTRIBUTE_COUNT_LIMIT",
}

// spanLimitOverrides are the general attribute limits (for every signal) and the span limits
// that override them: the SDK does not read the first when the second is set.
var spanLimitOverrides = map[string]string{
	"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
	"OTEL_ATTRIBUTE_COUNT_LIMIT":        "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
}

// warnFunc logs that a variable that is set is not used, and why; the relay goes on.
type warnFunc func(variable, why string)

// unusedWarner returns the warnFunc that logs to log.
func unusedWarner(log *slog.Logger) warnFunc {
	return func(variable, why string) {
		log.Warn("tracing: variable not used", "variable", variable, "why", why)
	}
}

// setupTracing configures OpenTelemetry tracing from the standard OTEL_* environment
// variables. It is off (a zero tracing, no-op shutdown) unless OTEL_TRACES_EXPORTER names
// exporters (a comma-separated list of otlp and console: each gets the spans) or an OTLP
// endpoint is set (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, with
// OTEL_TRACES_EXPORTER unset), and always off with OTEL_TRACES_EXPORTER=none or
// OTEL_SDK_DISABLED=true. A value it cannot honour is a usage error naming the variable; the
// variables of a part that is off (the OTLP ones without the otlp exporter, all of them with
// tracing off, OTEL_SDK_DISABLED included) are not read, and one that is set but not used is
// at most a warning.
func setupTracing(ctx context.Context, env *Env, log *slog.Logger, service string) (*tracing, error) {
	off := &tracing{shutdown: func(context.Context) error { return nil }}
	get := func(k string) string { return strings.TrimSpace(env.Getenv(k)) }
	warn := unusedWarner(log)
	// OTEL_SDK_DISABLED=true turns tracing off whatever else is set. Another value is read only
	// when tracing would be on: platforms set OTEL_SDK_DISABLED=1 for every process, and a
	// relay without an exporter or an endpoint starts whatever it says.
	sdkDisabled := get(envSDKDisabled)
	if strings.EqualFold(sdkDisabled, "true") {
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
	if sdkDisabled != "" && !strings.EqualFold(sdkDisabled, "false") {
		// The SDK takes it for false, with tracing on: one who wrote 1 or yes meant off.
		return nil, usageErr("invalid %s %q: only true and false are understood; the SDK takes anything else for false, which would leave tracing on (exporter %s): write true to turn it off, or false",
			envSDKDisabled, sdkDisabled, strings.Join(exporters, ","))
	}
	prop, err := propagators(get(envPropagators), warn)
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
	if err := checkSpanLimits(env.Getenv, warn); err != nil {
		return nil, err
	}
	if err := checkResourceAttributes(get(envResourceAttrs)); err != nil {
		return nil, err
	}
	var otlp *otlpConfig
	if slices.Contains(exporters, "otlp") {
		if otlp, err = otlpFromEnv(get, warn); err != nil {
			return nil, err
		}
	}

	var exps []sdktrace.SpanExporter
	stopAll := func() {
		for _, e := range exps {
			_ = e.Shutdown(ctx)
		}
	}
	for _, exporter := range exporters {
		var exp sdktrace.SpanExporter
		switch exporter {
		case "console":
			exp, err = stdouttrace.New(stdouttrace.WithWriter(env.Stdout))
		case "otlp":
			exp, err = otlp.exporter(ctx)
		}
		if err != nil {
			stopAll()
			return nil, fmt.Errorf("tracing: %s exporter: %w", exporter, err)
		}
		exps = append(exps, exp)
	}
	// OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (WithFromEnv, applied last) override the
	// defaults. No process detector: its command line would carry --database-url. The
	// detector's error for a malformed OTEL_RESOURCE_ATTRIBUTES is a partial-resource one, like
	// a host it cannot name: checkResourceAttributes refused the first already.
	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName(service), semconv.ServiceVersion(ReadBuildInfo().Version)),
		resource.WithTelemetrySDK(),
		resource.WithHost(),
		resource.WithFromEnv(),
	)
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		stopAll()
		return nil, usageErr("invalid %s or OTEL_SERVICE_NAME: %v", envResourceAttrs, err)
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
	if otlp != nil {
		// The endpoint the exporter was given: never its headers.
		attrs = append(attrs, "protocol", otlp.protocol, "endpoint", redact.DSN(otlp.endpoint), "tls", !otlp.insecure)
	}
	log.Info("tracing on", attrs...)
	return &tracing{tp: tp, prop: prop, shutdown: func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), tracingShutdownTimeout)
		defer cancel()
		return tp.Shutdown(ctx)
	}}, nil
}

// otlpConfig is the OTLP exporter's configuration as the relay resolved it from the
// OTEL_EXPORTER_OTLP_* variables (each _TRACES_ one over its general one), every one checked
// the way the exporter parses it. The exporter gets it as options, so the endpoint the relay
// logs is the one it uses; it reads the TLS files itself, once checked here.
type otlpConfig struct {
	protocol   string            // http/protobuf or grpc
	endpoint   string            // http/protobuf: the URL spans are posted to; grpc: the target
	insecure   bool              // no TLS
	headers    map[string]string // nil: none set; never logged
	timeout    time.Duration     // 0 with timeoutSet: no limit of the exporter's own
	timeoutSet bool
	gzip       bool
}

// otlpEndpoint is an endpoint variable's value, checked.
type otlpEndpoint struct {
	name   string // the variable
	target string // http/protobuf: the URL to post to; grpc: the target (host:port or unix:…)
	scheme string // http, https, unix, or "" (host:port for grpc: the INSECURE variables decide)
}

// otlpFromEnv resolves and checks the OTLP exporter's variables, each _TRACES_ one over its
// general one: only the one used is refused when its value is bad, the general one it
// overrides at most warned about. The endpoint is a URL with scheme http or https (a base one,
// /v1/traces appended, in OTEL_EXPORTER_OTLP_ENDPOINT; the traces URL itself in
// _TRACES_ENDPOINT), for grpc also host:port or a unix socket; the headers key=value pairs
// with percent-encoded values, empty items skipped; the timeout whole milliseconds, 0 or
// more; the compression gzip or none. The INSECURE variables are true or false where they
// decide (an endpoint without a scheme: the default one, a grpc host:port); where the
// endpoint's scheme decides, as the specification has it, one that says otherwise is a
// warning. With TLS the certificate files are PEM that parses, a client certificate with its
// key; without TLS they are not used (a warning), and the exporter is given no TLS
// configuration, so that it neither fails (http) nor switches to TLS (grpc) because of them.
func otlpFromEnv(get func(string) string, warn warnFunc) (*otlpConfig, error) {
	c := &otlpConfig{protocol: defaultOTLPProtocol}
	protocol, _, err := effective(get, warn, envProtocol, envTracesProtocol, func(name, v string) (string, error) {
		p := strings.ToLower(v)
		if p != "http/protobuf" && p != "grpc" {
			return "", usageErr("invalid %s %q: use http/protobuf or grpc", name, v)
		}
		return p, nil
	})
	if err != nil {
		return nil, err
	}
	if protocol != "" {
		c.protocol = protocol
	}
	ep, _, err := effective(get, warn, envEndpoint, envTracesEndpoint, func(name, v string) (*otlpEndpoint, error) {
		return parseOTLPEndpoint(name, v, c.protocol)
	})
	if err != nil {
		return nil, err
	}
	insecure, insecureVar, err := effective(get, warn, envInsecure, envTracesInsecure, parseBool)
	switch {
	case ep != nil && ep.scheme != "":
		// The scheme decides (the specification); the SDK would let the INSECURE variable
		// override it, which the exporter's options from the relay prevent.
		c.insecure = ep.scheme != "https"
		if insecureVar != "" && (err != nil || insecure != c.insecure) {
			warn(insecureVar, fmt.Sprintf("%s has scheme %s, which decides: %s", ep.name, ep.scheme, tlsWord(!c.insecure)))
		}
	case err != nil:
		return nil, err
	default:
		c.insecure = insecure
	}
	switch {
	case ep != nil:
		c.endpoint = ep.target
	case c.protocol == "grpc":
		c.endpoint = defaultGRPCEndpoint
	default:
		scheme := "https"
		if c.insecure {
			scheme = "http"
		}
		c.endpoint = scheme + "://" + defaultHTTPEndpoint + defaultTracesPath
	}
	// The exporter reads the general headers variable as well, before the relay's headers
	// replace it, and may log an item it cannot parse to stderr, value included.
	headers, _, err := effectiveNote(get, warn, envHeaders, envTracesHeaders,
		"; the exporter reads it as well, and may log an item it cannot parse to stderr, value included: fix or unset it",
		func(name, v string) (map[string]string, error) { return otlpHeaders(name, v, c.protocol) })
	if err != nil {
		return nil, err
	}
	c.headers = headers
	timeout, timeoutVar, err := effective(get, warn, envTimeout, envTracesTimeout, millis)
	if err != nil {
		return nil, err
	}
	c.timeout, c.timeoutSet = timeout, timeoutVar != ""
	c.gzip, _, err = effective(get, warn, envCompression, envTracesCompress, func(name, v string) (bool, error) {
		switch strings.ToLower(v) {
		case "gzip":
			return true, nil
		case "none":
			return false, nil
		}
		return false, usageErr("invalid %s %q: use gzip or none", name, v)
	})
	if err != nil {
		return nil, err
	}
	if c.insecure {
		// The certificates are not used: a platform may set them for every process.
		var set []string
		for _, name := range []string{envCertificate, envTracesCert, envClientCert, envClientKey, envTracesClientCert, envTracesClientKey} {
			if get(name) != "" {
				set = append(set, name)
			}
		}
		if len(set) > 0 {
			why := insecureVar + "=true"
			if ep != nil && ep.scheme != "" {
				why = ep.name + "'s scheme " + ep.scheme
			}
			warn(strings.Join(set, ","), "the exporter sends without TLS ("+why+"), so the certificates are not used")
		}
		return c, nil
	}
	if _, _, err := effective(get, warn, envCertificate, envTracesCert, func(name, file string) (struct{}, error) {
		return struct{}{}, checkCertificate(name, file)
	}); err != nil {
		return nil, err
	}
	// The client certificate and key go in pairs: the _TRACES_ pair, when either is set, over
	// the general one (the exporter ignores a pair that is not whole).
	general := [2]string{envClientCert, envClientKey}
	traces := [2]string{envTracesClientCert, envTracesClientKey}
	pairSet := func(p [2]string) bool { return get(p[0]) != "" || get(p[1]) != "" }
	used := general
	if pairSet(traces) {
		used = traces
		if pairSet(general) {
			if err := checkClientCertificate(general[0], general[1], get(general[0]), get(general[1])); err != nil {
				warn(general[0]+","+general[1], envTracesClientCert+" and "+envTracesClientKey+" override them; on their own they would be refused: "+err.Error())
			}
		}
	}
	if err := checkClientCertificate(used[0], used[1], get(used[0]), get(used[1])); err != nil {
		return nil, err
	}
	return c, nil
}

// effective checks the variable of a general and _TRACES_ pair that is used, the _TRACES_ one
// when set, else the general one, with parse, and returns its value and name ("" when neither
// is set). The general one that the _TRACES_ one overrides is not used: a value parse
// refuses is a warning.
func effective[T any](get func(string) string, warn warnFunc, general, traces string, parse func(name, v string) (T, error)) (T, string, error) {
	return effectiveNote(get, warn, general, traces, "", parse)
}

// effectiveNote is effective with a note appended to the warning.
func effectiveNote[T any](get func(string) string, warn warnFunc, general, traces, note string, parse func(name, v string) (T, error)) (T, string, error) {
	name, v := general, get(general)
	if tv := get(traces); tv != "" {
		if v != "" {
			if _, err := parse(general, v); err != nil {
				warn(general, traces+" overrides it; on its own it would be refused: "+err.Error()+note)
			}
		}
		name, v = traces, tv
	}
	if v == "" {
		var zero T
		return zero, "", nil
	}
	t, err := parse(name, v)
	return t, name, err
}

// tlsWord says whether TLS is used, for a warning.
func tlsWord(tls bool) string {
	if tls {
		return "TLS"
	}
	return "no TLS"
}

// parseOTLPEndpoint checks an endpoint variable's value for protocol, as the exporters read
// it (url.Parse, the host and path of an http or https URL) but refusing what they would
// drop or misuse without a word: a value without a scheme (127.0.0.1:4318 does not parse,
// localhost:4318 parses as scheme "localhost"; either way the exporter sent to its default),
// credentials, a query or a fragment (dropped), another scheme, no host, a bad port. For grpc
// it also takes host:port (TLS unless the INSECURE variable says otherwise) and unix:path,
// which the grpc exporter dials as given; an http or https URL has no path there (ignored).
// Its errors show the value with any password masked and without its query.
func parseOTLPEndpoint(name, v, protocol string) (*otlpEndpoint, error) {
	shown := redact.NATS(v)
	if i := strings.IndexAny(shown, "?#"); i >= 0 {
		shown = shown[:i] + "…"
	}
	bad := func(why string) error {
		return usageErr("invalid %s %q: %s", name, shown, why)
	}
	want := "want a URL with scheme http or https (http://collector:4318)"
	if protocol == "grpc" {
		want = "want a URL with scheme http or https (http://collector:4317), host:port (TLS unless " + envInsecure + "=true) or unix:/path/to/socket"
	}
	noScheme := !strings.Contains(v, "://")
	if protocol == "grpc" && noScheme && !strings.HasPrefix(strings.ToLower(v), "unix:") {
		// host:port. The exporter reads it as a URL too (scheme host, opaque port) and dials
		// it as given; one that does not parse as a URL (an IP address, a name with an
		// underscore) it drops, and dials its default.
		host, port, err := net.SplitHostPort(v)
		if err != nil || host == "" || !validPort(port) {
			return nil, bad(want)
		}
		if _, err := url.Parse(v); err != nil {
			return nil, bad("the exporter reads host:port only with a host name that starts with a letter (letters, digits, + - .): write http://" + shown + " (no TLS) or https://" + shown)
		}
		return &otlpEndpoint{name: name, target: v}, nil
	}
	u, err := url.Parse(v)
	if err != nil && protocol == "http/protobuf" && noScheme && strings.Contains(v, ":") {
		return nil, bad(want + ": a scheme is needed, http://" + shown + " or https://" + shown)
	}
	if err != nil {
		return nil, bad(want)
	}
	scheme := strings.ToLower(u.Scheme)
	switch {
	case scheme == "unix" && protocol == "grpc":
		if u.Path == "" && u.Opaque == "" || u.Host != "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
			return nil, bad("a unix socket is unix:/path/to/socket or unix:///path/to/socket")
		}
		return &otlpEndpoint{name: name, target: v, scheme: scheme}, nil
	case scheme != "http" && scheme != "https":
		if noScheme && protocol == "http/protobuf" {
			return nil, bad(want + ": a scheme is needed, http://" + shown + " or https://" + shown)
		}
		return nil, bad(want)
	case u.Opaque != "" || u.Hostname() == "":
		return nil, bad(want + ": no host")
	case u.User != nil:
		return nil, bad("the exporter does not send a URL's credentials: put them in " + envHeaders + " (Authorization=Basic%20…)")
	case u.RawQuery != "" || u.ForceQuery || u.Fragment != "" || strings.Contains(v, "#"):
		return nil, bad("the exporter drops a query or fragment: give the URL without it")
	case u.Port() != "" && !validPort(u.Port()):
		return nil, bad("the port is a number from 1 to 65535")
	}
	e := &otlpEndpoint{name: name, scheme: scheme}
	if protocol == "grpc" {
		if u.Path != "" && u.Path != "/" {
			return nil, bad("the grpc exporter ignores a path: give scheme, host and port only")
		}
		e.target = u.Host
		return e, nil
	}
	p := u.Path
	if name == envEndpoint {
		// A base URL: the exporter appends the traces path.
		p = path.Join(p, defaultTracesPath)
	} else if p == "" {
		p = "/"
	}
	e.target = (&url.URL{Scheme: scheme, Host: u.Host, Path: p}).String()
	return e, nil
}

func validPort(p string) bool {
	n, err := strconv.Atoi(p)
	return err == nil && n >= 1 && n <= 65535 && strings.TrimLeft(p, "0123456789") == ""
}

// exporter creates the OTLP exporter with the configuration's options; they override what
// the exporter reads from the same variables itself. Without TLS it gets no TLS configuration:
// from certificate variables it reads itself, the http exporter would fail to start ("insecure
// HTTP endpoint cannot use TLS client configuration") and the grpc one would use TLS, its
// credentials winning over WithInsecure.
func (c *otlpConfig) exporter(ctx context.Context) (sdktrace.SpanExporter, error) {
	if c.protocol == "grpc" {
		var opts []otlptracegrpc.Option
		if c.insecure {
			opts = append(opts, otlptracegrpc.WithEndpoint(c.endpoint), otlptracegrpc.WithInsecure(), otlptracegrpc.WithTLSCredentials(nil))
		} else {
			// An https URL sets the target's host and port and TLS (a secure target is
			// host:port; the exporter has no WithSecure).
			opts = append(opts, otlptracegrpc.WithEndpointURL("https://"+c.endpoint))
		}
		if c.headers != nil {
			opts = append(opts, otlptracegrpc.WithHeaders(c.headers))
		}
		if c.timeoutSet {
			opts = append(opts, otlptracegrpc.WithTimeout(c.timeout))
		}
		if c.gzip {
			opts = append(opts, otlptracegrpc.WithCompressor("gzip"))
		}
		return otlptracegrpc.New(ctx, opts...)
	}
	opts := []otlptracehttp.Option{otlptracehttp.WithEndpointURL(c.endpoint)} // its scheme sets TLS
	if c.insecure {
		opts = append(opts, otlptracehttp.WithTLSClientConfig(nil))
	}
	if c.headers != nil {
		opts = append(opts, otlptracehttp.WithHeaders(c.headers))
	}
	if c.timeoutSet {
		opts = append(opts, otlptracehttp.WithTimeout(c.timeout))
	}
	compression := otlptracehttp.NoCompression
	if c.gzip {
		compression = otlptracehttp.GzipCompression
	}
	opts = append(opts, otlptracehttp.WithCompression(compression))
	return otlptracehttp.New(ctx, opts...)
}

// otlpHeaders parses a headers variable as the exporter does (the W3C baggage format without
// properties): key=value pairs separated by commas, spaces around them ignored, the value
// percent-encoded; an empty item (a trailing comma) is skipped, as the exporter drops it. The
// exporter drops a pair it cannot parse and logs it, value and all; the relay refuses it
// (items are counted from 1, empty ones included), and its errors never show a value (headers carry credentials), nor a key
// that is not a header name (it may be a credential given without its key). A key must be an
// HTTP header name (RFC 9110 token), for grpc a metadata key (letters, digits, - _ .); a
// value must be one the client can send (no control characters; for grpc printable ASCII).
func otlpHeaders(name, v, protocol string) (map[string]string, error) {
	h := map[string]string{}
	for i, item := range strings.Split(v, ",") {
		n := i + 1
		if strings.TrimSpace(item) == "" {
			continue
		}
		k, val, ok := strings.Cut(item, "=")
		if !ok {
			return nil, usageErr("invalid %s: item %d has no '=' (want key=value pairs separated by commas; values are not shown)", name, n)
		}
		k = strings.TrimSpace(k)
		if !validHeaderKey(k, protocol) {
			what := "an HTTP header name (letters, digits and !#$%&'*+-.^_`|~)"
			if protocol == "grpc" {
				what = "a grpc metadata key (letters, digits, - _ .)"
			}
			return nil, usageErr("invalid %s: the key of item %d is not %s (keys and values are not shown)", name, n, what)
		}
		dec, err := url.PathUnescape(val)
		if err != nil {
			return nil, usageErr("invalid %s: the value of %s (item %d) is not percent-encoded right: a %% starts %%XX, two hex digits", name, k, n)
		}
		dec = strings.TrimSpace(dec)
		if !validHeaderValue(dec, k, protocol) {
			what := "control characters"
			if protocol == "grpc" {
				what = "characters other than printable ASCII"
			}
			return nil, usageErr("invalid %s: the value of %s (item %d) has %s, which the exporter cannot send", name, k, n, what)
		}
		h[k] = dec
	}
	return h, nil
}

func validHeaderKey(k, protocol string) bool {
	if k == "" {
		return false
	}
	for i := 0; i < len(k); i++ {
		b := k[i]
		switch {
		case b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' || b == '-' || b == '_' || b == '.':
		case protocol != "grpc" && strings.IndexByte("!#$%&'*+^`|~", b) >= 0:
		default:
			return false
		}
	}
	return true
}

func validHeaderValue(v, k, protocol string) bool {
	if protocol == "grpc" && strings.HasSuffix(strings.ToLower(k), "-bin") {
		return true // binary metadata: grpc encodes it
	}
	for i := 0; i < len(v); i++ {
		b := v[i]
		if b < ' ' && b != '\t' || b == 0x7f || protocol == "grpc" && (b < ' ' || b > '~') {
			return false
		}
	}
	return true
}

// checkCertificate checks a CA certificate variable's file: it must hold a PEM certificate
// (the exporter would go on with the system's roots without a word).
func checkCertificate(name, file string) error {
	// The value is never shown: it may be the secret itself, pasted where its file's path goes.
	if err := checkSecretFile(name, file); err != nil {
		return err
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return usageErr("invalid %s: not a readable file: %s (the value is not shown)", name, pathErrReason(err))
	}
	if !x509.NewCertPool().AppendCertsFromPEM(b) {
		return usageErr("invalid %s: the file holds no PEM certificate (the value is not shown)", name)
	}
	return nil
}

// checkClientCertificate checks a client certificate variable and its key's: both or neither
// (the exporter ignores one without the other), and a pair that loads.
func checkClientCertificate(certVar, keyVar, cert, key string) error {
	switch {
	case cert == "" && key == "":
		return nil
	case key == "":
		return usageErr("%s is set without %s: set both, the client certificate and its key, or neither", certVar, keyVar)
	case cert == "":
		return usageErr("%s is set without %s: set both, the client certificate and its key, or neither", keyVar, certVar)
	}
	// The values are never shown: one may be the key itself, pasted where its file's path goes.
	for _, f := range [][2]string{{certVar, cert}, {keyVar, key}} {
		if err := checkSecretFile(f[0], f[1]); err != nil {
			return err
		}
	}
	certPEM, err := os.ReadFile(cert)
	if err != nil {
		return usageErr("invalid %s: not a readable file: %s (the value is not shown)", certVar, pathErrReason(err))
	}
	keyPEM, err := os.ReadFile(key)
	if err != nil {
		return usageErr("invalid %s: not a readable file: %s (the value is not shown)", keyVar, pathErrReason(err))
	}
	if _, err := tls.X509KeyPair(certPEM, keyPEM); err != nil {
		return usageErr("invalid %s or %s: %s", certVar, keyVar, withoutValues(err, cert, key))
	}
	return nil
}

// checkResourceAttributes checks OTEL_RESOURCE_ATTRIBUTES as the SDK parses it: key=value
// pairs separated by commas, spaces around keys and values ignored, the value
// percent-encoded. The SDK drops a pair without '=' or a key, and keeps a value it cannot
// decode undecoded, with an error the relay would tolerate (a partial resource). An empty
// item (a trailing comma) is skipped: the SDK drops it, and keeps the others.
func checkResourceAttributes(v string) error {
	if v == "" {
		return nil
	}
	for i, item := range strings.Split(v, ",") {
		if strings.TrimSpace(item) == "" {
			continue
		}
		k, val, ok := strings.Cut(item, "=")
		switch {
		case !ok:
			return usageErr("invalid %s: item %d, %q, has no '=' (want key=value pairs separated by commas)", envResourceAttrs, i+1, strings.TrimSpace(item))
		case strings.TrimSpace(k) == "":
			return usageErr("invalid %s: item %d has no key (want key=value pairs separated by commas)", envResourceAttrs, i+1)
		}
		if _, err := url.PathUnescape(strings.TrimSpace(val)); err != nil {
			return usageErr("invalid %s: the value of %s is not percent-encoded right: a %% starts %%XX, two hex digits", envResourceAttrs, strings.TrimSpace(k))
		}
	}
	return nil
}

// checkSpanLimits checks the SDK's span limit variables: whole numbers (negative: no limit).
// get is not trimmed: the SDK does not trim them either. A general attribute limit that its
// span one overrides is not read: a bad value there is a warning.
func checkSpanLimits(get func(string) string, warn warnFunc) error {
	for _, name := range spanLimitVars {
		v := get(name)
		if v == "" {
			continue
		}
		if _, err := strconv.Atoi(v); err != nil {
			err := usageErr("invalid %s %q: want a whole number (negative: no limit)", name, v)
			if by := spanLimitOverrides[name]; by != "" && get(by) != "" {
				warn(name, by+" overrides it; on its own it would be refused: "+err.Error())
				continue
			}
			return err
		}
	}
	return nil
}

// parseBool reads a boolean variable's value as the specification has it: true or false in
// any case. Anything else is a usage error (the SDK takes it for false).
func parseBool(name, v string) (bool, error) {
	switch {
	case strings.EqualFold(v, "true"):
		return true, nil
	case strings.EqualFold(v, "false"):
		return false, nil
	}
	return false, usageErr("invalid %s %q: use true or false", name, v)
}

// millis reads a duration variable in whole milliseconds, 0 or more.
func millis(name, v string) (time.Duration, error) {
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 || n > math.MaxInt64/int64(time.Millisecond) {
		return 0, usageErr("invalid %s %q: want whole milliseconds, 0 or more", name, v)
	}
	return time.Duration(n) * time.Millisecond, nil
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

// propagators parses OTEL_PROPAGATORS: tracecontext, baggage and none, comma-separated, in
// any case (unset: tracecontext,baggage). The specification's other propagators (b3,
// b3multi, jaeger, xray, ottrace), which the relay does not have, are left out with a warning
// (platforms set the variable for every process); a name the specification does not know is
// a usage error naming the variable.
func propagators(v string, warn warnFunc) (propagation.TextMapPropagator, error) {
	if v == "" {
		v = "tracecontext,baggage"
	}
	var ps []propagation.TextMapPropagator
	var unknown []string // the specification's, not the relay's
	for _, name := range strings.Split(v, ",") {
		switch n := strings.ToLower(strings.TrimSpace(name)); n {
		case "tracecontext":
			ps = append(ps, propagation.TraceContext{})
		case "baggage":
			ps = append(ps, propagation.Baggage{})
		case "none", "":
		case "b3", "b3multi", "jaeger", "xray", "ottrace":
			unknown = append(unknown, n)
		default:
			return nil, usageErr("invalid %s: %q is not a propagator (use tracecontext, baggage or none)", envPropagators, strings.TrimSpace(name))
		}
	}
	for _, n := range unknown {
		if len(ps) == 0 {
			warn(envPropagators, fmt.Sprintf("the relay has no %s propagator (it has tracecontext and baggage), and none other is given: "+
				"no trace context is read or written, so the relay's spans do not join the producer's traces", n))
		} else {
			warn(envPropagators, fmt.Sprintf("the relay has no %s propagator: it propagates with the others given", n))
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
		if v := get(d.key); v != "" {
			ms, err := millis(d.key, v)
			if err != nil {
				return nil, err
			}
			opts = append(opts, d.opt(ms))
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
