package checkback

import (
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
	"github.com/txoutbox/txoutbox/outbox/checker"
)

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
		db     *testsvc.DB
		client *outbox.Client
		srv    *checker.Server
		id     string
		reg    *prometheus.Registry
		logs   *testsvc.LogBuffer
		mu     sync.Mutex
		known  map[string]bool
		asked  []string
	}
	newService := func() *service {
		s := &service{db: testsvc.NewDB(t), reg: prometheus.NewRegistry(), logs: &testsvc.LogBuffer{}, known: map[string]bool{}}
		var err error
		if s.client, err = outbox.NewClient(&outbox.Config{Schema: s.db.Schema}); err != nil {
			t.Fatal(err)
		}
		id, err := checker.OutboxIdentity(ctx, s.db.Pool, s.db.Schema)
		if err != nil {
			t.Fatal(err)
		}
		s.id = id
		s.srv, err = checker.Serve(n.Conn, "payments", func(_ context.Context, req checker.Request) (outbox.LocalState, error) {
			s.mu.Lock()
			defer s.mu.Unlock()
			s.asked = append(s.asked, req.MessageID.String())
			if s.known[req.MessageID.String()] {
				return outbox.StateCommit, nil
			}
			return outbox.StateRollback, nil
		}, &checker.Config{Outbox: id, Registerer: s.reg, Logger: slog.New(slog.NewTextHandler(s.logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.srv.Stop() })
		return s
	}
	a, b := newService(), newService()
	if a.id == b.id {
		t.Fatalf("two schemas have one identity %q", a.id)
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
	}{{a, b.id, idB}, {b, a.id, idA}} {
		testsvc.Eventually(t, 10*time.Second, "the checker of "+c.s.db.Schema+" to count the other outbox's request", func() bool {
			return foreignMetric(t, c.s.reg) >= 1
		})
		if logs := c.s.logs.String(); !strings.Contains(logs, c.other) || !strings.Contains(logs, c.otherID) {
			t.Errorf("the foreign request's log line does not name outbox %s and message %s:\n%s", c.other, c.otherID, logs)
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
	if _, err := checker.Serve(n.Conn, "payments", func(context.Context, checker.Request) (outbox.LocalState, error) { return outbox.StateCommit, nil }, nil); !errors.Is(err, checker.ErrNoOutbox) {
		t.Errorf("Serve without an outbox: %v, want checker.ErrNoOutbox", err)
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
