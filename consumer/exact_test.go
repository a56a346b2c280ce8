package consumer

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/url"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/relay"
)

// publishRaw stores a message in the ORDERS stream with exactly the header block given (one
// "Name: value" line each), written on the wire by hand: nats.go's writer would trim the
// values. It waits for the stream's PubAck.
func (e *env) publishRaw(subject string, headerLines []string, data string) {
	e.t.Helper()
	u, err := url.Parse(e.nats.URL())
	if err != nil {
		e.t.Fatal(err)
	}
	conn, err := net.DialTimeout("tcp", u.Host, 5*time.Second)
	if err != nil {
		e.t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	r := bufio.NewReader(conn)
	if _, err := r.ReadString('\n'); err != nil { // INFO
		e.t.Fatal(err)
	}
	inbox := nats.NewInbox()
	sub, err := e.nats.Conn.SubscribeSync(inbox)
	if err != nil {
		e.t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := e.nats.Conn.Flush(); err != nil {
		e.t.Fatal(err)
	}
	hdr := "NATS/1.0\r\n"
	for _, l := range headerLines {
		hdr += l + "\r\n"
	}
	hdr += "\r\n"
	fmt.Fprintf(conn, "CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"protocol\":1}\r\n")
	fmt.Fprintf(conn, "HPUB %s %s %d %d\r\n%s%s\r\nPING\r\n", subject, inbox, len(hdr), len(hdr)+len(data), hdr, data)
	if line, err := r.ReadString('\n'); err != nil || line != "PONG\r\n" {
		e.t.Fatalf("raw publish: %q, %v", line, err)
	}
	ack, err := sub.NextMsg(10 * time.Second)
	if err != nil {
		e.t.Fatalf("raw publish: no PubAck: %v", err)
	}
	var pa struct {
		Error *struct{ Description string } `json:"error"`
		Seq   uint64                        `json:"seq"`
	}
	if err := json.Unmarshal(ack.Data, &pa); err != nil || pa.Error != nil || pa.Seq == 0 {
		e.t.Fatalf("raw publish: PubAck %s (%v)", ack.Data, err)
	}
}

// The consumer uses keys exactly as they arrive: "order-1", "order-1 ", "order-1<NBSP>" and
// "<NBSP>" (sent by some other publisher, bypassing the producer's checks) are four keys and
// four effects, not one effect and three duplicates; an empty key is malformed.
func TestKeysUsedByteExact(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var mu sync.Mutex
	seen := map[string]Message{} // by payload
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		mu.Lock()
		seen[string(msg.Payload)] = msg
		mu.Unlock()
		return recordEffect(ctx, tx, msg)
	}
	e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}, outbox.HeaderBizKey: {"order-1"}}, "plain")
	e.publishRaw("orders.created", []string{outbox.HeaderMsgID + ": " + newID(), outbox.HeaderBizKey + ": order-1 ", outbox.HeaderKey + ": k\t"}, "trailing space")
	e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}, outbox.HeaderBizKey: {"order-1\u00a0"}, outbox.HeaderKey: {"\u00a0k"}}, "trailing nbsp")
	e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}, outbox.HeaderBizKey: {"\u00a0"}}, "nbsp only")
	e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}, outbox.HeaderBizKey: {""}}, "empty biz key")
	e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}, outbox.HeaderKey: {""}}, "empty key")
	e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {""}}, "empty msg id")

	c := e.newConsumer(nil, nil, h)
	e.run(c)
	e.waitEffects(4)
	testsvc.Eventually(t, 10*time.Second, "malformed dead letters", func() bool { return c.Stats().DeadLettered == 3 })
	if d, m := c.Stats().Duplicates, c.Stats().Malformed; d != 0 || m != 3 {
		t.Errorf("duplicates %d, malformed %d; want 0 and 3", d, m)
	}
	want := map[string]struct{ idem, key string }{
		"plain": {"order-1", ""}, "trailing space": {"order-1 ", "k\t"}, "trailing nbsp": {"order-1\u00a0", "\u00a0k"}, "nbsp only": {"\u00a0", ""},
	}
	mu.Lock()
	defer mu.Unlock()
	for payload, w := range want {
		m, ok := seen[payload]
		if !ok {
			t.Errorf("%s: handler never ran", payload)
			continue
		}
		if m.IdempotencyKey != w.idem || m.BizKey != w.idem || m.Key != w.key {
			t.Errorf("%s: idempotency key %q, biz key %q, key %q; want %q, %q, %q", payload, m.IdempotencyKey, m.BizKey, m.Key, w.idem, w.idem, w.key)
		}
		if n := e.effectsOf(w.idem); n != 1 {
			t.Errorf("%s: %d effects recorded under %q, want 1", payload, n, w.idem)
		}
	}
	for _, d := range e.deadLetters() {
		if d.Header.Get(HeaderDeadReason) != DeadReasonMalformed {
			t.Errorf("dead letter %q: reason %q", d.Data, d.Header.Get(HeaderDeadReason))
		}
	}
}

// End to end, through EnqueueTx, the relay and JetStream: the handler sees subject, payload,
// keys and every header exactly as the producer gave them, and two business keys that differ
// in one inner character are two events. What the wire would not carry exactly is refused at
// enqueue: a message EnqueueTx accepts and that does not arrive exactly fails the test.
func TestByteExactThroughOutboxAndRelay(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	client, err := outbox.NewClient(&outbox.Config{Schema: e.db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	binary := make([]byte, 256)
	for i := range binary {
		binary[i] = byte(i) // NUL, CR, LF, invalid UTF-8: all of it
	}
	msgs := []outbox.Message{
		{
			Subject: "orders.exact", Key: "order 1", BizKey: "order 1 created", Payload: binary,
			Headers: map[string][]string{
				"X-Tab":       {"a\tb"},
				"X-Spaces":    {"a  b   c"},
				"X-Empty":     {""},
				"X-Case":      {"upper"},
				"x-case":      {"lower"},
				"X-Multi":     {"first", "", "first", "vier 4"},
				"X-Unicode":   {"Grüße\u00a0aus 東京 🙂 \u2028 ende"},
				"traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
			},
		},
		// The same key; a business key differing from the first only in an inner character.
		{Subject: "orders.exact", Key: "order 1", BizKey: "order 1\u00a0created"},
		{Subject: "orders.ünïcode.注文", Key: "注文-🙂", Payload: []byte{}},
		{Subject: "orders.exact", BizKey: "b\u00a0\u3000b", Payload: []byte(" padded payload \r\n")},
		{Subject: "orders.exact", Payload: []byte("unkeyed, no business key, no headers")},
	}
	var ids []string
	err = pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
		got, err := client.EnqueueTx(ctx, tx, msgs...)
		for _, id := range got {
			ids = append(ids, id.String())
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	// Values the wire would drop, change, refuse or act on: each must be refused at enqueue,
	// or else arrive exactly as given like the rest.
	big := strings.Repeat("h", 65535) // a header block over nats-server's 64 KiB
	for _, m := range []outbox.Message{
		{Subject: "orders.exact", Key: "order 1 "},
		{Subject: "orders.exact", Key: "\torder 1"},
		{Subject: "orders.exact", BizKey: "order 1 created "},
		{Subject: "orders.exact", BizKey: "order 1 created\u00a0"},
		{Subject: "orders.exact", Headers: map[string][]string{"X-V": {" v"}}},
		{Subject: "orders.exact", Headers: map[string][]string{"X-V": {"v\t"}}},
		{Subject: "orders.exact", Headers: map[string][]string{"X-V": {"a\r\nb"}}},
		{Subject: "orders.exact", Headers: map[string][]string{"X-V": {}}},
		{Subject: "orders.exact", Headers: map[string][]string{"Status": {"100"}, "Description": {"Idle Heartbeat"}}},
		{Subject: "orders.exact", Headers: map[string][]string{"Nats-Expected-Stream": {"ANOTHER"}}, Payload: []byte("x")},
		{Subject: "orders.exact", Headers: map[string][]string{"nats-ttl": {"1s"}}, Payload: []byte("x")},
		{Subject: "orders.exact", Headers: map[string][]string{"X-Big": {big}}, Payload: []byte("x")},
	} {
		err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
			got, err := client.EnqueueTx(ctx, tx, m)
			if err == nil {
				msgs, ids = append(msgs, m), append(ids, got[0].String())
			}
			return err
		})
		var me *outbox.MessageError
		if err != nil && !errors.As(err, &me) {
			t.Fatalf("enqueue %+v: %v", m, err)
		}
	}

	r, err := relay.New(e.db.Pool, e.nats.JS, &relay.Config{Schema: e.db.Schema, Logger: quietLogger(), PollMax: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- r.Run(rctx) }()
	defer func() { cancel(); <-relayDone; r.Close() }()

	var mu sync.Mutex
	seen := map[string]Message{} // by message id
	h := func(ctx context.Context, tx pgx.Tx, msg Message) error {
		mu.Lock()
		msg.Payload = bytes.Clone(msg.Payload)
		seen[msg.ID] = msg
		mu.Unlock()
		_, err := tx.Exec(ctx, `INSERT INTO effects (idem, subject, payload, delivery) VALUES ($1, $2, $3, $4)`,
			msg.IdempotencyKey, msg.Subject, hex.EncodeToString(msg.Payload), msg.Delivery) // binary payloads are not text
		return err
	}
	c := e.newConsumer(nil, &Config{Ordered: true}, h)
	e.run(c)
	e.waitEffects(len(msgs))
	if d := c.Stats().Duplicates; d != 0 {
		t.Errorf("%d duplicates, want none: every message is its own event", d)
	}

	mu.Lock()
	defer mu.Unlock()
	for i, m := range msgs {
		got, ok := seen[ids[i]]
		if !ok {
			t.Errorf("message %d (%s): handler never ran", i, ids[i])
			continue
		}
		wantIdem := m.BizKey
		if wantIdem == "" {
			wantIdem = ids[i]
		}
		if got.Subject != m.Subject || !bytes.Equal(got.Payload, m.Payload) || got.Key != m.Key || got.BizKey != m.BizKey || got.IdempotencyKey != wantIdem {
			t.Errorf("message %d: handler saw subject %q data %q key %q biz key %q idempotency key %q; want %q %q %q %q %q",
				i, got.Subject, got.Payload, got.Key, got.BizKey, got.IdempotencyKey, m.Subject, m.Payload, m.Key, m.BizKey, wantIdem)
		}
		want := map[string][]string{outbox.HeaderMsgID: {ids[i]}}
		for k, v := range m.Headers {
			want[k] = v
		}
		if m.Key != "" {
			want[outbox.HeaderKey] = []string{m.Key}
		}
		if m.BizKey != "" {
			want[outbox.HeaderBizKey] = []string{m.BizKey}
		}
		if !reflect.DeepEqual(map[string][]string(got.Headers), want) {
			t.Errorf("message %d: headers\n got %q\nwant %q", i, got.Headers, want)
		}
		if n := e.effectsOf(wantIdem); n != 1 {
			t.Errorf("message %d: %d effects under %q, want 1", i, n, wantIdem)
		}
	}
	keys := make([]string, 0, len(seen))
	for _, m := range seen {
		keys = append(keys, m.IdempotencyKey)
	}
	slices.Sort(keys)
	if len(slices.Compact(keys)) != len(msgs) {
		t.Errorf("idempotency keys %q: want %d distinct", keys, len(msgs))
	}
}
