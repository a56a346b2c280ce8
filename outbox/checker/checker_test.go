package checker_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
)

func TestMain(m *testing.M) { os.Exit(testsvc.ExampleMain(m)) }

// The examples read TXOUTBOX_SCHEMA as a service does; unset, they must work in the default
// schema too.
func TestExamplesInDefaultSchema(t *testing.T) { testsvc.RunExamplesInDefaultSchema(t) }

// The wire contract the check-back relies on: a JSON Request on Subject(prefix, group) gets
// COMMIT, ROLLBACK or UNKNOWN; a checker error or panic a micro service error; a malformed
// request a 400; a request of another outbox no reply at all.
func TestServeAnswersItsOwnOutboxOnly(t *testing.T) {
	t.Parallel()
	n := testsvc.NewNATS(t)
	answers := map[uuid.UUID]outbox.LocalState{}
	commit, rollback, unknown, failing, panicking, invalid := uuid.New(), uuid.New(), uuid.New(), uuid.New(), uuid.New(), uuid.New()
	answers[commit], answers[rollback], answers[unknown] = outbox.StateCommit, outbox.StateRollback, outbox.StateUnknown
	answers[invalid] = outbox.LocalState(42) // not a state: an error answer, not UNKNOWN
	srv, err := checker.Serve(n.Conn, "pay", func(_ context.Context, req checker.Request) (outbox.LocalState, error) {
		switch req.MessageID {
		case failing:
			return outbox.StateUnknown, errors.New("ledger unreachable\nsecond line")
		case panicking:
			panic("boom")
		}
		return answers[req.MessageID], nil
	}, &checker.Config{Outbox: "db/one"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Stop() })

	ask := func(id uuid.UUID, outboxID string, raw []byte) (*nats.Msg, error) {
		if raw == nil {
			raw, _ = json.Marshal(checker.Request{MessageID: id, Subject: "pay.x", Group: "pay", Outbox: outboxID, Check: 1})
		}
		msg := nats.NewMsg(checker.Subject(checker.DefaultSubjectPrefix, "pay"))
		msg.Data = raw
		msg.Header.Set(checker.HeaderTimeout, "1s")
		return n.Conn.RequestMsg(msg, 2*time.Second)
	}
	for id, want := range map[uuid.UUID]string{commit: "COMMIT", rollback: "ROLLBACK", unknown: "UNKNOWN"} {
		resp, err := ask(id, "db/one", nil)
		if err != nil || string(resp.Data) != want {
			t.Fatalf("answer: %v %q, want %s", err, respData(resp), want)
		}
	}
	for _, c := range []struct {
		id   uuid.UUID
		raw  []byte
		code string
	}{{failing, nil, "500"}, {panicking, nil, "500"}, {invalid, nil, "500"}, {uuid.Nil, []byte("{not json"), "400"}} {
		resp, err := ask(c.id, "db/one", c.raw)
		if err != nil || resp.Header.Get(micro.ErrorCodeHeader) != c.code {
			t.Fatalf("error answer: %v, code %q, want %s", err, respCode(resp), c.code)
		}
		if e := resp.Header.Get(micro.ErrorHeader); len(e) > 1024 || containsNewline(e) {
			t.Fatalf("error text %q is not one line of at most 1024 bytes", e)
		}
	}
	// Another outbox's request is never answered, not even with an error: once the checker
	// has handled it, a round trip on the connection it shares with the asker (the server
	// delivers what the checker sent before it answers the PING) brings no reply.
	handled := make(chan checker.Request, 1)
	checker.OnForeign(srv, func(r checker.Request) { handled <- r })
	inbox := n.Conn.NewRespInbox()
	replies, err := n.Conn.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := json.Marshal(checker.Request{MessageID: commit, Subject: "pay.x", Group: "pay", Outbox: "db/two", Check: 1})
	if err := n.Conn.PublishRequest(checker.Subject(checker.DefaultSubjectPrefix, "pay"), inbox, raw); err != nil {
		t.Fatal(err)
	}
	if r := testsvc.Receive(t, handled, 10*time.Second, "the checker to handle the foreign request"); r.Outbox != "db/two" {
		t.Fatalf("handled a foreign request of outbox %q", r.Outbox)
	}
	if err := n.Conn.Flush(); err != nil {
		t.Fatal(err)
	}
	if msgs, _, _ := replies.Pending(); msgs != 0 {
		resp, _ := replies.NextMsg(0)
		t.Fatalf("a request of another outbox got an answer: %q %v", respData(resp), respCode(resp))
	}
	if _, err := checker.Serve(n.Conn, "pay", func(context.Context, checker.Request) (outbox.LocalState, error) {
		return outbox.StateCommit, nil
	}, nil); !errors.Is(err, checker.ErrNoOutbox) {
		t.Fatalf("Serve without an outbox: %v, want ErrNoOutbox", err)
	}
}

// Config follows the txoutbox Config convention: zero takes the documented default, a negative
// Concurrency or RequestTimeout is refused by Serve as a *txoutbox.ConfigError naming the field
// (it used to become the default silently), and a missing Outbox is ErrNoOutbox, also a
// ConfigError.
func TestConfigFollowsTheConvention(t *testing.T) {
	t.Parallel()
	d := (*checker.Config)(nil).WithDefaults()
	if d.SubjectPrefix != checker.DefaultSubjectPrefix || d.QueueGroup != checker.DefaultQueueGroup ||
		d.Concurrency != checker.DefaultConcurrency || d.RequestTimeout != checker.DefaultRequestTimeout || d.Logger == nil {
		t.Fatalf("WithDefaults: %+v", d)
	}
	if err := checker.ValidateConfig(&checker.Config{Outbox: "db/one"}); err != nil {
		t.Fatalf("defaults with an outbox: %v", err)
	}
	var ce *txoutbox.ConfigError
	if err := checker.ValidateConfig(&checker.Config{}); !errors.Is(err, checker.ErrNoOutbox) ||
		!errors.Is(err, txoutbox.ErrInvalidConfig) || !errors.As(err, &ce) || ce.Field != "Config.Outbox" {
		t.Fatalf("no outbox: %v", err)
	}
	n := testsvc.NewNATS(t)
	check := func(context.Context, checker.Request) (outbox.LocalState, error) { return outbox.StateCommit, nil }
	for field, o := range map[string]*checker.Config{
		"Config.Concurrency":    {Outbox: "db/one", Concurrency: -1},
		"Config.RequestTimeout": {Outbox: "db/one", RequestTimeout: -time.Second},
		"Config.SubjectPrefix":  {Outbox: "db/one", SubjectPrefix: "a b"},
		"Config.QueueGroup":     {Outbox: "db/one", QueueGroup: "q q"},
	} {
		srv, err := checker.Serve(n.Conn, "pay", check, o)
		if err == nil {
			_ = srv.Stop()
		}
		if !errors.As(err, &ce) || ce.Field != field || ce.Package != "checker" || !errors.Is(err, txoutbox.ErrInvalidConfig) {
			t.Errorf("%s: Serve returned %v, want a *txoutbox.ConfigError naming it", field, err)
		}
		// The subject rules' own sentinel stays visible through the ConfigError.
		if strings.HasPrefix(field, "Config.S") && !errors.Is(err, outbox.ErrInvalidSubject) {
			t.Errorf("%s: Serve returned %v, want it to wrap outbox.ErrInvalidSubject", field, err)
		}
	}
}

func respData(m *nats.Msg) string {
	if m == nil {
		return ""
	}
	return string(m.Data)
}

func respCode(m *nats.Msg) string {
	if m == nil {
		return ""
	}
	return m.Header.Get(micro.ErrorCodeHeader)
}

func containsNewline(s string) bool {
	for _, r := range s {
		if r == '\n' || r == '\r' {
			return true
		}
	}
	return false
}

// A bad producer group is refused the same way on both sides: by Serve as a
// *txoutbox.ConfigError naming group, by Prepare as one naming PrepareOptions.Group; both
// still match outbox.ErrInvalidGroup. Nothing is stored.
func TestBadGroupIsAConfigError(t *testing.T) {
	t.Parallel()
	n := testsvc.NewNATS(t)
	db := testsvc.NewDB(t)
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	check := func(context.Context, checker.Request) (outbox.LocalState, error) { return outbox.StateCommit, nil }
	for _, group := range []string{"", "pay.x", "pay x", strings.Repeat("g", outbox.MaxGroupLength+1)} {
		srv, err := checker.Serve(n.Conn, group, check, &checker.Config{Outbox: "db/one"})
		if err == nil {
			_ = srv.Stop()
		}
		var ce *txoutbox.ConfigError
		if !errors.As(err, &ce) || ce.Package != "checker" || ce.Field != "group" ||
			!errors.Is(err, txoutbox.ErrInvalidConfig) || !errors.Is(err, outbox.ErrInvalidGroup) {
			t.Errorf("Serve(group %q): %v; want a *txoutbox.ConfigError naming group, matching ErrInvalidGroup", group, err)
		}
		_, err = client.Prepare(context.Background(), db.Pool, outbox.Message{Subject: "pay.done"}, &outbox.PrepareOptions{Group: group})
		if !errors.As(err, &ce) || ce.Package != "outbox" || ce.Field != "PrepareOptions.Group" ||
			!errors.Is(err, txoutbox.ErrInvalidConfig) || !errors.Is(err, outbox.ErrInvalidGroup) {
			t.Errorf("Prepare(group %q): %v; want a *txoutbox.ConfigError naming PrepareOptions.Group, matching ErrInvalidGroup", group, err)
		}
	}
	var rows int
	if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM txoutbox_messages`).Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("rows stored: %d (%v), want 0", rows, err)
	}
}

// Stop cancels the context of the checks in progress and waits for them; a second Stop is
// harmless.
func TestStopCancelsChecksInProgress(t *testing.T) {
	t.Parallel()
	n := testsvc.NewNATS(t)
	started := make(chan struct{}, 1)
	ended := make(chan error, 1)
	srv, err := checker.Serve(n.Conn, "pay", func(ctx context.Context, _ checker.Request) (outbox.LocalState, error) {
		started <- struct{}{}
		<-ctx.Done()
		ended <- ctx.Err()
		return outbox.StateUnknown, ctx.Err()
	}, &checker.Config{Outbox: "db/one"})
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		raw, _ := json.Marshal(checker.Request{MessageID: uuid.New(), Subject: "pay.x", Group: "pay", Outbox: "db/one", Check: 1})
		msg := nats.NewMsg(checker.Subject(checker.DefaultSubjectPrefix, "pay"))
		msg.Data = raw
		msg.Header.Set(checker.HeaderTimeout, "1h") // its own timeout is far away: only Stop ends it
		_, _ = n.Conn.RequestMsg(msg, 30*time.Second)
	}()
	testsvc.Receive(t, started, 10*time.Second, "the check to start")
	stopped := make(chan error, 1)
	go func() { stopped <- srv.Stop() }()
	if err := testsvc.Receive(t, ended, 10*time.Second, "the check's context to end"); !errors.Is(err, context.Canceled) {
		t.Fatalf("the check's context ended with %v, want context.Canceled", err)
	}
	if err := testsvc.Receive(t, stopped, 10*time.Second, "Stop to return"); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if err := srv.Stop(); err != nil {
		t.Logf("second Stop: %v", err)
	}
}

// A failing checker logs when it starts failing and when it answers again, not once per
// check (past its timeout it fails every request, up to the check-back's rate), while
// txoutbox_checkback_checker_failed_checks_total counts every failure; checks cancelled by
// Stop are neither logged nor counted.
func TestFailuresAreLoggedOnAChangeOfState(t *testing.T) {
	t.Parallel()
	n := testsvc.NewNATS(t)
	var logs testsvc.LogBuffer
	reg := prometheus.NewRegistry()
	started := make(chan struct{}, 1)
	srv, err := checker.Serve(n.Conn, "pay", func(ctx context.Context, req checker.Request) (outbox.LocalState, error) {
		switch req.Subject {
		case "fail":
			return outbox.StateUnknown, errors.New("ledger unreachable")
		case "slow": // past the request's timeout
			<-ctx.Done()
			return outbox.StateUnknown, ctx.Err()
		case "hang": // until Stop
			started <- struct{}{}
			<-ctx.Done()
			return outbox.StateUnknown, fmt.Errorf("lookup: %w", ctx.Err())
		}
		return outbox.StateCommit, nil
	}, &checker.Config{Outbox: "db/one", Logger: logs.Logger(), Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	ask := func(subject, timeout string) string {
		t.Helper()
		raw, _ := json.Marshal(checker.Request{MessageID: uuid.New(), Subject: subject, Group: "pay", Outbox: "db/one", Check: 1})
		msg := nats.NewMsg(checker.Subject(checker.DefaultSubjectPrefix, "pay"))
		msg.Data = raw
		msg.Header.Set(checker.HeaderTimeout, timeout)
		resp, err := n.Conn.RequestMsg(msg, 10*time.Second)
		if err != nil {
			t.Fatalf("check %s: %v", subject, err)
		}
		if c := resp.Header.Get(micro.ErrorCodeHeader); c != "" {
			return c
		}
		return string(resp.Data)
	}
	// Each answer arrives after the checker has logged and counted the check, so the log
	// read after it is complete.
	for _, step := range []struct{ subject, timeout, want string }{
		{"ok", "1s", "COMMIT"},
		{"fail", "1s", "500"}, {"fail", "1s", "500"}, {"slow", "1ms", "500"}, {"slow", "1ms", "500"}, {"fail", "1s", "500"},
		{"ok", "1s", "COMMIT"}, {"ok", "1s", "COMMIT"},
		{"slow", "1ms", "500"}, {"fail", "1s", "500"},
	} {
		if got := ask(step.subject, step.timeout); got != step.want {
			t.Fatalf("check %s: %q, want %q", step.subject, got, step.want)
		}
	}
	failing := logs.Lines(t, "checker failing; the check-back will ask again; further failures are counted in txoutbox_checkback_checker_failed_checks_total and logged when a check answers again")
	again := logs.Lines(t, "checker answering again")
	if len(failing) != 2 || len(again) != 1 || len(logs.Lines(t, "")) != 3 {
		t.Fatalf("%d failing lines, %d recovered lines, want 2 and 1; the log:\n%s", len(failing), len(again), logs.String())
	}
	if again[0]["failed_checks"] != float64(5) || failing[0]["err"] != "ledger unreachable" {
		t.Fatalf("the lines do not say what failed and how often:\n%s", logs.String())
	}
	// A check cancelled by Stop: no line, not counted.
	raw, _ := json.Marshal(checker.Request{MessageID: uuid.New(), Subject: "hang", Group: "pay", Outbox: "db/one", Check: 1})
	hang := nats.NewMsg(checker.Subject(checker.DefaultSubjectPrefix, "pay"))
	hang.Data = raw
	hang.Header.Set(checker.HeaderTimeout, "1h")
	if err := n.Conn.PublishMsg(hang); err != nil {
		t.Fatal(err)
	}
	testsvc.Receive(t, started, 10*time.Second, "the check to start")
	if err := srv.Stop(); err != nil {
		t.Fatal(err)
	}
	if lines := logs.Lines(t, ""); len(lines) != 3 {
		t.Fatalf("the check cancelled by Stop was logged:\n%s", logs.String())
	}
	if got := failedChecks(t, reg); got != 7 {
		t.Fatalf("txoutbox_checkback_checker_failed_checks_total{group=\"pay\"} = %v, want 7", got)
	}
}

// failedChecks reads txoutbox_checkback_checker_failed_checks_total{group="pay"} from reg.
func failedChecks(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != "txoutbox_checkback_checker_failed_checks_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			if len(m.GetLabel()) == 1 && m.GetLabel()[0].GetValue() == "pay" {
				return m.GetCounter().GetValue()
			}
		}
	}
	t.Fatal(`no txoutbox_checkback_checker_failed_checks_total{group="pay"}`)
	return 0
}

// A busy checker does not spend its slots on requests nobody waits for: a request is checked
// until its requester's timeout runs out from its arrival, not for a fresh timeout from when
// a slot frees, and one that waits for a slot until then is dropped unanswered and counted.
// With one slot and four requests of 300 ms sent at once, the check function ran four times
// in a row (the last ending 1.2 s after the requests, all four requesters long gone).
func TestRequestsPastTheirTimeoutAreNotChecked(t *testing.T) {
	t.Parallel()
	n := testsvc.NewNATS(t)
	reg := prometheus.NewRegistry()
	type call struct{ started, deadline time.Time }
	calls := make(chan call, 8)
	srv, err := checker.Serve(n.Conn, "pay", func(ctx context.Context, _ checker.Request) (outbox.LocalState, error) {
		d, _ := ctx.Deadline()
		calls <- call{time.Now(), d}
		<-ctx.Done() // a check that takes the whole timeout
		return outbox.StateUnknown, ctx.Err()
	}, &checker.Config{Outbox: "db/one", Concurrency: 1, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Stop() })
	sent := time.Now()
	const timeout = 300 * time.Millisecond
	for range 4 {
		raw, _ := json.Marshal(checker.Request{MessageID: uuid.New(), Subject: "pay.x", Group: "pay", Outbox: "db/one", Check: 1})
		msg := nats.NewMsg(checker.Subject(checker.DefaultSubjectPrefix, "pay"))
		msg.Data = raw
		msg.Header.Set(checker.HeaderTimeout, timeout.String())
		if err := n.Conn.PublishMsg(msg); err != nil { // nobody waits for the answers
			t.Fatal(err)
		}
	}
	expired := func() float64 {
		mfs, _ := reg.Gather()
		for _, mf := range mfs {
			if mf.GetName() == "txoutbox_checkback_checker_expired_requests_total" {
				return mf.GetMetric()[0].GetCounter().GetValue()
			}
		}
		return 0
	}
	testsvc.Eventually(t, 10*time.Second, "three requests to be dropped", func() bool { return expired() == 3 })
	if got := len(calls); got != 1 {
		t.Fatalf("the check function ran %d times, want once (the others' requesters had stopped waiting)", got)
	}
	c := <-calls
	if c.deadline.Sub(sent) > timeout+time.Second { // the check's own arrival, plus scheduling
		t.Fatalf("the check's context ends %s after the requests were sent, want about their %s timeout", c.deadline.Sub(sent), timeout)
	}
}
