package relay

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go/jetstream"
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

	// Fine: a stream with subjects that also sources another, deny_delete; a warning for a
	// max_msg_size below the producers' default limit.
	e.createStream(jetstream.StreamConfig{Name: "AGG", Subjects: []string{"agg.>"}, Sources: []*jetstream.StreamSource{{Name: "ORDERS"}}, DenyDelete: true})
	e.createStream(jetstream.StreamConfig{Name: "SMALL", Subjects: []string{"small.>"}, MaxMsgSize: 4096})
	logs := &recordLog{}
	r := e.relay(&Config{Subjects: []string{"agg.>", "small.>"}, Logger: slog.New(logs)})
	if err := r.CheckStreams(ctx); err != nil {
		t.Fatalf("CheckStreams = %v for a sourcing stream and a small-message stream", err)
	}
	if w := logs.count(slog.LevelWarn, "small.>"); w != 1 {
		t.Fatalf("%d warnings about SMALL's max_msg_size, want 1", w)
	}
	if w := logs.count(slog.LevelWarn, "agg.>"); w != 0 {
		t.Fatalf("%d warnings about AGG, want 0", w)
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
	if d := r.Stats().Dead.Load(); d != 2 {
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
