package checkback

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/txoutbox/txoutbox/internal/safetext"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/txoutbox/txoutbox/outbox"
)

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

	// QueueGroup spreads the checks of a group over every process serving it. Defaults to
	// the NATS micro default ("q").
	QueueGroup string

	// Concurrency bounds the checks answered at once by this process. Defaults to 16.
	Concurrency int

	// Timeout bounds a check whose request does not say how long the check-back waits.
	// Defaults to DefaultRequestTimeout (3s).
	Timeout time.Duration

	// Logger receives errors of the checker. Defaults to slog.Default().
	Logger *slog.Logger
}

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
	log := o.Logger.With("component", "checkback.checker", "group", group)
	s := &Server{sem: make(chan struct{}, o.Concurrency)}
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
		Metadata:    map[string]string{"group": group},
		QueueGroup:  o.QueueGroup,
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
