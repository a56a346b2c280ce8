package relaycli

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/checkback"
	"github.com/txoutbox/txoutbox/internal/fault"
	"github.com/txoutbox/txoutbox/internal/redact"
	"github.com/txoutbox/txoutbox/relay"
)

func init() {
	register(command{name: "run", summary: "run the relay daemon", run: runCmd})
}

const runUsage = `
relay run: publish committed outbox rows to NATS JetStream until SIGINT or SIGTERM, then finish
and settle the batch in flight and exit 0.

Usage:
  relay run [settings]
`

// runFlags are the settings of `relay run`.
type runFlags struct {
	dsn, natsURL, schema string
	embedded             bool
	natsAuth             natsAuth

	cfg              relay.Config
	subjects         string
	logFormat, level string
	metricsAddr      string
	faultSettleDelay time.Duration

	cb          checkback.Config
	noCheckback bool

	faults string // testing only: fault-injection points to arm (hidden)
}

// fieldFlags maps relay.Config fields to the flags that set them, so that configuration
// errors name the setting the operator typed.
var fieldFlags = map[string]string{
	"ID": "relay-id", "Schema": "schema", "BatchSize": "batch-size", "MaxInFlight": "max-in-flight",
	"PublishTimeout": "publish-timeout", "PollMin": "poll-min", "PollMax": "poll-max",
	"BackoffBase": "backoff-base", "BackoffMax": "backoff-max", "BackoffJitter": "backoff-jitter",
	"MaxAttempts": "max-attempts", "PublishedRetention": "retention", "Partitions": "partitions",
	"LeaseInterval": "lease-interval", "HandoverAfter": "handover-after", "DoorbellSubject": "doorbell-subject", "DoorbellChannel": "doorbell-channel",
	"Subjects": "subjects", "CreateStream": "create-stream", "StreamDuplicates": "stream-duplicates",
	"SampleInterval": "sample-interval", "MaxMessageBytes": "max-message-bytes",
}

// literalZeros makes the command-line values literal: where relay.Config reads 0 as "the
// default", 0 here means none (txoutbox.Off), or is refused by run.
func (f *runFlags) literalZeros() {
	if f.cfg.BackoffJitter == 0 {
		f.cfg.BackoffJitter = txoutbox.Off
	}
}

func defineRunFlags(s *settings, f *runFlags) {
	sec := s.Section("Connections")
	s.String(&f.dsn, "database-url", "DATABASE_URL", "", "PostgreSQL connection URL (required unless --embedded)")
	sec("database-url")
	s.String(&f.natsURL, "nats-url", "NATS_URL", "", "NATS server URL")
	// Unset, it is DefaultNATSURL (connect), as relay checkback's default, or with --embedded
	// an in-process server: --help says so, not "".
	helpDefault(s, "nats-url", DefaultNATSURL+" (with --embedded: an in-process nats-server)")
	s.String(&f.schema, "schema", "", txoutbox.DefaultSchema, "Postgres schema holding the outbox tables")
	s.Bool(&f.embedded, "embedded", "", false, "development only: start a throwaway PostgreSQL and an in-process NATS for what is not configured, and migrate")
	// A development convenience is typed, never inherited: a stray TXOUTBOX_EMBEDDED in a
	// production environment must not turn it on.
	s.CommandLineOnly("embedded")
	defineNATSAuthFlags(s, &f.natsAuth)

	sec = s.Section("Publishing")
	s.String(&f.cfg.ID, "relay-id", "", "", "name of this relay in logs, metrics and partition listings (default hostname:pid)")
	sec("relay-id")
	s.Int(&f.cfg.BatchSize, "batch-size", "", relay.DefaultBatchSize, "rows per claim")
	s.Int(&f.cfg.MaxInFlight, "max-in-flight", "", relay.DefaultMaxInFlight, "async publishes awaiting their PubAck at most")
	s.Duration(&f.cfg.PublishTimeout, "publish-timeout", "", relay.DefaultPublishTimeout, "wait for one PubAck at most")
	s.Duration(&f.cfg.PollMin, "poll-min", "", relay.DefaultPollMin, "shortest poll interval (after a claim that found rows)")
	s.Duration(&f.cfg.PollMax, "poll-max", "", relay.DefaultPollMax, "longest poll interval (idle)")
	s.Duration(&f.cfg.BackoffBase, "backoff-base", "", relay.DefaultBackoffBase, "first retry delay of a failed row")
	s.Duration(&f.cfg.BackoffMax, "backoff-max", "", relay.DefaultBackoffMax, "longest retry delay (also caps the outage backoff)")
	s.FloatOr(&f.cfg.BackoffJitter, "backoff-jitter", "", relay.DefaultBackoffJitter, "off", "random spread of retry delays, a fraction in [0, 1) (off, -1 or 0: none)")
	s.Int(&f.cfg.MaxAttempts, "max-attempts", "", relay.DefaultMaxAttempts, "failed publishes before a row is dead")
	s.DurationOr(&f.cfg.PublishedRetention, "retention", "", 0, "forever", "keep published rows this long (0 deletes them at once; forever or -1 keeps them)")
	s.Int(&f.cfg.Partitions, "partitions", "", relay.DefaultPartitions, "partitions rows are spread over; the same on every relay")
	s.Duration(&f.cfg.LeaseInterval, "lease-interval", "", relay.DefaultLeaseInterval, "how often to heartbeat and rebalance partitions (a dead relay's are taken within about this long)")
	s.DurationOr(&f.cfg.HandoverAfter, "handover-after", "", relay.DefaultHandoverAfter, "off", "hand this relay's partitions to the others once JetStream has been unreachable from it this long (off or -1: never)")

	sec = s.Section("Streams and doorbell")
	s.String(&f.subjects, "subjects", "", "", "comma-separated subjects (wildcards allowed) a stream must capture; checked at start")
	sec("subjects")
	s.String(&f.cfg.CreateStream, "create-stream", "", "", "create a stream of this name for subjects no stream captures")
	s.Duration(&f.cfg.StreamDuplicates, "stream-duplicates", "", relay.DefaultStreamDuplicates, "duplicate window of a created stream")
	s.IntOr(&f.cfg.MaxMessageBytes, "max-message-bytes", "", relay.DefaultMaxMessageBytes, "off", "largest message producers may enqueue (their outbox.Config.MaxMessageBytes): a server or stream that takes less is refused at start (off, or -1: no check)")
	s.String(&f.cfg.DoorbellSubject, "doorbell-subject", "", relay.DefaultDoorbellSubject, "core NATS subject producers ring after commit")
	s.Bool(&f.cfg.DisableDoorbell, "no-doorbell", "", false, "do not listen for NATS doorbell rings")
	s.String(&f.cfg.DoorbellChannel, "doorbell-channel", "", "", "also LISTEN on this Postgres channel for rings (costs a connection)")

	defineCheckbackFlags(s, &f.cb, false)
	s.Bool(&f.noCheckback, "no-checkback", "", false, "do not run the check-back jobs in this process (run relay checkback elsewhere instead)")

	defineMetricsAddr(s, &f.metricsAddr)
	s.Duration(&f.cfg.SampleInterval, "sample-interval", "", relay.DefaultSampleInterval, "how often to sample the backlog gauges (a bounded query)")
	s.String(&f.logFormat, "log-format", "", "text", "log format: text or json")
	s.String(&f.level, "log-level", "", "info", "log level: debug, info, warn or error")
	if fault.Enabled { // only in binaries built with -tags txoutbox_fault, for the crash tests
		s.Duration(&f.faultSettleDelay, "fault-settle-delay", "", 0, "fault injection for crash tests: pause between publish and settle")
		s.Hide("fault-settle-delay")
		s.String(&f.faults, "fault", fault.EnvVar, "", "testing only: arm fault points, e.g. relay.before-settle=0.02 (SIGKILL there with that probability)")
		s.Hide("fault")
	}
}

func runCmd(ctx context.Context, env *Env, args []string) error {
	var f runFlags
	s := newSettings("run", runUsage, env.Stderr, env.Getenv)
	defineRunFlags(s, &f)
	if err := parseSettings(s, env, args); err != nil {
		return err
	}
	if len(s.Args()) > 0 {
		return usageErr("unexpected arguments %q", s.Args())
	}
	f.literalZeros()
	// Zero would silently mean "the default" to relay.Config; on the command line it is a mistake.
	for name, v := range map[string]int64{
		"batch-size": int64(f.cfg.BatchSize), "max-in-flight": int64(f.cfg.MaxInFlight), "max-attempts": int64(f.cfg.MaxAttempts),
		"partitions": int64(f.cfg.Partitions), "publish-timeout": int64(f.cfg.PublishTimeout), "poll-min": int64(f.cfg.PollMin),
		"poll-max": int64(f.cfg.PollMax), "backoff-base": int64(f.cfg.BackoffBase), "backoff-max": int64(f.cfg.BackoffMax),
		"lease-interval": int64(f.cfg.LeaseInterval), "sample-interval": int64(f.cfg.SampleInterval),
		"stream-duplicates": int64(f.cfg.StreamDuplicates), // relay.Config would read 0 as its default window
	} {
		if v <= 0 {
			return usageErr("invalid --%s: must be positive", name)
		}
	}
	if f.cfg.HandoverAfter == 0 {
		// Literally: hand the partitions over at the first publish JetStream does not answer.
		return usageErr("invalid --handover-after 0: the partitions would be handed over at the first publish JetStream does not answer; off (or -1) never hands them over")
	}
	if f.cfg.MaxMessageBytes == 0 {
		return usageErr("invalid --max-message-bytes: must be positive, or off (-1)")
	}
	log, err := newLogger(env.Stderr, f.logFormat, f.level)
	if err != nil {
		return err
	}
	// fault.Enabled is a constant: without the txoutbox_fault tag the compiler drops these
	// branches, and the linker the fault package's parser and point names with them.
	if fault.Enabled && f.faults != "" {
		if err := fault.ArmSpec(f.faults, nil); err != nil {
			return usageErr("invalid --fault: %v", err)
		}
		log.Warn("fault injection armed: this process will kill itself at these points", "points", f.faults)
	}
	cfg := f.cfg
	cfg.Schema = f.schema
	cfg.Logger = log
	for _, subj := range strings.Split(f.subjects, ",") {
		if subj = strings.TrimSpace(subj); subj != "" {
			cfg.Subjects = append(cfg.Subjects, subj)
		}
	}
	// Validate the configuration before connecting to anything.
	if err := relay.ValidateConfig(&cfg); err != nil {
		return configErr(err)
	}
	tr, err := setupTracing(ctx, env, log, defaultServiceName)
	if err != nil {
		return err
	}
	defer closeTracing(ctx, tr, log)
	cfg.TracerProvider, cfg.Propagator = tr.tp, tr.prop
	f.cb.TracerProvider, f.cb.Propagator = tr.tp, tr.prop
	if !f.noCheckback {
		f.cb.Schema = f.schema
		// The relay's retention: none (its rows are deleted as they are published, so there
		// is nothing to purge), a duration, or forever.
		f.cb.PublishedRetention = cmp.Or(cfg.PublishedRetention, txoutbox.Forever)
		f.cb.Logger = log
		if err := checkCheckbackFlags(&f.cb); err != nil {
			return err
		}
	}
	if f.natsURL != "" {
		if err := checkNATSURL(f.natsURL); err != nil {
			return err
		}
	}
	natsAuth, err := f.natsAuth.options(f.natsURL)
	if err != nil {
		return err
	}
	if err := checkMetricsAddr(f.metricsAddr); err != nil {
		return err
	}

	// One registry for the process: other components run by this command (the check-back,
	// ...) register their collectors here too, and /metrics serves them all.
	reg := newRegistry()
	waiting := &waitState{}
	var target *opsTarget
	if f.metricsAddr != "" { // nobody would read the metrics (and the backlog sampling costs queries)
		cfg.Registerer = reg
		// txoutbox_relay_health says starting while the relay waits for PostgreSQL or NATS (no
		// txoutbox series at all would keep TxoutboxRelayNotReady from firing); New adopts it.
		if err := relay.RegisterHealth(reg); err != nil {
			return err
		}
		// Served from the start: /healthz answers and /readyz says what the relay waits for.
		srv, t, err := startOpsEarly(f.metricsAddr, reg, cfg.WithDefaults().ID, f.schema, waiting, log)
		if err != nil {
			return err
		}
		defer srv.Close()
		target = t
	}
	c, err := connect(ctx, connectOptions{
		DSN: f.dsn, NATSURL: f.natsURL, NeedNATS: true, NATSAuth: natsAuth, Embedded: f.embedded,
		Schema: f.schema, Log: log, AppName: "txoutbox-relay", Wait: true, Waiting: waiting,
	})
	if err != nil {
		return err
	}
	defer c.Close()
	// A NATS connection nats.go gives up on for good (credentials refused after a rotation)
	// stops the relay like a signal, and is what it reports: exit status 1.
	ctx, stopWatching := c.untilNATSLost(ctx)
	defer stopWatching()
	err = runRelay(ctx, c, &f, cfg, reg, target, log)
	return c.withNATSLost(err)
}

// runRelay runs the relay (and the check-back unless --no-checkback) on c until ctx ends.
func runRelay(ctx context.Context, c *conns, f *runFlags, cfg relay.Config, reg *prometheus.Registry, target *opsTarget, log *slog.Logger) error {
	if err := checkSchema(ctx, c.Pool, f.schema); err != nil {
		return err
	}
	js, err := jetstream.New(c.NC)
	if err != nil {
		return err
	}
	r, err := relay.New(c.Pool, js, &cfg)
	if err != nil {
		return configErr(err)
	}
	if fault.Enabled && f.faultSettleDelay > 0 {
		// Crash tests wait for this line, then kill the relay between publish and settle.
		log.Warn("fault injection: every batch pauses between publish and settle", "delay", f.faultSettleDelay.String())
		d := f.faultSettleDelay
		if err := fault.Arm(fault.RelayBeforeSettle, 1, func(string) {
			log.Debug("fault injection: pausing before settle", "delay", d.String())
			time.Sleep(d)
		}); err != nil {
			return err
		}
	}
	if target != nil {
		target.attachRelay(c, r, f.schema)
	}
	if f.embedded {
		log.Info("embedded mode", "database_url", redact.DSN(c.DSN), "nats_url", redact.NATS(c.NATSURL))
	}
	// A nats-server too old for the relay is refused before the check-back starts.
	if err := relay.CheckServerVersion(c.NC); err != nil {
		return err
	}
	if f.noCheckback {
		return r.Run(ctx)
	}
	f.cb.Registerer = reg
	cb, err := checkback.New(c.Pool, c.NC, &f.cb)
	if err != nil {
		return checkbackConfigErr(err)
	}
	// The relay and the check-back run side by side; if the check-back fails, the relay stops
	// too and the failure is what relay run reports.
	rctx, stopRelay := context.WithCancel(ctx)
	defer stopRelay()
	cbctx, stopCheckback := context.WithCancel(ctx)
	cbErr := make(chan error, 1)
	go func() {
		err := cb.Run(cbctx)
		if err != nil {
			log.Error("check-back failed; stopping the relay", "err", err)
			stopRelay()
		}
		cbErr <- err
	}()
	// Both stop when ctx ends (SIGTERM). The check-back's work in flight (recording a check,
	// giving claimed rows back) has its own timeouts, which a PostgreSQL that stops answering
	// could spend past the relay's stop bound: relay run waits for it only until the relay's
	// own bound (relay.Config.MaxStopTime from the stop), so that it exits within
	// runStopBound. Rows it leaves claimed stay prepared and are checked again later.
	var stoppedAt atomic.Pointer[time.Time]
	unwatch := context.AfterFunc(ctx, func() { now := time.Now(); stoppedAt.Store(&now) })
	defer unwatch()
	err = r.Run(rctx)
	stopCheckback()
	from := time.Now()
	if at := stoppedAt.Load(); at != nil {
		from = *at
	}
	wait := time.NewTimer(max(time.Until(from.Add(f.cfg.MaxStopTime())), 0))
	defer wait.Stop()
	select {
	case cerr := <-cbErr:
		if cerr != nil {
			return errors.Join(fmt.Errorf("check-back: %w", cerr), err)
		}
	case <-wait.C:
		log.Warn("the check-back did not stop within the relay's stop bound; exiting without it (half messages it was checking stay prepared and are checked again)",
			"bound", f.cfg.MaxStopTime())
	}
	return err
}

// configErr turns a relay configuration error into a usage error naming the flag.
func configErr(err error) error {
	var ce *txoutbox.ConfigError
	if errors.As(err, &ce) {
		if name, ok := fieldFlags[strings.TrimPrefix(ce.Field, "Config.")]; ok {
			return usageErr("invalid --%s: %s", name, ce.Reason)
		}
	}
	return err
}
