package consumer

import (
	"cmp"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/backoff"
	"github.com/txoutbox/txoutbox/internal/natsname"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Defaults for Config.
const (
	DefaultConcurrency   = 4
	DefaultBatchSize     = 1
	DefaultMaxDeliveries = 10
	DefaultBackoffBase   = time.Second
	DefaultBackoffMax    = 5 * time.Minute
	DefaultBackoffJitter = 0.3
	DefaultAckWait       = 30 * time.Second
	DefaultMaxAckPending = 1000
	DefaultPullHeartbeat = 2500 * time.Millisecond
	// DefaultBatchWait is no wait: a batch takes the messages that have already arrived.
	DefaultBatchWait time.Duration = 0
	// DefaultDeadLetterPrefix followed by the durable name is the default dead-letter subject.
	DefaultDeadLetterPrefix = "txoutbox.dead."
)

// maxPullHeartbeat is half of the pull expiry (nats.go's default, 30s), the most nats.go accepts.
const maxPullHeartbeat = jetstream.DefaultExpires / 2

// MaxBatchSize bounds Config.BatchSize.
const MaxBatchSize = 1000

// Config configures a Consumer. Stream and Durable are required; everything else has a default.
type Config struct {
	// Stream is the JetStream stream to consume, a name JetStream accepts: at most 255
	// bytes, none of '.', '*', '>', white space, '/' or '\'. Required.
	Stream string

	// Durable names the durable pull consumer, which Run creates or updates with the settings
	// below (explicit acks). Every instance of one logical consumer uses the same name: they
	// share the work, and the name is also the consumer column of the dedup table, so it
	// must not change while dedup rows matter. A name JetStream accepts, as for Stream.
	// Required.
	Durable string

	// FilterSubjects restricts the consumer to these subjects (valid subjects, wildcards
	// allowed). Defaults to the whole stream.
	FilterSubjects []string

	// Schema is the Postgres schema holding txoutbox_consumer_dedup: at most 63 bytes, no NUL
	// byte. Defaults to txoutbox.DefaultSchema ("public").
	Schema string

	// Concurrency is how many messages (or, in batch mode, batches) are handled at once; each
	// uses one Postgres connection while it runs. At most 10000. Defaults to 4.
	Concurrency int

	// BatchSize, when above 1, switches to batch mode: up to BatchSize messages are handled
	// in one Postgres transaction and acked after its commit. This saves one commit (and its
	// WAL flush) per message.
	//
	// Handlers may run more than once per delivery in batch mode. The batch first runs without
	// savepoints; if a handler fails, that transaction is rolled back and the batch runs again
	// with a savepoint per message (the failing message, not run again, rolls back alone), so
	// the handlers of the other messages run twice. If the server refuses the batch's commit
	// (a deferred constraint, a serialization failure), every handler of the batch runs again,
	// each message in its own transaction. Handlers must therefore keep all their side effects
	// inside the transaction, and Stats.HandlerCalls, Stats.HandlerTime and the handler
	// latency metric count these reruns.
	//
	// Keep it at or below 64: every savepoint that writes takes a subtransaction id, and a
	// transaction with more than 64 of them overflows PostgreSQL's per-backend subtransaction
	// cache, which slows every other session's snapshots while it runs. A consumer made with
	// NewBatch runs its BatchHandler once per batch without savepoints (see NewBatch for its
	// reruns), and the 64 bound does not apply to it. Defaults to 1 (one transaction per
	// message), or DefaultBatchHandlerSize (100) with NewBatch. At most 1000.
	BatchSize int

	// BatchWait is how long a batch waits for more messages once it has one; not negative.
	// Defaults to DefaultBatchWait, 0: a batch takes what has already arrived and does not
	// wait.
	BatchWait time.Duration

	// Ordered, when set, applies the messages of one ordering key (the Txoutbox-Key header)
	// in stream order, across consumer restarts, crashes and any number of instances of the
	// durable, while different keys (and unkeyed messages) run in parallel. In the
	// transaction that applies a keyed message, the consumer locks the key's row of
	// txoutbox_consumer_key_order (migration 003; Setup refuses a schema without it) and
	// applies the message only when every earlier message of the key in the stream was
	// applied or dead-lettered; it then records the message's stream sequence for the key in
	// that transaction. A message whose earlier ones are still out (held by another instance,
	// or delivered to a consumer that died and waiting for their AckWait) waits, held and
	// kept alive, without counting a delivery. A failed keyed message is retried in place,
	// holding its key back; a dead-lettered one lets its key go on. Every instance of the
	// durable must set Ordered. In batch mode keyed messages get one transaction each (with
	// NewBatch, a batch of one).
	// Defaults to false.
	Ordered bool

	// MaxDeliveries is how many times a message is tried before it goes to the dead-letter
	// subject. The count is JetStream's delivery count (plus in-place retries in ordered mode),
	// so a delivery that timed out (a crashed or stuck consumer) counts too. The JetStream
	// consumer itself is created with unlimited deliveries, so the server never drops a message
	// silently: the consumer dead-letters it. It has no off or forever value (-1 is refused):
	// a message that always fails would come back for ever (and, in ordered mode, hold its
	// key back). Defaults to 10.
	MaxDeliveries int

	// BackoffBase, BackoffMax and BackoffJitter shape the redelivery delay after a handler
	// error (sent with NakWithDelay; JetStream's own BackOff applies only to ack timeouts):
	// BackoffBase·2^(deliveries-1), capped at BackoffMax, times a random factor in
	// [1-BackoffJitter, 1+BackoffJitter] (a jittered delay above BackoffMax is reflected
	// below it, so none exceeds BackoffMax), so messages that failed together do not come
	// back together — the same rule as the relay's and the check-back's. Both durations are
	// at most 24h, and BackoffMax at least BackoffBase. BackoffJitter is in (0, 1), or
	// txoutbox.Off for no jitter (0 is the default). Defaults to 1s, max(5m, BackoffBase)
	// (BackoffBase alone may be set above 5m) and 0.3.
	BackoffBase   time.Duration
	BackoffMax    time.Duration
	BackoffJitter float64

	// DeadLetterSubject receives messages that failed MaxDeliveries times, that the handler
	// rejected with Permanent, or that cannot be decoded. A JetStream stream must capture it
	// (Run checks), and it must not be one this consumer reads; a valid subject without
	// wildcards. Defaults to
	// "txoutbox.dead.<Durable>".
	DeadLetterSubject string

	// AckWait is how long JetStream waits for an ack before it redelivers. At least 1ms.
	// Defaults to 30s.
	AckWait time.Duration

	// InProgressInterval is how often a message the consumer holds (running, waiting for its
	// key, or waiting to be retried in place) is kept alive with an in-progress ack, so that
	// long handlers are not redelivered to another instance. The keepalive checks every
	// InProgressInterval/2, so two in-progress acks can be up to 1.5·InProgressInterval apart:
	// it must be at most AckWait/2. Defaults to AckWait/3 (derived, so no constant holds it).
	InProgressInterval time.Duration

	// MaxAckPending bounds the messages delivered and not yet acked, across all instances of
	// the durable. It has no off or forever value (-1, JetStream's "unlimited", is refused):
	// it is what bounds the messages an instance holds, parked keys' messages included in
	// ordered mode. Defaults to 1000.
	MaxAckPending int

	// PullMaxMessages is how many messages the JetStream client buffers ahead of the workers.
	// The consumer takes in at most Concurrency·BatchSize + PullMaxMessages messages; while it
	// is full, up to PullMaxMessages more wait in the client's buffer, and those get no
	// in-progress ack: their AckWait runs from their delivery. Keep it small enough that the
	// workers get through PullMaxMessages messages well within AckWait, or JetStream
	// redelivers them (a duplicate, caught by its dedup row, and a delivery that counts
	// towards MaxDeliveries). Defaults to 2·Concurrency·BatchSize, at least 16 (derived, so no
	// constant holds it).
	PullMaxMessages int

	// PullHeartbeat is how often JetStream confirms that the consumer's open pull request is
	// still held while no message comes. A pull lost on the server's side — a stream or
	// consumer leader election answers it with no responders, or a restarted node forgets it —
	// is noticed after two missing heartbeats and made again. It must be at most 15s (half of
	// the client's 30s pull expiry) and at least 100ms. Defaults to 2.5s: the consumer resumes within about 5s of
	// the stream having a leader again.
	PullHeartbeat time.Duration

	// StopTimeout bounds the graceful stop: handlers still running that long after the stop
	// have their context cancelled and their messages are nak'ed for redelivery (no attempt
	// counted, and neither counted nor logged as an outage: Stats.Unavailable is for real
	// failures); txoutbox.Forever waits for them however long they run. Defaults to AckWait
	// (derived, so no constant holds it).
	StopTimeout time.Duration

	// Logger receives structured logs, one line per state change. Defaults to slog.Default().
	Logger *slog.Logger

	// Registerer, when set, registers the consumer's Prometheus metrics (labelled with the
	// durable name). Consumers of one durable sharing a registry (several in a process, or one
	// restarted) share the counters. The same counts, per Consumer, are always available from
	// Consumer.Stats. Defaults to none.
	Registerer prometheus.Registerer

	// TracerProvider provides the tracer of the consumer's process spans: one per message
	// handled ("process <subject>", kind consumer), a child of the trace context the producer
	// captured in the message's headers, carried by the handler's ctx and ended with the
	// message's outcome (applied, duplicate, retried, dead_lettered); with NewBatch, one per
	// batch with a link per message. Defaults to the global provider
	// (otel.GetTracerProvider), which records nothing until the application sets one.
	TracerProvider trace.TracerProvider

	// Propagator reads the producer's trace context from a message's headers, and writes the
	// process span's into a dead letter of a message that carried none. Defaults to the
	// global propagator (otel.GetTextMapPropagator), which does nothing until the application
	// sets one.
	Propagator propagation.TextMapPropagator
}

// WithDefaults returns a copy of c with every unset field set to its default (Stream and
// Durable, required, have none), except: DeadLetterSubject stays empty while Durable is (its
// default derives from it); Registerer stays nil (no metrics, its default); and a nil
// TracerProvider and Propagator stay nil: they mean OpenTelemetry's global provider and
// propagator (otel.GetTracerProvider, otel.GetTextMapPropagator), taken by New, not filled in
// here. c may be nil.
func (c *Config) WithDefaults() *Config {
	out := Config{}
	if c != nil {
		out = *c
	}
	out.Schema = cmp.Or(out.Schema, txoutbox.DefaultSchema)
	out.Concurrency = cmp.Or(out.Concurrency, DefaultConcurrency)
	out.BatchSize = cmp.Or(out.BatchSize, DefaultBatchSize)
	out.MaxDeliveries = cmp.Or(out.MaxDeliveries, DefaultMaxDeliveries)
	out.BackoffBase = cmp.Or(out.BackoffBase, DefaultBackoffBase)
	out.BackoffMax = cmp.Or(out.BackoffMax, max(DefaultBackoffMax, out.BackoffBase))
	out.BackoffJitter = cmp.Or(out.BackoffJitter, DefaultBackoffJitter)
	if out.Durable != "" {
		out.DeadLetterSubject = cmp.Or(out.DeadLetterSubject, DefaultDeadLetterPrefix+out.Durable)
	}
	out.BatchWait = cmp.Or(out.BatchWait, DefaultBatchWait)
	out.AckWait = cmp.Or(out.AckWait, DefaultAckWait)
	out.InProgressInterval = cmp.Or(out.InProgressInterval, out.AckWait/3)
	out.MaxAckPending = cmp.Or(out.MaxAckPending, DefaultMaxAckPending)
	out.PullMaxMessages = cmp.Or(out.PullMaxMessages, max(16, 2*out.Concurrency*out.BatchSize))
	out.PullHeartbeat = cmp.Or(out.PullHeartbeat, DefaultPullHeartbeat)
	out.StopTimeout = cmp.Or(out.StopTimeout, out.AckWait)
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	return &out
}

func (c *Config) validate() error {
	bad := func(field, format string, args ...any) error {
		return &txoutbox.ConfigError{Package: "consumer", Field: "Config." + field, Reason: fmt.Sprintf(format, args...)}
	}
	// badErr is bad for a failure with an error behind it (a validation sentinel), kept as Err.
	badErr := func(field string, err error, format string, args ...any) error {
		return &txoutbox.ConfigError{Package: "consumer", Field: "Config." + field, Reason: fmt.Sprintf(format, args...), Err: err}
	}
	if err := natsname.ValidateName(c.Stream); err != nil {
		return bad("Stream", "%v", err)
	}
	if err := natsname.ValidateName(c.Durable); err != nil {
		return bad("Durable", "%v", err)
	}
	if err := migrations.ValidateSchemaName(c.Schema); err != nil {
		return bad("Schema", "is invalid: %v", err)
	}
	for _, s := range c.FilterSubjects {
		if err := outbox.ValidateSubjectFilter(s); err != nil {
			return badErr("FilterSubjects", err, "has an invalid subject %q: %v", s, err)
		}
	}
	if err := outbox.ValidateSubject(c.DeadLetterSubject); err != nil {
		return badErr("DeadLetterSubject", err, "is invalid: %v", err)
	}
	for _, f := range c.FilterSubjects {
		if natsname.Covers(f, c.DeadLetterSubject) {
			return bad("DeadLetterSubject", "%q is matched by FilterSubjects %q: dead letters would come back to this consumer", c.DeadLetterSubject, f)
		}
	}
	switch {
	case c.Concurrency < 1 || c.Concurrency > 10000:
		return bad("Concurrency", "must be between 1 and 10000, got %d", c.Concurrency)
	case c.BatchSize < 1 || c.BatchSize > MaxBatchSize:
		return bad("BatchSize", "must be between 1 and %d, got %d", MaxBatchSize, c.BatchSize)
	case c.BatchWait < 0:
		return bad("BatchWait", "must not be negative, got %s", c.BatchWait)
	case c.MaxDeliveries < 1:
		return bad("MaxDeliveries", "must be at least 1, got %d", c.MaxDeliveries)
	case c.BackoffBase <= 0 || c.BackoffBase > backoff.MaxDelay:
		return bad("BackoffBase", "must be positive and at most %s, got %s", backoff.MaxDelay, c.BackoffBase)
	case c.BackoffMax < c.BackoffBase:
		return bad("BackoffMax", "must be at least BackoffBase (%s), got %s", c.BackoffBase, c.BackoffMax)
	case c.BackoffMax > backoff.MaxDelay:
		return bad("BackoffMax", "must be at most %s, got %s", backoff.MaxDelay, c.BackoffMax)
	case c.BackoffJitter != txoutbox.Off && !(c.BackoffJitter > 0 && c.BackoffJitter < 1): // NaN too
		return bad("BackoffJitter", "must be in (0, 1), or txoutbox.Off (-1) for no jitter (0 is the default), got %g", c.BackoffJitter)
	case c.AckWait < time.Millisecond:
		return bad("AckWait", "must be at least 1ms, got %s", c.AckWait)
	case c.InProgressInterval <= 0 || c.InProgressInterval > c.AckWait/2:
		return bad("InProgressInterval", "must be positive and at most AckWait/2 (%s), got %s", c.AckWait/2, c.InProgressInterval)
	case c.MaxAckPending < 1:
		return bad("MaxAckPending", "must be at least 1, got %d", c.MaxAckPending)
	case c.PullMaxMessages < 1:
		return bad("PullMaxMessages", "must be at least 1, got %d", c.PullMaxMessages)
	case c.PullHeartbeat < 100*time.Millisecond || c.PullHeartbeat > maxPullHeartbeat:
		return bad("PullHeartbeat", "must be between 100ms and %s, got %s", maxPullHeartbeat, c.PullHeartbeat)
	case c.StopTimeout <= 0 && c.StopTimeout != txoutbox.Forever:
		return bad("StopTimeout", "must be positive, or txoutbox.Forever (-1), got %s", c.StopTimeout)
	}
	return nil
}

// ValidateConfig reports whether cfg, with defaults applied, is valid; errors are
// *txoutbox.ConfigError values naming the field.
func ValidateConfig(cfg *Config) error { return cfg.WithDefaults().validate() }

// backoff is the redelivery delay after the attempt-th failed attempt (1-based).
func (c *Config) backoff(attempt int) time.Duration {
	return backoff.Exponential(max(attempt, 1), c.BackoffBase, c.BackoffMax, c.BackoffJitter)
}

// setupDelay is the wait after the pass-th failed set-up (Run waiting for JetStream): 100ms
// doubling up to 2s, with BackoffJitter (the one backoff every component uses).
func (c *Config) setupDelay(pass int) time.Duration {
	return backoff.Exponential(pass, 100*time.Millisecond, 2*time.Second, c.BackoffJitter)
}
