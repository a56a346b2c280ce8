package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/outbox"
)

// TestWhatTheProducerGivesTheConsumerSees sends messages with every kind of value the
// producer accepts at its edges through the real relay and JetStream to a real consumer, and
// checks that the handler sees each of them byte for byte.
func TestWhatTheProducerGivesTheConsumerSees(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	e.nats.Stream(t, "DEAD", "txoutbox.dead.>")

	bigValue := strings.Repeat("v", outbox.MaxHeaderBytes) // trimmed below to fill the block exactly
	msgs := []outbox.Message{
		{Subject: "orders.a", Key: "order 1", BizKey: "order-1", Payload: []byte("plain"),
			Headers: map[string][]string{"traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}, "tracestate": {"k=v"}}},
		// Differs from the one above only by a character inside the business key.
		{Subject: "orders.a", Key: "order 1", BizKey: "order-1\u00a0x", Payload: []byte("inner nbsp")},
		{Subject: "orders.a", BizKey: "ordér·1 — ünïcödé 注文", Payload: []byte{0, 1, 2, 0xff, '\r', '\n', 0},
			Headers: map[string][]string{
				"X-Inner":  {"a  b\tc", "second value", ""}, // inner spaces and tab, several values in order, an empty one
				"x-case":   {"lower"},
				"X-Case":   {"upper"}, // names differing only in case stay two headers
				"X-Colons": {"a: b: c"},
				"X-Utf8":   {"naïve — 値"},
			}},
		{Subject: "orders.b", Key: "k\u3000inner", Payload: nil},
		{Subject: "orders.b", Key: "k", Payload: []byte{}},
	}
	// The largest header block JetStream stores, exactly.
	full := outbox.Message{Subject: "orders.c", Key: "big", Payload: []byte("big headers")}
	full.Headers = map[string][]string{"X-Big": {""}}
	full.Headers["X-Big"][0] = bigValue[:outbox.MaxHeaderBytes-outbox.HeaderSize(&full)]
	if got := outbox.HeaderSize(&full); got != outbox.MaxHeaderBytes {
		t.Fatalf("HeaderSize = %d, want %d", got, outbox.MaxHeaderBytes)
	}
	msgs = append(msgs, full)
	ids := e.enqueue(msgs...)

	drain(t, e.relay(nil))
	if left := e.count(`true`); left != 0 {
		t.Fatalf("%d rows left in the outbox: every accepted message must be publishable", left)
	}

	var (
		mu   sync.Mutex
		seen = map[string]consumer.Message{}
		all  = make(chan struct{})
	)
	c, err := consumer.New(e.db.Pool, e.nats.JS, func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		seen[m.ID] = m
		if len(seen) == len(msgs) {
			close(all)
		}
		return nil
	}, &consumer.Config{Stream: "ORDERS", Durable: "exact", Schema: e.db.Schema, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(cctx) }()
	select {
	case <-all:
	case err := <-done:
		t.Fatalf("consumer stopped: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatalf("the handler saw %d of %d messages", len(seen), len(msgs))
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	for i, want := range msgs {
		got, ok := seen[ids[i].String()]
		if !ok {
			t.Fatalf("message %d (%s) never reached the handler", i, ids[i])
		}
		what := fmt.Sprintf("message %d", i)
		if got.Subject != want.Subject || got.Key != want.Key || got.BizKey != want.BizKey {
			t.Errorf("%s: subject/key/biz key = %q/%q/%q, want %q/%q/%q", what, got.Subject, got.Key, got.BizKey, want.Subject, want.Key, want.BizKey)
		}
		if !bytes.Equal(got.Data, want.Payload) {
			t.Errorf("%s: payload = %q, want %q", what, got.Data, want.Payload)
		}
		wantIdem := want.BizKey
		if wantIdem == "" {
			wantIdem = ids[i].String()
		}
		if got.IdempotencyKey != wantIdem {
			t.Errorf("%s: idempotency key = %q, want %q", what, got.IdempotencyKey, wantIdem)
		}
		// Every header the producer set arrives as it was given, and nothing else but the
		// relay's own.
		wantH := maps.Clone(want.Headers)
		if wantH == nil {
			wantH = map[string][]string{}
		}
		wantH[outbox.HeaderMsgID] = []string{ids[i].String()}
		if want.Key != "" {
			wantH[outbox.HeaderKey] = []string{want.Key}
		}
		if want.BizKey != "" {
			wantH[outbox.HeaderBizKey] = []string{want.BizKey}
		}
		gotH := map[string][]string(got.Headers)
		for _, name := range slices.Sorted(maps.Keys(wantH)) {
			if !slices.Equal(gotH[name], wantH[name]) {
				t.Errorf("%s: header %q = %q, want %q", what, name, short(gotH[name]), short(wantH[name]))
			}
		}
		for name := range gotH {
			if _, ok := wantH[name]; !ok {
				t.Errorf("%s: unexpected header %q = %q", what, name, gotH[name])
			}
		}
	}
	// Two business keys that differ by one inner character are two effects.
	var n int
	if err := e.db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_consumer_dedup WHERE consumer = 'exact'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != len(msgs) {
		t.Fatalf("dedup rows = %d, want %d (one per distinct idempotency key)", n, len(msgs))
	}
}

func short(vs []string) []string {
	out := make([]string, len(vs))
	for i, v := range vs {
		if len(v) > 40 {
			v = fmt.Sprintf("%s…(%d bytes)", v[:20], len(v))
		}
		out[i] = v
	}
	return out
}

// TestHeaderBlockOneOverTheLimitIsRefused: one byte more than JetStream stores is refused at
// enqueue, before anything is written; the same message at the limit is published (above).
func TestHeaderBlockOneOverTheLimitIsRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, keyed := range []bool{false, true} {
		m := outbox.Message{Subject: "orders.c", Payload: []byte("x"), BizKey: "b", Headers: map[string][]string{"X-Big": {""}}}
		if keyed {
			m.Key = "some key"
		}
		m.Headers["X-Big"][0] = strings.Repeat("v", outbox.MaxHeaderBytes+1-outbox.HeaderSize(&m))
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
