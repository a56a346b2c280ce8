package checkback

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// syncBuffer is a log sink several goroutines write to.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Two services, two outboxes (two schemas), one NATS, the same producer group name. Each
// service's checker answers COMMIT for the messages it knows and ROLLBACK for any other — the
// answer that would roll back the other service's payment if it reached the other check-back.
// Each check-back settles only its own messages, by its own checker's answer; each checker
// sees the other's request, does not answer it, counts it and logs it once.
func TestCheckersNeverAnswerForAnotherOutbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	n := testsvc.NewNATS(t)
	type service struct {
		db      *testsvc.DB
		client  *outbox.Client
		srv     *Server
		reg     *prometheus.Registry
		logs    *syncBuffer
		mu      sync.Mutex
		known   map[string]bool
		asked   []string
		foreign chan CheckRequest
	}
	newService := func() *service {
		s := &service{db: testsvc.NewDB(t), reg: prometheus.NewRegistry(), logs: &syncBuffer{}, known: map[string]bool{},
			foreign: make(chan CheckRequest, 16)}
		var err error
		if s.client, err = outbox.NewClient(&outbox.Config{Schema: s.db.Schema}); err != nil {
			t.Fatal(err)
		}
		id, err := OutboxIdentity(ctx, s.db.Pool, s.db.Schema)
		if err != nil {
			t.Fatal(err)
		}
		s.srv, err = Serve(n.Conn, "payments", func(_ context.Context, req CheckRequest) (State, error) {
			s.mu.Lock()
			defer s.mu.Unlock()
			s.asked = append(s.asked, req.MessageID.String())
			if s.known[req.MessageID.String()] {
				return Commit, nil
			}
			return Rollback, nil
		}, &ServeOptions{Outbox: id, Registerer: s.reg, Logger: slog.New(slog.NewTextHandler(s.logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		f := func(req CheckRequest) { s.foreign <- req }
		s.srv.onForeign.Store(&f)
		t.Cleanup(func() { _ = s.srv.Stop() })
		return s
	}
	a, b := newService(), newService()
	if a.srv.outbox == b.srv.outbox {
		t.Fatalf("two schemas have one identity %q", a.srv.outbox)
	}
	prepare := func(s *service) string {
		h, err := s.client.Prepare(ctx, s.db.Pool, outbox.Message{Subject: "payments.charged", Payload: []byte("x")}, &outbox.PrepareOptions{Group: "payments"})
		if err != nil {
			t.Fatal(err)
		}
		s.mu.Lock()
		s.known[h.ID.String()] = true
		s.mu.Unlock()
		// Back-date it past the transaction timeout.
		if _, err := s.db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET created_at = now() - interval '1 hour', next_check_at = now() - interval '1 second' WHERE message_id = $1`, h.ID); err != nil {
			t.Fatal(err)
		}
		return h.ID.String()
	}
	idA, idB := prepare(a), prepare(b)

	for _, s := range []*service{a, b} {
		cfg := fastConfig()
		cfg.Schema = s.db.Schema
		cfg.Logger = testLogger()
		cb, err := New(s.db.Pool, n.Conn, cfg)
		if err != nil {
			t.Fatal(err)
		}
		res := mustResolve(t, cb)
		if res.Committed != 1 || res.RolledBack != 0 {
			t.Fatalf("check-back of %s: %+v, want one commit and no rollback", s.db.Schema, res)
		}
	}
	for _, c := range []struct {
		s    *service
		want string
	}{{a, idA}, {b, idB}} {
		var st string
		if err := c.s.db.Pool.QueryRow(ctx, `SELECT state FROM txoutbox_messages WHERE message_id = $1`, c.want).Scan(&st); err != nil {
			t.Fatal(err)
		}
		if st != "ready" {
			t.Errorf("message of %s is %s, want ready (committed by its own checker)", c.s.db.Schema, st)
		}
	}
	// Each checker received the other outbox's request (its own queue group) and ignored it.
	for _, c := range []struct {
		s       *service
		other   string
		otherID string
	}{{a, b.srv.outbox, idB}, {b, a.srv.outbox, idA}} {
		select {
		case req := <-c.s.foreign:
			if req.Outbox != c.other || req.MessageID.String() != c.otherID {
				t.Errorf("foreign request %+v, want message %s of outbox %s", req, c.otherID, c.other)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("checker of %s never saw the other outbox's request", c.s.db.Schema)
		}
		c.s.mu.Lock()
		asked := append([]string(nil), c.s.asked...)
		c.s.mu.Unlock()
		for _, id := range asked {
			if id == c.otherID {
				t.Errorf("checker of %s was asked about %s of the other outbox", c.s.db.Schema, id)
			}
		}
		if got := foreignMetric(t, c.s.reg); got != 1 {
			t.Errorf("txoutbox_checkback_checker_foreign_requests_total{group=\"payments\"} = %v, want 1", got)
		}
		if got := strings.Count(c.s.logs.String(), "check request of another outbox not answered"); got != 1 {
			t.Errorf("%d log lines about the foreign request, want 1:\n%s", got, c.s.logs.String())
		}
	}
	// A checker that is not told its outbox does not start.
	if _, err := Serve(n.Conn, "payments", func(context.Context, CheckRequest) (State, error) { return Commit, nil }, nil); !errors.Is(err, ErrNoOutbox) {
		t.Errorf("Serve without an outbox: %v, want ErrNoOutbox", err)
	}
}

// foreignMetric reads txoutbox_checkback_checker_foreign_requests_total{group="payments"}.
func foreignMetric(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "txoutbox_checkback_checker_foreign_requests_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "group" && l.GetValue() == "payments" {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return -1
}
