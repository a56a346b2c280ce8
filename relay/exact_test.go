package relay

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// TestHeaderBlockLimitIsJetStreams: outbox.JetStreamMaxHeaderBytes is the real server's
// limit, and outbox.MaxHeaderBytes leaves DeadLetterHeaderReserve below it. One byte over
// MaxHeaderBytes is refused at enqueue, before anything is written; the message the relay
// would build with a block one byte over JetStream's limit is refused by JetStream, one byte
// shorter it is stored.
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
		if !errors.Is(err, outbox.ErrMessageTooLarge) || !errors.As(err, &me) || !strings.Contains(err.Error(), fmt.Sprint(outbox.MaxHeaderBytes+1)) {
			t.Fatalf("keyed=%v: err = %v, want a *MessageError wrapping ErrMessageTooLarge giving the size %d", keyed, err, outbox.MaxHeaderBytes+1)
		}
		// JetStream's own limit: the message the relay would have built with a block one byte
		// over it is refused by the server, and the same message one byte shorter is stored.
		m.Headers["X-Big"][0] = strings.Repeat("v", outbox.JetStreamMaxHeaderBytes+1-outbox.HeaderBlockSize(&m)+len(m.Headers["X-Big"][0]))
		row := store.Claimed{MessageID: uuid.New(), Subject: m.Subject, Key: m.Key, Payload: m.Payload}
		h := maps.Clone(m.Headers)
		h[outbox.HeaderBizKey] = []string{m.BizKey}
		row.Headers, _ = json.Marshal(h)
		msg, err := buildMsg(&row)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.nats.JS.PublishMsg(context.Background(), msg); err == nil {
			t.Fatalf("keyed=%v: JetStream stored a header block of %d bytes", keyed, outbox.JetStreamMaxHeaderBytes+1)
		}
		msg.Header["X-Big"][0] = msg.Header["X-Big"][0][1:]
		if _, err := e.nats.JS.PublishMsg(context.Background(), msg); err != nil {
			t.Fatalf("keyed=%v: JetStream refused a header block of %d bytes: %v", keyed, outbox.JetStreamMaxHeaderBytes, err)
		}
	}
	if n := e.count(`true`); n != 0 {
		t.Fatalf("%d rows written", n)
	}
}

// A stored row that the producer would have refused (written before the producer's rules, or
// not by package outbox) is never sent and never altered on the wire: it is dead at once,
// saying why, and holds its key back; the rows next to it are published. The class: every
// rule of package outbox's validation applies to the stored subject (not a literal publish
// subject, or NATS's own, where a publish is a request to the server made with the relay's
// credentials), key, header names and header values.
func TestStoredRowThatWouldBeAlteredIsDead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	e.enqueue(outbox.Message{Subject: "orders.created", Payload: []byte("first")})
	r := e.relay(nil)
	drain(t, r)
	bad := []struct{ subject, key, headers, why string }{
		{"orders.created", "k1 ", `{}`, "white space"},
		{"orders.created", "k2", `{"X-V": ["trailing "]}`, "white space"},
		{"orders.created", "k3", `{"X-V": ["a\u00a0"]}`, "white space"},
		{"orders.created", "k4", `{"Nats-Expected-Stream": ["OTHER"]}`, "reserved"},
		{"orders.created", "k5", `{"Txoutbox-Biz-Key": [" biz"]}`, "white space"},
		{"orders.created", "k6", `{"Status": ["404"]}`, "reserved"},
		{"orders.created", "k7", `{"bad name": ["v"]}`, "not a valid header name"},
		{"orders.created", "k8", `{"X:Y": ["v"]}`, "not a valid header name"},
		{"orders.created", "k9", `{"nats-rollup": ["all"]}`, "reserved"},
		{"$JS.API.STREAM.PURGE.ORDERS", "k10", `{}`, "reserved for NATS"},
		{"$SYS.REQ.SERVER.PING", "k11", `{}`, "reserved for NATS"},
		{"orders.created ", "k12", `{}`, "whitespace"},
		{"orders.*", "k13", `{}`, "wildcard"},
		{"orders.>", "k14", `{}`, "wildcard"},
		{"orders..created", "k15", `{}`, "empty"},
		{"orders.a\u0085b", "k16", `{}`, "control character"},
		{"", "k17", `{}`, "empty"},
		// The text Nats-Msg-Id in a key, business key, header name or value: nats-server
		// would take it for the message id header and store the message without its id.
		{"orders.created", "k18 Nats-Msg-Id", `{}`, `key holds the text "Nats-Msg-Id"`},
		{"orders.created", "k19", `{"X-V": ["Nats-Msg-IdNats-Msg-Id"]}`, "store the message without deduplication"},
		{"orders.created", "k20", `{"X-Orig-Nats-Msg-Id": ["v"]}`, `name "X-Orig-Nats-Msg-Id" holds the text "Nats-Msg-Id"`},
		{"orders.created", "k21", `{"Txoutbox-Biz-Key": ["b:Nats-Msg-Id"]}`, `key holds the text "Nats-Msg-Id"`},
		{"orders.created", "k22", `{"a": ["x", "copy of Nats-Msg-Id 1"]}`, "store the message without deduplication"},
	}
	for i, b := range bad {
		_, err := e.db.Pool.Exec(ctx, `INSERT INTO txoutbox_messages (message_id, subject, msg_key, partition_key, headers, payload, ready_at)
VALUES ($1, $2, $3, 0, $4::jsonb, $5, now())`, uuid.New(), b.subject, b.key, b.headers, []byte(fmt.Sprint("bad-", i)))
		if err != nil {
			t.Fatal(err)
		}
	}
	e.enqueue(outbox.Message{Subject: "orders.created", Payload: []byte("fine")},
		outbox.Message{Subject: "orders.created", Key: "k10", Payload: []byte("held")})
	if _, err := r.runOnce(ctx); err != nil {
		t.Fatal(err)
	}
	for i, b := range bad {
		row := e.row(fmt.Sprint("bad-", i))
		if row.state != "dead" || row.attempts != 1 || !strings.Contains(row.lastErr, b.why) {
			t.Errorf("row with subject %q key %q headers %s: %+v, want dead after 1 attempt saying %q", b.subject, b.key, b.headers, row, b.why)
		}
	}
	// Nothing was purged: the stream still holds what it held, and the good row.
	if got := payloads(e.streamMsgs("ORDERS")); got != "first,fine" {
		t.Fatalf("ORDERS holds %q, want first,fine", got)
	}
	if row := e.row("held"); row.state != "ready" || row.attempts != 0 {
		t.Fatalf("the row behind a dead one of its key: %+v, want ready, held back", row)
	}
}

// The reason EnqueueTx, the SQL functions and checkStored refuse the text Nats-Msg-Id in keys,
// business keys, header names and values (outbox.HeaderMsgID), shown on the nats-server this
// module builds against: the server finds a message's id by searching the raw header block
// for that text, and a name or value holding it twice ("Nats-Msg-IdNats-Msg-Id") before the
// real Nats-Msg-Id line makes it miss the id: a republish is stored again, outside the
// duplicate window. nats.go writes a message's headers in map order, so either order happens;
// here each header block is written as it is, through the client protocol. (nats-server 2.9,
// the oldest the relay supports, looks only at the first occurrence: a single one before the
// id is enough there.) Should a later nats-server find the id in every case, the rule stays,
// for the older servers.
func TestMsgIDTextInAHeaderDefeatsDeduplication(t *testing.T) {
	t.Parallel()
	n := testsvc.NewNATS(t)
	n.Stream(t, "ORDERS", "orders.>")
	inbox := nats.NewInbox()
	acks, err := n.Conn.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Conn.Flush(); err != nil {
		t.Fatal(err)
	}
	conn, err := net.Dial("tcp", strings.TrimPrefix(n.URL(), "nats://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	r := bufio.NewReader(conn)
	if line, err := r.ReadString('\n'); err != nil || !strings.HasPrefix(line, "INFO ") {
		t.Fatalf("read the server's INFO: %q, %v", line, err)
	}
	if _, err := fmt.Fprint(conn, "CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"protocol\":1}\r\n"); err != nil {
		t.Fatal(err)
	}
	// publish sends the header block and a payload, and returns whether JetStream took the
	// message for a duplicate.
	publish := func(block string) bool {
		t.Helper()
		const payload = "x"
		if _, err := fmt.Fprintf(conn, "HPUB orders.created %s %d %d\r\n%s%s\r\n", inbox, len(block), len(block)+len(payload), block, payload); err != nil {
			t.Fatal(err)
		}
		m, err := acks.NextMsg(10 * time.Second)
		if err != nil {
			t.Fatalf("no PubAck: %v", err)
		}
		var ack struct {
			Seq       uint64          `json:"seq"`
			Duplicate bool            `json:"duplicate"`
			Error     json.RawMessage `json:"error"`
		}
		if err := json.Unmarshal(m.Data, &ack); err != nil || ack.Seq == 0 || ack.Error != nil {
			t.Fatalf("PubAck %s: %v", m.Data, err)
		}
		return ack.Duplicate
	}
	for i, c := range []struct {
		name, line string // line: one header line (the text in a name or a value)
		before     bool   // the line before the Nats-Msg-Id line, else after it
		dedup      bool   // the republish is dropped as a duplicate
	}{
		{"no other header", "", false, true},
		{"an ordinary header before the id", "X-V: v", true, true},
		{"the text twice in a value after the id", "X-V: Nats-Msg-IdNats-Msg-Id", false, true},
		{"the text twice in a value before the id", "X-V: Nats-Msg-IdNats-Msg-Id", true, false},
		{"the text twice in a key before the id", outbox.HeaderKey + ": Nats-Msg-IdNats-Msg-Id", true, false},
		{"the text twice in a name before the id", "X-Nats-Msg-IdNats-Msg-Id: v", true, false},
	} {
		id := fmt.Sprintf("%s: %d-%s", outbox.HeaderMsgID, i, uuid.NewString())
		lines := []string{id}
		if c.line != "" {
			lines = append(lines, c.line)
			if c.before {
				lines[0], lines[1] = lines[1], lines[0]
			}
		}
		block := "NATS/1.0\r\n" + strings.Join(lines, "\r\n") + "\r\n\r\n"
		if publish(block) {
			t.Fatalf("%s: the first publish was taken for a duplicate", c.name)
		}
		if got := publish(block); got != c.dedup {
			t.Errorf("%s: the republish was a duplicate: %v, want %v (header block %q)", c.name, got, c.dedup, block)
		}
	}
}

// startSmallNATS starts a JetStream nats-server whose max_payload is maxPayload bytes, below
// the producers' default limit (outbox.DefaultMaxMessageBytes), with the stream ORDERS.
func startSmallNATS(t *testing.T, maxPayload int32) *testsvc.NATS {
	t.Helper()
	srv, err := server.NewServer(&server.Options{
		Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(),
		MaxPayload: maxPayload, NoLog: true, NoSigs: true, DisableJetStreamBanner: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	t.Cleanup(srv.Shutdown)
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not start")
	}
	nc, err := testsvc.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	n := &testsvc.NATS{Conn: nc, JS: js}
	n.Stream(t, "ORDERS", "orders.>")
	return n
}

// The start check refuses a server whose max_payload is below what producers may enqueue
// (ErrMessageLimit, naming both limits). With the check off (MaxMessageBytes txoutbox.Off) it
// only warns, and a message that package outbox accepted under its default limit but that is
// over the server's max_payload can never be published (nats.go refuses it before sending):
// its row is dead at once, saying so and naming the limit, and holds its key back. The other
// rows are published.
func TestMessageOverServerMaxPayloadIsDeadAtOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	client, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	const maxPayload = 256 << 10
	e := &env{t: t, db: db, nats: startSmallNATS(t, maxPayload), client: client}
	var se *StreamError
	err = e.relay(&Config{Subjects: []string{"orders.>"}}).CheckStreams(ctx)
	if !errors.Is(err, ErrMessageLimit) || !errors.As(err, &se) || se.Stream != "" || se.Limit != maxPayload || se.Producers != outbox.DefaultMaxMessageBytes ||
		!strings.Contains(err.Error(), "max_payload is 262144") {
		t.Fatalf("CheckStreams with max_payload %d = %v, want ErrMessageLimit naming the server's max_payload and the producers' limit", maxPayload, err)
	}
	if err := e.relay(&Config{Subjects: []string{"orders.>"}, MaxMessageBytes: maxPayload}).CheckStreams(ctx); !errors.Is(err, ErrMessageLimit) {
		t.Fatalf("CheckStreams told the Go producers' limit, with the SQL producers' 1 MiB = %v, want ErrMessageLimit", err)
	}
	logs := &testsvc.LogBuffer{}
	r := e.relay(&Config{Subjects: []string{"orders.>"}, MaxMessageBytes: txoutbox.Off, Logger: logs.LoggerAt(slog.LevelInfo)})
	if err := r.CheckStreams(ctx); err != nil {
		t.Fatal(err)
	}
	if out := logs.String(); strings.Count(out, `"limit":"the server's max_payload"`) != 1 || !strings.Contains(out, fmt.Sprintf(`"limit_bytes":%d`, maxPayload)) {
		t.Fatalf("want one warning naming the server's max_payload (%d bytes); logs:\n%s", maxPayload, out)
	}
	big := make([]byte, maxPayload+1)
	e.enqueue(
		outbox.Message{Subject: "orders.created", Key: "k", Payload: big},
		outbox.Message{Subject: "orders.created", Key: "k", Payload: []byte("after")},
		outbox.Message{Subject: "orders.created", Payload: []byte("fine")},
		outbox.Message{Subject: "orders.created", Payload: make([]byte, maxPayload-200)}, // fits with its headers
	)
	if _, err := r.runOnce(ctx); err != nil {
		t.Fatal(err)
	}
	var st, lastErr string
	var attempts int
	if err := db.Pool.QueryRow(ctx, "SELECT state, attempts, last_error FROM txoutbox_messages WHERE length(payload) = $1", len(big)).Scan(&st, &attempts, &lastErr); err != nil {
		t.Fatal(err)
	}
	if st != "dead" || attempts != 1 || !strings.Contains(lastErr, "max_payload") || !strings.Contains(lastErr, fmt.Sprint(maxPayload)) {
		t.Fatalf("the row over max_payload: state %s, %d attempts, last_error %q; want dead at once, naming max_payload and its value", st, attempts, lastErr)
	}
	if row := e.row("after"); row.state != "ready" || row.attempts != 0 {
		t.Fatalf("the row behind it: %+v, want ready, held back", row)
	}
	if n := len(e.streamMsgs("ORDERS")); n != 2 {
		t.Fatalf("ORDERS holds %d messages, want the 2 that fit", n)
	}
	if n := e.count("true"); n != 2 {
		t.Fatalf("%d rows left, want the dead one and the one held behind it", n)
	}
}
