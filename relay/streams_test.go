package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

func (e *env) createStream(cfg jetstream.StreamConfig) {
	e.t.Helper()
	if cfg.Mirror == nil && cfg.Duplicates == 0 {
		cfg.Duplicates = 2 * time.Minute
	}
	if _, err := e.nats.JS.CreateStream(context.Background(), cfg); err != nil {
		e.t.Fatalf("create stream %s: %v", cfg.Name, err)
	}
}

// testRow is one outbox row as a test sees it.
type testRow struct {
	state    string
	attempts int
	lastErr  string
}

func (e *env) row(payload string) testRow {
	e.t.Helper()
	var r testRow
	var lastErr *string
	err := e.db.Pool.QueryRow(context.Background(),
		"SELECT state, attempts, last_error FROM txoutbox_messages WHERE payload = $1", []byte(payload)).Scan(&r.state, &r.attempts, &lastErr)
	if err != nil {
		e.t.Fatalf("row %q: %v", payload, err)
	}
	if lastErr != nil {
		r.lastErr = *lastErr
	}
	return r
}

func payloads(msgs []*jetstream.RawStreamMsg) string {
	var out []string
	for _, m := range msgs {
		out = append(out, string(m.Data))
	}
	return strings.Join(out, ",")
}

// The start check refuses a stream the relay cannot publish to, naming the stream, the
// subject and the setting; a stream that also sources others is fine; a max_msg_size below
// what producers may enqueue is a warning.
func TestCheckStreamsRefusesUnusableStreams(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	e.createStream(jetstream.StreamConfig{Name: "NOACK", Subjects: []string{"noack.>"}, NoAck: true})
	e.createStream(jetstream.StreamConfig{Name: "SEALED", Subjects: []string{"sealed.>"}})
	s, err := e.nats.JS.Stream(ctx, "SEALED")
	if err != nil {
		t.Fatal(err)
	}
	sealed := s.CachedInfo().Config
	sealed.Sealed = true
	if _, err := e.nats.JS.UpdateStream(ctx, sealed); err != nil {
		t.Fatal(err)
	}
	e.createStream(jetstream.StreamConfig{Name: "MIRROR", Mirror: &jetstream.StreamSource{Name: "ORDERS"}})
	e.createStream(jetstream.StreamConfig{Name: "COUNTER", Subjects: []string{"counter.>"}, AllowMsgCounter: true})

	for _, tc := range []struct {
		subject, create, stream, setting string
	}{
		{"noack.>", "", "NOACK", "no_ack"},
		{"sealed.>", "", "SEALED", "sealed"},
		// A mirror captures no subject: it is met when the relay is told to extend it.
		{"mirrored.>", "MIRROR", "MIRROR", "mirror"},
		{"counter.>", "", "COUNTER", "allow_msg_counter"},
	} {
		r := e.relay(&Config{Subjects: []string{"orders.>", tc.subject}, CreateStream: tc.create})
		err := r.CheckStreams(ctx)
		var se *StreamError
		if !errors.Is(err, ErrStreamUnusable) || !errors.As(err, &se) || se.Stream != tc.stream || se.Setting != tc.setting || se.Subject != tc.subject {
			t.Errorf("%s: CheckStreams = %v, want ErrStreamUnusable for stream %s, setting %s", tc.subject, err, tc.stream, tc.setting)
			continue
		}
		for _, want := range []string{`"` + tc.stream + `"`, `"` + tc.subject + `"`, tc.setting} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s: %q does not name %s", tc.subject, err, want)
			}
		}
		// Run refuses to start the same way.
		if err := r.Run(ctx); !errors.Is(err, ErrStreamUnusable) {
			t.Errorf("%s: Run = %v, want ErrStreamUnusable", tc.subject, err)
		}
	}

	// Fine: a stream with subjects that also sources another, deny_delete. A max_msg_size
	// below what producers may enqueue is refused (ErrMessageLimit), unless the check is off:
	// then a warning.
	e.createStream(jetstream.StreamConfig{Name: "AGG", Subjects: []string{"agg.>"}, Sources: []*jetstream.StreamSource{{Name: "ORDERS"}}, DenyDelete: true})
	e.createStream(jetstream.StreamConfig{Name: "SMALL", Subjects: []string{"small.>"}, MaxMsgSize: 4096})
	var se *StreamError
	if err := e.relay(&Config{Subjects: []string{"agg.>", "small.>"}}).CheckStreams(ctx); !errors.Is(err, ErrMessageLimit) || !errors.As(err, &se) ||
		se.Stream != "SMALL" || se.Subject != "small.>" || se.Limit != 4096 || se.Producers != outbox.DefaultMaxMessageBytes {
		t.Fatalf("CheckStreams with SMALL's max_msg_size 4096 = %v (%+v), want ErrMessageLimit naming SMALL, small.> and both limits", err, se)
	}
	logs := &recordLog{}
	r := e.relay(&Config{Subjects: []string{"agg.>", "small.>"}, MaxMessageBytes: txoutbox.Off, Logger: slog.New(logs)})
	if err := r.CheckStreams(ctx); err != nil {
		t.Fatalf("CheckStreams = %v for a sourcing stream and a small-message stream, the check off", err)
	}
	if w := logs.count(slog.LevelWarn, "small.>"); w != 1 {
		t.Fatalf("%d warnings about SMALL's max_msg_size, want 1", w)
	}
	if w := logs.count(slog.LevelWarn, "agg.>"); w != 0 {
		t.Fatalf("%d warnings about AGG, want 0", w)
	}
}

// A subject captured by a no_ack stream created after the start fails alone: the healthy
// subjects of the batch are published in the same pass, without a broker outage; the no_ack
// rows count an attempt, say why, and hold back their key's later rows (on any subject).
// Their retries fail at once, unsent, instead of holding up their batch for a publish timeout.
func TestNoAckStreamFailsItsSubjectOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const publishTimeout = time.Second
	r := e.relay(&Config{PublishTimeout: publishTimeout, BackoffBase: time.Millisecond, BackoffMax: 5 * time.Millisecond})
	e.createStream(jetstream.StreamConfig{Name: "NOACK", Subjects: []string{"noack.>"}, NoAck: true})
	e.enqueue(
		outbox.Message{Subject: "noack.created", Key: "k", Payload: []byte("noack-k")},
		outbox.Message{Subject: "orders.created", Key: "k", Payload: []byte("orders-k")}, // held behind noack-k
		outbox.Message{Subject: "orders.created", Payload: []byte("orders-unkeyed")},
		outbox.Message{Subject: "orders.created", Key: "other", Payload: []byte("orders-other")},
		outbox.Message{Subject: "noack.created", Payload: []byte("noack-unkeyed")},
	)
	ctx := context.Background()
	if _, err := r.runOnce(ctx); err != nil {
		t.Fatalf("runOnce = %v, want nil: a no_ack stream is not a broker outage", err)
	}
	if got := payloads(e.streamMsgs("ORDERS")); got != "orders-unkeyed,orders-other" {
		t.Fatalf("ORDERS holds %q after the first pass, want the healthy rows", got)
	}
	for _, p := range []string{"noack-k", "noack-unkeyed"} {
		row := e.row(p)
		if row.state != "ready" || row.attempts != 1 || !strings.Contains(row.lastErr, `stream "NOACK"`) || !strings.Contains(row.lastErr, "no_ack") {
			t.Fatalf("%s: %+v, want ready, 1 attempt, an error naming NOACK and no_ack", p, row)
		}
	}
	if row := e.row("orders-k"); row.state != "ready" || row.attempts != 0 {
		t.Fatalf("orders-k: %+v, want ready and never attempted (held behind noack-k)", row)
	}

	// The retries: the rows fail at once without being sent, and orders-k stays held.
	testsvc.Eventually(t, 10*time.Second, "the no_ack rows' second attempt", func() bool {
		start := time.Now()
		if _, err := r.runOnce(ctx); err != nil {
			t.Fatal(err)
		}
		if d := time.Since(start); d >= publishTimeout {
			t.Fatalf("a pass took %s: a row of a stream known to be unusable must not wait for a PubAck", d)
		}
		return e.count("attempts >= 2") == 2
	})
	if row := e.row("orders-k"); row.state != "ready" || row.attempts != 0 {
		t.Fatalf("orders-k: %+v, want still held", row)
	}
	if got := payloads(e.streamMsgs("ORDERS")); got != "orders-unkeyed,orders-other" {
		t.Fatalf("ORDERS holds %q, want only the healthy rows", got)
	}
	if r.Health() == HealthNATSUnavailable {
		t.Fatal("health is nats_unavailable")
	}
}

// The same with the daemon loop: no outage state, no backoff, the healthy subject keeps
// flowing while the no_ack subject fails.
func TestNoAckStreamDoesNotStallTheRelay(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	logs := &recordLog{}
	r := e.relay(&Config{Subjects: []string{"orders.>"}, PublishTimeout: 300 * time.Millisecond,
		BackoffBase: 50 * time.Millisecond, BackoffMax: 200 * time.Millisecond, Logger: slog.New(logs)})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	testsvc.Eventually(t, 10*time.Second, "the relay's first round", func() bool { return r.Health() == "ok" })
	// Created after the start check: only the run time can find it.
	e.createStream(jetstream.StreamConfig{Name: "NOACK", Subjects: []string{"noack.>"}, NoAck: true})
	e.enqueue(
		outbox.Message{Subject: "noack.created", Key: "k", Payload: []byte("noack-k")},
		outbox.Message{Subject: "orders.created", Key: "k", Payload: []byte("orders-k")},
		outbox.Message{Subject: "orders.created", Payload: []byte("orders-1")},
	)
	testsvc.Eventually(t, 15*time.Second, "orders-1 published and noack-k retried", func() bool {
		return e.count("payload = 'orders-1'") == 0 && e.count("payload = 'noack-k' AND attempts >= 2") == 1
	})
	e.enqueue(outbox.Message{Subject: "orders.created", Payload: []byte("orders-2")})
	r.Wake()
	testsvc.Eventually(t, 15*time.Second, "orders-2 published", func() bool { return e.count("payload = 'orders-2'") == 0 })
	if h := r.Health(); h != "ok" {
		t.Fatalf("health %q, want ok", h)
	}
	if n := logs.countMsg(slog.LevelWarn, "relay degraded; backing off and retrying"); n != 0 {
		t.Fatalf("%d outage warnings, want 0", n)
	}
	if n := logs.countMsg(slog.LevelWarn, "stream cannot take publishes: the rows of its subjects fail without being sent (retried with backoff) until it is fixed"); n != 1 {
		t.Fatalf("%d warnings about NOACK, want 1", n)
	}
	if row := e.row("orders-k"); row.state != "ready" || row.attempts != 0 {
		t.Fatalf("orders-k: %+v, want held behind noack-k", row)
	}

	// The operator turns no_ack off: the key drains, in order.
	s, err := e.nats.JS.Stream(context.Background(), "NOACK")
	if err != nil {
		t.Fatal(err)
	}
	fixed := s.CachedInfo().Config
	fixed.NoAck = false
	if _, err := e.nats.JS.UpdateStream(context.Background(), fixed); err != nil {
		t.Fatal(err)
	}
	testsvc.Eventually(t, 15*time.Second, "key k to drain", func() bool { return e.count("true") == 0 })
	if got := payloads(e.streamMsgs("ORDERS")); got != "orders-1,orders-2,orders-k" {
		t.Fatalf("ORDERS holds %q", got)
	}
}

// A subject with no stream but a core NATS subscriber that never answers: every publish times
// out, nothing in the batch is acknowledged, yet JetStream answers that no stream captures it:
// the subject's failure, not an outage.
func TestSilentNonStreamSubscriberFailsItsSubject(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	sub, err := e.nats.Conn.Subscribe("ghost.>", func(*nats.Msg) {})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := e.nats.Conn.Flush(); err != nil {
		t.Fatal(err)
	}
	e.enqueue(outbox.Message{Subject: "ghost.x", Payload: []byte("ghost")})
	r := e.relay(&Config{PublishTimeout: 200 * time.Millisecond})
	if _, err := r.runOnce(context.Background()); err != nil {
		t.Fatalf("runOnce = %v, want nil", err)
	}
	if row := e.row("ghost"); row.attempts != 1 || !strings.Contains(row.lastErr, `no JetStream stream captures it`) || !strings.Contains(row.lastErr, `"ghost.x"`) {
		t.Fatalf("ghost: %+v", row)
	}
}

// A message a stream can never store (larger than its max_msg_size; a sealed stream) is dead
// at once with a last_error saying why, and holds back its key.
func TestNeverStorableMessageIsDeadAtOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.createStream(jetstream.StreamConfig{Name: "SMALL", Subjects: []string{"small.>"}, MaxMsgSize: 1024})
	e.createStream(jetstream.StreamConfig{Name: "SEAL", Subjects: []string{"seal.>"}})
	ctx := context.Background()
	s, err := e.nats.JS.Stream(ctx, "SEAL")
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	cfg.Sealed = true
	if _, err := e.nats.JS.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	e.enqueue(
		outbox.Message{Subject: "small.x", Key: "k", Payload: make([]byte, 2000)},
		outbox.Message{Subject: "orders.created", Key: "k", Payload: []byte("after")},
		outbox.Message{Subject: "seal.x", Payload: []byte("sealed")},
		outbox.Message{Subject: "orders.created", Payload: []byte("fine")},
	)
	logs := &recordLog{}
	r := e.relay(&Config{Logger: slog.New(logs)})
	if _, err := r.runOnce(ctx); err != nil {
		t.Fatal(err)
	}
	var big testRow
	var lastErr string
	if err := e.db.Pool.QueryRow(ctx, "SELECT state, attempts, last_error FROM txoutbox_messages WHERE subject = 'small.x'").Scan(&big.state, &big.attempts, &lastErr); err != nil {
		t.Fatal(err)
	}
	if big.state != "dead" || big.attempts != 1 || !strings.Contains(lastErr, `stream "SMALL"`) || !strings.Contains(lastErr, "max_msg_size") {
		t.Fatalf("too large: %s after %d attempts, last_error %q", big.state, big.attempts, lastErr)
	}
	if row := e.row("sealed"); row.state != "dead" || row.attempts != 1 || !strings.Contains(row.lastErr, "sealed") || !strings.Contains(row.lastErr, `"SEAL"`) {
		t.Fatalf("sealed: %+v", row)
	}
	if row := e.row("after"); row.state != "ready" || row.attempts != 0 {
		t.Fatalf("after: %+v, want held behind the dead row of its key", row)
	}
	if got := payloads(e.streamMsgs("ORDERS")); got != "fine" {
		t.Fatalf("ORDERS holds %q", got)
	}
	if n := logs.countMsg(slog.LevelError, "message is dead: it can never be published as it is (see its last_error)"); n != 2 {
		t.Fatalf("%d dead-for-good lines, want 2", n)
	}
	if d := r.Stats().Dead; d != 2 {
		t.Fatalf("dead = %d, want 2", d)
	}
}

// What the relay stores in last_error is storable text of bounded length, whatever it came
// from.
func TestLastErrorIsStorable(t *testing.T) {
	t.Parallel()
	long := "bad \x00 bytes \xff\xfe " + strings.Repeat("é", 1000)
	got := lastError(long)
	if len(got) > LastErrorMaxBytes || !utf8.ValidString(got) || strings.ContainsRune(got, 0) || !strings.HasPrefix(got, "bad \uFFFD bytes") {
		t.Fatalf("lastError = %d bytes %q", len(got), got[:min(len(got), 40)])
	}
}

// The SQL producers' limit in the relay's database (txoutbox.max_message_bytes) counts in the
// start check when it is larger than Config.MaxMessageBytes: with it at 8 MiB, a server whose
// max_payload is 1 MiB is refused, naming the setting; an invalid setting is a
// configuration error naming it.
func TestCheckStreamsReadsTheSQLProducersLimit(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	relayWith := func(setting string) *Relay {
		pcfg, err := pgxpool.ParseConfig(e.db.DSN)
		if err != nil {
			t.Fatal(err)
		}
		pcfg.ConnConfig.RuntimeParams["txoutbox.max_message_bytes"] = setting
		pool, err := pgxpool.NewWithConfig(ctx, pcfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		r, err := New(pool, e.nats.JS, &Config{Schema: e.db.Schema, Subjects: []string{"orders.>"}, Logger: quietLogger()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(r.Close)
		return r
	}
	var se *StreamError
	err := relayWith("8388608").CheckStreams(ctx)
	if !errors.Is(err, ErrMessageLimit) || !errors.As(err, &se) || se.Producers != 8<<20 || se.Limit != e.nats.Conn.MaxPayload() ||
		!strings.Contains(err.Error(), "the database's txoutbox.max_message_bytes") {
		t.Fatalf("CheckStreams with the SQL producers at 8 MiB = %v, want ErrMessageLimit naming the database's setting", err)
	}
	if err := relayWith("1024").CheckStreams(ctx); err != nil {
		t.Fatalf("CheckStreams with the SQL producers at 1 KiB = %v, want nil (the relay's own limit, 1 MiB, fits)", err)
	}
	var ce *txoutbox.ConfigError
	if err := relayWith("lots").CheckStreams(ctx); !errors.As(err, &ce) || ce.Field != "txoutbox.max_message_bytes" {
		t.Fatalf("CheckStreams with txoutbox.max_message_bytes = lots: %v, want a ConfigError naming the setting", err)
	}
}

// Run started while PostgreSQL does not answer waits (the start-up check's read of the SQL
// producers' message limit is waited for, saying so once, like an unanswered JetStream)
// instead of returning an error.
func TestRunWaitsForPostgresAtTheStreamCheck(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	logs := &testsvc.LogBuffer{}
	r := e.relayWithoutPostgres(t, logs)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	testsvc.Eventually(t, 20*time.Second, "the relay to say it waits for PostgreSQL", func() bool {
		select {
		case err := <-done:
			t.Fatalf("Run returned %v while PostgreSQL did not answer, want it to wait", err)
		default:
		}
		return strings.Contains(logs.String(), "waiting for PostgreSQL to answer the start-up stream check")
	})
	cancel()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("Run after cancel = %v", err)
	}
}

// relayWithoutPostgres is a relay for orders.> on e's JetStream whose pool points at a port
// where no PostgreSQL answers, logging to logs (info and above).
func (e *env) relayWithoutPostgres(t *testing.T, logs *testsvc.LogBuffer) *Relay {
	t.Helper()
	port, err := embedded.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(context.Background(), fmt.Sprintf("postgres://postgres@127.0.0.1:%d/test?connect_timeout=1", port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	r, err := New(pool, e.nats.JS, &Config{Schema: e.db.Schema, Subjects: []string{"orders.>"}, Logger: logs.LoggerAt(slog.LevelInfo)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	return r
}
