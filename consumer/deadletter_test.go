package consumer

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// rawHeaderBlock is the size of the header block NATS stores for h.
func rawHeaderBlock(h nats.Header) int { return headerBlockSize(h) }

// Every message package outbox accepts can be dead-lettered whole: at the producer's header
// limit, with the longest subject, key and business key, a durable and a stream name of
// JetStream's longest (255 bytes) and a handler error far over the 1 KiB it is cut to, the
// dead letter keeps every header and the payload, at the first attempt, and what it added
// fits in outbox.DeadLetterHeaderReserve.
func TestDeadLetterOfLargestAcceptedMessage(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	stream := strings.Repeat("S", 255)
	if _, err := e.nats.JS.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{"big.>"}, Storage: jetstream.MemoryStorage, Duplicates: time.Minute}); err != nil {
		t.Fatal(err)
	}
	subject := "big." + strings.Repeat("s", outbox.MaxSubjectLength-len("big."))
	m := outbox.Message{Subject: subject, Key: strings.Repeat("k", outbox.MaxKeyLength), BizKey: strings.Repeat("b", outbox.MaxKeyLength),
		Payload: []byte("the payload"), Headers: map[string][]string{"X-Big": {""}, "traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}}
	m.Headers["X-Big"][0] = strings.Repeat("v", outbox.MaxHeaderBytes-outbox.HeaderBlockSize(&m))
	if n := outbox.HeaderBlockSize(&m); n != outbox.MaxHeaderBytes {
		t.Fatalf("block %d, want %d", n, outbox.MaxHeaderBytes)
	}
	// What EnqueueTx accepts, published as the relay publishes it.
	c, err := outbox.NewClient(&outbox.Config{Schema: e.db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error { _, err := c.EnqueueTx(ctx, tx, m); return err }); err != nil {
		t.Fatalf("EnqueueTx refused the message: %v", err)
	}
	msg := nats.NewMsg(subject)
	msg.Header[outbox.HeaderMsgID] = []string{newID()}
	msg.Header[outbox.HeaderKey] = []string{m.Key}
	msg.Header[outbox.HeaderBizKey] = []string{m.BizKey}
	for k, v := range m.Headers {
		msg.Header[k] = v
	}
	msg.Data = m.Payload
	if n := rawHeaderBlock(msg.Header); n != outbox.MaxHeaderBytes {
		t.Fatalf("published block %d, want %d", n, outbox.MaxHeaderBytes)
	}
	if _, err := e.nats.JS.PublishMsg(ctx, msg); err != nil {
		t.Fatal(err)
	}

	cfg := e.config(&Config{Durable: strings.Repeat("d", 255)})
	cfg.Stream = stream
	cons, err := New(e.db.Pool, e.nats.JS, func(context.Context, pgx.Tx, Message) error {
		return Permanent(errors.New(strings.Repeat("é", 1500)))
	}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.run(cons)
	testsvc.Eventually(t, 20*time.Second, "the dead letter", func() bool { return cons.Stats().DeadLettered == 1 || cons.Stats().Unavailable > 0 })
	if cons.Stats().DeadLettered != 1 || cons.Stats().Unavailable != 0 || cons.Stats().HandlerCalls != 1 {
		t.Fatalf("dead-lettered %d, put back %d times, handler calls %d; want 1, 0, 1", cons.Stats().DeadLettered, cons.Stats().Unavailable, cons.Stats().HandlerCalls)
	}
	dead := e.deadLetters()
	if len(dead) != 1 {
		t.Fatalf("DEAD holds %d messages", len(dead))
	}
	d := dead[0]
	for k, v := range msg.Header {
		if k == outbox.HeaderMsgID {
			continue
		}
		if got := d.Header[k]; len(got) != len(v) || got[0] != v[0] {
			t.Errorf("header %s did not arrive as it was (%d bytes, want %d)", k, len(strings.Join(got, "")), len(strings.Join(v, "")))
		}
	}
	if string(d.Data) != string(m.Payload) || d.Header.Get(HeaderDeadHeadersDropped) != "" || d.Header.Get(HeaderDeadPayloadDropped) != "" {
		t.Fatalf("dead letter: payload %q, headers dropped %q, payload dropped %q", d.Data, d.Header.Get(HeaderDeadHeadersDropped), d.Header.Get(HeaderDeadPayloadDropped))
	}
	if got := d.Header.Get(HeaderDeadSubject); got != subject {
		t.Fatalf("dead subject %d bytes, want the original's %d", len(got), len(subject))
	}
	added := rawHeaderBlock(d.Header) - outbox.MaxHeaderBytes
	t.Logf("the dead letter's header block is %d bytes: %d more than the original's (reserve %d)", rawHeaderBlock(d.Header), added, outbox.DeadLetterHeaderReserve)
	if added > outbox.DeadLetterHeaderReserve {
		t.Fatalf("the dead letter added %d bytes of headers, over outbox.DeadLetterHeaderReserve (%d)", added, outbox.DeadLetterHeaderReserve)
	}
}

// A message from another publisher whose headers leave no room for the dead letter's (a
// header block of JetStream's limit, or thousands of small headers) is still dead-lettered at
// its first failure, never put back forever: the largest of its headers are left out, the
// dead letter says how many (HeaderDeadHeadersDropped), and the payload and every
// Txoutbox-Dead-* header arrive.
func TestDeadLetterOfOversizedHeaderBlock(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		headers func() map[string][]string
		dropped string
	}{
		{"one large header", func() map[string][]string {
			h := map[string][]string{"X-Small": {"kept"}, "X-Big": {""}}
			probe := nats.Header{outbox.HeaderMsgID: {newID()}, "X-Small": {"kept"}, "X-Big": {""}}
			h["X-Big"][0] = strings.Repeat("v", outbox.JetStreamMaxHeaderBytes-rawHeaderBlock(probe))
			return h
		}, "1"},
		{"many small headers", func() map[string][]string {
			// With a header of the dead letter's own name, which the dead letter replaces and
			// never leaves out, however long its own value.
			h := map[string][]string{"X-Small": {"kept"}, HeaderDeadError: {"forged"}}
			// Within JetStream's limit by less than the dead letter adds.
			for i := 0; rawHeaderBlock(h)+len("Nats-Msg-Id: \r\n")+36 < outbox.JetStreamMaxHeaderBytes-200; i++ {
				h["X-H"] = append(h["X-H"], fmt.Sprintf("%s%05d", strings.Repeat("h", 20), i))
			}
			return h
		}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			h := tc.headers()
			h[outbox.HeaderMsgID] = []string{newID()}
			if n := rawHeaderBlock(h); n > outbox.JetStreamMaxHeaderBytes || n < outbox.JetStreamMaxHeaderBytes-outbox.DeadLetterHeaderReserve {
				t.Fatalf("fixture block %d bytes", n)
			}
			e.publish("orders.created", h, "the payload")
			c := e.newConsumer(nil, nil, func(context.Context, pgx.Tx, Message) error {
				return Permanent(errors.New("cannot handle this order: " + strings.Repeat("x", 2000)))
			})
			e.run(c)
			testsvc.Eventually(t, 20*time.Second, "the dead letter", func() bool { return c.Stats().DeadLettered == 1 || c.Stats().Unavailable > 0 })
			if c.Stats().DeadLettered != 1 || c.Stats().Unavailable != 0 || c.Stats().HandlerCalls != 1 {
				t.Fatalf("dead-lettered %d, put back %d times, handler calls %d; want 1, 0, 1", c.Stats().DeadLettered, c.Stats().Unavailable, c.Stats().HandlerCalls)
			}
			dead := e.deadLetters()
			if len(dead) != 1 {
				t.Fatalf("DEAD holds %d messages", len(dead))
			}
			d := dead[0]
			if string(d.Data) != "the payload" || d.Header.Get(HeaderDeadPayloadDropped) != "" {
				t.Fatalf("payload %q (dropped %q), want it whole", d.Data, d.Header.Get(HeaderDeadPayloadDropped))
			}
			dropped := d.Header.Get(HeaderDeadHeadersDropped)
			if dropped == "" || tc.dropped != "" && dropped != tc.dropped {
				t.Fatalf("%s = %q, want %q", HeaderDeadHeadersDropped, dropped, tc.dropped)
			}
			if d.Header.Get("X-Small") != "kept" || d.Header.Get(HeaderDeadReason) != DeadReasonPermanent || !strings.Contains(d.Header.Get(HeaderDeadError), "cannot handle this order") ||
				d.Header.Get(HeaderDeadMsgID) != h[outbox.HeaderMsgID][0] {
				t.Fatalf("dead letter headers: small %q, reason %q, error %q, msg id %q", d.Header.Get("X-Small"), d.Header.Get(HeaderDeadReason), d.Header.Get(HeaderDeadError), d.Header.Get(HeaderDeadMsgID))
			}
			t.Logf("%s: %s header values left out; the dead letter's block is %d bytes", tc.name, dropped, rawHeaderBlock(d.Header))
		})
	}
}

// A dead-letter stream whose max_msg_size is below the message's own headers: the dead
// letter leaves out the payload, then the original's headers, and is stored with its
// Txoutbox-Dead-* headers, saying what it left out, instead of being put back forever.
func TestDeadLetterStreamSmallerThanTheHeaders(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	s, err := e.nats.JS.Stream(ctx, deadStream)
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	cfg.MaxMsgSize = 2048
	if _, err := e.nats.JS.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	e.publish("orders.created", map[string][]string{outbox.HeaderMsgID: {newID()}, "X-Big": {strings.Repeat("h", 3000)}}, "the payload")
	c := e.newConsumer(nil, nil, func(context.Context, pgx.Tx, Message) error { return Permanent(errors.New("poison")) })
	e.run(c)
	testsvc.Eventually(t, 20*time.Second, "the dead letter", func() bool { return c.Stats().DeadLettered == 1 || c.Stats().Unavailable > 0 })
	dead := e.deadLetters()
	if c.Stats().Unavailable != 0 || len(dead) != 1 {
		t.Fatalf("put back %d times, %d dead letters; want 0 and 1", c.Stats().Unavailable, len(dead))
	}
	d := dead[0]
	if len(d.Data) != 0 || d.Header.Get(HeaderDeadPayloadDropped) != "true" || d.Header.Get(HeaderDeadHeadersDropped) != "1" ||
		d.Header.Get("X-Big") != "" || d.Header.Get(HeaderDeadReason) != DeadReasonPermanent {
		t.Fatalf("dead letter: payload %d bytes, dropped payload %q headers %q, X-Big %d bytes, reason %q", len(d.Data),
			d.Header.Get(HeaderDeadPayloadDropped), d.Header.Get(HeaderDeadHeadersDropped), len(d.Header.Get("X-Big")), d.Header.Get(HeaderDeadReason))
	}
}

// outbox.DeadLetterHeaderReserve covers the most a dead letter adds to a message package
// outbox accepted, every field at its longest: the durable and stream names at JetStream's
// 255 bytes, the subject at outbox.MaxSubjectLength, the error at its 1 KiB cut, 20-digit
// counts, the longest RFC 3339 time, both "dropped" markers and the dead letter's own
// Nats-Msg-Id, less the relay's Nats-Msg-Id (a UUID) it leaves out.
func TestDeadLetterHeaderReserveCoversTheWorstCase(t *testing.T) {
	t.Parallel()
	const name = 255 // JetStream's longest stream or consumer name
	digits := strings.Repeat("9", 20)
	h := nats.Header{}
	h.Set(HeaderDeadConsumer, strings.Repeat("d", name))
	h.Set(HeaderDeadReason, DeadReasonPermanent)
	h.Set(HeaderDeadError, strings.Repeat("e", maxErrorHeader))
	h.Set(HeaderDeadDeliveries, digits)
	h.Set(HeaderDeadSubject, strings.Repeat("s", outbox.MaxSubjectLength))
	h.Set(HeaderDeadStream, strings.Repeat("S", name))
	h.Set(HeaderDeadStreamSeq, digits)
	h.Set(HeaderDeadMsgID, newID())
	h.Set(HeaderDeadAt, time.Date(2026, 12, 31, 23, 59, 59, 999999999, time.UTC).Format(time.RFC3339Nano))
	h.Set(HeaderDeadPayloadDropped, "true")
	h.Set(HeaderDeadHeadersDropped, digits)
	h.Set(jetstream.MsgIDHeader, strings.Repeat("d", name)+":"+strings.Repeat("S", name)+":"+digits)
	added := headerBlockSize(h) - len("NATS/1.0\r\n\r\n") - len(outbox.HeaderMsgID+": "+newID()+"\r\n")
	t.Logf("a dead letter adds at most %d bytes of headers (reserve %d)", added, outbox.DeadLetterHeaderReserve)
	if added > outbox.DeadLetterHeaderReserve {
		t.Fatalf("a dead letter may add %d bytes of headers, over outbox.DeadLetterHeaderReserve (%d)", added, outbox.DeadLetterHeaderReserve)
	}
}
