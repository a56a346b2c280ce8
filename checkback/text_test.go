package checkback

import (
	"context"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
)

// Whatever a checker answers — an error text or a reply with a NUL, invalid UTF-8, or so long
// that a cut by bytes would split a character — each check is recorded (check_count goes up,
// last_error is valid text within store.MaxErrorText) and the row reaches check_exhausted.
func TestCheckerTextsAreAlwaysStorable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	cfg := fastConfig()
	cfg.MaxChecks = 3
	cb := e.checkback(cfg)

	// "x" then 2-byte characters: a cut at any fixed even byte count splits one.
	long := "x" + strings.Repeat("é", 1500)
	answers := map[string]func(m *nats.Msg){
		"errnul":    func(m *nats.Msg) { respondError(m, "db \x00 down") },
		"errutf":    func(m *nats.Msg) { respondError(m, "bad \xff\xfe bytes") },
		"errlong":   func(m *nats.Msg) { respondError(m, long) },
		"replynul":  func(m *nats.Msg) { _ = m.Respond([]byte("COMMIT\x00")) },
		"replyutf":  func(m *nats.Msg) { _ = m.Respond([]byte("\xffMAYBE")) },
		"replylong": func(m *nats.Msg) { _ = m.Respond([]byte(long)) },
	}
	var halves []outbox.Half
	for group, f := range answers {
		sub, err := e.nats.Conn.Subscribe(checker.Subject(DefaultSubjectPrefix, group), f)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sub.Unsubscribe() })
		halves = append(halves, e.prepare(outbox.Message{}, &outbox.PrepareOptions{Group: group}))
	}
	for check := 1; check <= cfg.MaxChecks; check++ {
		// Back-date the rows: prepared long ago, next check due now.
		if _, err := e.db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET created_at = now() - interval '1 hour', next_check_at = now() - interval '1 second' WHERE state = 'prepared'`); err != nil {
			t.Fatal(err)
		}
		mustResolve(t, cb)
		for _, h := range halves {
			st, n := e.state(h.ID)
			if n != check {
				t.Fatalf("group %s: %d checks recorded after %d passes (state %s): a check that cannot be recorded is asked forever", h.Group, n, check, st)
			}
		}
	}
	for _, h := range halves {
		var st, lastErr string
		if err := e.db.Pool.QueryRow(ctx, `SELECT state, last_error FROM txoutbox_messages WHERE message_id = $1`, h.ID).Scan(&st, &lastErr); err != nil {
			t.Fatal(err)
		}
		if st != store.StateCheckExhausted {
			t.Errorf("group %s: %s, want check_exhausted", h.Group, st)
		}
		if lastErr == "" || len(lastErr) > store.MaxErrorText || !utf8.ValidString(lastErr) || strings.ContainsRune(lastErr, 0) {
			t.Errorf("group %s: last_error %d bytes %q", h.Group, len(lastErr), lastErr[:min(len(lastErr), 60)])
		}
	}
}

// respondError answers as a micro service does when the handler fails, with text as the
// error header, byte for byte.
func respondError(m *nats.Msg, text string) {
	r := nats.NewMsg(m.Reply)
	r.Header[micro.ErrorHeader] = []string{text}
	r.Header[micro.ErrorCodeHeader] = []string{"500"}
	_ = m.RespondMsg(r)
}
