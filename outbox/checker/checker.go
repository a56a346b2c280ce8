// Package checker is the producer's side of the check-back: a producer group's checker
// answers, over NATS, whether the local transaction of a stale half message committed
// (RocketMQ's checkLocalTransaction). Producers import it, not the check-back's job runner.
//
// The check-back (package checkback, run by `relay run` or `relay checkback`) asks on
// Subject(prefix, group) with a JSON Request; Serve answers COMMIT, ROLLBACK or UNKNOWN, and
// only for requests of the outbox it was given.
package checker

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/dbhandle"
	"github.com/txoutbox/txoutbox/internal/prom"
	"github.com/txoutbox/txoutbox/internal/safetext"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/tracing"
	"github.com/txoutbox/txoutbox/outbox"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// ErrNoOutbox is matched (errors.Is) by the error Serve and ValidateConfig return when
// Config.Outbox is empty: a checker must know which outbox it answers for, or it could settle
// the half messages of another service that uses the same producer group name. That error is
// a *txoutbox.ConfigError naming Config.Outbox, so it also matches txoutbox.ErrInvalidConfig.
var ErrNoOutbox = errors.New("checker: no outbox named")

// Func answers a check: did the local transaction of this half message commit? Return
// outbox.StateCommit or outbox.StateRollback only when the outcome is certain;
// outbox.StateUnknown (or an error) makes the check-back ask again later, up to its maximum
// number of checks. ctx ends when the check-back stops waiting for the answer.
type Func func(ctx context.Context, req Request) (outbox.LocalState, error)

// Defaults for Config.
const (
	// DefaultSubjectPrefix is also the check-back's default Config.SubjectPrefix
	// (checkback.DefaultSubjectPrefix is defined as it).
	DefaultSubjectPrefix = "txoutbox.check"
	// DefaultQueueGroup is the NATS micro default queue group.
	DefaultQueueGroup  = micro.DefaultQueueGroup
	DefaultConcurrency = 16
	// DefaultRequestTimeout is also the check-back's default Config.RequestTimeout
	// (checkback.DefaultRequestTimeout is defined as it).
	DefaultRequestTimeout = 3 * time.Second
	// ServiceVersion is the version the checker micro services announce.
	ServiceVersion = "1.0.0"
)

// Config configures Serve. nil means all defaults, but Outbox is required. It follows the
// txoutbox Config convention: a zero field means its default (Config.WithDefaults applies
// them), no field takes txoutbox.Off or txoutbox.Forever (-1 is refused), and an invalid value
// (a negative Concurrency or RequestTimeout among them) is a *txoutbox.ConfigError naming the field.
type Config struct {
	// SubjectPrefix must match the check-back's Config.SubjectPrefix. Defaults to
	// "txoutbox.check".
	SubjectPrefix string

	// Outbox is the outbox this checker answers for: what OutboxIdentity returns for the
	// database and schema the group's producers prepare their half messages in, or the
	// explicit name the check-back is given as Config.Outbox (relay --check-outbox).
	// Required. A check request of any other outbox (another service using the same producer
	// group name on the same NATS, or a check-back configured for another outbox) is never
	// answered: it is counted in txoutbox_checkback_checker_foreign_requests_total and logged
	// once per foreign outbox.
	Outbox string

	// QueueGroup spreads the checks of a group over every process serving it; the outbox's
	// token (see OutboxToken) is appended, so that the checkers of two outboxes are never in
	// one queue group. Defaults to "q" (DefaultQueueGroup, the NATS micro default).
	QueueGroup string

	// Concurrency bounds the checks answered at once by this process: a request that waits
	// for one of them until its requester's timeout (HeaderTimeout) runs out is dropped
	// unanswered (txoutbox_checkback_checker_expired_requests_total), and a check's ctx ends
	// when that timeout runs out from the request's arrival. Defaults to 16.
	Concurrency int

	// RequestTimeout bounds a check whose request does not say how long the check-back waits
	// (the check-back sends its own Config.RequestTimeout with every request). Defaults to
	// DefaultRequestTimeout, 3s (the check-back's default RequestTimeout).
	RequestTimeout time.Duration

	// Logger receives errors of the checker. Defaults to slog.Default(). Failed checks are
	// logged when they start (a warning with the first error) and when a check answers again
	// (info, with how many failed meanwhile), not one line each: a checker past its timeout
	// fails every request. Checks cancelled by Stop are not logged.
	Logger *slog.Logger

	// Registerer, when set, registers txoutbox_checkback_checker_foreign_requests_total and
	// txoutbox_checkback_checker_failed_checks_total (shared by every checker on the
	// registry, labelled by group). Defaults to none.
	Registerer prometheus.Registerer

	// TracerProvider provides the tracer of the checker's spans: one per check answered
	// ("check <group>", kind server), continuing the check-back's check span whose context
	// the request carries, and carried by the ctx the Func gets. Defaults to the global
	// provider (otel.GetTracerProvider), which records nothing until the application sets one.
	TracerProvider trace.TracerProvider

	// Propagator reads the check-back's trace context from a request's headers. Defaults to
	// the global propagator (otel.GetTextMapPropagator), which reads nothing until the
	// application sets one.
	Propagator propagation.TextMapPropagator
}

// WithDefaults returns a copy of c with SubjectPrefix, QueueGroup, Concurrency,
// RequestTimeout and Logger set to their defaults when unset. Outbox, required, has no
// default; Registerer stays nil (no metrics); a nil TracerProvider and Propagator stay nil:
// they mean OpenTelemetry's global provider and propagator (otel.GetTracerProvider,
// otel.GetTextMapPropagator), taken by Serve, not filled in here. c may be nil.
func (c *Config) WithDefaults() *Config {
	out := Config{}
	if c != nil {
		out = *c
	}
	out.SubjectPrefix = cmp.Or(out.SubjectPrefix, DefaultSubjectPrefix)
	out.QueueGroup = cmp.Or(out.QueueGroup, DefaultQueueGroup)
	out.Concurrency = cmp.Or(out.Concurrency, DefaultConcurrency)
	out.RequestTimeout = cmp.Or(out.RequestTimeout, DefaultRequestTimeout)
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	return &out
}

func (c *Config) validate() error {
	bad := func(field, format string, args ...any) error {
		return &txoutbox.ConfigError{Package: "checker", Field: "Config." + field, Reason: fmt.Sprintf(format, args...)}
	}
	if c.Outbox == "" {
		return &txoutbox.ConfigError{Package: "checker", Field: "Config.Outbox", Err: ErrNoOutbox,
			Reason: "is required: the outbox this checker answers for " +
				"(OutboxIdentity of the producers' database and schema, or the name set as the check-back's Config.Outbox)"}
	}
	wrap := func(field string, err error) error {
		return &txoutbox.ConfigError{Package: "checker", Field: "Config." + field, Reason: "is invalid: " + err.Error(), Err: err}
	}
	if err := outbox.ValidateSubject(c.SubjectPrefix); err != nil {
		return wrap("SubjectPrefix", err)
	}
	// micro takes a queue group of subject characters (wildcards included).
	if err := outbox.ValidateSubjectFilter(c.QueueGroup); err != nil {
		return wrap("QueueGroup", err)
	}
	switch {
	case c.Concurrency < 1:
		return bad("Concurrency", "must be at least 1, got %d", c.Concurrency)
	case c.RequestTimeout <= 0:
		return bad("RequestTimeout", "must be positive, got %s", c.RequestTimeout)
	}
	return nil
}

// ValidateConfig reports whether cfg, with defaults applied, is valid; errors are
// *txoutbox.ConfigError values naming the field (ErrNoOutbox when Outbox is empty).
func ValidateConfig(cfg *Config) error { return cfg.WithDefaults().validate() }

// maxForeignLogged bounds the foreign outboxes one Server remembers having logged.
const maxForeignLogged = 64

// Server is a producer group's checker, a NATS micro service named txoutbox-check-<group>
// with one endpoint, "check", on <prefix>.<group>.
type Server struct {
	svc micro.Service
	sem chan struct{}
	// done is closed by Stop: the checks in progress see their context cancelled.
	done chan struct{}

	mu      sync.Mutex // orders wg.Add against Stop's wg.Wait; guards stopped, pending and done's close
	stopped bool
	pending int // requests checked or waiting for a slot (at most maxPending)
	wg      sync.WaitGroup

	outbox string
	// foreign counts the requests of other outboxes this checker did not answer.
	foreign prometheus.Counter
	// failed counts the checks answered with an error (not those cancelled by Stop).
	failed prometheus.Counter
	// expired counts the requests dropped before a slot was free (see expiredRequest).
	expired prometheus.Counter
	// failMu guards the failing state: whether the last check that ended failed, since when,
	// and how many checks failed since then (logged on a change of state only).
	failMu      sync.Mutex
	failing     bool
	failedSince time.Time
	failedRun   int
	// logged are the foreign outboxes already logged (one line each).
	loggedMu sync.Mutex
	logged   map[string]bool
	// onForeign, when set (tests), is called when the handling of a foreign request ends
	// (counted, logged, not answered).
	onForeign atomic.Pointer[func(Request)]
}

// Service returns the underlying micro service (for its info and stats).
func (s *Server) Service() micro.Service { return s.svc }

// Stop stops taking checks, cancels the checks in progress and waits for them to end.
func (s *Server) Stop() error {
	err := s.svc.Stop()
	s.mu.Lock()
	if !s.stopped {
		s.stopped = true
		close(s.done)
	}
	s.mu.Unlock()
	s.wg.Wait()
	return err
}

// maxPending bounds the requests a Server holds, checked or waiting for a slot; one beyond
// it is dropped as expired. Each check-back asks a group at most Config.GroupConcurrency (4)
// at a time: a thousand check-backs' worth.
const maxPending = 4096

// requestTimeout is how long the requester of req waits for the answer: its HeaderTimeout,
// else def.
func requestTimeout(req micro.Request, def time.Duration) time.Duration {
	if v := req.Headers().Get(HeaderTimeout); v != "" {
		if d, err := time.ParseDuration(v); err == nil && d > 0 {
			return d
		}
	}
	return def
}

// expiredRequest records a request dropped because its requester stopped waiting before a
// slot was free (every Concurrency slot busy for its whole timeout), or because maxPending
// requests were already held: logged at debug level,
// counted by txoutbox_checkback_checker_expired_requests_total. The check-back counts it as
// a timeout and asks again later.
func (s *Server) expiredRequest(req micro.Request, log *slog.Logger) {
	s.expired.Inc()
	log.Debug("check request dropped: every slot stayed busy until its requester stopped waiting, or too many requests were waiting (raise Config.Concurrency, or make the check faster)",
		"subject", req.Subject())
}

// checkContext returns the context of one check: a child of parent (which carries the
// check's span) that ends at deadline (when the requester stops waiting), or when Stop is
// called.
func (s *Server) checkContext(parent context.Context, deadline time.Time) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithDeadline(parent, deadline)
	go func() {
		select {
		case <-s.done:
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}

// Serve registers check as the checker of producer group group: the check-back asks it, over
// nc, whether the local transactions of the group's stale half messages committed. Requests
// carry the message id, subject, key and headers (see Request); check's answer is sent
// back as COMMIT, ROLLBACK or UNKNOWN, and an error as a micro service error (counted by the
// check-back as an inconclusive check). cfg may be nil. A nil nc or check, and a group that
// outbox.ValidateGroup refuses, are a *txoutbox.ConfigError naming the argument (group's
// matching outbox.ErrInvalidGroup), as an invalid cfg is one naming the field (a missing
// Config.Outbox's matching ErrNoOutbox); each matches txoutbox.ErrInvalidConfig. Serve also
// fails when Config.Registerer refuses the checker's counters, or when NATS refuses the micro
// service. check's ctx ends when the request's timeout has run out since its arrival, or when Stop is called.
//
// Serve it from every process of the group: requests are spread over them by a queue group.
func Serve(nc *nats.Conn, group string, check Func, cfg *Config) (*Server, error) {
	if nc == nil {
		return nil, &txoutbox.ConfigError{Package: "checker", Field: "nc", Reason: "must not be nil: pass the group's *nats.Conn"}
	}
	if check == nil {
		return nil, &txoutbox.ConfigError{Package: "checker", Field: "check", Reason: "must not be nil: pass the function that answers a check"}
	}
	if err := outbox.ValidateGroup(group); err != nil {
		return nil, &txoutbox.ConfigError{Package: "checker", Field: "group", Reason: "is invalid: " + err.Error(), Err: err}
	}
	c := cfg.WithDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	foreign, failed, expired, err := counters(c.Registerer, group)
	if err != nil {
		return nil, err
	}
	log := c.Logger.With("component", "checker", "group", group, "outbox", c.Outbox)
	tr := &checkerTracer{t: tracing.Tracer(c.TracerProvider, "checker"), p: tracing.Propagator(c.Propagator), group: group}
	s := &Server{sem: make(chan struct{}, c.Concurrency), done: make(chan struct{}), outbox: c.Outbox, foreign: foreign, failed: failed, expired: expired, logged: map[string]bool{}}

	handler := micro.HandlerFunc(func(req micro.Request) {
		// The requester waits for the answer from now until its timeout: a request that waits
		// for one of the Concurrency slots longer than that is dropped, unanswered (nobody
		// would read the answer), and one that gets a slot is checked until then, not for a
		// whole timeout more. micro calls handlers one at a time per subscription: the
		// handler never blocks (a blocked one queued the next requests unstamped, each then
		// checked for a fresh timeout after the requester had given up).
		deadline := time.Now().Add(requestTimeout(req, c.RequestTimeout))
		// Requests still buffered while the service drains may arrive after Stop: drop them
		// (the check-back asks again) instead of racing Stop's wait.
		s.mu.Lock()
		if s.stopped {
			s.mu.Unlock()
			return
		}
		if s.pending >= maxPending {
			// A flood (or a requester asking for long timeouts) is bounded as the
			// subscription's pending buffer bounded it when the handler blocked.
			s.mu.Unlock()
			s.expiredRequest(req, log)
			return
		}
		s.pending++
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			defer func() {
				s.mu.Lock()
				s.pending--
				s.mu.Unlock()
			}()
			slot := time.NewTimer(time.Until(deadline))
			select {
			case s.sem <- struct{}{}:
				slot.Stop()
			case <-s.done:
				slot.Stop()
				return
			case <-slot.C:
				s.expiredRequest(req, log)
				return
			}
			defer func() { <-s.sem }()
			if !time.Now().Before(deadline) { // the slot freed as the wait ran out
				s.expiredRequest(req, log)
				return
			}
			s.answer(req, replier{nc: nc, subject: req.Reply()}, check, deadline, log, tr)
		}()
	})
	svc, err := micro.AddService(nc, micro.Config{
		Name:        "txoutbox-check-" + group,
		Version:     ServiceVersion,
		Description: "txoutbox check-back: did the local transaction of a half message of group " + group + " commit?",
		Metadata:    map[string]string{"group": group, "outbox": c.Outbox},
		// Checkers of another outbox that serve the same subject are in another queue group:
		// they get their own copy of each request (and ignore it) instead of taking ours.
		QueueGroup: c.QueueGroup + "." + OutboxToken(c.Outbox),
	})
	if err != nil {
		return nil, fmt.Errorf("checker: Serve: %w", err)
	}
	if err := svc.AddEndpoint("check", handler, micro.WithEndpointSubject(Subject(c.SubjectPrefix, group))); err != nil {
		_ = svc.Stop()
		return nil, fmt.Errorf("checker: Serve: %w", err)
	}
	s.svc = svc
	return s, nil
}

// replier answers a check request from the goroutine that checks it. micro.Request's
// Respond and Error record the outcome in the request for the service's statistics, which
// micro reads as soon as the handler returns: called from another goroutine they race with
// it. The answer is the same message they would send; micro's own statistics (nats micro
// stats) count the requests but not these errors, which the checker logs and the
// check-back counts (txoutbox_checkback_checks_total by outcome).
type replier struct {
	nc      *nats.Conn
	subject string
}

func (r replier) Respond(data []byte) error {
	return r.nc.PublishMsg(&nats.Msg{Subject: r.subject, Data: data})
}

func (r replier) Error(code, description string) error {
	return r.nc.PublishMsg(&nats.Msg{Subject: r.subject, Header: nats.Header{
		micro.ErrorHeader:     []string{description},
		micro.ErrorCodeHeader: []string{code},
	}})
}

// answer checks req and answers through rep; it reads req (its data and headers, which
// nothing changes) but never answers through it (see replier).
func (s *Server) answer(req micro.Request, rep replier, check Func, deadline time.Time, log *slog.Logger, tr *checkerTracer) {
	ctx, span := tr.start(context.Background(), req)
	defer span.End()
	var cr Request
	if err := json.Unmarshal(req.Data(), &cr); err != nil {
		tracing.Fail(span, err, "malformed")
		_ = rep.Error("400", oneLine("malformed check request: "+err.Error()))
		return
	}
	if cr.Outbox != s.outbox {
		// Never answer for another outbox: not even an error, which could reach its
		// check-back before its own checker's answer.
		if f := s.onForeign.Load(); f != nil {
			defer (*f)(cr) // tests: once the request is handled, whatever the branch does
		}
		span.SetAttributes(tracing.Outcome.String("foreign"))
		s.foreignRequest(cr, log)
		return
	}
	span.SetAttributes(tracing.MessageID.String(cr.MessageID.String()), tracing.CheckNumber.Int(cr.Check))
	ctx, cancel := s.checkContext(ctx, deadline)
	defer cancel()
	st, err := func() (st outbox.LocalState, err error) {
		defer func() {
			if p := recover(); p != nil {
				err = fmt.Errorf("checker panicked: %v", p)
			}
		}()
		return check(ctx, cr)
	}()
	if err == nil && !st.Valid() {
		err = fmt.Errorf("%w: the checker's Func answered LocalState(%d)", outbox.ErrInvalidLocalState, int(st))
	}
	if err != nil {
		tracing.Fail(span, err, "error")
		s.checkFailed(cr, err, log)
		_ = rep.Error("500", oneLine(err.Error()))
		return
	}
	s.checkAnswered(log)
	span.SetAttributes(tracing.Outcome.String(strings.ToLower(st.String())))
	if err := rep.Respond([]byte(st.String())); err != nil {
		log.Warn("checker could not reply", "message_id", cr.MessageID.String(), "err", err)
	}
}

// checkFailed counts a failed check and logs it if it is the first of a run of failures. A
// check cancelled by Stop (context.Canceled, or any error once Stop has begun) is neither: it
// is the shutdown, not the checker, and the check-back asks again.
func (s *Server) checkFailed(cr Request, err error, log *slog.Logger) {
	if errors.Is(err, context.Canceled) || s.stopping() {
		return
	}
	s.failed.Inc()
	s.failMu.Lock()
	first := !s.failing
	if first {
		s.failing, s.failedSince, s.failedRun = true, time.Now(), 0
	}
	s.failedRun++
	s.failMu.Unlock()
	if first {
		log.Warn("checker failing; the check-back will ask again; further failures are counted in txoutbox_checkback_checker_failed_checks_total and logged when a check answers again",
			"message_id", cr.MessageID.String(), "err", err)
	}
}

// checkAnswered ends a run of failures, logging how long it lasted.
func (s *Server) checkAnswered(log *slog.Logger) {
	s.failMu.Lock()
	was, since, n := s.failing, s.failedSince, s.failedRun
	s.failing = false
	s.failMu.Unlock()
	if was {
		log.Info("checker answering again", "failed_checks", n, "failing_for", time.Since(since).Round(time.Millisecond).String())
	}
}

// stopping reports whether Stop has begun.
func (s *Server) stopping() bool {
	select {
	case <-s.done:
		return true
	default:
		return false
	}
}

// oneLine makes s, an error text of the checker's, a header value that arrives as sent
// (valid UTF-8, one line, at most 1024 bytes cut on a character boundary).
func oneLine(s string) string { return safetext.Header(s, 1024) }

// foreignRequest counts, and logs once per foreign outbox, a check request of another outbox.
func (s *Server) foreignRequest(cr Request, log *slog.Logger) {
	s.foreign.Inc()
	s.loggedMu.Lock()
	first := !s.logged[cr.Outbox] && len(s.logged) < maxForeignLogged
	if first {
		s.logged[cr.Outbox] = true
	}
	s.loggedMu.Unlock()
	if first {
		log.Warn("check request of another outbox not answered: another service uses the same producer group name on this NATS, "+
			"or this checker or the check-back is configured for the wrong outbox (see txoutbox_checkback_checker_foreign_requests_total)",
			"request_outbox", cr.Outbox, "message_id", cr.MessageID.String())
	}
}

// counters returns the checker's counters of group: foreign requests and failed checks.
func counters(reg prometheus.Registerer, group string) (foreign, failed, expired prometheus.Counter, err error) {
	foreignVec := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "txoutbox", Subsystem: "checkback", Name: "checker_foreign_requests_total",
		Help: "Check requests of another outbox that this process's checkers did not answer (a producer group name shared by two services, or a misconfigured outbox), by group.",
	}, []string{"group"})
	failedVec := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "txoutbox", Subsystem: "checkback", Name: "checker_failed_checks_total",
		Help: "Checks this process's checkers answered with an error (the check function's error or panic, or an answer that is no state), by group; checks cancelled by Stop are not counted.",
	}, []string{"group"})
	expiredVec := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "txoutbox", Subsystem: "checkback", Name: "checker_expired_requests_total",
		Help: "Check requests this process's checkers dropped unanswered because every Concurrency slot stayed busy until the requester stopped waiting (its timeout), by group.",
	}, []string{"group"})
	// Checkers on one registry share the counters.
	if err := prom.Register(reg, "checker: Serve", prom.Of(&foreignVec), prom.Of(&failedVec), prom.Of(&expiredVec)); err != nil {
		return nil, nil, nil, err
	}
	return foreignVec.WithLabelValues(group), failedVec.WithLabelValues(group), expiredVec.WithLabelValues(group), nil
}

// OutboxToken is a short token of an outbox identity, usable in NATS subjects and queue group
// names: 16 hex digits of its SHA-256.
func OutboxToken(outbox string) string {
	sum := sha256.Sum256([]byte(outbox))
	return hex.EncodeToString(sum[:8])
}

// OutboxIdentity returns the default identity of the outbox in schema of the database db is
// connected to: "<system identifier>/<database>/<schema>", the system identifier being
// pg_control_system()'s (unique per cluster, shared by its physical replicas). Producers pass
// it to Serve as Config.Outbox; the check-back computes the same from its own pool when
// Config.Outbox is empty. Any role may call it. A schema without the outbox table (a
// mistyped name: a checker for it would never answer the check-back) is ErrNoOutboxTable.
func OutboxIdentity(ctx context.Context, db txoutbox.DBTX, schema string) (string, error) {
	if err := dbhandle.RequireArg("checker", "db", "the producers' database (a *pgxpool.Pool)", db); err != nil {
		return "", err
	}
	if schema == "" {
		schema = txoutbox.DefaultSchema
	}
	var sysid int64
	var database string
	var found bool
	if err := db.QueryRow(ctx, store.OutboxIdentityQuery, schema).Scan(&sysid, &database, &found); err != nil {
		return "", fmt.Errorf("checker: outbox identity: %w", err)
	}
	return outboxIdentity(sysid, database, schema, found)
}

// ErrNoOutboxTable: OutboxIdentity was given a schema that holds no outbox table.
var ErrNoOutboxTable = errors.New("checker: no outbox table in the schema")

func outboxIdentity(sysid int64, database, schema string, found bool) (string, error) {
	if !found {
		return "", fmt.Errorf("%w: schema %q of database %q has no %s (a mistyped schema, or the migrations not run)",
			ErrNoOutboxTable, schema, database, store.MessagesTable)
	}
	return fmt.Sprintf("%d/%s/%s", uint64(sysid), database, schema), nil
}

// Request is what the check-back asks a producer group's checker about: a half message
// still prepared after the transaction timeout. It travels as JSON.
type Request struct {
	MessageID uuid.UUID           `json:"message_id"`
	Subject   string              `json:"subject"`
	Key       string              `json:"key,omitempty"`
	Headers   map[string][]string `json:"headers,omitempty"`
	Group     string              `json:"group"`
	// Outbox identifies the outbox the message is in (checkback.Config.Outbox, by
	// default OutboxIdentity): a checker answers only the requests of its own outbox.
	Outbox string `json:"outbox"`
	// Check is this check's number, from 1.
	Check      int       `json:"check"`
	PreparedAt time.Time `json:"prepared_at"`
}

// HeaderTimeout carries the requester's timeout (a Go duration) so that the checker can stop
// working on an answer nobody waits for.
const HeaderTimeout = "Txoutbox-Check-Timeout"

// Subject is the subject a producer group's checker serves.
func Subject(prefix, group string) string { return prefix + "." + group }
