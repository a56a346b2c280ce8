package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

type badCase struct {
	name    string
	msg     outbox.Message
	want    error
	inError string // the error must say each |-separated part
}

// badMessages are messages NATS would not store, or would not deliver exactly as given.
func badMessages() []badCase {
	var cases []badCase
	// What no key and no header value may hold, and why the error must say so.
	anywhere := []struct{ name, s, says string }{
		{"leading space", " v", "begins with white space (U+0020)"},
		{"trailing space", "v ", "ends with white space (U+0020)"},
		{"leading tab", "\tv", "begins with white space (U+0009)"},
		{"trailing tab", "v\t", "ends with white space (U+0009)"},
		{"leading NBSP", "\u00a0v", "begins with white space (U+00A0)"},
		{"trailing NBSP", "v\u00a0", "ends with white space (U+00A0)"},
		{"leading ideographic space", "\u3000v", "begins with white space (U+3000)"},
		{"trailing line separator", "v\u2028", "ends with white space (U+2028)"},
		{"leading paragraph separator", "\u2029v", "begins with white space (U+2029)"},
		{"trailing narrow NBSP", "v\u202f", "ends with white space (U+202F)"},
		{"leading BOM", "\ufeffv", "begins with white space (U+FEFF)"},
		{"trailing zero-width space", "v\u200b", "ends with white space (U+200B)"},
		{"space only", " ", "white space (U+0020)"},
		{"NBSP only", "\u00a0", "white space (U+00A0)"},
		{"spaces only", "   ", "white space (U+0020)"},
		{"SOH inside", "a\x01b", "control character U+0001"},
		{"DEL inside", "a\x7fb", "control character U+007F"},
		{"NEL inside", "a\u0085b", "control character U+0085"},
		{"trailing NEL", "v\u0085", "ends with white space (U+0085)"},
		{"C1 CSI inside", "a\u009bb", "control character U+009B"},
		{"NUL inside", "a\x00b", "control character U+0000"},
		{"CR LF inside", "a\r\nb", "control character U+000D"},
		{"LF inside", "a\nb", "control character U+000A"},
		{"VT inside", "a\vb", "control character U+000B"},
		{"ESC inside", "a\x1b[0mb", "control character U+001B"},
		{"invalid UTF-8", "a\xffb", "not valid UTF-8"},
		// The text nats-server searches the header block for to find the message id: it
		// would take it for the relay's Nats-Msg-Id and store the message without it.
		{"message id header's text inside", "copy of Nats-Msg-Id 7", `holds the text "Nats-Msg-Id"|store the message without deduplication`},
		{"message id header's text twice", "Nats-Msg-IdNats-Msg-Id", `holds the text "Nats-Msg-Id"`},
		{"message id header's text at the start", "Nats-Msg-Id: 1", `holds the text "Nats-Msg-Id"`},
		{"message id header's text at the end", "x-Nats-Msg-Id", `holds the text "Nats-Msg-Id"`},
	}
	for _, c := range anywhere {
		cases = append(cases,
			badCase{"Key " + c.name, outbox.Message{Subject: "a.b", Key: c.s}, outbox.ErrInvalidKey, "Key |" + c.says},
			badCase{"BizKey " + c.name, outbox.Message{Subject: "a.b", BizKey: c.s}, outbox.ErrInvalidKey, "BizKey |" + c.says},
			badCase{"header value " + c.name, outbox.Message{Subject: "a.b", Headers: map[string][]string{"X-V": {c.s}}}, outbox.ErrInvalidHeader, `value 1 of "X-V"|` + c.says},
			badCase{"second header value " + c.name, outbox.Message{Subject: "a.b", Headers: map[string][]string{"X-V": {"ok", c.s}}}, outbox.ErrInvalidHeader, `value 2 of "X-V"|` + c.says},
		)
	}
	// A tab is fine inside a header value, never in a key.
	cases = append(cases,
		badCase{"Key tab inside", outbox.Message{Subject: "a.b", Key: "a\tb"}, outbox.ErrInvalidKey, "Key|control character U+0009"},
		badCase{"BizKey tab inside", outbox.Message{Subject: "a.b", BizKey: "a\tb"}, outbox.ErrInvalidKey, "BizKey|control character U+0009"},
		badCase{"Key too long", outbox.Message{Subject: "a.b", Key: strings.Repeat("k", outbox.MaxKeyLength+1)}, outbox.ErrInvalidKey, "Key|1025 bytes"},
		badCase{"BizKey too long", outbox.Message{Subject: "a.b", BizKey: strings.Repeat("k", outbox.MaxKeyLength+1)}, outbox.ErrInvalidKey, "BizKey|1025 bytes"},
	)
	// Reserved header names, whatever their case.
	for _, name := range []string{
		"Nats-Msg-Id", "NATS-MSG-ID", "Nats-Expected-Stream", "Nats-Expected-Last-Sequence", "nats-ttl", "Nats-Rollup",
		"Nats-Incr", "Nats-Batch-Id", "Nats-Schedule", "Nats-Trace-Dest", "Nats-Required-Api-Level", "Nats-Anything",
		"Txoutbox-Key", "txoutbox-biz-key", "Txoutbox-Dead-Reason", "TXOUTBOX-Anything",
		"Status", "status", "Description", "description",
	} {
		cases = append(cases, badCase{"reserved header " + name, outbox.Message{Subject: "a.b", Headers: map[string][]string{name: {"1"}}},
			outbox.ErrInvalidHeader, strconv.Quote(name) + "|reserved"})
	}
	cases = append(cases,
		badCase{"header without values", outbox.Message{Subject: "a.b", Headers: map[string][]string{"X-Empty": {}}}, outbox.ErrInvalidHeader, `"X-Empty" has no value`},
		badCase{"header with nil values", outbox.Message{Subject: "a.b", Headers: map[string][]string{"X-Nil": nil}}, outbox.ErrInvalidHeader, `"X-Nil" has no value`},
		badCase{"header name with colon", outbox.Message{Subject: "a.b", Headers: map[string][]string{"X:Y": {"v"}}}, outbox.ErrInvalidHeader, "not a valid header name"},
		badCase{"header name non-ASCII", outbox.Message{Subject: "a.b", Headers: map[string][]string{"X-Ä": {"v"}}}, outbox.ErrInvalidHeader, "not a valid header name"},
	)
	// Names that hold the message id header's text, in its case, without being reserved.
	for _, name := range []string{"X-Orig-Nats-Msg-Id", "XNats-Msg-Id", "a.Nats-Msg-Id.b", "X-Nats-Msg-IdNats-Msg-Id"} {
		cases = append(cases, badCase{"header name holding Nats-Msg-Id " + name, outbox.Message{Subject: "a.b", Headers: map[string][]string{name: {"1"}}},
			outbox.ErrInvalidHeader, strconv.Quote(name) + `|holds the text "Nats-Msg-Id"|without deduplication`})
	}
	// Subjects of NATS itself.
	for _, s := range []string{"$JS.API.STREAM.DELETE.ORDERS", "$JS.API.x", "$JS", "$JSC.R.x", "$SYS.REQ.SERVER.PING", "$NRG.AE.x"} {
		cases = append(cases, badCase{"subject " + s, outbox.Message{Subject: s}, outbox.ErrInvalidSubject, "reserved for NATS"})
	}
	return cases
}

// checkRefused checks that err is a *MessageError for message index wrapping want, and that
// its text says every |-separated part of says.
func checkRefused(t *testing.T, err error, index int, want error, says string) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Fatalf("err = %v, want %v", err, want)
	}
	var me *outbox.MessageError
	if !errors.As(err, &me) {
		t.Fatalf("err %T is not a *MessageError", err)
	}
	if me.Index != index || !errors.Is(me.Err, want) || !strings.Contains(err.Error(), fmt.Sprintf("message %d ", index)) {
		t.Fatalf("error %q: index %d, want %d", err, me.Index, index)
	}
	// The detail is the validator's own, not an error text cut down: the sentinel is said once.
	if strings.Count(err.Error(), want.Error()) != 1 || me.Detail == "" {
		t.Fatalf("error %q: detail %q, want the sentinel %q said once and a detail", err, me.Detail, want)
	}
	for _, s := range strings.Split(says, "|") {
		if !strings.Contains(me.Detail, s) && !strings.Contains(err.Error(), s) {
			t.Fatalf("error %q does not say %q", err, s)
		}
	}
}

// Everything the wire would drop, change, refuse or act on is refused at the door, by
// EnqueueTx and by Prepare alike, and nothing is written.
func TestRefusedAtEnqueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	good := outbox.Message{Subject: "orders.created", Key: "order 1", Payload: []byte("ok")}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	for _, tc := range badMessages() {
		t.Run(tc.name, func(t *testing.T) {
			// A good message first: all or nothing means it must not be written either.
			_, err := c.EnqueueTx(ctx, tx, good, tc.msg)
			checkRefused(t, err, 1, tc.want, tc.inError)
			var n int
			if err := tx.QueryRow(ctx, "SELECT count(*) FROM txoutbox_messages").Scan(&n); err != nil {
				t.Fatalf("tx unusable after a validation error: %v", err)
			}
			if n != 0 {
				t.Fatalf("rows = %d, want 0", n)
			}

			_, err = c.Prepare(ctx, db.Pool, tc.msg, &outbox.PrepareOptions{Group: "g"})
			checkRefused(t, err, 0, tc.want, tc.inError)
		})
	}
	if n := count(t, db, "true"); n != 0 {
		t.Fatalf("%d rows written by refused messages", n)
	}
}

// What is accepted: white space and tabs inside, Unicode, empty values, names differing in
// case, several values; stored exactly as given.
func TestAcceptedAtEnqueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	msgs := []outbox.Message{
		{Subject: "orders.created", Key: "order 1", BizKey: "order 1\u00a0created"},
		{Subject: "orders.created", Key: "Bestellung-Ä-注文-🙂", BizKey: "a\u3000b"},
		{Subject: "orders.created", Headers: map[string][]string{
			"X-Tab": {"a\tb"}, "X-Space": {"a  b"}, "X-Empty": {""}, "X-Multi": {"1", "", "1", "zwei 2"},
			"X-Case": {"upper"}, "x-case": {"lower"}, "X-Unicode": {"Grüße\u00a0aus 東京 🙂"},
			"X-Nats-Like": {"ok"}, "Natsy": {"ok"}, "Statuses": {"ok"}, "traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		}},
		{Subject: "$js.lowercase.is.ordinary"},
		{Subject: "$KV.bucket.key"},
		{Subject: "JS.API.x"},
	}
	var ids []string
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		got, err := c.EnqueueTx(ctx, tx, msgs...)
		for _, id := range got {
			ids = append(ids, id.String())
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for i, m := range msgs {
		var subject string
		var key *string
		var headers map[string][]string
		if err := db.Pool.QueryRow(ctx, "SELECT subject, msg_key, headers FROM txoutbox_messages WHERE message_id = $1", ids[i]).Scan(&subject, &key, &headers); err != nil {
			t.Fatal(err)
		}
		if subject != m.Subject || (m.Key == "") != (key == nil) || (key != nil && *key != m.Key) {
			t.Errorf("message %d stored as subject %q key %v", i, subject, key)
		}
		want := map[string][]string{}
		for k, v := range m.Headers {
			want[k] = v
		}
		if m.BizKey != "" {
			want[outbox.HeaderBizKey] = []string{m.BizKey}
		}
		if fmt.Sprintf("%q", sortedHeaders(headers)) != fmt.Sprintf("%q", sortedHeaders(want)) {
			t.Errorf("message %d stored headers %q, want %q", i, headers, want)
		}
	}
	for i, m := range msgs {
		if _, err := c.Prepare(ctx, db.Pool, m, &outbox.PrepareOptions{Group: "g"}); err != nil {
			t.Errorf("Prepare of message %d: %v", i, err)
		}
	}
}

func sortedHeaders(h map[string][]string) []string {
	var out []string
	for k, vs := range h {
		out = append(out, k+"="+strings.Join(vs, "\x00"))
	}
	sort.Strings(out)
	return out
}

// nats-server refuses a header block over 65535 bytes whatever the payload, and a consumer's
// dead letter adds up to DeadLetterHeaderReserve: the block as the relay publishes it (its own
// headers included) may be exactly MaxHeaderBytes, not one more.
func TestHeaderBlockLimitExact(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil) // MaxMessageBytes 1 MiB: only the header block limit applies
	if outbox.JetStreamMaxHeaderBytes != 65535 || outbox.MaxHeaderBytes != 65535-outbox.DeadLetterHeaderReserve {
		t.Fatalf("MaxHeaderBytes = %d, want nats-server's 65535 less the dead-letter reserve %d", outbox.MaxHeaderBytes, outbox.DeadLetterHeaderReserve)
	}
	const limit = outbox.MaxHeaderBytes
	over := fmt.Sprintf("%d|%d", limit+1, limit)
	line := func(name, value string) int { return len(name + ": " + value + "\r\n") }
	uuid36 := strings.Repeat("0", 36)
	for _, tc := range []struct {
		name        string
		key, bizKey string
	}{
		{"unkeyed", "", ""},
		{"keyed", "order-1", ""},
		{"unkeyed with BizKey", "", "order:1:created"},
		{"keyed with BizKey", strings.Repeat("k", outbox.MaxKeyLength), "order:1:created"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// "NATS/1.0\r\n" + lines + "\r\n"; the relay adds Nats-Msg-Id, Txoutbox-Key, Txoutbox-Biz-Key.
			fixed := len("NATS/1.0\r\n") + len("\r\n") + line("Nats-Msg-Id", uuid36) + line("X-Small", "s") + line("X-Pad", "")
			if tc.key != "" {
				fixed += line("Txoutbox-Key", tc.key)
			}
			if tc.bizKey != "" {
				fixed += line("Txoutbox-Biz-Key", tc.bizKey)
			}
			pad := strings.Repeat("p", limit-fixed)
			m := outbox.Message{Subject: "a.b", Key: tc.key, BizKey: tc.bizKey, Payload: []byte("payload"),
				Headers: map[string][]string{"X-Pad": {pad}, "X-Small": {"s"}}}
			if got := outbox.HeaderBlockSize(&m); got != limit {
				t.Fatalf("HeaderBlockSize = %d, want %d", got, limit)
			}
			if got := outbox.EncodedSize(&m); got != limit+len("payload") {
				t.Fatalf("EncodedSize = %d, want %d", got, limit+len("payload"))
			}
			err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { _, err := c.EnqueueTx(ctx, tx, m); return err })
			if err != nil {
				t.Fatalf("a header block of exactly MaxHeaderBytes (%d) must be accepted: %v", limit, err)
			}
			m.Headers["X-Pad"] = []string{pad + "p"}
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			_, err = c.EnqueueTx(ctx, tx, outbox.Message{Subject: "ok"}, m)
			checkRefused(t, err, 1, outbox.ErrHeadersTooLarge, over)
			if !errors.Is(err, outbox.ErrMessageTooLarge) {
				t.Fatalf("ErrHeadersTooLarge must also be ErrMessageTooLarge: %v", err)
			}
			_, err = c.Prepare(ctx, db.Pool, m, &outbox.PrepareOptions{Group: "g"})
			checkRefused(t, err, 0, outbox.ErrHeadersTooLarge, over)
		})
	}
}

func TestValidateSubjectReservedForNATS(t *testing.T) {
	t.Parallel()
	for s, ok := range map[string]bool{
		"$JS.API.STREAM.DELETE.ORDERS": false, "$JS.x": false, "$JS": false, "$JSC.x": false, "$SYS.x": false, "$NRG.x": false,
		"$js.x": true, "$KV.b.k": true, "$O.b.x": true, "$JSX.x": true, "x.$JS.API": true, "orders.created": true,
	} {
		err := outbox.ValidateSubject(s)
		if (err == nil) != ok || (err != nil && !errors.Is(err, outbox.ErrInvalidSubject)) {
			t.Errorf("ValidateSubject(%q) = %v, want ok=%v", s, err, ok)
		}
	}
	for s, ok := range map[string]bool{
		"$JS.>": false, "$JS.API.*": false, "$SYS.>": false, "$JSC.*": false, "$NRG.>": false,
		"$KV.>": true, "orders.>": true, ">": true, "*.API.>": true, "$js.>": true,
	} {
		err := outbox.ValidateSubjectFilter(s)
		if (err == nil) != ok || (err != nil && !errors.Is(err, outbox.ErrInvalidSubject)) {
			t.Errorf("ValidateSubjectFilter(%q) = %v, want ok=%v", s, err, ok)
		}
	}
}

// Subjects: every control character (C0, DEL, C1) is refused; other Unicode, white space
// included (NATS splits subjects on ASCII white space only), is carried byte for byte.
func TestValidateSubjectControlCharacters(t *testing.T) {
	t.Parallel()
	for r := rune(0); r <= 0x9f; r++ {
		if r > 0x20 && r < 0x7f || r == '.' {
			continue
		}
		s := "orders.a" + string(r) + "b"
		if err := outbox.ValidateSubject(s); !errors.Is(err, outbox.ErrInvalidSubject) {
			t.Errorf("ValidateSubject(%q) = %v, want ErrInvalidSubject", s, err)
		}
	}
	for _, s := range []string{"orders.a\u00a0b", "orders.\u00a0", "注文.作成", "orders.🙂", "orders.a\u2028b"} {
		if err := outbox.ValidateSubject(s); err != nil {
			t.Errorf("ValidateSubject(%q) = %v, want it accepted", s, err)
		}
	}
	for name, ok := range map[string]bool{"X-Trace": true, "traceparent": true, "a b": false, "X:Y": false, "": false, "Nats-Rollup": false, "Ünicode": false} {
		if err := outbox.ValidateHeaderName(name); (err == nil) != ok || err != nil && !errors.Is(err, outbox.ErrInvalidHeader) {
			t.Errorf("ValidateHeaderName(%q) = %v, want ok=%v", name, err, ok)
		}
	}
}

func TestIsReservedHeader(t *testing.T) {
	t.Parallel()
	for name, reserved := range map[string]bool{
		"Nats-Msg-Id": true, "nats-expected-stream": true, "NATS-TTL": true, "Nats-": true,
		"Txoutbox-Key": true, "txoutbox-dead-error": true, "Status": true, "DESCRIPTION": true,
		"Nats": false, "NatsMsgId": false, "X-Nats-Msg-Id": false, "Txoutbox": false, "Statuses": false,
		"traceparent": false, "X-Status": false,
	} {
		if got := outbox.IsReservedHeader(name); got != reserved {
			t.Errorf("IsReservedHeader(%q) = %v, want %v", name, got, reserved)
		}
	}
}

func TestValidateKeyAndHeaderValue(t *testing.T) {
	t.Parallel()
	for _, c := range badMessages() {
		switch {
		case c.msg.Key != "":
			if err := outbox.ValidateKey(c.msg.Key); !errors.Is(err, outbox.ErrInvalidKey) {
				t.Errorf("%s: ValidateKey(%q) = %v, want ErrInvalidKey", c.name, c.msg.Key, err)
			}
		case strings.HasPrefix(c.name, "header value "):
			if err := outbox.ValidateHeaderValue(c.msg.Headers["X-V"][0]); !errors.Is(err, outbox.ErrInvalidHeader) {
				t.Errorf("%s: ValidateHeaderValue = %v, want ErrInvalidHeader", c.name, err)
			}
		}
	}
	for _, s := range []string{"", "a b", "order:1", "a\u00a0b", "注文", "🙂", "nats-msg-id", "NATS-MSG-ID", "Nats-Msg-ID", "Nats-Msg", "Msg-Id"} {
		if err := outbox.ValidateKey(s); err != nil {
			t.Errorf("ValidateKey(%q) = %v", s, err)
		}
	}
	for _, s := range []string{"", "a\tb", "a  b", "x", "nats-msg-id", "Nats-Msg-ID"} {
		if err := outbox.ValidateHeaderValue(s); err != nil {
			t.Errorf("ValidateHeaderValue(%q) = %v", s, err)
		}
	}
	// Header names: the message id header's text in its case is refused anywhere in a name;
	// in another case it is an ordinary name, and not reserved.
	for name, ok := range map[string]bool{
		"X-Orig-Nats-Msg-Id": false, "Nats-Msg-IdX": false, "XNats-Msg-Id": false, "Nats-Msg-Id": false,
		"x-orig-nats-msg-id": true, "X-Orig-NATS-MSG-ID": true, "X-Msg-Id": true,
	} {
		err := outbox.ValidateHeaderName(name)
		if ok != (err == nil) || err != nil && !errors.Is(err, outbox.ErrInvalidHeader) {
			t.Errorf("ValidateHeaderName(%q) = %v, want ok %v", name, err, ok)
		}
	}
}

func TestConfigMaxMessageBytesLimit(t *testing.T) {
	t.Parallel()
	if _, err := outbox.NewClient(&outbox.Config{MaxMessageBytes: outbox.MaxMessageBytesLimit}); err != nil {
		t.Fatal(err)
	}
	var ce *txoutbox.ConfigError
	if _, err := outbox.NewClient(&outbox.Config{MaxMessageBytes: outbox.MaxMessageBytesLimit + 1}); !errors.As(err, &ce) || ce.Field != "Config.MaxMessageBytes" {
		t.Fatalf("err = %v, want a *txoutbox.ConfigError naming Config.MaxMessageBytes", err)
	}
}

// ValidateSubject reads the tokens without splitting the subject (it runs for every message
// enqueued and published): it says what a split would, for every subject of up to five bytes
// over the letters that matter (the separator, the wildcards, the reserved prefixes' first
// letters), and for the reserved subjects.
func TestValidateSubjectTokensAsSplit(t *testing.T) {
	t.Parallel()
	split := func(s string) string { // the rules of the token loop, with strings.Split
		if s == "" || len(s) > outbox.MaxSubjectLength {
			return "not checked here"
		}
		toks := strings.Split(s, ".")
		for i, tok := range toks {
			switch tok {
			case "":
				return fmt.Sprintf("token %d is empty", i+1)
			case "*", ">":
				return fmt.Sprintf("token %d is the wildcard %q", i+1, tok)
			}
		}
		switch toks[0] {
		case "$JS", "$JSC", "$SYS", "$NRG":
			return "reserved for NATS"
		}
		return ""
	}
	var subjects []string
	var grow func(prefix string)
	grow = func(prefix string) {
		subjects = append(subjects, prefix)
		if len(prefix) == 5 {
			return
		}
		for _, c := range []string{"a", ".", "*", ">", "$", "J", "S"} {
			grow(prefix + c)
		}
	}
	grow("")
	subjects = append(subjects, "$JS.API.x", "$JSC.x", "$SYS.x", "$NRG.x", "$JS", "x.$JS", "$JSX.x")
	for _, s := range subjects[1:] {
		want := split(s)
		err := outbox.ValidateSubject(s)
		switch {
		case want == "" && err != nil:
			t.Fatalf("ValidateSubject(%q) = %v, want nil", s, err)
		case want != "" && (err == nil || !strings.Contains(err.Error(), want)):
			t.Fatalf("ValidateSubject(%q) = %v, want an error saying %q", s, err, want)
		}
	}
}

// ValidateGroup names the character it refuses, not the first byte of its encoding, and a
// byte that is not UTF-8 as a byte.
func TestValidateGroupNamesTheCharacter(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ group, want string }{
		{"ü", `'ü' at byte 0`},
		{"ab٣", `'٣' at byte 2`},
		{"x\u0301", `'́' at byte 1`},
		{"a b", `' ' at byte 1`},
		{"a\xffb", `the byte 0xff (not UTF-8) at byte 1`},
	} {
		err := outbox.ValidateGroup(c.group)
		if !errors.Is(err, outbox.ErrInvalidGroup) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ValidateGroup(%q) = %v, want ErrInvalidGroup saying %s", c.group, err, c.want)
		}
	}
	if err := outbox.ValidateGroup("orders-svc_2"); err != nil {
		t.Errorf("ValidateGroup(orders-svc_2) = %v", err)
	}
}
