package checkback

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/safetext"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/txoutbox/txoutbox/outbox"
)

// ErrNoOutbox is returned by Serve when ServeOptions.Outbox is empty: a checker must know
// which outbox it answers for, or it could settle the half messages of another service that
// uses the same producer group name.
var ErrNoOutbox = errors.New("checkback: ServeOptions.Outbox is required: the outbox this checker answers for " +
	"(OutboxIdentity of the producers' database and schema, or the name set as the check-back's Config.Outbox)")

// CheckFunc answers a check: did the local transaction of this half message commit? Return
// Commit or Rollback only when the outcome is certain; Unknown (or an error) makes the
// check-back ask again later, up to its maximum number of checks. ctx ends when the
// check-back stops waiting for the answer.
type CheckFunc func(ctx context.Context, req CheckRequest) (State, error)

// Defaults for ServeOptions.
const (
	DefaultServeConcurrency = 16
	// ServiceVersion is the version the checker micro services announce.
	ServiceVersion = "1.0.0"
)

// ServeOptions configure Serve. nil means all defaults.
type ServeOptions struct {
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
	// one queue group. Defaults to the NATS micro default ("q").
	QueueGroup string

	// Concurrency bounds the checks answered at once by this process. Defaults to 16.
	Concurrency int

	// Timeout bounds a check whose request does not say how long the check-back waits.
	// Defaults to DefaultRequestTimeout (3s).
	Timeout time.Duration

	// Logger receives errors of the checker. Defaults to slog.Default().
	Logger *slog.Logger

	// Registerer, when set, registers txoutbox_checkback_checker_foreign_requests_total
	// (shared by every checker on the registry, labelled by group). Defaults to none.
	Registerer prometheus.Registerer
}

// maxForeignLogged bounds the foreign outboxes one Server remembers having logged.
const maxForeignLogged = 64

// Server is a producer group's checker, a NATS micro service named txoutbox-check-<group>
// with one endpoint, "check", on <prefix>.<group>.
type Server struct {
	svc    micro.Service
	sem    chan struct{}
	ctx    context.Context
	cancel context.CancelFunc

	mu      sync.Mutex // orders wg.Add against Stop's wg.Wait
	stopped bool
	wg      sync.WaitGroup

	outbox string
	// foreign counts the requests of other outboxes this checker did not answer.
	foreign prometheus.Counter
	// logged are the foreign outboxes already logged (one line each).
	loggedMu sync.Mutex
	logged   map[string]bool
	// onForeign, when set (tests), is called after a foreign request was counted.
	onForeign atomic.Pointer[func(CheckRequest)]
}

// Service returns the underlying micro service (for its info and stats).
func (s *Server) Service() micro.Service { return s.svc }

// Stop stops taking checks, cancels the checks in progress and waits for them to end.
func (s *Server) Stop() error {
	err := s.svc.Stop()
	s.mu.Lock()
	s.stopped = true
	s.mu.Unlock()
	s.cancel()
	s.wg.Wait()
	return err
}

// Serve registers check as the checker of producer group group: the check-back asks it, over
// nc, whether the local transactions of the group's stale half messages committed. Requests
// carry the message id, subject, key and headers (see CheckRequest); check's answer is sent
// back as COMMIT, ROLLBACK or UNKNOWN, and an error as a micro service error (counted by the
// check-back as an inconclusive check). opts may be nil.
//
// Serve it from every process of the group: requests are spread over them by a queue group.
func Serve(nc *nats.Conn, group string, check CheckFunc, opts *ServeOptions) (*Server, error) {
	if nc == nil {
		return nil, errors.New("checkback: Serve: nc is nil")
	}
	if check == nil {
		return nil, errors.New("checkback: Serve: check is nil")
	}
	if err := outbox.ValidateGroup(group); err != nil {
		return nil, fmt.Errorf("checkback: Serve: %w", err)
	}
	var o ServeOptions
	if opts != nil {
		o = *opts
	}
	if o.SubjectPrefix == "" {
		o.SubjectPrefix = DefaultSubjectPrefix
	}
	if err := outbox.ValidateSubject(o.SubjectPrefix); err != nil {
		return nil, fmt.Errorf("checkback: ServeOptions.SubjectPrefix: %w", err)
	}
	if o.Concurrency <= 0 {
		o.Concurrency = DefaultServeConcurrency
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultRequestTimeout
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Outbox == "" {
		return nil, ErrNoOutbox
	}
	if o.QueueGroup == "" {
		o.QueueGroup = micro.DefaultQueueGroup
	}
	foreign, err := foreignCounter(o.Registerer, group)
	if err != nil {
		return nil, err
	}
	log := o.Logger.With("component", "checkback.checker", "group", group, "outbox", o.Outbox)
	s := &Server{sem: make(chan struct{}, o.Concurrency), outbox: o.Outbox, foreign: foreign, logged: map[string]bool{}}
	s.ctx, s.cancel = context.WithCancel(context.Background())

	handler := micro.HandlerFunc(func(req micro.Request) {
		// micro calls handlers one at a time per subscription: answer in goroutines, bounded.
		select {
		case s.sem <- struct{}{}:
		case <-s.ctx.Done():
			return
		}
		// Requests still buffered while the service drains may arrive after Stop: drop them
		// (the check-back asks again) instead of racing Stop's wait.
		s.mu.Lock()
		if s.stopped {
			s.mu.Unlock()
			<-s.sem
			return
		}
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			defer func() { <-s.sem }()
			s.answer(req, check, o.Timeout, log)
		}()
	})
	svc, err := micro.AddService(nc, micro.Config{
		Name:        "txoutbox-check-" + group,
		Version:     ServiceVersion,
		Description: "txoutbox check-back: did the local transaction of a half message of group " + group + " commit?",
		Metadata:    map[string]string{"group": group, "outbox": o.Outbox},
		// Checkers of another outbox that serve the same subject are in another queue group:
		// they get their own copy of each request (and ignore it) instead of taking ours.
		QueueGroup: o.QueueGroup + "." + OutboxToken(o.Outbox),
	})
	if err != nil {
		s.cancel()
		return nil, fmt.Errorf("checkback: Serve: %w", err)
	}
	if err := svc.AddEndpoint("check", handler, micro.WithEndpointSubject(Subject(o.SubjectPrefix, group))); err != nil {
		_ = svc.Stop()
		s.cancel()
		return nil, fmt.Errorf("checkback: Serve: %w", err)
	}
	s.svc = svc
	return s, nil
}

func (s *Server) answer(req micro.Request, check CheckFunc, def time.Duration, log *slog.Logger) {
	var cr CheckRequest
	if err := json.Unmarshal(req.Data(), &cr); err != nil {
		_ = req.Error("400", oneLine("malformed check request: "+err.Error()), nil)
		return
	}
	if cr.Outbox != s.outbox {
		// Never answer for another outbox: not even an error, which could reach its
		// check-back before its own checker's answer.
		s.foreignRequest(cr, log)
		return
	}
	timeout := def
	if v := req.Headers().Get(HeaderTimeout); v != "" {
		if d, err := time.ParseDuration(v); err == nil && d > 0 {
			timeout = d
		}
	}
	ctx, cancel := context.WithTimeout(s.ctx, timeout)
	defer cancel()
	st, err := func() (st State, err error) {
		defer func() {
			if p := recover(); p != nil {
				err = fmt.Errorf("checker panicked: %v", p)
			}
		}()
		return check(ctx, cr)
	}()
	if err != nil {
		if !errors.Is(err, context.Canceled) {
			log.Warn("checker failed; the check-back will ask again", "message_id", cr.MessageID.String(), "err", err)
		}
		_ = req.Error("500", oneLine(err.Error()), nil)
		return
	}
	if err := req.Respond([]byte(st.String())); err != nil {
		log.Warn("checker could not reply", "message_id", cr.MessageID.String(), "err", err)
	}
}

// oneLine makes s, an error text of the checker's, a header value that arrives as sent
// (valid UTF-8, one line, at most 1024 bytes cut on a character boundary).
func oneLine(s string) string { return safetext.Header(s, 1024) }

// foreignRequest counts, and logs once per foreign outbox, a check request of another outbox.
func (s *Server) foreignRequest(cr CheckRequest, log *slog.Logger) {
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
	if f := s.onForeign.Load(); f != nil {
		(*f)(cr)
	}
}

func foreignCounter(reg prometheus.Registerer, group string) (prometheus.Counter, error) {
	vec := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "txoutbox", Subsystem: "checkback", Name: "checker_foreign_requests_total",
		Help: "Check requests of another outbox that this process's checkers did not answer (a producer group name shared by two services, or a misconfigured outbox), by group.",
	}, []string{"group"})
	if reg != nil {
		if err := reg.Register(vec); err != nil {
			var are prometheus.AlreadyRegisteredError
			existing, ok := (*prometheus.CounterVec)(nil), false
			if errors.As(err, &are) {
				existing, ok = are.ExistingCollector.(*prometheus.CounterVec)
			}
			if !ok {
				return nil, fmt.Errorf("checkback: Serve: register metrics: %w", err)
			}
			vec = existing
		}
	}
	return vec.WithLabelValues(group), nil
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
// it to Serve as ServeOptions.Outbox; the check-back computes the same from its own pool when
// Config.Outbox is empty. Any role may call it.
func OutboxIdentity(ctx context.Context, db txoutbox.DBTX, schema string) (string, error) {
	if schema == "" {
		schema = txoutbox.DefaultSchema
	}
	var sysid int64
	var database string
	if err := db.QueryRow(ctx, `SELECT system_identifier, current_database() FROM pg_control_system()`).Scan(&sysid, &database); err != nil {
		return "", fmt.Errorf("checkback: outbox identity: %w", err)
	}
	return fmt.Sprintf("%d/%s/%s", uint64(sysid), database, schema), nil
}
