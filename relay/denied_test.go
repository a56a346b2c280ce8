package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// deniedEnv is one server, stream ACC on acc.>, and a relay whose NATS user may publish to
// every subject but acc.denied: a configuration error, never a leader election.
type deniedEnv struct {
	t       *testing.T
	db      *testsvc.DB
	admin   jetstream.JetStream
	client  *outbox.Client
	log     *eventLog
	handled atomic.Int64 // violations the relay connection's own error handler saw
}

func newDeniedEnv(t *testing.T) *deniedEnv {
	t.Helper()
	_, admin := startDenyingServer(t, &server.Permissions{Publish: &server.SubjectPermission{Deny: []string{"acc.denied"}}})
	db := testsvc.NewDB(t)
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	e := &deniedEnv{t: t, db: db, admin: admin, client: c, log: newEventLog()}
	return e
}

// startDenyingServer starts a nats-server with an admin user and a relay user with perms,
// creates stream ACC on acc.> as admin, and returns the server's URL and
// the admin's JetStream.
func startDenyingServer(t *testing.T, perms *server.Permissions) (string, jetstream.JetStream) {
	t.Helper()
	srv, err := embedded.StartNATS(embedded.NATSOptions{StoreDir: t.TempDir(), Configure: func(so *server.Options) {
		so.Users = []*server.User{
			{Username: "admin", Password: "admin"},
			{Username: "relay", Password: "relay", Permissions: perms},
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	anc, err := nats.Connect(srv.URL(), nats.UserInfo("admin", "admin"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(anc.Close)
	admin, err := jetstream.New(anc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CreateStream(context.Background(), jetstream.StreamConfig{
		Name: "ACC", Subjects: []string{"acc.>"}, Storage: jetstream.FileStorage, Duplicates: 2 * time.Minute,
	}); err != nil {
		t.Fatal(err)
	}
	return srv.URL(), admin
}

// relay returns a relay connected as the user that may not publish to acc.denied; the
// connection has an error handler of its own (which must still be called).
func (e *deniedEnv) relay(cfg *Config, url string) *Relay {
	e.t.Helper()
	nc, err := nats.Connect(url, nats.UserInfo("relay", "relay"), nats.ReconnectBufSize(-1),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			if errors.Is(err, nats.ErrPermissionViolation) {
				e.handled.Add(1)
			}
		}))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		e.t.Fatal(err)
	}
	cfg.Schema = e.db.Schema
	cfg.ID = uuid.NewString()[:8]
	cfg.Logger = slog.New(e.log)
	cfg.LeaseInterval = time.Second
	r, err := New(e.db.Pool, js, cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	r.initTestSignals()
	e.t.Cleanup(r.Close)
	return r
}

func (e *deniedEnv) url() string {
	e.t.Helper()
	return e.admin.Conn().ConnectedUrl()
}

// enqueue commits the test's rows: on acc.ok and acc.denied, unkeyed and under keys, the
// second row of key kd after a denied one.
func (e *deniedEnv) enqueue() {
	e.t.Helper()
	msgs := []outbox.Message{
		{Subject: "acc.ok", Payload: []byte("ok1")},
		{Subject: "acc.denied", Payload: []byte("d1")},
		{Subject: "acc.denied", Key: "kd", Payload: []byte("kd1")},
		{Subject: "acc.ok", Key: "ko", Payload: []byte("ko1")},
		{Subject: "acc.denied", Payload: []byte("d2")},
		{Subject: "acc.ok", Key: "kd", Payload: []byte("kd2")},
		{Subject: "acc.ok", Key: "ko", Payload: []byte("ko2")},
		{Subject: "acc.ok", Payload: []byte("ok2")},
	}
	tx, err := e.db.Pool.Begin(context.Background())
	if err != nil {
		e.t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := e.client.EnqueueTx(context.Background(), tx, msgs...); err != nil {
		e.t.Fatal(err)
	}
	if err := tx.Commit(context.Background()); err != nil {
		e.t.Fatal(err)
	}
}

// countAttrs counts the lines whose attributes contain s.
func (l *eventLog) countAttrs(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, x := range l.lines {
		if strings.Contains(x.attrs, s) {
			n++
		}
	}
	return n
}

func (e *deniedEnv) count(where string) int {
	e.t.Helper()
	var n int
	if err := e.db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM txoutbox_messages WHERE "+where).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

func (e *deniedEnv) retryNow() {
	e.t.Helper()
	if _, err := e.db.Pool.Exec(context.Background(), "UPDATE txoutbox_messages SET next_attempt_at = now() - interval '1 second' WHERE state = 'ready' AND attempts > 0"); err != nil {
		e.t.Fatal(err)
	}
}

// checkStored checks that ACC holds exactly the acc.ok messages, once each.
func (e *deniedEnv) checkStored(want int) {
	e.t.Helper()
	msgs := testsvc.StreamMsgs(e.t, e.admin, "ACC")
	seen := map[string]bool{}
	for _, m := range msgs {
		if m.Subject != "acc.ok" || seen[string(m.Data)] {
			e.t.Fatalf("stream ACC holds %s %q (twice, or on a denied subject)", m.Subject, m.Data)
		}
		seen[string(m.Data)] = true
	}
	if len(msgs) != want {
		e.t.Fatalf("stream ACC holds %d messages, want %d", len(msgs), want)
	}
}

const deniedRows = "subject = 'acc.denied'"

// A subject the relay's NATS user may not publish to is a message-level failure, reported as
// such at once: the server's permission violation (which nats.go hands to the connection's
// error handler only, the publish waiting out its timeout) fails the publish as soon as it
// arrives, with ErrPublishDenied; the rows get an attempt and a last_error naming the
// subject, go through backoff and become dead after MaxAttempts; their keys' later rows wait;
// the other rows of the same stream are published; no stream outage is reported; for
// deniedRecheck after a violation the subject's rows fail unsent. Before, the
// publishes timed out and the stream, whose info answers, was taken as in an outage for ever
// ("its leader just changed?"): no attempt, no last_error, the rows never dead.
func TestDeniedSubjectFailsItsRows(t *testing.T) {
	t.Parallel()
	e := newDeniedEnv(t)
	e.enqueue()
	// A publish timeout far longer than the test: a denied publish must fail before it.
	r := e.relay(&Config{PublishTimeout: time.Minute, MaxAttempts: 3, BackoffBase: time.Hour, BackoffMax: time.Hour}, e.url())
	var mu sync.Mutex
	var outcomes []error
	r.hooks.afterWave = func(_ int, outs []outcome) {
		mu.Lock()
		defer mu.Unlock()
		for _, o := range outs {
			outcomes = append(outcomes, o.err)
		}
	}
	done := make(chan error, 1)
	go func() { // drain, off the test goroutine: a relay that waits for the timeout must not hang the test
		for {
			n, err := r.runOnce(t.Context())
			if err != nil || n == 0 {
				done <- err
				return
			}
		}
	}()
	if err := testsvc.Receive(t, done, 30*time.Second, "the batch with denied publishes to be settled (before the publish timeout)"); err != nil {
		t.Fatalf("runOnce: %v", err)
	}
	// acc.ok: published (and so gone from the table), but for kd2, which waits behind the
	// denied kd1.
	e.checkStored(4)
	if n := e.count("subject = 'acc.ok'"); n != 1 {
		t.Fatalf("acc.ok rows left = %d, want 1 (kd2)", n)
	}
	if n := e.count(deniedRows + " AND state = 'ready' AND attempts = 1 AND last_error LIKE '%may not publish to subject \"acc.denied\"%'"); n != 3 {
		t.Fatalf("denied rows failed once with a last_error naming the subject = %d, want 3", n)
	}
	if n := e.count("msg_key = 'kd' AND subject = 'acc.ok' AND state = 'ready' AND attempts = 0"); n != 1 {
		t.Fatalf("kd2 is not waiting, untouched, behind the denied kd1 (%d)", n)
	}
	mu.Lock()
	denied := 0
	for _, err := range outcomes {
		if errors.Is(err, ErrPublishDenied) {
			if !errors.Is(err, nats.ErrPermissionViolation) {
				t.Errorf("%v does not match nats.ErrPermissionViolation", err)
			}
			denied++
		}
	}
	mu.Unlock()
	if denied != 3 {
		t.Fatalf("publish outcomes with ErrPublishDenied = %d, want 3", denied)
	}
	if st := r.Stats(); st.Failed != 3 || st.Dead != 0 {
		t.Fatalf("stats = %+v, want 3 failed, none dead", st)
	}
	if n := e.handled.Load(); n == 0 {
		t.Fatal("the connection's own error handler saw no violation: the relay's watch replaced it")
	}

	// A retry while the subject was denied within deniedRecheck fails the same way, unsent:
	// the relay's connection publishes nothing (counted on the client, synchronously; the
	// server's refusals reach the connection's handler asynchronously, and a row sent right
	// after a refusal arrived legitimately fails unsent, so they are no exact count).
	sentMsgs := func() uint64 { return r.pub.Conn().Stats().OutMsgs }
	e.datedDenied(r, time.Now())
	e.retryNow()
	sentBefore := sentMsgs()
	drain(t, r)
	if n := e.count(deniedRows + " AND state = 'ready' AND attempts = 2 AND last_error LIKE '%may not publish to subject \"acc.denied\"%'"); n != 3 {
		t.Fatalf("denied rows failed twice = %d, want 3", n)
	}
	if sent := sentMsgs() - sentBefore; sent != 0 {
		t.Fatalf("%d messages sent by a retry within deniedRecheck, want none", sent)
	}
	// Past deniedRecheck the rows are sent again, denied again, and dead (MaxAttempts 3).
	e.datedDenied(r, time.Now().Add(-deniedRecheck-time.Second))
	e.retryNow()
	sentBefore = sentMsgs()
	drain(t, r)
	if sent := sentMsgs() - sentBefore; sent == 0 {
		t.Fatal("a retry past deniedRecheck sent nothing, want the subject tried again")
	}
	if n := e.count(deniedRows + " AND state = 'dead' AND attempts = 3 AND last_error LIKE '%acc.denied%'"); n != 3 {
		t.Fatalf("dead denied rows = %d, want 3", n)
	}
	if n := e.log.count(slog.LevelWarn, "stream unavailable"); n != 0 {
		e.log.dump(t)
		t.Fatalf("%d stream outages reported for a denied subject", n)
	}
	if r.outages.n.Load() != 0 {
		t.Fatal("stream ACC is held as in an outage")
	}
	e.checkStored(4)

	// Close gives the connection its own handler back.
	r.Close()
	observed := r.denied.n.Load()
	nc := r.pub.Conn()
	before := e.handled.Load()
	if err := nc.Publish("acc.denied", nil); err != nil {
		t.Fatal(err)
	}
	testsvc.Eventually(t, 10*time.Second, "the connection's own handler to see a violation after Close", func() bool {
		return e.handled.Load() > before
	})
	if n := r.denied.n.Load(); n != observed {
		t.Fatalf("violations the closed relay observed = %d, want the %d it had at Close", n, observed)
	}
}

// datedDenied dates every violation r has seen at at.
func (e *deniedEnv) datedDenied(r *Relay, at time.Time) {
	r.denied.mu.Lock()
	defer r.denied.mu.Unlock()
	for s, d := range r.denied.m {
		d.at = at
		r.denied.m[s] = d
	}
}

// The "its leader just changed" allowance is bounded, whatever makes a stream's publishes
// time out while its info answers with a leader: here, a denied subject whose violation the
// relay does not see (the watch stopped). leaderGraceWaves waves in a row are taken as an
// outage of the stream; the next fails the rows as a message-level failure naming stream and
// subject (attempt, backoff, dead after MaxAttempts), and later retries fail at once, with no
// new outage. Before, the outage lasted for ever.
func TestTimeoutsWhileTheLeaderAnswersAreBounded(t *testing.T) {
	t.Parallel()
	e := newDeniedEnv(t)
	e.enqueue()
	r := e.relay(&Config{PublishTimeout: 200 * time.Millisecond, MaxAttempts: 2, BackoffBase: time.Hour, BackoffMax: time.Hour}, e.url())
	r.unwatch()
	ctx := context.Background()
	testsvc.Eventually(t, 60*time.Second, "the denied rows to fail", func() bool {
		if _, err := r.runOnce(ctx); err != nil && !errors.Is(err, errNoPartitions) && !errors.Is(err, errStreamUnavailable) {
			t.Fatalf("runOnce: %v", err)
		}
		r.askOutages()
		return e.count(deniedRows+" AND attempts > 0") == 3
	})
	if n := e.count(deniedRows + ` AND state = 'ready' AND attempts = 1 AND last_error LIKE '%on subject "acc.denied", captured by stream "ACC"%not a leader election%'`); n != 3 {
		var text string
		_ = e.db.Pool.QueryRow(ctx, "SELECT coalesce(last_error, '') FROM txoutbox_messages WHERE "+deniedRows+" AND attempts > 0 LIMIT 1").Scan(&text)
		t.Fatalf("denied rows failed with a last_error naming stream and subject = %d, want 3 (last_error %q)", n, text)
	}
	// One line per row taken as in the outage; the wave is in its reason.
	strikes := e.log.count(slog.LevelWarn, "stream unavailable") + e.log.count(slog.LevelDebug, "stream still unavailable")
	for w := 1; w <= leaderGraceWaves+1; w++ {
		n := e.log.countAttrs(fmt.Sprintf("(wave %d of the %d allowed", w, leaderGraceWaves))
		if w <= leaderGraceWaves && n == 0 || w > leaderGraceWaves && n != 0 {
			e.log.dump(t)
			t.Fatalf("rows taken as an outage in wave %d = %d; want some in each of the first %d waves, none after", w, n, leaderGraceWaves)
		}
	}
	if !strings.Contains(e.log.attrsOf("stream unavailable"), "leader just changed") {
		t.Fatalf("outage reason = %s", e.log.attrsOf("stream unavailable"))
	}
	// The retry: a message-level failure at once, no outage again; dead after MaxAttempts.
	e.retryNow()
	testsvc.Eventually(t, 30*time.Second, "the denied rows to be dead", func() bool {
		if _, err := r.runOnce(ctx); err != nil && !errors.Is(err, errNoPartitions) && !errors.Is(err, errStreamUnavailable) {
			t.Fatalf("runOnce: %v", err)
		}
		return e.count(deniedRows+" AND state = 'dead'") == 3
	})
	if n := e.log.count(slog.LevelWarn, "stream unavailable") + e.log.count(slog.LevelDebug, "stream still unavailable"); n != strikes {
		e.log.dump(t)
		t.Fatalf("the retry was taken as an outage again (%d outage lines, %d before)", n, strikes)
	}
	drain(t, r)
	e.checkStored(4)
}

// The allowance's count: waves in a row for one leader; another leader named, or none (an
// election seen), or a PubAck on a subject that struck, starts it again.
func TestLeaderStrikes(t *testing.T) {
	t.Parallel()
	var s leaderStrikes
	for i := 1; i <= 4; i++ {
		if n := s.strike("ACC", "n1", "acc.x"); n != i {
			t.Fatalf("strike %d for n1 = %d", i, n)
		}
	}
	if n := s.strike("ACC", "n2", "acc.x"); n != 1 {
		t.Fatalf("first strike for another leader = %d, want 1", n)
	}
	if n := s.strike("OTHER", "n2", "other.x"); n != 1 {
		t.Fatalf("first strike of another stream = %d, want 1", n)
	}
	s.reset("ACC")
	if n := s.strike("ACC", "n2", "acc.x"); n != 1 {
		t.Fatalf("strike after an election seen = %d, want 1", n)
	}
	s.also("ACC", "acc.y")
	s.acked([]string{"acc.z"})
	if n := s.strike("ACC", "n2", "acc.x"); n != 2 {
		t.Fatalf("strike after a PubAck on a subject that never struck = %d, want 2", n)
	}
	s.acked([]string{"acc.y"})
	if n := s.strike("ACC", "n2", "acc.x"); n != 1 {
		t.Fatalf("strike after a PubAck on a subject that struck = %d, want 1", n)
	}
	if n := s.strike("OTHER", "n2", "other.x"); n != 2 {
		t.Fatalf("another stream's count = %d, want 2 (untouched)", n)
	}
	// A wave that strikes long after the last one starts a new series (back-dated).
	s.mu.Lock()
	s.m["OTHER"].last = time.Now().Add(-leaderStrikeExpiry - time.Second)
	s.mu.Unlock()
	if n := s.strike("OTHER", "n2", "other.y"); n != 1 {
		t.Fatalf("strike %s after the last = %d, want 1 (a new series)", leaderStrikeExpiry, n)
	}
	if n := s.strike("OTHER", "n2", "other.z"); n != 2 {
		t.Fatalf("strike right after = %d, want 2", n)
	}
}

// The permission violations the server sends: on a publish subject, on a reply subject (every
// publish), and on a subscription (none of the relay's publishes).
func TestDeniedSubjectsObserve(t *testing.T) {
	t.Parallel()
	var d deniedSubjects
	before := time.Now()
	ch := d.changed()
	d.observe(errors.New(`nats: permissions violation: Permissions Violation for Publish to "acc.denied"`)) // not the sentinel
	d.observe(errors.Join(nats.ErrPermissionViolation, errors.New(`Permissions Violation for Subscription to "acc.x"`)))
	if d.n.Load() != 0 {
		t.Fatal("a violation that is not a publish's was recorded")
	}
	d.observe(errors.Join(nats.ErrPermissionViolation, errors.New(`Permissions Violation for Publish to "acc.denied"`)))
	select {
	case <-ch:
	default:
		t.Fatal("changed() was not closed by a violation")
	}
	if err := d.check("acc.denied", before); !errors.Is(err, ErrPublishDenied) || !strings.Contains(err.Error(), `"acc.denied"`) {
		t.Fatalf("check(acc.denied) = %v", err)
	}
	if err := d.check("acc.ok", before); err != nil {
		t.Fatalf("check(acc.ok) = %v", err)
	}
	if err := d.check("acc.denied", time.Now().Add(time.Second)); err != nil {
		t.Fatalf("a violation before the publish was sent counted: %v", err)
	}
	// Subjects the server quotes with escapes (Go's %q): a backslash, a double quote, a
	// character that is not printable.
	for _, subj := range []string{`orders.a\b`, `orders."x"`, "orders.a\u200bb", "orders.ü"} {
		d.observe(errors.Join(nats.ErrPermissionViolation, fmt.Errorf("Permissions Violation for Publish to %q", subj)))
		if err := d.check(subj, before); !errors.Is(err, ErrPublishDenied) {
			t.Errorf("check(%q) after the server's %q = %v, want ErrPublishDenied", subj, fmt.Sprintf("Permissions Violation for Publish to %q", subj), err)
		}
	}
	d.observe(errors.Join(nats.ErrPermissionViolation, errors.New(`Permissions Violation for Publish with Reply of "_INBOX.abc.def"`)))
	if err := d.check("acc.ok", before); !errors.Is(err, ErrPublishDenied) || !errors.Is(err, nats.ErrPermissionViolation) {
		t.Fatalf("check(acc.ok) after a reply violation = %v", err)
	}
}

// A relay whose NATS user may not use the JetStream API, or may not receive its answers (a
// subscription to its inbox denied), ends its start-up stream check with ErrPublishDenied
// naming what is denied, instead of waiting for ever for answers that never come (the server
// drops the requests, or the replies, and says so to the connection's error handler only).
func TestStartCheckDeniedJetStreamAPIFails(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		perms *server.Permissions
		want  string
	}{
		{"API", &server.Permissions{Publish: &server.SubjectPermission{Deny: []string{"$JS.API.>"}}}, "JetStream API"},
		{"inbox", &server.Permissions{Subscribe: &server.SubjectPermission{Deny: []string{"_INBOX.>"}}}, "reply subjects"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			url, _ := startDenyingServer(t, tc.perms)
			db := testsvc.NewDB(t)
			nc, err := nats.Connect(url, nats.UserInfo("relay", "relay"), nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(nc.Close)
			js, err := jetstream.New(nc)
			if err != nil {
				t.Fatal(err)
			}
			r, err := New(db.Pool, js, &Config{Schema: db.Schema, ID: uuid.NewString()[:8], Subjects: []string{"acc.>"},
				PublishTimeout: 2 * time.Second, Logger: slog.New(newEventLog()), LeaseInterval: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(r.Close)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			err = r.Run(ctx)
			if !errors.Is(err, ErrPublishDenied) || !errors.Is(err, nats.ErrPermissionViolation) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Run = %v, want ErrPublishDenied naming the %s", err, tc.want)
			}
			if ctx.Err() != nil {
				t.Fatal("Run waited until the test's deadline")
			}
		})
	}
}

// Only a subscription under the connection's inbox denies the relay's PubAcks: another
// subscription the server refuses on a shared connection is not the relay's.
func TestDeniedInboxSubscription(t *testing.T) {
	t.Parallel()
	d := deniedSubjects{inbox: "_INBOX"}
	before := time.Now()
	d.observe(errors.Join(nats.ErrPermissionViolation, errors.New(`Permissions Violation for Subscription to "orders.>"`)))
	if err := d.check("acc.ok", before); err != nil || d.deniedAPI(before) != nil {
		t.Fatalf("another subscription's violation denies the relay's publishes: %v", err)
	}
	d.observe(errors.Join(nats.ErrPermissionViolation, errors.New(`Permissions Violation for Subscription to "_INBOX.abc.*"`)))
	if err := d.check("acc.ok", before); !errors.Is(err, ErrPublishDenied) || !strings.Contains(err.Error(), "_INBOX.>") {
		t.Fatalf("check after the inbox subscription was denied = %v, want ErrPublishDenied naming _INBOX.>", err)
	}
	if err := d.deniedAPI(before); !errors.Is(err, ErrPublishDenied) {
		t.Fatalf("deniedAPI after the inbox subscription was denied = %v", err)
	}
}
