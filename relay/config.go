package relay

import (
	"cmp"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"math"
	"os"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox"
	backoffpkg "github.com/txoutbox/txoutbox/internal/backoff"
	"github.com/txoutbox/txoutbox/internal/natsname"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Defaults for Config.
const (
	DefaultBatchSize        = 500
	DefaultMaxInFlight      = 1000
	DefaultPublishTimeout   = 5 * time.Second
	DefaultPollMin          = 10 * time.Millisecond
	DefaultPollMax          = time.Second
	DefaultBackoffBase      = time.Second
	DefaultBackoffMax       = time.Minute
	DefaultBackoffJitter    = 0.2
	DefaultMaxAttempts      = 20
	DefaultPartitions       = 8
	DefaultLeaseInterval    = 2 * time.Second
	DefaultHandoverAfter    = 10 * time.Second
	DefaultStreamDuplicates = 2 * time.Minute
	// DefaultMaxMessageBytes is outbox.DefaultMaxMessageBytes, the producers' default limit.
	DefaultMaxMessageBytes = outbox.DefaultMaxMessageBytes
	// DefaultDoorbellSubject is outbox.DefaultDoorbellSubject, the one value producers and
	// relays share; it has this name too so that every Config default is in its package.
	DefaultDoorbellSubject = outbox.DefaultDoorbellSubject
	DefaultSampleInterval  = 10 * time.Second
	DefaultSampleLimit     = 100_000
	// DefaultPublishedRetention is none: published rows are deleted as they are published.
	DefaultPublishedRetention time.Duration = 0
)

// maxLeaseInterval bounds Config.LeaseInterval: the lease arithmetic (the 10× lease, the 11×
// fence, the duplicate window's 14×) stays far from overflowing, and failover from taking
// more than hours.
const maxLeaseInterval = time.Hour

// Config configures a Relay. The zero value, given a pool and a JetStream, is usable.
type Config struct {
	// ID names this relay in logs, metrics, partition listings and its lease connection's
	// application_name (of which PostgreSQL keeps 63 bytes). It must be valid UTF-8 without a
	// NUL byte (PostgreSQL's text refuses both). Defaults to hostname:pid, or, where the
	// hostname cannot be read, relay-<8 random hex digits>:pid (derived, so no constant holds
	// it).
	ID string

	// Schema is the Postgres schema holding the outbox table: at most 63 bytes, no NUL byte.
	// Defaults to txoutbox.DefaultSchema ("public").
	Schema string

	// BatchSize is how many rows one claim takes. At most 10000. Defaults to 500.
	BatchSize int

	// MaxInFlight bounds the async publishes awaiting their PubAck. Defaults to 1000.
	MaxInFlight int

	// PublishTimeout bounds the wait for one PubAck (nats.go has no timeout by default).
	// At least 10ms. Defaults to 5s.
	PublishTimeout time.Duration

	// PollMin and PollMax bound the adaptive poll: after a claim that found nothing the interval
	// doubles up to PollMax; after one that found rows the relay claims again at once.
	// PollMax must be at least PollMin. Defaults to 10ms and max(1s, PollMin): PollMin alone
	// may be set above 1s. A doorbell ring wakes the relay at any time.
	PollMin time.Duration
	PollMax time.Duration

	// BackoffBase, BackoffMax and BackoffJitter shape the delay before a failed row's next
	// attempt: BackoffBase·2^(attempts-1), capped at BackoffMax, then multiplied by a random
	// factor in [1-BackoffJitter, 1+BackoffJitter]; a jittered delay above BackoffMax is
	// reflected below it, so no delay exceeds BackoffMax. BackoffMax also caps the relay's own
	// backoff while Postgres or NATS is unreachable. Both are at most 24h, and BackoffMax at
	// least BackoffBase. BackoffJitter is in (0, 1), or txoutbox.Off for no jitter (0 is the
	// default). Defaults to 1s, max(1m, BackoffBase) (BackoffBase alone may be set above 1m)
	// and 0.2.
	BackoffBase   time.Duration
	BackoffMax    time.Duration
	BackoffJitter float64

	// MaxAttempts is how many failed publishes make a row dead. Broker outages (timeouts,
	// lost connections) do not count: only errors about the message itself do. It has no off
	// or forever value (-1 is refused): a message the broker keeps refusing would hold its
	// key's later messages back for ever. Defaults to 20.
	MaxAttempts int

	// PublishedRetention, when positive, keeps published rows (state published, with
	// published_at and the stream sequence) for the check-back's purge job to delete after
	// PublishedRetention (set checkback.Config.PublishedRetention to the same value; relay run
	// does);
	// txoutbox.Forever keeps them and the check-back never purges them. Defaults to
	// DefaultPublishedRetention, none: rows are deleted as they are published, which keeps the table
	// small.
	PublishedRetention time.Duration

	// Partitions is the number of partitions rows are spread over (by hash of the key, or of
	// the id when there is no key). Each partition is published by one relay at a time, which
	// holds a session advisory lock on it as its lease; live relays share them evenly. Every
	// relay of one outbox must use the same value: a relay that finds a live relay with another
	// count refuses to run (ErrPartitionMismatch). At most 4096. Defaults to 8.
	Partitions int

	// LeaseInterval is how often the relay runs a lease round: it refreshes its membership
	// heartbeat, takes free partitions up to its fair share (and free partitions no
	// responsive relay waits for, beyond it) and releases extra ones another relay waits for.
	// A dead relay's partitions are taken within about this long. Each round renews the
	// relay's lease for 10×LeaseInterval, counted on its monotonic clock from the round's
	// start: it publishes nothing once that has passed without a renewal (a pause, a database
	// it cannot reach). Another relay ends the lease session of a relay whose heartbeat it has
	// seen unchanged for 11×LeaseInterval (the fence) and takes its partitions. Every relay of
	// one outbox should use the same value. At least 10ms, at most 1h (a dead relay's
	// partitions would wait that long, and a frozen one's 11 times as long). Defaults to 2s.
	LeaseInterval time.Duration

	// HandoverAfter: once this relay's own NATS connection has been down this long (whether
	// or not it had messages to publish: it counts from the first failed publish, or from the
	// first idle poll that found the connection down), the relay hands its partitions to the
	// relays that can still publish: it releases them and leaves the membership, then rejoins when its connection
	// is back and JetStream answers (it looks every lease round). A broker failing everyone
	// with the connections up is no reason to hand over. It needs a connection that does not
	// buffer publishes while it reconnects (nats.ReconnectBufSize(-1)); on any other, New
	// turns it off. Defaults to 10s; txoutbox.Off: never hand over.
	HandoverAfter time.Duration

	// DoorbellSubject is the core NATS subject producers ring after a commit (see
	// outbox.NATSDoorbell); a valid subject, wildcards allowed. Defaults to
	// "txoutbox.doorbell". DisableDoorbell turns it off.
	DoorbellSubject string
	DisableDoorbell bool

	// DoorbellChannel, when set, makes the relay LISTEN on this Postgres channel too (see
	// outbox.PostgresDoorbell). It costs one more connection. It must be valid UTF-8 of 1 to
	// outbox.MaxDoorbellChannelLength (63) bytes without a NUL byte, as the producers'
	// channel (outbox.ValidateDoorbellChannel): PostgreSQL would cut a longer name short for
	// LISTEN while the producers' pg_notify on the full name fails. Defaults to "" (off).
	DoorbellChannel string

	// Subjects are the subjects (wildcards allowed) this relay is expected to serve. At start,
	// Run checks that a stream captures each of them, that the stream can take publishes (not
	// no_ack, sealed, a mirror or a counter stream: ErrStreamUnusable), takes messages as large
	// as the producers may enqueue (MaxMessageBytes: ErrMessageLimit) and that its duplicate
	// window covers the relays' worst republish delay, RequiredDuplicateWindow: PublishTimeout
	// + min(PublishTimeout, 2s) + PollMax + max(BackoffMax, HandoverAfter + 2×LeaseInterval,
	// 11s + 2×LeaseInterval, 14×LeaseInterval), 68s with the defaults. See CheckStreams.
	// Defaults to none.
	Subjects []string

	// CreateStream, when set, names a stream Run creates (file storage) for Subjects that no
	// stream captures, with a duplicate window of StreamDuplicates; a valid stream name, and
	// only with Subjects (without them it would create nothing). Defaults to "" (a missing
	// stream is an error).
	CreateStream string

	// StreamDuplicates is the duplicate window of a stream created by CreateStream. Defaults
	// to 2m, raised to the required window if that is longer.
	StreamDuplicates time.Duration

	// MaxMessageBytes is the largest message the producers of this outbox may enqueue, counted
	// as package outbox counts it (outbox.EncodedSize): set it to the producers'
	// outbox.Config.MaxMessageBytes. At start, CheckStreams refuses a stream serving Subjects
	// whose max_msg_size, or a nats-server whose max_payload, is smaller (ErrMessageLimit): a
	// message the producers accept between the two limits could never be published. The
	// limit the SQL producers enforce in the relay's database (the setting
	// txoutbox.max_message_bytes, as txoutbox_max_message_bytes() reads it in the relay's
	// session) counts too when it is larger. Defaults to DefaultMaxMessageBytes, the producers'
	// default (outbox.DefaultMaxMessageBytes); txoutbox.Off: no such check (a smaller limit is
	// then only logged as a warning). At least 1024 and at most outbox.MaxMessageBytesLimit.
	MaxMessageBytes int

	// Logger receives structured logs, one line per state change. Defaults to slog.Default().
	Logger *slog.Logger

	// Registerer, when set, registers the relay's Prometheus metrics. Relays sharing a
	// registry share the collectors (counters add up; a per-relay gauge such as the partitions
	// held shows the last value set): wrap it per relay, e.g.
	// prometheus.WrapRegistererWith(prometheus.Labels{"relay": id}, reg), to tell them apart.
	// Defaults to none.
	Registerer prometheus.Registerer

	// SampleInterval is how often the relay samples the backlog gauges (rows by state, ready
	// backlog and oldest ready age per held partition) with a bounded query, when Registerer
	// is set. At least 10ms. Defaults to 10s.
	SampleInterval time.Duration

	// SampleLimit bounds the rows each sampling count reads, so sampling stays cheap however
	// large the backlog grows; a gauge at SampleLimit means "at least". Defaults to 100000.
	SampleLimit int

	// TracerProvider provides the tracer of the relay's publish spans: one span per message
	// published that carries a trace context ("publish <subject>", kind client), a child of
	// the trace context the producer captured in the message's headers and linked to it; a
	// message without one gets no span (see the README's Traces section). Defaults
	// to the global provider (otel.GetTracerProvider), which records nothing until the
	// application sets one.
	TracerProvider trace.TracerProvider

	// Propagator reads the producer's trace context from a message's headers. The relay never
	// changes those headers: the consumer gets the producer's context as it was captured.
	// Defaults to the global propagator (otel.GetTextMapPropagator), which reads nothing until
	// the application sets one.
	Propagator propagation.TextMapPropagator
}

// WithDefaults returns a copy of c with every unset field set to its default, except
// TracerProvider and Propagator: left nil, they mean the OpenTelemetry globals (see those
// fields).
func (c *Config) WithDefaults() *Config {
	out := Config{}
	if c != nil {
		out = *c
	}
	if out.ID == "" {
		out.ID = fmt.Sprintf("%s:%d", hostname(), os.Getpid())
	}
	out.Schema = cmp.Or(out.Schema, txoutbox.DefaultSchema)
	out.BatchSize = cmp.Or(out.BatchSize, DefaultBatchSize)
	out.MaxInFlight = cmp.Or(out.MaxInFlight, DefaultMaxInFlight)
	out.PublishTimeout = cmp.Or(out.PublishTimeout, DefaultPublishTimeout)
	out.PollMin = cmp.Or(out.PollMin, DefaultPollMin)
	out.PollMax = cmp.Or(out.PollMax, max(DefaultPollMax, out.PollMin))
	out.BackoffBase = cmp.Or(out.BackoffBase, DefaultBackoffBase)
	out.BackoffMax = cmp.Or(out.BackoffMax, max(DefaultBackoffMax, out.BackoffBase))
	out.BackoffJitter = cmp.Or(out.BackoffJitter, DefaultBackoffJitter)
	out.MaxAttempts = cmp.Or(out.MaxAttempts, DefaultMaxAttempts)
	out.Partitions = cmp.Or(out.Partitions, DefaultPartitions)
	out.LeaseInterval = cmp.Or(out.LeaseInterval, DefaultLeaseInterval)
	out.HandoverAfter = cmp.Or(out.HandoverAfter, DefaultHandoverAfter)
	out.PublishedRetention = cmp.Or(out.PublishedRetention, DefaultPublishedRetention)
	out.DoorbellSubject = cmp.Or(out.DoorbellSubject, DefaultDoorbellSubject)
	out.StreamDuplicates = cmp.Or(out.StreamDuplicates, DefaultStreamDuplicates)
	out.MaxMessageBytes = cmp.Or(out.MaxMessageBytes, DefaultMaxMessageBytes)
	out.SampleInterval = cmp.Or(out.SampleInterval, DefaultSampleInterval)
	out.SampleLimit = cmp.Or(out.SampleLimit, DefaultSampleLimit)
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	return &out
}

// hostname is the host's name for the default ID: os.Hostname, made valid for an ID (valid
// UTF-8, no NUL byte); where it cannot be read (or is empty), "relay-" and 8 random hex
// digits, so that relays on such hosts still tell apart.
func hostname() string {
	host, err := os.Hostname()
	host = strings.ReplaceAll(strings.ToValidUTF8(host, "?"), "\x00", "")
	if err != nil || host == "" {
		var b [4]byte
		_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24)
		host = "relay-" + hex.EncodeToString(b[:])
	}
	return host
}

// RequiredDuplicateWindow is the shortest stream duplicate window that absorbs every republish
// the relays of one outbox make while they run, all configured like c. A message stored at
// time S is republished (sent again, because its row was not settled) at the latest:
//
//   - by the same relay, after a publish whose PubAck timed out, the look at JetStream that
//     explains it (min(PublishTimeout, 2s)) and its backoff: PublishTimeout + min(PublishTimeout,
//     2s) + BackoffMax, and a poll interval more (PollMax) when the backoff was the row's own
//     (a failed row waits for the next claim after its retry time);
//   - by the relay its partitions were handed to while its NATS connection was down:
//     PublishTimeout + HandoverAfter + 2×LeaseInterval (unless HandoverAfter is txoutbox.Off);
//   - by the relay that takes its partitions once PostgreSQL ended its lease session (the
//     process died: at once; its host died or its network was cut: within the session's TCP
//     keepalive and user timeout, 11s): PublishTimeout + 11s + 2×LeaseInterval;
//   - by the relay that fenced it after it froze (SIGSTOP, a VM pause, a long GC) right after
//     the PubAck: the fence comes 11×LeaseInterval after the fencing relay first saw its last
//     heartbeat (the 10×LeaseInterval lease plus 10% for clock rates), then up to a round to
//     see that heartbeat and one to take the partitions and claim: PublishTimeout +
//     14×LeaseInterval.
//
// A relay that took partitions while it slept (it already held some) claims their rows at its
// next poll: each takeover may wait PollMax more; and the look at JetStream comes before the
// handover clock starts. So, every term with both: PublishTimeout + min(PublishTimeout, 2s) +
// PollMax + max(BackoffMax, HandoverAfter + 2×LeaseInterval, 11s + 2×LeaseInterval,
// 14×LeaseInterval). The configuration's defaults apply to unset fields (a nil Config is the
// defaults'): with the defaults, 5s + 2s + 1s + 1m = 68s. The frozen relay itself never
// republishes: a lease also expires on its holder's monotonic clock, 10 lease intervals
// after its last successful lease round, and a relay checks that expiry immediately before it
// hands each message to the NATS client, so a relay that wakes after being fenced sends
// nothing more.
//
// Outages are not bounded, and the window cannot cover them: a republish after one may come
// later than the window, and the stream then stores the message a second time (a new stream
// sequence). The idempotent consumer's dedup row (by Nats-Msg-Id) absorbs those copies. They
// come from
//
//   - a relay or a database that is down longer than the window (its unsettled rows are
//     republished when it is back); a database too slow to answer counts as down: a settle
//     waits for the next claim and then for itself (30 s each at most), and rows whose settle
//     failed are claimed again, up to about a minute after their PubAck;
//   - a NATS or stream outage longer than the window: a message the stream stored whose PubAck
//     was lost (the stream's leader died with it in flight, the connection dropped) stays
//     ready, no attempt counted — its stream is in an outage, or the broker is down — and is
//     republished when the stream answers again, however long that took.
//
// The causes add up: the window covers each delay on its own, and an outage that follows
// another (a freeze and a takeover, a crash and a restart) adds its whole length to it, so an
// outage a few seconds shorter than the window can be enough (seen in the cluster chaos proof:
// a frozen relay's send, taken over, then a 12 s stream outage, republished 14.7 s after the
// first copy with a 13.5 s window). Size the window generously; the consumer's dedup row is
// what makes such copies harmless.
//
// The sums saturate: a configuration whose window would pass the largest time.Duration
// (about 292 years; ValidateConfig refuses none of the fields it adds up on that account)
// gets that largest value, never a wrapped negative one.
func (c *Config) RequiredDuplicateWindow() time.Duration {
	c = c.WithDefaults()
	d := c.BackoffMax
	if c.HandoverAfter >= 0 {
		d = max(d, addSat(c.HandoverAfter, mulSat(2, c.LeaseInterval)))
	}
	d = max(d, addSat(sessionEndBound, mulSat(2, c.LeaseInterval)), mulSat(fenceFactor+3, c.LeaseInterval))
	return addSat(addSat(addSat(c.PublishTimeout, min(c.PublishTimeout, probeBound)), c.PollMax), d)
}

// addSat is a+b for non-negative durations, saturating at the largest time.Duration.
func addSat(a, b time.Duration) time.Duration {
	if b > 0 && a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// mulSat is n·d for a positive n and a non-negative d, saturating at the largest
// time.Duration.
func mulSat(n int64, d time.Duration) time.Duration {
	if d > 0 && int64(d) > math.MaxInt64/n {
		return math.MaxInt64
	}
	return time.Duration(n) * d
}

func (c *Config) validate() error {
	bad := func(field, format string, args ...any) error {
		return &txoutbox.ConfigError{Package: "relay", Field: "Config." + field, Reason: fmt.Sprintf(format, args...)}
	}
	// badErr is bad for a failure with an error behind it (a validation sentinel), kept as Err.
	badErr := func(field string, err error, format string, args ...any) error {
		return &txoutbox.ConfigError{Package: "relay", Field: "Config." + field, Reason: fmt.Sprintf(format, args...), Err: err}
	}
	if err := migrations.ValidateSchemaName(c.Schema); err != nil {
		return bad("Schema", "is invalid: %v", err)
	}
	switch {
	case c.BatchSize < 1 || c.BatchSize > 10000:
		return bad("BatchSize", "must be between 1 and 10000, got %d", c.BatchSize)
	case c.MaxInFlight < 1:
		return bad("MaxInFlight", "must be at least 1, got %d", c.MaxInFlight)
	case c.PublishTimeout < 10*time.Millisecond:
		return bad("PublishTimeout", "must be at least 10ms, got %s", c.PublishTimeout)
	case c.PollMin <= 0:
		return bad("PollMin", "must be positive, got %s", c.PollMin)
	case c.PollMax < c.PollMin:
		return bad("PollMax", "must be at least PollMin (%s), got %s", c.PollMin, c.PollMax)
	case c.BackoffBase <= 0 || c.BackoffBase > backoffpkg.MaxDelay:
		return bad("BackoffBase", "must be positive and at most %s, got %s", backoffpkg.MaxDelay, c.BackoffBase)
	case c.BackoffMax < c.BackoffBase:
		return bad("BackoffMax", "must be at least BackoffBase (%s), got %s", c.BackoffBase, c.BackoffMax)
	case c.BackoffMax > backoffpkg.MaxDelay:
		return bad("BackoffMax", "must be at most %s, got %s", backoffpkg.MaxDelay, c.BackoffMax)
	case c.BackoffJitter != txoutbox.Off && !(c.BackoffJitter > 0 && c.BackoffJitter < 1): // NaN too
		return bad("BackoffJitter", "must be in (0, 1), or txoutbox.Off (-1) for no jitter (0 is the default), got %g", c.BackoffJitter)
	case c.MaxAttempts < 1:
		return bad("MaxAttempts", "must be at least 1, got %d", c.MaxAttempts)
	case c.PublishedRetention < 0 && c.PublishedRetention != txoutbox.Forever:
		return bad("PublishedRetention", "must not be negative except txoutbox.Forever (-1), got %s", c.PublishedRetention)
	case c.HandoverAfter < 0 && c.HandoverAfter != txoutbox.Off:
		return bad("HandoverAfter", "must not be negative except txoutbox.Off (-1), got %s", c.HandoverAfter)
	case c.Partitions < 1 || c.Partitions > 4096:
		return bad("Partitions", "must be between 1 and 4096, got %d", c.Partitions)
	case c.LeaseInterval < 10*time.Millisecond || c.LeaseInterval > maxLeaseInterval:
		return bad("LeaseInterval", "must be at least 10ms and at most %s, got %s", maxLeaseInterval, c.LeaseInterval)
	case c.StreamDuplicates < 0:
		return bad("StreamDuplicates", "must not be negative, got %s", c.StreamDuplicates)
	case c.MaxMessageBytes != txoutbox.Off && (c.MaxMessageBytes < 1024 || c.MaxMessageBytes > outbox.MaxMessageBytesLimit):
		return bad("MaxMessageBytes", "must be between 1024 and %d (outbox.MaxMessageBytesLimit), or txoutbox.Off (-1), got %d", outbox.MaxMessageBytesLimit, c.MaxMessageBytes)
	case c.SampleInterval < 10*time.Millisecond:
		return bad("SampleInterval", "must be at least 10ms, got %s", c.SampleInterval)
	case c.SampleLimit < 1:
		return bad("SampleLimit", "must be at least 1, got %d", c.SampleLimit)
	}
	if err := validText(c.ID); err != nil {
		return bad("ID", "%v", err)
	}
	if c.DoorbellChannel != "" {
		// The producers' rule (outbox.NewPostgresDoorbell refuses the same names).
		if err := outbox.ValidateDoorbellChannel(c.DoorbellChannel); err != nil {
			return bad("DoorbellChannel", "%v", err)
		}
	}
	if !c.DisableDoorbell {
		if err := outbox.ValidateSubjectFilter(c.DoorbellSubject); err != nil {
			return badErr("DoorbellSubject", err, "is invalid: %v", err)
		}
	}
	for _, s := range c.Subjects {
		if err := outbox.ValidateSubjectFilter(s); err != nil {
			return badErr("Subjects", err, "has an invalid subject %q: %v", s, err)
		}
	}
	if c.CreateStream != "" {
		if err := natsname.ValidateName(c.CreateStream); err != nil {
			return bad("CreateStream", "is not a valid stream name: %v", err)
		}
		if len(c.Subjects) == 0 {
			return bad("CreateStream", "needs Subjects: the stream is created for the subjects no stream captures, and none are named")
		}
	}
	return nil
}

// validText reports whether s can be a PostgreSQL text value: valid UTF-8, no NUL byte.
func validText(s string) error {
	switch {
	case !utf8.ValidString(s):
		return fmt.Errorf("%q is not valid UTF-8", s)
	case strings.IndexByte(s, 0) >= 0:
		return fmt.Errorf("%q contains a NUL byte", s)
	}
	return nil
}

// ValidateConfig reports whether cfg, with defaults applied, is valid; errors are
// *txoutbox.ConfigError values naming the field.
func ValidateConfig(cfg *Config) error { return cfg.WithDefaults().validate() }
