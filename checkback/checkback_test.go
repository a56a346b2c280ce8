package checkback

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
	"github.com/txoutbox/txoutbox/relay"
	"golang.org/x/time/rate"
)

func TestMain(m *testing.M) { os.Exit(testsvc.Main(m)) }

type env struct {
	t      *testing.T
	db     *testsvc.DB
	nats   *testsvc.NATS
	client *outbox.Client
}

func newEnv(t *testing.T) *env {
	t.Helper()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	n.Stream(t, "ORDERS", "orders.>")
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE orders (id int PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	return &env{t: t, db: db, nats: n, client: c}
}

func testLogger() *slog.Logger { return testsvc.Logger() }

// fastConfig shrinks every timing knob so that tests run in well under a second each.
func fastConfig() *Config {
	return &Config{
		TransactionTimeout: 100 * time.Millisecond,
		RequestTimeout:     300 * time.Millisecond,
		BackoffBase:        5 * time.Millisecond,
		BackoffMax:         20 * time.Millisecond,
		GroupRate:          1000,
	}
}

func (e *env) checkback(cfg *Config) *CheckBack {
	e.t.Helper()
	if cfg == nil {
		cfg = fastConfig()
	}
	cfg.Schema = e.db.Schema
	if cfg.Logger == nil {
		cfg.Logger = testLogger()
	}
	cb, err := New(e.db.Pool, e.nats.Conn, cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	return cb
}

// startRelay runs a real relay until the test ends.
func (e *env) startRelay() {
	e.t.Helper()
	r, err := relay.New(e.db.Pool, e.nats.JS, &relay.Config{
		Schema: e.db.Schema, PollMax: 20 * time.Millisecond, LeaseInterval: 50 * time.Millisecond,
		ID: uuid.NewString()[:8], Logger: testLogger(),
	})
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	e.t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			e.t.Errorf("relay: %v", err)
		}
		r.Close()
	})
}

func (e *env) prepare(msg outbox.Message, opts *outbox.PrepareOptions) outbox.Half {
	e.t.Helper()
	if msg.Subject == "" {
		msg.Subject = "orders.created"
	}
	h, err := e.client.Prepare(context.Background(), e.db.Pool, msg, opts)
	if err != nil {
		e.t.Fatal(err)
	}
	return h
}

func (e *env) state(id uuid.UUID) (state string, checks int) {
	e.t.Helper()
	err := e.db.Pool.QueryRow(context.Background(), `SELECT state, check_count FROM txoutbox_messages WHERE message_id = $1`, id).Scan(&state, &checks)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", 0
	}
	if err != nil {
		e.t.Fatal(err)
	}
	return state, checks
}

// backdate moves the prepared rows (all of them, or those of ids) d into the past, as if they
// had been prepared d earlier: a transaction timeout up to d has passed without the test
// waiting for it.
func (e *env) backdate(d time.Duration, ids ...uuid.UUID) {
	e.t.Helper()
	if _, err := e.db.Pool.Exec(context.Background(), `UPDATE txoutbox_messages SET created_at = created_at - $1::float8 * interval '1 millisecond'
		WHERE state = 'prepared' AND (coalesce(cardinality($2::uuid[]), 0) = 0 OR message_id = ANY($2::uuid[]))`,
		float64(d.Milliseconds()), ids); err != nil {
		e.t.Fatal(err)
	}
}

// due makes every row's next check due now, whatever its backoff (or state) says.
func (e *env) due() {
	e.t.Helper()
	if _, err := e.db.Pool.Exec(context.Background(), `UPDATE txoutbox_messages SET next_check_at = now() - interval '1 second'`); err != nil {
		e.t.Fatal(err)
	}
}

// streamIDs returns the Nats-Msg-Id of every message in the ORDERS stream, in stream order.
func (e *env) streamIDs() []string {
	var out []string
	for _, m := range testsvc.StreamMsgs(e.t, e.nats.JS, "ORDERS") {
		out = append(out, m.Header.Get("Nats-Msg-Id"))
	}
	return out
}

// waitStream waits until the stream holds n messages, then checks it still does shortly after.
func (e *env) waitStream(n int) []string {
	e.t.Helper()
	testsvc.Eventually(e.t, 10*time.Second, "the stream to hold the messages", func() bool { return len(e.streamIDs()) >= n })
	ids := e.streamIDs()
	if len(ids) != n {
		e.t.Fatalf("stream holds %d messages, want %d: %v", len(ids), n, ids)
	}
	return ids
}

// settle waits (the relay running) until no row is ready any more, and returns the stream.
func (e *env) drained() []string {
	e.t.Helper()
	testsvc.Eventually(e.t, 10*time.Second, "the relay to drain the ready rows", func() bool {
		var n int
		_ = e.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM txoutbox_messages WHERE state = 'ready'`).Scan(&n)
		return n == 0
	})
	return e.streamIDs()
}

// outbox is the identity of the test's outbox, as the check-back computes it by default.
func (e *env) outbox() string {
	e.t.Helper()
	id, err := checker.OutboxIdentity(context.Background(), e.db.Pool, e.db.Schema)
	if err != nil {
		e.t.Fatal(err)
	}
	return id
}

// scriptedChecker serves a group with a scripted answer and records the requests.
type scriptedChecker struct {
	mu     sync.Mutex
	reqs   []checker.Request
	at     []time.Time
	answer func(checker.Request) (outbox.LocalState, error)
}

func (e *env) serve(group string, answer func(checker.Request) (outbox.LocalState, error)) *scriptedChecker {
	e.t.Helper()
	ck := &scriptedChecker{answer: answer}
	srv, err := checker.Serve(e.nats.Conn, group, func(ctx context.Context, req checker.Request) (outbox.LocalState, error) {
		ck.mu.Lock()
		ck.reqs = append(ck.reqs, req)
		ck.at = append(ck.at, time.Now())
		ans := ck.answer
		ck.mu.Unlock()
		return ans(req)
	}, &checker.Config{Logger: testLogger(), Outbox: e.outbox()})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = srv.Stop() })
	return ck
}

func (c *scriptedChecker) requests() []checker.Request {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]checker.Request(nil), c.reqs...)
}

func (c *scriptedChecker) setAnswer(f func(checker.Request) (outbox.LocalState, error)) {
	c.mu.Lock()
	c.answer = f
	c.mu.Unlock()
}

func answer(s outbox.LocalState) func(checker.Request) (outbox.LocalState, error) {
	return func(checker.Request) (outbox.LocalState, error) { return s, nil }
}

func mustResolve(t *testing.T, cb *CheckBack) ResolveResult {
	t.Helper()
	res, err := cb.resolveOnce(context.Background())
	if err != nil {
		t.Fatalf("resolve: %v", err)
	}
	return res
}

func TestPrepareCommitPublishedOnceRollbackNever(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	e.startRelay()
	committed := e.prepare(outbox.Message{Key: "o1", Payload: []byte("yes")}, &outbox.PrepareOptions{Group: "orders"})
	rolledBack := e.prepare(outbox.Message{Payload: []byte("no")}, &outbox.PrepareOptions{Group: "orders"})
	waiting := e.prepare(outbox.Message{Payload: []byte("later")}, &outbox.PrepareOptions{Group: "orders", CheckImmunity: time.Hour})

	// Prepared messages are invisible to the relay: the passes that publish the committed one
	// below see them too, and the stream then holds the committed message only.
	if err := e.client.Commit(ctx, e.db.Pool, committed.ID); err != nil {
		t.Fatal(err)
	}
	if err := e.client.Rollback(ctx, e.db.Pool, rolledBack.ID); err != nil {
		t.Fatal(err)
	}
	ids := e.waitStream(1)
	if ids[0] != committed.ID.String() {
		t.Fatalf("published %v, want %s", ids, committed.ID)
	}
	e.drained()
	// A late second commit cannot publish it again: the relay deleted it.
	if err := e.client.Commit(ctx, e.db.Pool, committed.ID); !errors.Is(err, outbox.ErrNotFound) {
		t.Fatalf("second commit: %v", err)
	}
	if st, _ := e.state(committed.ID); st != "" {
		t.Fatalf("the late second commit left the row %q, want it gone", st)
	}
	if ids := e.drained(); len(ids) != 1 {
		t.Fatalf("stream holds %v, want only %s", ids, committed.ID)
	}
	if st, _ := e.state(rolledBack.ID); st != "rolled_back" {
		t.Fatalf("rolled back message is %q", st)
	}
	if st, _ := e.state(waiting.ID); st != "prepared" {
		t.Fatalf("waiting message is %q", st)
	}
}

// The producer prepares and "dies": its checker answers for it.
func TestCheckerAnswersCommitOrRollback(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startRelay()
	cfg := fastConfig()
	cfg.TransactionTimeout = time.Hour // passed by back-dating the rows, not by waiting
	cb := e.checkback(cfg)
	hdr := map[string][]string{"traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}
	commit := e.prepare(outbox.Message{Key: "order-7", Headers: hdr, Payload: []byte("c")}, &outbox.PrepareOptions{Group: "orders"})
	rollback := e.prepare(outbox.Message{Payload: []byte("r")}, &outbox.PrepareOptions{Group: "payments"})
	orders := e.serve("orders", answer(outbox.StateCommit))
	payments := e.serve("payments", answer(outbox.StateRollback))

	// Before the transaction timeout nobody is asked.
	if res := mustResolve(t, cb); len(res.Checks) != 0 || len(orders.requests()) != 0 {
		t.Fatalf("checked before the timeout: %+v", res)
	}
	e.backdate(cfg.TransactionTimeout)
	res := mustResolve(t, cb)
	if res.Committed != 1 || res.RolledBack != 1 || res.Checks[OutcomeCommit] != 1 || res.Checks[OutcomeRollback] != 1 {
		t.Fatalf("resolve: %+v", res)
	}
	ids := e.waitStream(1)
	if ids[0] != commit.ID.String() {
		t.Fatalf("published %v, want %s", ids, commit.ID)
	}
	if st, n := e.state(rollback.ID); st != "rolled_back" || n != 1 {
		t.Fatalf("rolled back message: %s after %d checks", st, n)
	}
	// The request carried what the checker needs.
	req := orders.requests()[0]
	if req.MessageID != commit.ID || req.Key != "order-7" || req.Subject != "orders.created" || req.Group != "orders" ||
		req.Check != 1 || req.Headers["traceparent"][0] != hdr["traceparent"][0] || req.PreparedAt.IsZero() {
		t.Fatalf("check request: %+v", req)
	}
	if len(payments.requests()) != 1 {
		t.Fatalf("payments checker asked %d times", len(payments.requests()))
	}
	// Settled rows are never asked about again.
	mustResolve(t, cb)
	if len(orders.requests()) != 1 || len(payments.requests()) != 1 {
		t.Fatal("a settled message was checked again")
	}
	e.drained()
	if ids := e.streamIDs(); len(ids) != 1 {
		t.Fatalf("stream: %v", ids)
	}
}

func TestUnknownUntilExhaustedThenResumed(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startRelay()
	reg := prometheus.NewRegistry()
	cfg := fastConfig()
	cfg.Registerer = reg
	cb := e.checkback(cfg)
	h := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "orders"})
	ck := e.serve("orders", answer(outbox.StateUnknown))
	e.backdate(cfg.TransactionTimeout)

	// One check per pass, each made due at once rather than waited for (the backoff between
	// checks is TestCheckTimeline's).
	exhausted := 0
	for i := 0; i < DefaultMaxChecks; i++ {
		e.due()
		exhausted += mustResolve(t, cb).Exhausted
	}
	st, n := e.state(h.ID)
	if st != "check_exhausted" || n != DefaultMaxChecks || exhausted != 1 {
		t.Fatalf("after the checks: %s with %d checks (exhausted %d)", st, n, exhausted)
	}
	if got := len(ck.requests()); got != DefaultMaxChecks {
		t.Fatalf("checker asked %d times, want %d", got, DefaultMaxChecks)
	}
	for i, r := range ck.requests() {
		if r.Check != i+1 {
			t.Fatalf("request %d says check %d", i, r.Check)
		}
	}
	// Exhausted rows are no longer checked, even with a check due, are counted and listed.
	e.due()
	mustResolve(t, cb)
	if got := len(ck.requests()); got != DefaultMaxChecks {
		t.Fatalf("an exhausted row was checked again (%d requests)", got)
	}
	sr, err := cb.staleOnce(context.Background())
	if err != nil || sr.Exhausted != 1 || sr.Prepared != 0 {
		t.Fatalf("stale report: %+v %v", sr, err)
	}
	rows, err := cb.q.ListHalf(context.Background(), e.db.Pool, []string{"check_exhausted"}, "", 10)
	if err != nil || len(rows) != 1 || rows[0].MessageID != h.ID || rows[0].CheckCount != DefaultMaxChecks || rows[0].LastError == "" {
		t.Fatalf("list: %+v %v", rows, err)
	}
	if v := counter(t, reg, "txoutbox_checkback_exhausted_total", ""); v != 1 {
		t.Fatalf("exhausted_total = %v", v)
	}
	if v := counter(t, reg, "txoutbox_checkback_checks_total", "unknown"); v != DefaultMaxChecks {
		t.Fatalf("checks_total{unknown} = %v", v)
	}
	if ids := e.streamIDs(); len(ids) != 0 {
		t.Fatalf("published: %v", ids)
	}

	// Resume: the checks start over; this time the checker knows.
	resumed, err := cb.q.Resume(context.Background(), e.db.Pool, []uuid.UUID{h.ID}, false, "")
	if err != nil || len(resumed) != 1 {
		t.Fatalf("resume: %v %v", resumed, err)
	}
	if st, n := e.state(h.ID); st != "prepared" || n != 0 {
		t.Fatalf("resumed row: %s, %d checks", st, n)
	}
	ck.setAnswer(answer(outbox.StateCommit))
	if res := mustResolve(t, cb); res.Committed != 1 {
		t.Fatalf("resolve after resume: %+v", res)
	}
	if ids := e.waitStream(1); ids[0] != h.ID.String() {
		t.Fatalf("published %v", ids)
	}
}

// counter reads a counter (with label value lv, or unlabelled) from reg.
func counter(t *testing.T, reg *prometheus.Registry, name, lv string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if lv == "" || (len(m.GetLabel()) > 0 && m.GetLabel()[0].GetValue() == lv) {
				return m.GetCounter().GetValue()
			}
		}
	}
	return -1
}

// A slow checker, an absent one, one replying garbage and one failing: each counts as a check,
// nothing is settled, and the next check is scheduled later.
func TestInconclusiveAnswersCountAsChecks(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := fastConfig()
	cfg.BackoffBase, cfg.BackoffMax = time.Hour, time.Hour // one check each in this test
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	cb := e.checkback(cfg)

	slow := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "slow"})
	absent := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "absent"})
	garbage := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "garbage"})
	failing := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "failing"})
	stuck := make(chan struct{})
	e.serve("slow", func(checker.Request) (outbox.LocalState, error) {
		<-stuck // answers after the request timeout: when the test ends
		return outbox.StateCommit, nil
	})
	t.Cleanup(func() { close(stuck) })
	e.serve("failing", func(checker.Request) (outbox.LocalState, error) {
		return outbox.StateCommit, errors.New("database unreachable\r\nsecond line")
	})
	// A raw responder that answers nonsense.
	sub, err := e.nats.Conn.Subscribe(checker.Subject(DefaultSubjectPrefix, "garbage"), func(m *nats.Msg) { _ = m.Respond([]byte("MAYBE")) })
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()

	e.backdate(cfg.TransactionTimeout)
	res := mustResolve(t, cb)
	want := map[string]int{OutcomeTimeout: 1, OutcomeNoResponders: 1, OutcomeMalformed: 1, OutcomeError: 1}
	for k, v := range want {
		if res.Checks[k] != v {
			t.Fatalf("checks %v, want %v", res.Checks, want)
		}
	}
	if res.Committed+res.RolledBack+res.Exhausted != 0 {
		t.Fatalf("something was settled: %+v", res)
	}
	for _, h := range []outbox.Half{slow, absent, garbage, failing} {
		var st, lastErr string
		var n int
		var dueSec float64
		if err := e.db.Pool.QueryRow(context.Background(), `SELECT state, check_count, last_error, extract(epoch FROM next_check_at - now())::float8
			FROM txoutbox_messages WHERE message_id = $1`, h.ID).Scan(&st, &n, &lastErr, &dueSec); err != nil {
			t.Fatal(err)
		}
		due := time.Duration(dueSec * float64(time.Second))
		if st != "prepared" || n != 1 || due < 30*time.Minute {
			t.Fatalf("%s: %s after %d checks, next in %s (%s)", h.Group, st, n, due, lastErr)
		}
		t.Logf("%s: %s", h.Group, lastErr)
		if h.Group == "garbage" && lastErr != `malformed: malformed reply: "MAYBE" is not COMMIT, ROLLBACK or UNKNOWN` {
			t.Errorf("last_error of the garbage reply: %q", lastErr)
		}
	}
	for k, v := range want {
		if got := counter(t, reg, "txoutbox_checkback_checks_total", k); got != float64(v) {
			t.Fatalf("checks_total{%s} = %v", k, got)
		}
	}
	// Not due again: nothing is asked.
	if res := mustResolve(t, cb); len(res.Checks) != 0 {
		t.Fatalf("checked again before the backoff: %+v", res)
	}
}

// Many stale rows of one group never become a storm: concurrency and rate are bounded.
func TestChecksPerGroupAreBounded(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := fastConfig()
	cfg.GroupConcurrency, cfg.GroupRate, cfg.BatchSize = 2, 40, 30
	cb := e.checkback(cfg)
	var inFlight, peak atomic.Int32
	e.serve("orders", func(checker.Request) (outbox.LocalState, error) {
		n := inFlight.Add(1)
		defer inFlight.Add(-1)
		for {
			p := peak.Load()
			if n <= p || peak.CompareAndSwap(p, n) {
				break
			}
		}
		time.Sleep(10 * time.Millisecond) // slow work: checks overlap in time
		return outbox.StateRollback, nil
	})
	for i := 0; i < 30; i++ {
		e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "orders"})
	}
	e.backdate(cfg.TransactionTimeout)
	start := time.Now()
	res := mustResolve(t, cb)
	took := time.Since(start)
	if res.RolledBack != 30 {
		t.Fatalf("resolve: %+v", res)
	}
	if p := peak.Load(); p > 2 {
		t.Fatalf("%d checks in flight at once, the bound is 2", p)
	}
	// 30 requests at 40/s with a burst of 2 take at least 28/40 s.
	if min := 28 * time.Second / 40; took < min {
		t.Fatalf("30 checks took %s: faster than the rate allows (%s)", took, min)
	}
	t.Logf("30 checks, concurrency 2, rate 40/s: %s, peak in flight %d", took, peak.Load())
}

// GroupRate txoutbox.Forever lifts the rate limit (GroupConcurrency still bounds the checks
// in flight): the group's limiter has no rate, the claim lease stays finite and positive, and
// a pass settles every stale row of the group.
func TestGroupRateForeverHasNoRateLimit(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := fastConfig()
	cfg.GroupConcurrency, cfg.GroupRate, cfg.BatchSize = 2, txoutbox.Forever, 20
	cb := e.checkback(cfg)
	if got := cb.Config().GroupRate; got != txoutbox.Forever {
		t.Fatalf("GroupRate after WithDefaults: %v, want txoutbox.Forever", got)
	}
	if l := cb.limiter("orders"); l.rate.Limit() != rate.Inf || cap(l.sem) != 2 {
		t.Fatalf("limiter: rate %v, concurrency %d; want no rate limit and 2", l.rate.Limit(), cap(l.sem))
	}
	if d := cb.lease(); d <= 0 || d > time.Minute {
		t.Fatalf("claim lease %s with no rate limit", d)
	}
	e.serve("orders", answer(outbox.StateRollback))
	for i := 0; i < 20; i++ {
		e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "orders"})
	}
	e.backdate(cfg.TransactionTimeout)
	if res := mustResolve(t, cb); res.RolledBack != 20 {
		t.Fatalf("resolve with no rate limit: %+v, want 20 rolled back", res)
	}
}

func TestImmunityDelaysTheFirstCheck(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cb := e.checkback(nil)
	ck := e.serve("orders", answer(outbox.StateCommit))
	preparing := time.Now()
	immune := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "orders", CheckImmunity: 800 * time.Millisecond})
	plain := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "orders"})
	e.backdate(cb.cfg.TransactionTimeout) // the immunity, not the transaction timeout, holds the check back
	if res := mustResolve(t, cb); res.Committed != 1 {
		t.Fatalf("resolve: %+v", res)
	}
	if st, _ := e.state(plain.ID); st != "ready" {
		t.Fatalf("plain message: %s", st)
	}
	if st, n := e.state(immune.ID); st != "prepared" || n != 0 {
		t.Fatalf("immune message checked early: %s, %d checks", st, n)
	}
	testsvc.Eventually(t, 5*time.Second, "the immune message to be checked", func() bool {
		mustResolve(t, cb)
		st, _ := e.state(immune.ID)
		return st == "ready"
	})
	reqs := ck.requests()
	if len(reqs) != 2 || reqs[1].MessageID != immune.ID {
		t.Fatalf("requests: %+v", reqs)
	}
	ck.mu.Lock()
	at := ck.at[1]
	ck.mu.Unlock()
	if age := at.Sub(preparing); age < 800*time.Millisecond {
		t.Fatalf("immune message checked %s after its prepare, before its immunity", age)
	}
}

// The fencing race between the check-back and a CommitTx in flight, in every order: the
// business row and the message always agree.
func TestFenceRace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	// agree asserts that order id's business row exists iff its message was published.
	agree := func(e *env, order int, h outbox.Half, wantPublished bool) {
		e.t.Helper()
		ids := e.drained()
		published := false
		for _, id := range ids {
			published = published || id == h.ID.String()
		}
		var n int
		if err := e.db.Pool.QueryRow(ctx, `SELECT count(*) FROM orders WHERE id = $1`, order).Scan(&n); err != nil {
			e.t.Fatal(err)
		}
		if published != (n == 1) || published != wantPublished {
			e.t.Fatalf("business row exists: %v, message published: %v (want %v)", n == 1, published, wantPublished)
		}
	}

	t.Run("CommitTxHoldsTheRowThenCommits", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		e.startRelay()
		cb := e.checkback(nil)
		h := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Fence: true})
		e.backdate(cb.cfg.TransactionTimeout) // the business transaction runs past the timeout
		tx, err := e.db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if _, err := tx.Exec(ctx, `INSERT INTO orders VALUES (1)`); err != nil {
			t.Fatal(err)
		}
		if err := e.client.CommitTx(ctx, tx, h.ID); err != nil {
			t.Fatal(err)
		}
		if res := mustResolve(t, cb); res.Fenced != 0 {
			t.Fatalf("fenced a row whose CommitTx holds it: %+v", res)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		mustResolve(t, cb)
		e.waitStream(1)
		agree(e, 1, h, true)
	})

	t.Run("CommitTxHoldsTheRowThenRollsBack", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		e.startRelay()
		cb := e.checkback(nil)
		h := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Fence: true})
		e.backdate(cb.cfg.TransactionTimeout) // the business transaction runs past the timeout
		tx, _ := e.db.Pool.Begin(ctx)
		_, _ = tx.Exec(ctx, `INSERT INTO orders VALUES (1)`)
		if err := e.client.CommitTx(ctx, tx, h.ID); err != nil {
			t.Fatal(err)
		}
		if res := mustResolve(t, cb); res.Fenced != 0 {
			t.Fatalf("fenced a row whose CommitTx holds it: %+v", res)
		}
		_ = tx.Rollback(ctx) // the business transaction fails
		if res := mustResolve(t, cb); res.Fenced != 1 {
			t.Fatalf("resolve after the business rollback: %+v", res)
		}
		agree(e, 1, h, false)
	})

	t.Run("FenceFirstThenCommitTxFails", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		e.startRelay()
		cb := e.checkback(nil)
		h := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Fence: true})
		e.backdate(cb.cfg.TransactionTimeout)
		if res := mustResolve(t, cb); res.Fenced != 1 {
			t.Fatalf("resolve: %+v", res)
		}
		tx, _ := e.db.Pool.Begin(ctx)
		_, _ = tx.Exec(ctx, `INSERT INTO orders VALUES (1)`)
		if err := e.client.CommitTx(ctx, tx, h.ID); !errors.Is(err, outbox.ErrRolledBack) {
			t.Fatalf("late CommitTx: %v, want ErrRolledBack", err)
		}
		if err := tx.Commit(ctx); !errors.Is(err, pgx.ErrTxCommitRollback) {
			t.Fatalf("business commit after a lost CommitTx: %v", err)
		}
		agree(e, 1, h, false)
	})

	t.Run("CommitTxWaitsOnTheFenceThenFails", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		e.startRelay()
		cb := e.checkback(nil)
		h := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Fence: true})
		e.backdate(cb.cfg.TransactionTimeout)

		// The fence holds the row lock while the business transaction's CommitTx arrives.
		locked, release := make(chan struct{}), make(chan struct{})
		cb.hooks.afterFenceLock = func(context.Context, []int64) { close(locked); <-release }
		fenceDone := make(chan ResolveResult, 1)
		go func() { res, _ := cb.resolveOnce(ctx); fenceDone <- res }()
		testsvc.Receive(t, locked, 10*time.Second, "the fence to lock the row")

		tx, _ := e.db.Pool.Begin(ctx)
		defer func() { _ = tx.Rollback(ctx) }()
		_, _ = tx.Exec(ctx, `INSERT INTO orders VALUES (1)`)
		var pid int
		_ = tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid)
		commitErr := make(chan error, 1)
		go func() { commitErr <- e.client.CommitTx(ctx, tx, h.ID) }()
		testsvc.Eventually(t, 10*time.Second, "CommitTx to wait on the row lock", func() bool {
			var wait string
			_ = e.db.AdminPool.QueryRow(ctx, `SELECT coalesce(wait_event_type, '') FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&wait)
			return wait == "Lock"
		})
		close(release)
		if res := <-fenceDone; res.Fenced != 1 {
			t.Fatalf("fence: %+v", res)
		}
		if err := <-commitErr; !errors.Is(err, outbox.ErrRolledBack) {
			t.Fatalf("CommitTx: %v, want ErrRolledBack", err)
		}
		if err := tx.Commit(ctx); !errors.Is(err, pgx.ErrTxCommitRollback) {
			t.Fatalf("business commit: %v", err)
		}
		agree(e, 1, h, false)
	})
}

// A half message committed by its checker takes its key's place after the messages of that
// key committed before it, and half messages of one key committed in one pass keep their
// prepare order: the relay publishes them in commit order.
func TestCheckerCommitKeepsKeyOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	cb := e.checkback(nil)
	e.serve("orders", func(checker.Request) (outbox.LocalState, error) {
		time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond) // answers arrive in any order
		return outbox.StateCommit, nil
	})
	var halves []string
	for i := 0; i < 5; i++ {
		h := e.prepare(outbox.Message{Key: "order-1", Payload: []byte("half")}, &outbox.PrepareOptions{Group: "orders"})
		halves = append(halves, h.ID.String())
	}
	var enq []uuid.UUID
	if err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
		var err error
		enq, err = e.client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.created", Key: "order-1", Payload: []byte("direct")})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	e.backdate(cb.cfg.TransactionTimeout)
	if res := mustResolve(t, cb); res.Committed != 5 {
		t.Fatalf("resolve: %+v", res)
	}
	e.startRelay()
	ids := e.waitStream(6)
	want := append([]string{enq[0].String()}, halves...)
	if strings.Join(ids, " ") != strings.Join(want, " ") {
		t.Fatalf("stream order %v, want %v (commit order)", ids, want)
	}
}

func TestStaleReadyRowsAreReportedNotTouched(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	cfg := fastConfig()
	cfg.StaleReadyAfter = time.Minute
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	logs := &testsvc.LogBuffer{}
	cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	cb := e.checkback(cfg)
	var ids []uuid.UUID
	_ = pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
		var err error
		ids, err = e.client.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.a"}, outbox.Message{Subject: "orders.b"}, outbox.Message{Subject: "orders.c"})
		return err
	})
	if r, err := cb.staleOnce(ctx); err != nil || r.StaleReady != 0 || r.OldestReady > time.Minute {
		t.Fatalf("fresh rows: %+v %v", r, err)
	}
	// Two rows have waited 5 and 10 minutes (no relay runs): the one with the smaller id is
	// the younger, as a dead row requeued by an operator is (it keeps its id).
	for i, age := range []string{"5 minutes", "10 minutes"} {
		if _, err := e.db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET ready_at = now() - $2::interval WHERE message_id = $1`, ids[i], age); err != nil {
			t.Fatal(err)
		}
	}
	r, err := cb.staleOnce(ctx)
	if err != nil || r.StaleReady != 2 || r.OldestReady < 10*time.Minute || r.OldestReady > 11*time.Minute {
		t.Fatalf("stale report: %+v %v", r, err)
	}
	var n int
	_ = e.db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_messages WHERE state = 'ready' AND attempts = 0`).Scan(&n)
	if n != 3 {
		t.Fatalf("%d rows still ready and untouched, want 3", n)
	}
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() == "txoutbox_checkback_stale_ready_rows" && mf.GetMetric()[0].GetGauge().GetValue() != 2 {
			t.Fatalf("stale_ready_rows gauge: %v", mf.GetMetric()[0].GetGauge().GetValue())
		}
	}

	// One line per state change: the stale backlog is logged when it starts (naming the dead
	// rows that may hold it back), not on every pass (it was again every 5 minutes), and once
	// when it ends.
	for range 3 {
		if _, err := cb.staleOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	const warning, ended = "ready rows are waiting longer than they should", "no stale ready rows any more"
	if n := strings.Count(logs.String(), warning); n != 1 {
		t.Fatalf("%d stale warnings over 4 passes, want 1:\n%s", n, logs.String())
	}
	if !strings.Contains(logs.String(), "relay dead list") {
		t.Errorf("the stale warning does not point at the dead rows that may hold the key back:\n%s", logs.String())
	}
	if _, err := e.db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET ready_at = now()`); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := cb.staleOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if n := strings.Count(logs.String(), ended); n != 1 {
		t.Fatalf("%d lines saying the stale backlog ended, want 1:\n%s", n, logs.String())
	}
}

func TestRetentionPurgesOnlyWhatIsOld(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	cfg := fastConfig()
	cfg.PublishedRetention = time.Hour
	cfg.RolledBackRetention = 24 * time.Hour
	cfg.DedupRetention = 7 * 24 * time.Hour
	cfg.PurgeBatchSize = 2 // several batches
	cb := e.checkback(cfg)

	type row struct {
		state string
		age   string
		gone  bool
	}
	rows := []row{
		{"published", "2 hours", true}, {"published", "3 hours", true}, {"published", "90 minutes", true},
		{"published", "30 minutes", false}, {"published", "1 minute", false},
		{"rolled_back", "25 hours", true}, {"rolled_back", "2 days", true}, {"rolled_back", "23 hours", false},
		// Never purged, however old.
		{"ready", "30 days", false}, {"prepared", "30 days", false}, {"dead", "30 days", false}, {"check_exhausted", "30 days", false},
	}
	ids := make([]uuid.UUID, len(rows))
	for i, r := range rows {
		ids[i] = uuid.New()
		if _, err := e.db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state, created_at, published_at, settled_at)
			VALUES ($1, 'orders.x', 1, '', $2, now() - $3::interval, now() - $3::interval, now() - $3::interval)`, ids[i], r.state, r.age); err != nil {
			t.Fatal(err)
		}
	}
	dedup := []struct {
		age  string
		gone bool
	}{{"8 days", true}, {"30 days", true}, {"6 days", false}, {"1 hour", false}}
	for i, d := range dedup {
		if _, err := e.db.Pool.Exec(ctx, `INSERT INTO txoutbox_consumer_dedup (consumer, idempotency_key, processed_at) VALUES ('c', $1, now() - $2::interval)`,
			strconv.Itoa(i), d.age); err != nil {
			t.Fatal(err)
		}
	}
	r, err := cb.purgeOnce(ctx)
	if err != nil || r.Published != 3 || r.RolledBack != 2 || r.Dedup != 2 {
		t.Fatalf("purge: %+v %v", r, err)
	}
	for i, rw := range rows {
		st, _ := e.state(ids[i])
		if (st == "") != rw.gone {
			t.Errorf("%s row aged %s: present %v, want gone %v", rw.state, rw.age, st != "", rw.gone)
		}
	}
	for i, d := range dedup {
		var n int
		_ = e.db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_consumer_dedup WHERE idempotency_key = $1`, strconv.Itoa(i)).Scan(&n)
		if (n == 0) != d.gone {
			t.Errorf("dedup row aged %s: present %v, want gone %v", d.age, n == 1, d.gone)
		}
	}
	if r, err := cb.purgeOnce(ctx); err != nil || r != (PurgeResult{}) {
		t.Fatalf("second purge: %+v %v", r, err)
	}

	// A check-back that is not told the relay's retention leaves published rows alone.
	if _, err := e.db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, partition_key, payload, state, created_at, published_at, settled_at)
		VALUES ($1, 'orders.x', 1, '', 'published', now() - interval '30 days', now() - interval '30 days', now() - interval '30 days')`, uuid.New()); err != nil {
		t.Fatal(err)
	}
	cfg.PublishedRetention = 0
	if r, err := e.checkback(cfg).purgeOnce(ctx); err != nil || r.Published != 0 {
		t.Fatalf("purge without a published retention: %+v %v", r, err)
	}
}

func TestConfigErrorsNameTheField(t *testing.T) {
	t.Parallel()
	for field, cfg := range map[string]*Config{
		"Schema":          {Schema: strings.Repeat("s", 64)},
		"MaxChecks":       {MaxChecks: -1},
		"BackoffMax":      {BackoffBase: time.Minute, BackoffMax: time.Second},
		"BackoffJitter":   {BackoffJitter: 1.5},
		"GroupRate":       {GroupRate: -2},
		"SubjectPrefix":   {SubjectPrefix: "txoutbox.*"},
		"ResolveSchedule": {ResolveSchedule: "every second"},
		"PurgeSchedule":   {PurgeSchedule: "@every 1ms"},
		"DedupRetention":  {DedupRetention: -time.Hour},
	} {
		err := ValidateConfig(cfg)
		var ce *txoutbox.ConfigError
		if !errors.As(err, &ce) || ce.Field != "Config."+field {
			t.Errorf("%s: got %v", field, err)
		}
	}
	if err := ValidateConfig(&Config{ResolveSchedule: "*/5 * * * * *", StaleSchedule: ScheduleOff, PurgeSchedule: "@hourly"}); err != nil {
		t.Errorf("valid schedules refused: %v", err)
	}
	if _, err := checker.Serve(nil, "g", nil, nil); err == nil {
		t.Error("Serve without a connection succeeded")
	}
}

func TestBackoff(t *testing.T) {
	t.Parallel()
	for n, want := range map[int]time.Duration{1: 5 * time.Second, 2: 10 * time.Second, 3: 20 * time.Second, 4: 40 * time.Second, 5: time.Minute, 15: time.Minute} {
		if got := backoff(n, 5*time.Second, time.Minute, 0); got != want {
			t.Errorf("backoff(%d) = %s, want %s", n, got, want)
		}
		for i := 0; i < 100; i++ {
			got := backoff(n, 5*time.Second, time.Minute, 0.2)
			if got < want*8/10 || got > want*12/10 {
				t.Fatalf("backoff(%d) with jitter = %s, outside %s ± 20%%", n, got, want)
			}
		}
	}
}

// TestCheckTimeline runs the real scheduler against a checker that always answers UNKNOWN and
// logs when each check arrived: the first after the transaction timeout, then the backoff
// between checks, until the row is check_exhausted. With TXOUTBOX_CHECK_TIMELINE=defaults it
// uses the default timings (6s timeout, 5s base, 1m cap, schedule @every 1s) for 4 checks
// (about 45s); otherwise small ones.
//
//	go test ./checkback -run TestCheckTimeline -count=1 -v
//	TXOUTBOX_CHECK_TIMELINE=defaults go test ./checkback -run TestCheckTimeline -count=1 -v
func TestCheckTimeline(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := &Config{
		TransactionTimeout: 500 * time.Millisecond,
		BackoffBase:        100 * time.Millisecond,
		BackoffMax:         400 * time.Millisecond,
		MaxChecks:          6,
		ResolveSchedule:    "@every 20ms",
	}
	if os.Getenv("TXOUTBOX_CHECK_TIMELINE") == "defaults" {
		cfg = &Config{MaxChecks: 4}
	}
	cfg.StaleSchedule, cfg.PurgeSchedule = ScheduleOff, ScheduleOff
	cb := e.checkback(cfg)
	c := cb.cfg
	ck := e.serve("orders", answer(outbox.StateUnknown))

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cb.Run(ctx) }()
	prepared := time.Now()
	h := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "orders"})
	limit := c.TransactionTimeout + time.Duration(c.MaxChecks)*c.BackoffMax*2 + 30*time.Second
	testsvc.Eventually(t, limit, "the row to be check_exhausted", func() bool {
		st, _ := e.state(h.ID)
		return st == "check_exhausted"
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	ck.mu.Lock()
	at := append([]time.Time(nil), ck.at...)
	ck.mu.Unlock()
	if len(at) != c.MaxChecks {
		t.Fatalf("%d checks, want %d", len(at), c.MaxChecks)
	}
	t.Logf("timeline: transaction timeout %s, backoff base %s cap %s jitter ±%.0f%%, schedule %q, max checks %d",
		c.TransactionTimeout, c.BackoffBase, c.BackoffMax, c.BackoffJitter*100, c.ResolveSchedule, c.MaxChecks)
	first := at[0].Sub(prepared)
	t.Logf("check 1 at +%s after prepare", first.Round(time.Millisecond))
	if first < c.TransactionTimeout {
		t.Fatalf("first check %s after prepare, before the transaction timeout %s", first, c.TransactionTimeout)
	}
	for i := 1; i < len(at); i++ {
		gap := at[i].Sub(at[i-1])
		nominal := backoff(i, c.BackoffBase, c.BackoffMax, 0)
		t.Logf("check %d at +%s, %s after check %d (nominal backoff %s, so %s..%s with jitter)", i+1,
			at[i].Sub(prepared).Round(time.Millisecond), gap.Round(time.Millisecond), i, nominal,
			time.Duration(float64(nominal)*(1-c.BackoffJitter)).Round(time.Millisecond),
			time.Duration(float64(nominal)*(1+c.BackoffJitter)).Round(time.Millisecond))
		if low := time.Duration(float64(nominal) * (1 - c.BackoffJitter)); gap < low {
			t.Fatalf("check %d came %s after the previous one, before its backoff (at least %s)", i+1, gap, low)
		}
	}
	st, n := e.state(h.ID)
	t.Logf("then: %s after %d checks, %s after prepare", st, n, time.Since(prepared).Round(time.Millisecond))
}

// While the check-back's own NATS connection is down, checks are postponed, not counted: an
// outage on our side must not burn a message's checks.
func TestNATSDownPostponesChecks(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cb := e.checkback(nil)
	h := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "orders"})
	e.backdate(cb.cfg.TransactionTimeout)
	e.nats.Stop()
	testsvc.Eventually(t, 5*time.Second, "the connection to notice", func() bool { return !e.nats.Conn.IsConnected() })
	res := mustResolve(t, cb)
	if len(res.Checks) != 0 || res.Released != 1 {
		t.Fatalf("resolve with NATS down: %+v", res)
	}
	if st, n := e.state(h.ID); st != "prepared" || n != 0 {
		t.Fatalf("%s after %d checks, want prepared with none counted", st, n)
	}
	if err := e.nats.Start(); err != nil {
		t.Fatal(err)
	}
	testsvc.Eventually(t, 10*time.Second, "the connection to come back", e.nats.Conn.IsConnected)
	e.serve("orders", answer(outbox.StateCommit))
	if res := mustResolve(t, cb); res.Committed != 1 {
		t.Fatalf("resolve with NATS back: %+v", res)
	}
}

// A group whose checker hangs must not hold up the other groups, nor the fence: the scheduled
// passes go on while its checks wait for their timeouts.
func TestHungCheckerDoesNotHoldUpOtherGroups(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := fastConfig()
	cfg.RequestTimeout = 3 * time.Second // the hung group's pass waits this long per check
	cfg.GroupConcurrency = 1
	cfg.ResolveSchedule = "@every 50ms"
	cfg.StaleSchedule, cfg.PurgeSchedule = ScheduleOff, ScheduleOff
	cb := e.checkback(cfg)
	release := make(chan struct{})
	defer close(release)
	asked := make(chan struct{}, 1)
	e.serve("hung", func(checker.Request) (outbox.LocalState, error) {
		select {
		case asked <- struct{}{}:
		default:
		}
		<-release
		return outbox.StateCommit, nil
	})
	e.serve("fast", answer(outbox.StateRollback))
	hung := []outbox.Half{
		e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "hung"}),
		e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "hung"}),
	}
	e.backdate(cfg.TransactionTimeout)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cb.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	// The scheduler has claimed the hung group's rows once its checker is asked; then rows of
	// others come due.
	testsvc.Receive(t, asked, 10*time.Second, "the hung group's checker to be asked")
	fast := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "fast"})
	fenced := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Fence: true})
	e.backdate(cfg.TransactionTimeout, fast.ID, fenced.ID)
	start := time.Now()
	testsvc.Eventually(t, 2*time.Second, "the other group's row and the fence row to be settled", func() bool {
		a, _ := e.state(fast.ID)
		b, _ := e.state(fenced.ID)
		return a == "rolled_back" && b == "rolled_back"
	})
	// The hung group's checks are still out (each waits RequestTimeout, one at a time).
	for _, h := range hung {
		if st, n := e.state(h.ID); st != "prepared" || n != 0 {
			t.Fatalf("hung group's row is %s after %d checks, want prepared and unchecked still", st, n)
		}
	}
	t.Logf("other group settled %s after its prepare, while the hung group's checks were out", time.Since(start).Round(time.Millisecond))
}

// A job that keeps failing (an outage) is one warning, not one per run; its recovery is one
// info line.
func TestFailingJobLogsOncePerStateChange(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var buf bytes.Buffer
	cfg := fastConfig()
	cfg.Logger = slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelInfo}))
	cb := e.checkback(cfg)
	fail := true
	j := job{name: "resolve", run: func(context.Context) error {
		if fail {
			return errors.New("postgres is away")
		}
		return nil
	}}
	for range 4 {
		if err := cb.runJob(context.Background(), j); err == nil {
			t.Fatal("the failing job returned no error")
		}
	}
	fail = false
	for range 2 {
		if err := cb.runJob(context.Background(), j); err != nil {
			t.Fatal(err)
		}
	}
	out := buf.String()
	if w, i := strings.Count(out, `"level":"WARN"`), strings.Count(out, `"msg":"check-back job succeeds again"`); w != 1 || i != 1 {
		t.Fatalf("%d warnings and %d recovery lines, want 1 and 1:\n%s", w, i, out)
	}
}

const (
	msgRecordFailed    = "check-back: recording a producer group's checks failed; its rows are asked again later (further failures of the group are logged at debug level until its checks are recorded again)"
	msgRecordRecovered = "check-back: a producer group's checks are recorded again"
)

// A scheduled resolve pass (Run's: it does not wait for the checkers) whose group's checks
// cannot be recorded — PostgreSQL refuses the write, pass after pass — logs one warning when
// the group starts failing and one info line when its checks are recorded again, not a
// warning per pass (every second by default); each failed pass counts in
// job_errors_total{job="resolve"}.
func TestScheduledResolveLogsARecordingFailureOncePerGroup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	var logs testsvc.LogBuffer
	cfg := fastConfig()
	cfg.Logger = logs.LoggerAt(slog.LevelInfo)
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	cb := e.checkback(cfg)
	ck := e.serve("orders", answer(outbox.StateUnknown))
	h := e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: "orders"})
	e.backdate(time.Second)
	// PostgreSQL refuses to record a check (an UPDATE of check_count): the claim, which only
	// moves next_check_at, still works.
	if _, err := e.db.Pool.Exec(ctx, `
CREATE FUNCTION refuse_check() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'recording refused by the test'; END $$;
CREATE TRIGGER refuse_check BEFORE UPDATE ON txoutbox_messages FOR EACH ROW
  WHEN (NEW.check_count IS DISTINCT FROM OLD.check_count) EXECUTE FUNCTION refuse_check()`); err != nil {
		t.Fatal(err)
	}
	asked := 0
	// pass runs one scheduled pass and waits for its unit, which asks the checker once.
	pass := func() {
		t.Helper()
		e.due()
		if _, err := cb.resolve(ctx, false); err != nil {
			t.Fatal(err)
		}
		cb.bg.Wait()
		asked++
		if n := len(ck.requests()); n != asked {
			t.Fatalf("the checker was asked %d times after %d passes, want once a pass", n, asked)
		}
	}
	const failing = 4
	for range failing {
		pass()
	}
	if _, checks := e.state(h.ID); checks != 0 {
		t.Fatalf("%d checks recorded while PostgreSQL refused them", checks)
	}
	if w := logs.Lines(t, msgRecordFailed, "group", "orders"); len(w) != 1 || w[0]["level"] != "WARN" {
		t.Fatalf("%d failed passes logged %d lines saying so, want 1 warning: %v", failing, len(w), w)
	}
	if n := counter(t, reg, "txoutbox_checkback_job_errors_total", "resolve"); n != failing {
		t.Errorf("job_errors_total{job=\"resolve\"} = %v after %d failed passes, want %d", n, failing, failing)
	}
	if n := len(logs.Lines(t, msgRecordRecovered)); n != 0 {
		t.Fatalf("%d lines saying the checks are recorded again while they are not", n)
	}

	if _, err := e.db.Pool.Exec(ctx, `DROP TRIGGER refuse_check ON txoutbox_messages`); err != nil {
		t.Fatal(err)
	}
	pass()
	pass()
	if _, checks := e.state(h.ID); checks != 2 {
		t.Fatalf("%d checks recorded after two passes that could record them, want 2", checks)
	}
	if r := logs.Lines(t, msgRecordRecovered, "group", "orders"); len(r) != 1 || r[0]["level"] != "INFO" || r[0]["failed_passes"] != float64(failing) {
		t.Errorf("lines saying the checks are recorded again: %v, want one info line counting %d failed passes", r, failing)
	}
	if w := logs.Lines(t, msgRecordFailed); len(w) != 1 {
		t.Errorf("%d warnings, want still 1", len(w))
	}
	if n := counter(t, reg, "txoutbox_checkback_job_errors_total", "resolve"); n != failing {
		t.Errorf("job_errors_total{job=\"resolve\"} = %v, want still %d", n, failing)
	}
}

// A producer group's failures are a series while they follow each other within the gap; one
// after a longer pause (the group had no due checks meanwhile: its failing series never saw
// the unit that succeeds) starts a new series, logged as a new failure.
func TestGroupFailureAfterAPauseIsANewSeries(t *testing.T) {
	t.Parallel()
	var f failures
	t0 := time.Now()
	const gap = time.Minute
	for i, c := range []struct {
		at     time.Duration
		failed bool
		want   int
	}{
		{0, true, 0},                   // starts failing: warned
		{30 * time.Second, true, 1},    // goes on
		{80 * time.Second, true, 2},    // goes on (50 s after the previous one)
		{10 * time.Minute, true, 0},    // after a pause longer than the gap: a new series
		{10*time.Minute + 1, false, 1}, // recorded again: the series of one ends
		{11 * time.Minute, true, 0},
	} {
		if got := f.recordAt("orders", c.failed, t0.Add(c.at), gap); got != c.want {
			t.Fatalf("step %d (at %s, failed %v): %d failures before, want %d", i, c.at, c.failed, got, c.want)
		}
	}
	if got := f.record("job", true); got != 0 { // jobs: no gap rule
		t.Fatalf("record = %d", got)
	}
	if got := f.record("job", true); got != 1 {
		t.Fatalf("record = %d, want 1", got)
	}
}
