package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/outbox"
)

// TestHeaderBlockLimitIsJetStreams: outbox.MaxHeaderBytes is the real server's limit. One
// byte over is refused at enqueue, before anything is written, and the message the relay
// would have built from it is refused by JetStream; one byte shorter, JetStream stores it.
func TestHeaderBlockLimitIsJetStreams(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, keyed := range []bool{false, true} {
		m := outbox.Message{Subject: "orders.c", Payload: []byte("x"), BizKey: "b", Headers: map[string][]string{"X-Big": {""}}}
		if keyed {
			m.Key = "some key"
		}
		m.Headers["X-Big"][0] = strings.Repeat("v", outbox.MaxHeaderBytes+1-outbox.HeaderBlockSize(&m))
		err := pgx.BeginFunc(context.Background(), e.db.Pool, func(tx pgx.Tx) error {
			_, err := e.client.EnqueueTx(context.Background(), tx, m)
			return err
		})
		var me *outbox.MessageError
		if !errors.Is(err, outbox.ErrMessageTooLarge) || !errors.As(err, &me) || !strings.Contains(err.Error(), "65536") {
			t.Fatalf("keyed=%v: err = %v, want a *MessageError wrapping ErrMessageTooLarge giving the size 65536", keyed, err)
		}
		// The limit is JetStream's: the message the relay would have built is refused by the
		// server, and the same message one byte shorter is stored.
		row := store.Claimed{MessageID: uuid.New(), Subject: m.Subject, Key: m.Key, Payload: m.Payload}
		h := maps.Clone(m.Headers)
		h[outbox.HeaderBizKey] = []string{m.BizKey}
		row.Headers, _ = json.Marshal(h)
		msg, err := buildMsg(&row)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.nats.JS.PublishMsg(context.Background(), msg); err == nil {
			t.Fatalf("keyed=%v: JetStream stored a header block of %d bytes", keyed, outbox.MaxHeaderBytes+1)
		}
		msg.Header["X-Big"][0] = msg.Header["X-Big"][0][1:]
		if _, err := e.nats.JS.PublishMsg(context.Background(), msg); err != nil {
			t.Fatalf("keyed=%v: JetStream refused a header block of %d bytes: %v", keyed, outbox.MaxHeaderBytes, err)
		}
	}
	if n := e.count(`true`); n != 0 {
		t.Fatalf("%d rows written", n)
	}
}

// A stored row that would not arrive as stored (written before the producer's rules, or not
// by package outbox) is never altered on the wire: it is dead at once, saying why, and holds
// its key back; the rows next to it are published.
func TestStoredRowThatWouldBeAlteredIsDead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	bad := []struct{ key, headers, why string }{
		{"k1 ", `{}`, "white space"},
		{"k2", `{"X-V": ["trailing "]}`, "white space"},
		{"k3", `{"X-V": ["a\u00a0"]}`, "white space"},
		{"k4", `{"Nats-Expected-Stream": ["OTHER"]}`, "reserved"},
		{"k5", `{"Txoutbox-Biz-Key": [" biz"]}`, "white space"},
		{"k6", `{"Status": ["404"]}`, "reserved"},
	}
	for i, b := range bad {
		_, err := e.db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, msg_key, partition_key, headers, payload, ready_at)
VALUES ($1, 'orders.created', $2, 0, $3::jsonb, $4, now())`, uuid.New(), b.key, b.headers, []byte(fmt.Sprint("bad-", i)))
		if err != nil {
			t.Fatal(err)
		}
	}
	e.enqueue(outbox.Message{Subject: "orders.created", Payload: []byte("fine")})
	r := e.relay(nil)
	if _, err := r.runOnce(ctx); err != nil {
		t.Fatal(err)
	}
	for i, b := range bad {
		row := e.row(fmt.Sprint("bad-", i))
		if row.state != "dead" || row.attempts != 1 || !strings.Contains(row.lastErr, b.why) {
			t.Errorf("row with key %q headers %s: %+v, want dead after 1 attempt saying %q", b.key, b.headers, row, b.why)
		}
	}
	if got := payloads(e.streamMsgs("ORDERS")); got != "fine" {
		t.Fatalf("ORDERS holds %q, want only the good row", got)
	}
}
