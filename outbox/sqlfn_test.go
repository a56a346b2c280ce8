package outbox_test

// The SQL contract (migration 4): txoutbox_enqueue and friends must never disagree with the
// Go client. Every row of one table of good and bad messages goes through EnqueueTx and
// through txoutbox_enqueue, and must get the same outcome.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// sqlStates maps the Go client's sentinels to the SQLSTATE codes of the functions (README,
// "The SQL contract"). ErrHeadersTooLarge wraps ErrMessageTooLarge: it comes first.
var sqlStates = []struct {
	err  error
	code string
}{
	{outbox.ErrInvalidSubject, "TX001"},
	{outbox.ErrInvalidKey, "TX002"},
	{outbox.ErrInvalidHeader, "TX003"},
	{outbox.ErrHeadersTooLarge, "TX004"},
	{outbox.ErrMessageTooLarge, "TX005"},
	{outbox.ErrDuplicateID, "TX006"},
	{outbox.ErrInvalidGroup, "TX007"},
	{outbox.ErrRolledBack, "TX101"},
	{outbox.ErrAlreadyCommitted, "TX102"},
	// Before ErrNotFound: a message or business key that is not scheduled. (A *ScheduleError
	// of a message or business key with no row wraps both: TX202, see goOutcome.)
	{outbox.ErrNotScheduled, "TX201"},
	{outbox.ErrNotFound, "TX103"},
	{outbox.ErrInvalidDeliverAt, "TX009"},
	// An invalid argument of a call (PrepareOptions.CheckImmunity; batch arrays of unequal
	// length have no Go form).
	{txoutbox.ErrInvalidConfig, "TX008"},
}

// goOutcome is "ok" or the SQLSTATE code of err's sentinel. A *ScheduleError for a message
// that does not exist matches ErrNotScheduled and ErrNotFound: TX202 (migration 010), the
// code of neither alone (ErrNotFound alone is a half message's TX103).
func goOutcome(err error) string {
	if err == nil {
		return "ok"
	}
	var se *outbox.ScheduleError
	if errors.As(err, &se) && errors.Is(err, outbox.ErrNotScheduled) && errors.Is(err, outbox.ErrNotFound) {
		return "TX202"
	}
	for _, s := range sqlStates {
		if errors.Is(err, s.err) {
			return s.code
		}
	}
	return "unexpected: " + err.Error()
}

// sqlOutcome is "ok" or err's SQLSTATE.
func sqlOutcome(err error) string {
	if err == nil {
		return "ok"
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return "unexpected: " + err.Error()
}

// serverRefused: text that is not valid UTF-8 or holds a NUL (and JSON holding \u0000) never
// reaches the functions: PostgreSQL's own input refuses it (22021, 22P05), before any call.
func serverRefused(code string) bool { return code == "22021" || code == "22P05" }

// headersJSON encodes h for the headers argument. Invalid UTF-8 is written as it is
// (encoding/json would replace it with U+FFFD, which is valid): the server must see it.
func headersJSON(h map[string][]string) any {
	if h == nil {
		return nil
	}
	if _, ok := h[jsonNullKey]; ok {
		return "null"
	}
	str := func(s string) string {
		if !utf8.ValidString(s) {
			return `"` + s + `"`
		}
		b, _ := json.Marshal(s)
		return string(b)
	}
	var b strings.Builder
	b.WriteString("{")
	first := true
	for name, vals := range h {
		if !first {
			b.WriteString(",")
		}
		first = false
		b.WriteString(str(name) + ":[")
		for i, v := range vals {
			if i > 0 {
				b.WriteString(",")
			}
			b.WriteString(str(v))
		}
		b.WriteString("]")
	}
	b.WriteString("}")
	return b.String()
}

// jsonNullKey marks jsonNullHeaders, which headersJSON passes as JSON null ('null'::jsonb,
// psycopg's Jsonb(None)): no headers, as nil is for EnqueueTx (migration 010).
const jsonNullKey = "\x00json null"

var jsonNullHeaders = map[string][]string{jsonNullKey: nil}

// nilIfEmpty is s, or NULL when s is empty.
func nilIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// enqueueSQL calls txoutbox_enqueue with m in tx.
func enqueueSQL(ctx context.Context, tx pgx.Tx, m outbox.Message) (uuid.UUID, error) {
	return enqueueSQLWith(ctx, tx, m, false)
}

// sqlID is the id argument for m: NULL when it has none, or the all-zero UUID when zeroID.
func sqlID(m outbox.Message, zeroID bool) *string {
	if m.ID == uuid.Nil && !zeroID {
		return nil
	}
	id := m.ID.String()
	return &id
}

// enqueueSQLWith is enqueueSQL, passing the all-zero UUID for m's id when it has none and
// zeroID is set (EnqueueTx's uuid.Nil: draw one).
func enqueueSQLWith(ctx context.Context, tx pgx.Tx, m outbox.Message, zeroID bool) (uuid.UUID, error) {
	id := sqlID(m, zeroID)
	payload := m.Payload
	if payload == nil {
		payload = []byte{}
	}
	var out uuid.UUID
	err := tx.QueryRow(ctx, `SELECT txoutbox_enqueue($1, $2, $3, $4::jsonb, $5, $6::uuid, $7::timestamptz)`,
		m.Subject, payload, nilIfEmpty(m.Key), headersJSON(m.Headers), nilIfEmpty(m.BizKey), id, deliverAt(m)).Scan(&out)
	return out, err
}

// deliverAt is m's delivery time as an argument: NULL when it has none.
func deliverAt(m outbox.Message) *time.Time {
	if m.DeliverAt.IsZero() {
		return nil
	}
	return &m.DeliverAt
}

// enqueueManySQL calls txoutbox_enqueue_many with msgs (ids included) in tx.
func enqueueManySQL(ctx context.Context, tx pgx.Tx, msgs []outbox.Message) ([]uuid.UUID, error) {
	return enqueueManySQLWith(ctx, tx, msgs, false)
}

// enqueueManySQLWith is enqueueManySQL, passing the all-zero UUID for the messages without an
// id when zeroID is set.
func enqueueManySQLWith(ctx context.Context, tx pgx.Tx, msgs []outbox.Message, zeroID bool) ([]uuid.UUID, error) {
	return enqueueManySQLFrom(ctx, tx, msgs, zeroID, 1)
}

// from0 renumbers the array argument $n of type typ from 0 ('[0:1]={a,b}', what a PL/pgSQL
// producer filling s[i] from 0 passes); NULL stays NULL.
func from0(n int, typ string) string {
	a := fmt.Sprintf("$%d::%s", n, typ)
	if typ == "jsonb[]" {
		a = fmt.Sprintf("$%d::text[]::jsonb[]", n)
	}
	return fmt.Sprintf("(CASE WHEN cardinality(%[1]s) > 0 THEN ('[0:' || cardinality(%[1]s) - 1 || ']=' || %[1]s::text)::%[2]s ELSE %[1]s END)", a, typ)
}

// enqueueManySQLFrom is enqueueManySQLWith with every array argument numbered from lower (1,
// as pgx sends arrays, or 0).
func enqueueManySQLFrom(ctx context.Context, tx pgx.Tx, msgs []outbox.Message, zeroID bool, lower int) ([]uuid.UUID, error) {
	n := len(msgs)
	subjects, payloads := make([]string, n), make([][]byte, n)
	keys, bizKeys := make([]*string, n), make([]*string, n)
	hdrs := make([]any, n)
	ids := make([]*string, n)
	dues := make([]*time.Time, n)
	delayed := false
	for i, m := range msgs {
		dues[i] = deliverAt(m)
		delayed = delayed || dues[i] != nil
		subjects[i], payloads[i] = m.Subject, m.Payload
		if payloads[i] == nil {
			payloads[i] = []byte{}
		}
		if m.Key != "" {
			keys[i] = &msgs[i].Key
		}
		if m.BizKey != "" {
			bizKeys[i] = &msgs[i].BizKey
		}
		hdrs[i] = headersJSON(m.Headers)
		ids[i] = sqlID(m, zeroID)
	}
	var out []uuid.UUID
	if !delayed {
		dues = nil // the argument left NULL, as a caller without delayed messages passes it
	}
	call := `SELECT txoutbox_enqueue_many($1::text[], $2::bytea[], $3::text[], $4::text[]::jsonb[], $5::text[], $6::uuid[], $7::timestamptz[])`
	if lower == 0 {
		call = `SELECT txoutbox_enqueue_many(` + from0(1, "text[]") + `, ` + from0(2, "bytea[]") + `, ` + from0(3, "text[]") + `, ` +
			from0(4, "jsonb[]") + `, ` + from0(5, "text[]") + `, ` + from0(6, "uuid[]") + `, ` + from0(7, "timestamptz[]") + `)`
	}
	err := tx.QueryRow(ctx, call, subjects, payloads, keys, hdrs, bizKeys, ids, dues).Scan(&out)
	return out, err
}

type agreementRow struct {
	name string
	m    outbox.Message
	want string // "ok" or the SQLSTATE (the Go sentinel's code)
	// server: the SQL side is refused by PostgreSQL's input (invalid UTF-8, NUL) before the
	// function runs; the Go side must refuse it with want.
	server bool
	// dup: the same message (without its delivery time) is enqueued first, in the same
	// transaction.
	dup bool
	// zeroID: the message has no id; the SQL side passes the all-zero UUID (uuid.Nil) for it,
	// and both sides must draw one.
	zeroID bool
	// jsonNull: the message has no headers; the SQL side passes JSON null for them.
	jsonNull bool
}

// sized returns m with one header "X" whose value makes HeaderBlockSize(m) == block.
func sized(m outbox.Message, block int) outbox.Message {
	h := map[string][]string{}
	for k, v := range m.Headers {
		h[k] = v
	}
	h["X"] = []string{""}
	m.Headers = h
	base := outbox.HeaderBlockSize(&m)
	h["X"] = []string{strings.Repeat("v", block-base)}
	return m
}

// payloadFor returns m with a payload making EncodedSize(m) == total.
func payloadFor(m outbox.Message, total int) outbox.Message {
	m.Payload = bytes.Repeat([]byte{'p'}, total-outbox.HeaderBlockSize(&m))
	return m
}

func agreementRows() []agreementRow {
	msg := func(subject string) outbox.Message { return outbox.Message{Subject: subject, Payload: []byte("x")} }
	withKey := func(k string) outbox.Message { m := msg("k.v"); m.Key = k; return m }
	withBiz := func(k string) outbox.Message { m := msg("k.v"); m.BizKey = k; return m }
	withHdr := func(h map[string][]string) outbox.Message { m := msg("h.v"); m.Headers = h; return m }
	one := func(name, value string) outbox.Message { return withHdr(map[string][]string{name: {value}}) }
	const tp00 = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	full := outbox.Message{Subject: "s.v", Key: "order-1", BizKey: "order:1:created", Headers: map[string][]string{"traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}}
	rows := []agreementRow{
		// Subjects.
		{name: "subject ok", m: msg("orders.created"), want: "ok"},
		{name: "subject empty", m: msg(""), want: "TX001"},
		{name: "subject at the limit", m: msg(strings.Repeat("a", outbox.MaxSubjectLength)), want: "ok"},
		{name: "subject one over", m: msg(strings.Repeat("a", outbox.MaxSubjectLength+1)), want: "TX001"},
		{name: "subject 1024 bytes of 2-byte characters", m: msg(strings.Repeat("é", outbox.MaxSubjectLength/2)), want: "ok"},
		{name: "subject 1025 bytes with a 2-byte character", m: msg(strings.Repeat("é", outbox.MaxSubjectLength/2) + "a"), want: "TX001"},
		{name: "subject with a space", m: msg("a b"), want: "TX001"},
		{name: "subject with a tab", m: msg("a\tb"), want: "TX001"},
		{name: "subject with DEL", m: msg("a\x7fb"), want: "TX001"},
		{name: "subject with C1 NEL", m: msg("a\u0085b"), want: "TX001"},
		{name: "subject with C1 U+009F", m: msg("a\u009fb"), want: "TX001"},
		{name: "subject with U+0080", m: msg("a\u0080b"), want: "TX001"},
		{name: "subject with U+00A0 (not a control)", m: msg("a\u00a0b"), want: "ok"},
		{name: "subject with U+00A1", m: msg("a\u00a1b"), want: "ok"},
		{name: "subject with NUL", m: msg("a\x00b"), want: "TX001", server: true},
		{name: "subject not UTF-8", m: msg("a\xffb"), want: "TX001", server: true},
		{name: "subject leading dot", m: msg(".a"), want: "TX001"},
		{name: "subject trailing dot", m: msg("a."), want: "TX001"},
		{name: "subject double dot", m: msg("a..b"), want: "TX001"},
		{name: "subject wildcard *", m: msg("a.*"), want: "TX001"},
		{name: "subject wildcard >", m: msg("a.>"), want: "TX001"},
		{name: "subject only *", m: msg("*"), want: "TX001"},
		{name: "subject * inside a token", m: msg("a.*b"), want: "ok"},
		{name: "subject > inside a token", m: msg("a>b.c"), want: "ok"},
		{name: "subject $JS", m: msg("$JS.API.INFO"), want: "TX001"},
		{name: "subject $JS alone", m: msg("$JS"), want: "TX001"},
		{name: "subject $JSC", m: msg("$JSC.x"), want: "TX001"},
		{name: "subject $SYS", m: msg("$SYS.REQ.x"), want: "TX001"},
		{name: "subject $NRG", m: msg("$NRG.x"), want: "TX001"},
		{name: "subject $js (case-sensitive)", m: msg("$js.x"), want: "ok"},
		{name: "subject $JSX", m: msg("$JSX.x"), want: "ok"},
		{name: "subject $JS not first", m: msg("x.$JS"), want: "ok"},
		// Keys.
		{name: "key ok", m: withKey("order-1"), want: "ok"},
		{name: "key with inner space", m: withKey("a b"), want: "ok"},
		{name: "key unicode", m: withKey("ключ🔑"), want: "ok"},
		{name: "key at the limit", m: withKey(strings.Repeat("k", outbox.MaxKeyLength)), want: "ok"},
		{name: "key one over", m: withKey(strings.Repeat("k", outbox.MaxKeyLength+1)), want: "TX002"},
		{name: "key leading space", m: withKey(" k"), want: "TX002"},
		{name: "key trailing space", m: withKey("k "), want: "TX002"},
		{name: "key trailing tab", m: withKey("k\t"), want: "TX002"},
		{name: "key inner tab", m: withKey("a\tb"), want: "TX002"},
		{name: "key leading NBSP", m: withKey("\u00a0k"), want: "TX002"},
		{name: "key trailing U+3000", m: withKey("k\u3000"), want: "TX002"},
		{name: "key trailing U+205F", m: withKey("k\u205f"), want: "TX002"},
		{name: "key trailing ZWSP", m: withKey("k\u200b"), want: "TX002"},
		{name: "key trailing U+200D", m: withKey("k\u200d"), want: "TX002"},
		{name: "key leading BOM", m: withKey("\ufeffk"), want: "TX002"},
		{name: "key leading U+2060", m: withKey("\u2060k"), want: "TX002"},
		{name: "key leading U+1680", m: withKey("\u1680k"), want: "TX002"},
		{name: "key trailing U+2029", m: withKey("k\u2029"), want: "TX002"},
		{name: "key inner ZWSP", m: withKey("a\u200bb"), want: "ok"},
		{name: "key trailing U+200E (not space)", m: withKey("k\u200e"), want: "ok"},
		{name: "key inner C0", m: withKey("a\x01b"), want: "TX002"},
		{name: "key inner C1", m: withKey("a\u0085b"), want: "TX002"},
		{name: "key inner DEL", m: withKey("a\x7fb"), want: "TX002"},
		{name: "key NUL", m: withKey("a\x00b"), want: "TX002", server: true},
		{name: "key not UTF-8", m: withKey("a\xffb"), want: "TX002", server: true},
		{name: "biz key ok", m: withBiz("order:1:created"), want: "ok"},
		{name: "biz key at the limit", m: withBiz(strings.Repeat("b", outbox.MaxKeyLength)), want: "ok"},
		{name: "biz key one over", m: withBiz(strings.Repeat("b", outbox.MaxKeyLength+1)), want: "TX002"},
		{name: "biz key leading space", m: withBiz(" b"), want: "TX002"},
		{name: "biz key inner LF", m: withBiz("a\nb"), want: "TX002"},
		// Header names.
		{name: "header ok", m: one("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), want: "ok"},
		{name: "header name of every token character", m: one("!#$%&'*+-.^_`|~09AZaz", "v"), want: "ok"},
		{name: "header name with a space", m: one("a b", "v"), want: "TX003"},
		{name: "header name with a colon", m: one("a:b", "v"), want: "TX003"},
		{name: "header name empty", m: one("", "v"), want: "TX003"},
		{name: "header name non-ASCII", m: one("é", "v"), want: "TX003"},
		{name: "header name with a slash", m: one("a/b", "v"), want: "TX003"},
		{name: "header Nats-Msg-Id", m: one("Nats-Msg-Id", "v"), want: "TX003"},
		{name: "header nats-expected-stream", m: one("nats-expected-stream", "v"), want: "TX003"},
		{name: "header NATS-TTL", m: one("NATS-TTL", "5s"), want: "TX003"},
		{name: "header NatsFoo (no dash)", m: one("NatsFoo", "v"), want: "ok"},
		{name: "header Txoutbox-Key", m: one("Txoutbox-Key", "v"), want: "TX003"},
		{name: "header txoutbox-biz-key", m: one("txoutbox-biz-key", "v"), want: "TX003"},
		{name: "header Txoutbox-Dead-Error", m: one("Txoutbox-Dead-Error", "v"), want: "TX003"},
		{name: "header Status", m: one("Status", "503"), want: "TX003"},
		{name: "header description", m: one("description", "v"), want: "TX003"},
		{name: "header Statuses", m: one("Statuses", "v"), want: "ok"},
		{name: "header with no value", m: withHdr(map[string][]string{"a": {}}), want: "TX003"},
		// One ASCII header with nothing escaped (migration 7 reads it with string functions).
		{name: "header traceparent", m: one("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), want: "ok"},
		{name: "header name with DEL", m: one("a\x7f", "v"), want: "TX003"},
		{name: "header name with a bracket", m: one("a[", "v"), want: "TX003"},
		{name: "header name mimicking the JSON", m: one(`a": ["b`, "v"), want: "TX003"},
		{name: "header DESCRIPTION", m: one("DESCRIPTION", "v"), want: "TX003"},
		{name: "header Txoutbox-x", m: one("Txoutbox-x", "v"), want: "TX003"},
		{name: "header Descriptions", m: one("Descriptions", "v"), want: "ok"},
		{name: "header value mimicking the JSON", m: one("a", `v"], "b": ["w`), want: "ok"},
		{name: "header value of brackets", m: one("a", `["x"]`), want: "ok"},
		{name: "header value leading space", m: one("a", " v"), want: "TX003"},
		{name: "header value one space", m: one("a", " "), want: "TX003"},
		{name: "header value inner DEL", m: one("a", "v\x7fw"), want: "TX003"},
		{name: "header value trailing DEL", m: one("a", "v\x7f"), want: "TX003"},
		{name: "header value with a backslash", m: one("a", `v\w`), want: "ok"},
		{name: "header value of a quote", m: one("a", `"`), want: "ok"},
		{name: "header value trailing NBSP", m: one("a", "v\u00a0"), want: "TX003"},
		// Header values.
		{name: "header value empty", m: one("a", ""), want: "ok"},
		{name: "header many values", m: withHdr(map[string][]string{"a": {"1", "2", ""}, "B": {"x"}, "b": {"y"}}), want: "ok"},
		{name: "header value inner tab", m: one("a", "x\ty"), want: "ok"},
		{name: "header value inner space", m: one("a", "x y"), want: "ok"},
		{name: "header value leading tab", m: one("a", "\tv"), want: "TX003"},
		{name: "header value trailing space", m: one("a", "v "), want: "TX003"},
		{name: "header value CRLF", m: one("a", "v\r\nX: y"), want: "TX003"},
		{name: "header value inner C1", m: one("a", "a\u0080b"), want: "TX003"},
		{name: "header value trailing NEL", m: one("a", "v\u0085"), want: "TX003"},
		{name: "header value leading U+2060", m: one("a", "\u2060v"), want: "TX003"},
		{name: "header value trailing U+202F", m: one("a", "v\u202f"), want: "TX003"},
		{name: "header value unicode", m: one("a", "zürich ☃"), want: "ok"},
		{name: "header value NUL", m: one("a", "a\x00b"), want: "TX003", server: true},
		{name: "header value not UTF-8", m: one("a", "a\xffb"), want: "TX003", server: true},
		{name: "header name not UTF-8", m: one("a\xff", "v"), want: "TX003", server: true},
		// The text Nats-Msg-Id, in that case, nowhere in a key, business key, header name or
		// value: nats-server finds the message id by searching the header block for it
		// (outbox.HeaderMsgID; migration 011 for the SQL functions).
		{name: "key holding Nats-Msg-Id", m: withKey("order-Nats-Msg-Id-1"), want: "TX002"},
		{name: "key starting with Nats-Msg-Id", m: withKey("Nats-Msg-Id"), want: "TX002"},
		{name: "key ending with Nats-Msg-Id", m: withKey("order:Nats-Msg-Id"), want: "TX002"},
		{name: "key holding nats-msg-id (another case)", m: withKey("order-nats-msg-id-1"), want: "ok"},
		{name: "biz key holding Nats-Msg-Id", m: withBiz("b:Nats-Msg-Id:1"), want: "TX002"},
		{name: "biz key Nats-Msg-Id twice", m: withBiz("Nats-Msg-IdNats-Msg-Id"), want: "TX002"},
		{name: "biz key holding NATS-MSG-ID (another case)", m: withBiz("b:NATS-MSG-ID"), want: "ok"},
		{name: "header value holding Nats-Msg-Id", m: one("a", "copy of Nats-Msg-Id 1"), want: "TX003"},
		{name: "header value Nats-Msg-Id twice", m: one("a", "Nats-Msg-IdNats-Msg-Id"), want: "TX003"},
		{name: "header value starting with Nats-Msg-Id", m: one("a", "Nats-Msg-Id: 1"), want: "TX003"},
		{name: "header value ending with Nats-Msg-Id", m: one("a", "x-Nats-Msg-Id"), want: "TX003"},
		{name: "header value Nats-Msg-Id, escaped JSON", m: one("a", `v\Nats-Msg-Id`), want: "TX003"},
		{name: "header value Nats-Msg-Id, second value", m: withHdr(map[string][]string{"a": {"x", "Nats-Msg-Id"}}), want: "TX003"},
		{name: "header value Nats-Msg-Id, second header", m: withHdr(map[string][]string{"a": {"x"}, "b": {"Nats-Msg-Id"}}), want: "TX003"},
		{name: "header value holding nats-msg-id (another case)", m: one("a", "nats-msg-id"), want: "ok"},
		{name: "header name holding Nats-Msg-Id", m: one("X-Orig-Nats-Msg-Id", "v"), want: "TX003"},
		{name: "header name ending with Nats-Msg-Id", m: one("XNats-Msg-Id", "v"), want: "TX003"},
		{name: "header name starting with Nats-Msg-Id (reserved: Nats-*)", m: one("Nats-Msg-IdX", "v"), want: "TX003"},
		{name: "header name holding Nats-Msg-Id, with other headers", m: withHdr(map[string][]string{"a": {"1", "2"}, "X-Nats-Msg-Id": {"v"}}), want: "TX003"},
		{name: "header name holding x-nats-msg-id (another case)", m: one("X-Orig-nats-msg-id", "v"), want: "ok"},
		{name: "bad key and a header value holding Nats-Msg-Id", m: outbox.Message{Subject: "a", Key: "k ", Headers: map[string][]string{"a": {"Nats-Msg-Id"}}}, want: "TX002"},
		{name: "header value holding Nats-Msg-Id and header block too large", m: sized(one("a", "Nats-Msg-Id"), outbox.MaxHeaderBytes+1), want: "TX003"},
		{name: "key holding Nats-Msg-Id and bad delivery time", m: withDue(withKey("Nats-Msg-Id"), tooLate), want: "TX002"},
		// traceparent (name in any case): one W3C trace context (outbox.ValidateTraceparent,
		// ErrInvalidTraceparent; migration 010 for the SQL functions).
		{name: "traceparent version 00", m: one("traceparent", tp00), want: "ok"},
		{name: "traceparent future version, longer", m: one("traceparent", "cc"+tp00[2:]+"-what-comes-later"), want: "ok"},
		{name: "traceparent future version, 55 characters", m: one("traceparent", "01"+tp00[2:]), want: "ok"},
		{name: "traceparent Traceparent, valid", m: one("Traceparent", tp00), want: "ok"},
		{name: "traceparent TRACEPARENT, valid, with other headers", m: withHdr(map[string][]string{"TRACEPARENT": {tp00}, "tracestate": {"a=b"}, "x": {`v\w`}}), want: "ok"},
		{name: "traceparent named in another header's value", m: one("a", `"traceparent": ["x"]`), want: "ok"},
		// Version 00 defines the flags 01 (sampled) and 02 (random) only: OpenTelemetry's
		// propagator drops a version 00 traceparent with another bit set (migration 011).
		{name: "traceparent version 00, flags 00", m: one("traceparent", tp00[:53]+"00"), want: "ok"},
		{name: "traceparent version 00, flags 02", m: one("traceparent", tp00[:53]+"02"), want: "ok"},
		{name: "traceparent version 00, flags 03", m: one("traceparent", tp00[:53]+"03"), want: "ok"},
		{name: "traceparent version 00, flags 04", m: one("traceparent", tp00[:53]+"04"), want: "TX003"},
		{name: "traceparent version 00, flags 0a", m: one("traceparent", tp00[:53]+"0a"), want: "TX003"},
		{name: "traceparent version 00, flags 10", m: one("traceparent", tp00[:53]+"10"), want: "TX003"},
		{name: "traceparent version 00, flags ff", m: one("traceparent", tp00[:53]+"ff"), want: "TX003"},
		{name: "traceparent Traceparent, version 00, flags ff, with other headers", m: withHdr(map[string][]string{"Traceparent": {tp00[:53] + "ff"}, "x": {`v\w`}}), want: "TX003"},
		{name: "traceparent future version, flags ff", m: one("traceparent", "01"+tp00[2:53]+"ff"), want: "ok"},
		{name: "traceparent future version, flags ff, longer", m: one("traceparent", "fe"+tp00[2:53]+"ff-later"), want: "ok"},
		{name: "traceparent uppercase hex", m: one("traceparent", strings.ToUpper(tp00)), want: "TX003"},
		{name: "traceparent uppercase trace id", m: one("traceparent", "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"), want: "TX003"},
		{name: "traceparent all-zero trace id", m: one("traceparent", "00-00000000000000000000000000000000-00f067aa0ba902b7-01"), want: "TX003"},
		{name: "traceparent all-zero span id", m: one("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"), want: "TX003"},
		{name: "traceparent version ff", m: one("traceparent", "ff"+tp00[2:]), want: "TX003"},
		{name: "traceparent version ff, longer", m: one("traceparent", "ff"+tp00[2:]+"-x"), want: "TX003"},
		{name: "traceparent one short", m: one("traceparent", tp00[:54]), want: "TX003"},
		{name: "traceparent version 00, longer", m: one("traceparent", tp00+"-x"), want: "TX003"},
		{name: "traceparent future version, more without a dash", m: one("traceparent", "01"+tp00[2:]+"x"), want: "TX003"},
		{name: "traceparent dashes misplaced", m: one("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01"), want: "TX003"},
		{name: "traceparent non-hex flags", m: one("traceparent", tp00[:53]+"0g"), want: "TX003"},
		{name: "traceparent with a 2-byte character", m: one("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e473é-00f067aa0ba902b7-01"), want: "TX003"},
		{name: "traceparent empty", m: one("traceparent", ""), want: "TX003"},
		{name: "traceparent two values", m: withHdr(map[string][]string{"traceparent": {tp00, tp00}}), want: "TX003"},
		{name: "traceparent two headers of two cases", m: withHdr(map[string][]string{"traceparent": {tp00}, "Traceparent": {tp00}}), want: "TX003"},
		{name: "traceparent Traceparent, bad", m: one("Traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7"), want: "TX003"},
		{name: "traceparent TRACEPARENT, bad, with other headers", m: withHdr(map[string][]string{"TRACEPARENT": {"garbage"}, "x": {`v\w`}}), want: "TX003"},
		{name: "traceparent bad and header block too large", m: sized(one("traceparent", "garbage"), outbox.MaxHeaderBytes+1), want: "TX003"},
		{name: "traceparent bad and a bad key", m: outbox.Message{Subject: "s.v", Key: " k", Headers: map[string][]string{"traceparent": {"garbage"}}}, want: "TX002"},
		{name: "traceparent bad and bad delivery time", m: withDue(one("traceparent", "garbage"), tooLate), want: "TX003"},
		// Sizes, as NATS counts them with the relay's headers.
		{name: "header block at the limit", m: sized(msg("s.v"), outbox.MaxHeaderBytes), want: "ok"},
		{name: "header block one over", m: sized(msg("s.v"), outbox.MaxHeaderBytes+1), want: "TX004"},
		{name: "header block with key and biz key at the limit", m: sized(full, outbox.MaxHeaderBytes), want: "ok"},
		{name: "header block with key and biz key one over", m: sized(full, outbox.MaxHeaderBytes+1), want: "TX004"},
		{name: "header block too large and payload too", m: payloadFor(sized(full, outbox.MaxHeaderBytes+1), outbox.DefaultMaxMessageBytes+10), want: "TX004"},
		{name: "message at the limit", m: payloadFor(msg("s.v"), outbox.DefaultMaxMessageBytes), want: "ok"},
		{name: "message one over", m: payloadFor(msg("s.v"), outbox.DefaultMaxMessageBytes+1), want: "TX005"},
		{name: "message with key, biz key and headers at the limit", m: payloadFor(full, outbox.DefaultMaxMessageBytes), want: "ok"},
		{name: "message with key, biz key and headers one over", m: payloadFor(full, outbox.DefaultMaxMessageBytes+1), want: "TX005"},
		{name: "message with a full header block at the limit", m: payloadFor(sized(full, outbox.MaxHeaderBytes), outbox.DefaultMaxMessageBytes), want: "ok"},
		{name: "message with a full header block one over", m: payloadFor(sized(full, outbox.MaxHeaderBytes), outbox.DefaultMaxMessageBytes+1), want: "TX005"},
		{name: "empty payload", m: outbox.Message{Subject: "s.v"}, want: "ok"},
		// Order of the checks: the first problem names the class.
		{name: "bad subject and bad key", m: outbox.Message{Subject: "a..b", Key: " k"}, want: "TX001"},
		{name: "bad key and bad header", m: outbox.Message{Subject: "a", Key: " k", Headers: map[string][]string{"Nats-X": {"v"}}}, want: "TX002"},
		{name: "bad biz key and bad header", m: outbox.Message{Subject: "a", BizKey: "b ", Headers: map[string][]string{"Nats-X": {"v"}}}, want: "TX002"},
		// Ids.
		{name: "given id", m: outbox.Message{Subject: "s.v", ID: uuid.New()}, want: "ok"},
		{name: "id already in the outbox", m: outbox.Message{Subject: "s.v", ID: uuid.New()}, want: "TX006", dup: true},
		// Delivery times (migration 005).
		{name: "delivery time ahead", m: outbox.Message{Subject: "s.v", Key: "k", BizKey: "b:1:2030-01-01T10:00:00Z", DeliverAt: time.Date(2030, 1, 1, 10, 0, 0, 0, time.UTC)}, want: "ok"},
		{name: "delivery time past", m: outbox.Message{Subject: "s.v", DeliverAt: time.Date(2001, 1, 1, 0, 0, 0, 0, time.UTC)}, want: "ok"},
		{name: "delivery time at the lower bound", m: outbox.Message{Subject: "s.v", DeliverAt: outbox.MinDeliverAt}, want: "ok"},
		{name: "delivery time before 1970", m: outbox.Message{Subject: "s.v", DeliverAt: outbox.MinDeliverAt.Add(-time.Second)}, want: "TX009"},
		{name: "delivery time at the upper bound", m: outbox.Message{Subject: "s.v", DeliverAt: outbox.MaxDeliverAt}, want: "ok"},
		{name: "delivery time after 9999", m: outbox.Message{Subject: "s.v", DeliverAt: outbox.MaxDeliverAt.Add(time.Second)}, want: "TX009"},
		{name: "bad subject and bad delivery time", m: outbox.Message{Subject: "a..b", DeliverAt: outbox.MaxDeliverAt.Add(time.Second)}, want: "TX001"},
		// A delivery time is the message's last check, after its size (migration 009).
		{name: "bad key and bad delivery time", m: outbox.Message{Subject: "s.v", Key: " k", DeliverAt: tooLate}, want: "TX002"},
		{name: "bad biz key and bad delivery time", m: outbox.Message{Subject: "s.v", BizKey: "b\n", DeliverAt: tooEarly}, want: "TX002"},
		{name: "bad header and bad delivery time", m: withDue(one("Nats-Rollup", "all"), tooLate), want: "TX003"},
		{name: "header block too large and bad delivery time", m: withDue(sized(msg("s.v"), outbox.MaxHeaderBytes+1), tooLate), want: "TX004"},
		{name: "message too large and bad delivery time", m: withDue(payloadFor(msg("s.v"), outbox.DefaultMaxMessageBytes+1), tooEarly), want: "TX005"},
		{name: "delayed message at the size limit", m: withDue(payloadFor(full, outbox.DefaultMaxMessageBytes), ahead), want: "ok"},
		{name: "delayed message one over the size limit", m: withDue(payloadFor(full, outbox.DefaultMaxMessageBytes+1), ahead), want: "TX005"},
		{name: "delayed message with an id already in the outbox", m: outbox.Message{Subject: "s.v", ID: uuid.New(), DeliverAt: ahead}, want: "TX006", dup: true},
		// A keyed delayed message takes no key lock (it is locked when it falls due).
		{name: "delayed keyed message", m: outbox.Message{Subject: "s.v", Key: "order-7", DeliverAt: ahead}, want: "ok"},
		{name: "delayed keyed message, due already", m: outbox.Message{Subject: "s.v", Key: "order-7", DeliverAt: time.Date(2001, 1, 1, 0, 0, 0, 0, time.UTC)}, want: "ok"},
		// The all-zero id is no id (uuid.Nil): one is drawn (keyed, so that the partitions compare).
		{name: "zero id", m: outbox.Message{Subject: "s.v", Key: "z"}, want: "ok", zeroID: true},
		{name: "zero id, delayed", m: outbox.Message{Subject: "s.v", Key: "z", DeliverAt: ahead}, want: "ok", zeroID: true},
		{name: "zero id and bad delivery time", m: outbox.Message{Subject: "s.v", Key: "z", DeliverAt: tooLate}, want: "TX009", zeroID: true},
		{name: "zero id and bad subject", m: outbox.Message{Subject: "s..v", Key: "z"}, want: "TX001", zeroID: true},
		// Headers that are JSON null are none, as NULL is (migration 010).
		{name: "headers JSON null", m: msg("h.v"), want: "ok", jsonNull: true},
		{name: "headers JSON null, keyed, with a business key", m: outbox.Message{Subject: "h.v", Key: "k", BizKey: "b:1", Payload: []byte("x")}, want: "ok", jsonNull: true},
		{name: "headers JSON null, delayed", m: withDue(msg("h.v"), ahead), want: "ok", jsonNull: true},
		{name: "headers JSON null and a bad key", m: outbox.Message{Subject: "h.v", Key: "k "}, want: "TX002", jsonNull: true},
	}
	return rows
}

// Delivery times of the agreement rows: one ahead, one before MinDeliverAt, one after
// MaxDeliverAt.
var (
	ahead    = time.Date(2030, 1, 1, 10, 0, 0, 0, time.UTC)
	tooEarly = outbox.MinDeliverAt.Add(-time.Microsecond)
	tooLate  = outbox.MaxDeliverAt.Add(time.Microsecond)
)

// withDue returns m with the delivery time at.
func withDue(m outbox.Message, at time.Time) outbox.Message {
	m.DeliverAt = at
	return m
}

// sqlAgreementRows are agreementRows and the rows only the SQL functions' agreement test
// runs (their dup enqueues a message the other tables' would refuse).
func sqlAgreementRows() []agreementRow {
	return append(agreementRows(),
		// The delivery time before the id: EnqueueTx refuses the message before its insert
		// meets the id in the outbox.
		agreementRow{name: "bad delivery time and an id already in the outbox", m: outbox.Message{Subject: "s.v", ID: uuid.New(), DeliverAt: tooLate}, want: "TX009", dup: true},
	)
}

// keyLocks is what the transaction holds of key locks: its advisory locks and its count in
// the txoutbox.key_locks budget.
func keyLocks(t *testing.T, ctx context.Context, tx pgx.Tx) string {
	t.Helper()
	var n int
	var budget string
	if err := tx.QueryRow(ctx, `SELECT count(*), coalesce(nullif(current_setting('txoutbox.key_locks', true), ''), '0')
FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'`).Scan(&n, &budget); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("%d advisory locks, txoutbox.key_locks %s", n, budget)
}

// keyLocksHeld is keyLocks with the locks themselves: class/key hash/mode of each advisory
// lock the transaction holds, so that the keys locked compare, not only their number.
func keyLocksHeld(t *testing.T, ctx context.Context, tx pgx.Tx) string {
	t.Helper()
	var which string
	if err := tx.QueryRow(ctx, `SELECT coalesce(string_agg(format('%s/%s/%s', classid, objid, mode), ' ' ORDER BY classid, objid, mode), '')
FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'`).Scan(&which); err != nil {
		t.Fatal(err)
	}
	return keyLocks(t, ctx, tx) + " (" + which + ")"
}

// storedRow is what a message became in the outbox.
type storedRow struct {
	Subject   string
	Key       string // "<NULL>" for none
	Partition int32
	Headers   map[string][]string
	Payload   []byte
	State     string
	DeliverAt string // "<NULL>" for none
	ReadyAt   bool   // ready_at set
}

func readStored(t *testing.T, ctx context.Context, tx pgx.Tx, id uuid.UUID) storedRow {
	t.Helper()
	var r storedRow
	var hdr []byte
	if err := tx.QueryRow(ctx, `SELECT subject, coalesce(msg_key, '<NULL>'), partition_key, headers, payload, state,
    coalesce(to_char(deliver_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US'), '<NULL>'), ready_at IS NOT NULL
FROM txoutbox_messages WHERE message_id = $1`, id).
		Scan(&r.Subject, &r.Key, &r.Partition, &hdr, &r.Payload, &r.State, &r.DeliverAt, &r.ReadyAt); err != nil {
		t.Fatalf("read %s: %v", id, err)
	}
	if hdr != nil {
		if err := json.Unmarshal(hdr, &r.Headers); err != nil {
			t.Fatal(err)
		}
	}
	return r
}

// One table of good and bad messages through EnqueueTx and through txoutbox_enqueue: the
// same outcome for every row (accepted, or refused with the code of the Go sentinel), and
// an accepted message stored the same way, with the same key locks taken.
func TestSQLEnqueueAgreesWithEnqueueTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	for _, row := range sqlAgreementRows() {
		m := row.m
		if m.ID == uuid.Nil && !row.zeroID {
			m.ID = uuid.Must(uuid.NewV7()) // the same id on both sides, so that rows compare
		}
		// checkID checks the id a side returned: the given one, or one drawn for none.
		checkID := func(side string, id uuid.UUID) {
			switch {
			case row.zeroID:
				if id == uuid.Nil {
					t.Errorf("%s: %s returned the zero id, want one drawn", row.name, side)
				} else {
					checkDrawnIDs(t, []uuid.UUID{id})
				}
			case id != m.ID:
				t.Errorf("%s: %s returned %s, want the given id %s", row.name, side, id, m.ID)
			}
		}
		sqlM := m // what the SQL calls pass: JSON null for no headers, for a jsonNull row
		if row.jsonNull {
			sqlM.Headers = jsonNullHeaders
		}
		var locks [4]string
		run := func(side int, enqueue func(tx pgx.Tx) (string, *storedRow)) (string, *storedRow) {
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(ctx) }()
			if row.dup {
				first := m
				first.DeliverAt = time.Time{}
				if _, err := c.EnqueueTx(ctx, tx, first); err != nil {
					t.Fatalf("%s: first enqueue: %v", row.name, err)
				}
			}
			got, r := enqueue(tx)
			if r != nil {
				locks[side] = keyLocksHeld(t, ctx, tx)
			}
			return got, r
		}
		goGot, goRow := run(0, func(tx pgx.Tx) (string, *storedRow) {
			ids, err := c.EnqueueTx(ctx, tx, m)
			if err != nil {
				return goOutcome(err), nil
			}
			checkID("EnqueueTx", ids[0])
			r := readStored(t, ctx, tx, ids[0])
			return "ok", &r
		})
		sqlGot, sqlRow := run(1, func(tx pgx.Tx) (string, *storedRow) {
			id, err := enqueueSQLWith(ctx, tx, sqlM, row.zeroID)
			if err != nil {
				return sqlOutcome(err), nil
			}
			checkID("txoutbox_enqueue", id)
			r := readStored(t, ctx, tx, id)
			return "ok", &r
		})
		manyGot, manyRow := run(2, func(tx pgx.Tx) (string, *storedRow) {
			ids, err := enqueueManySQLWith(ctx, tx, []outbox.Message{sqlM}, row.zeroID)
			if err != nil {
				return sqlOutcome(err), nil
			}
			checkID("txoutbox_enqueue_many", ids[0])
			r := readStored(t, ctx, tx, ids[0])
			return "ok", &r
		})
		// The same call with every array numbered from 0 ('[0:0]={...}'): the same outcome,
		// row and key locks (migration 010).
		from0Got, from0Row := run(3, func(tx pgx.Tx) (string, *storedRow) {
			ids, err := enqueueManySQLFrom(ctx, tx, []outbox.Message{sqlM}, row.zeroID, 0)
			if err != nil {
				return sqlOutcome(err), nil
			}
			checkID("txoutbox_enqueue_many of arrays from 0", ids[0])
			r := readStored(t, ctx, tx, ids[0])
			return "ok", &r
		})
		if row.server && serverRefused(manyGot) {
			manyGot = sqlGot
		}
		if row.server && serverRefused(from0Got) {
			from0Got = sqlGot
		}
		if from0Got != manyGot {
			t.Errorf("%s: txoutbox_enqueue_many of arrays numbered from 0: %s, from 1: %s: they must agree", row.name, from0Got, manyGot)
		}
		if from0Row != nil && manyRow != nil && (fmt.Sprintf("%+v", *from0Row) != fmt.Sprintf("%+v", *manyRow) || !bytes.Equal(from0Row.Payload, manyRow.Payload)) {
			t.Errorf("%s: txoutbox_enqueue_many of arrays numbered from 0 stored it differently", row.name)
		}
		if goRow != nil && from0Row != nil && locks[3] != locks[0] {
			t.Errorf("%s: key locks held after the enqueue: EnqueueTx %s, txoutbox_enqueue_many of arrays from 0 %s: they must agree", row.name, locks[0], locks[3])
		}
		if manyGot != sqlGot {
			t.Errorf("%s: txoutbox_enqueue_many: %s, txoutbox_enqueue: %s: they must agree", row.name, manyGot, sqlGot)
		}
		if manyRow != nil && sqlRow != nil && (fmt.Sprintf("%+v", *manyRow) != fmt.Sprintf("%+v", *sqlRow) || !bytes.Equal(manyRow.Payload, sqlRow.Payload)) {
			t.Errorf("%s: txoutbox_enqueue_many stored it differently from txoutbox_enqueue", row.name)
		}
		if goRow != nil && (sqlRow != nil && locks[1] != locks[0] || manyRow != nil && locks[2] != locks[0]) {
			t.Errorf("%s: key locks held after the enqueue: EnqueueTx %s, txoutbox_enqueue %s, txoutbox_enqueue_many %s: they must agree",
				row.name, locks[0], locks[1], locks[2])
		}
		if goGot != row.want {
			t.Errorf("%s: EnqueueTx: %s, want %s", row.name, goGot, row.want)
		}
		switch {
		case row.server:
			if !serverRefused(sqlGot) {
				t.Errorf("%s: txoutbox_enqueue: %s, want PostgreSQL's input to refuse it (22021 or 22P05)", row.name, sqlGot)
			}
		case sqlGot != goGot:
			t.Errorf("%s: txoutbox_enqueue: %s, EnqueueTx: %s: they must agree", row.name, sqlGot, goGot)
		}
		if goRow != nil && sqlRow != nil {
			g, s := fmt.Sprintf("%+v", *goRow), fmt.Sprintf("%+v", *sqlRow)
			if g != s || !bytes.Equal(goRow.Payload, sqlRow.Payload) {
				t.Errorf("%s: stored differently:\n  EnqueueTx:        %.300s\n  txoutbox_enqueue: %.300s", row.name, g, s)
			}
		}
	}
}

// The batch form validates every message before writing any, refuses with the code of the
// first bad one and names it, and returns the ids in order.
func TestSQLEnqueueManyAgreesWithEnqueueTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	var good []outbox.Message
	for _, row := range agreementRows() {
		if row.want == "ok" && row.m.ID == uuid.Nil {
			good = append(good, row.m)
		}
	}
	call := func(tx pgx.Tx, msgs []outbox.Message) ([]uuid.UUID, error) { return enqueueManySQL(ctx, tx, msgs) }

	tx := beginTx(t, db)
	ids, err := call(tx, good)
	if err != nil || len(ids) != len(good) {
		t.Fatalf("txoutbox_enqueue_many of %d good messages: %d ids, %v", len(good), len(ids), err)
	}
	// Ids in order, each a UUIDv7, rows in id order.
	var order []uuid.UUID
	rows, _ := tx.Query(ctx, `SELECT message_id FROM txoutbox_messages ORDER BY id`)
	order, err = pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(order) != fmt.Sprint(ids) {
		t.Fatalf("row order %v, want the call's order %v", order, ids)
	}
	checkDrawnIDs(t, ids)
	// Two calls in a row (most likely in one millisecond), of many messages each: every id
	// drawn is a UUIDv7 of its own.
	many := make([]outbox.Message, 1000)
	for i := range many {
		many[i] = outbox.Message{Subject: "orders.created", Payload: []byte("x")}
	}
	var all []uuid.UUID
	for range 2 {
		ids, err := call(tx, many)
		if err != nil {
			t.Fatal(err)
		}
		checkDrawnIDs(t, ids)
		all = append(all, ids...)
	}
	seen := map[uuid.UUID]bool{}
	for _, id := range all {
		if seen[id] {
			t.Fatalf("id %s drawn twice in two calls", id)
		}
		seen[id] = true
	}
	_ = tx.Rollback(ctx)

	// One bad message at position 3 (0-based 2): nothing written, the same class.
	bad := append(append([]outbox.Message{}, good[:2]...), outbox.Message{Subject: "a", Headers: map[string][]string{"Status": {"1"}}})
	bad = append(bad, good[2:5]...)
	tx = beginTx(t, db)
	_, goErr := c.EnqueueTx(ctx, tx, bad...)
	var me *outbox.MessageError
	if !errors.As(goErr, &me) || me.Index != 2 || goOutcome(goErr) != "TX003" {
		t.Fatalf("EnqueueTx: %v", goErr)
	}
	_ = tx.Rollback(ctx)
	tx = beginTx(t, db)
	_, sqlErr := call(tx, bad)
	var pgErr *pgconn.PgError
	if !errors.As(sqlErr, &pgErr) || pgErr.Code != "TX003" || !strings.Contains(pgErr.Message, "message 3:") {
		t.Fatalf("txoutbox_enqueue_many: %v; want TX003 naming message 3", sqlErr)
	}
	_ = tx.Rollback(ctx)

	// Two messages of one call with one id; an id already in the outbox; unequal arrays.
	id := uuid.New()
	tx = beginTx(t, db)
	if err := tx.QueryRow(ctx, `SELECT txoutbox_enqueue_many(ARRAY['a','b'], ARRAY['\x'::bytea,'\x'], ids => ARRAY[$1::uuid, $1::uuid])`, id).Scan(new([]uuid.UUID)); sqlOutcome(err) != "TX006" {
		t.Fatalf("same id twice in one call: %v", err)
	}
	_ = tx.Rollback(ctx)
	tx = beginTx(t, db)
	if _, err := c.EnqueueTx(ctx, tx, outbox.Message{Subject: "a", ID: id}); err != nil {
		t.Fatal(err)
	}
	err = tx.QueryRow(ctx, `SELECT txoutbox_enqueue_many(ARRAY['a','b'], ARRAY['\x'::bytea,'\x'], ids => ARRAY[NULL, $1::uuid])`, id).Scan(new([]uuid.UUID))
	if !errors.As(err, &pgErr) || pgErr.Code != "TX006" || !strings.Contains(pgErr.Message, "message 2:") {
		t.Fatalf("id already in the outbox: %v; want TX006 naming message 2", err)
	}
	_ = tx.Rollback(ctx)
	tx = beginTx(t, db)
	if err := tx.QueryRow(ctx, `SELECT txoutbox_enqueue_many(ARRAY['a','b'], ARRAY['\x'::bytea])`).Scan(new([]uuid.UUID)); sqlOutcome(err) != "TX008" {
		t.Fatalf("unequal arrays: %v; want TX008", err)
	}
}

// The message a batch is refused for is the first refused, whether for its content or for an
// id an earlier message of the call has, and the error is that message's first problem: its
// content before its id, as EnqueueTx checks them (message by message). Several messages
// refused at once, each for a different class, name the first with its own error (a header
// block over the limit before a message whose headers are invalid, so that the size counted
// is the first's). A delivery time is a message's last check, after its size and before its
// id: a message bad only in its delivery time is named before a later one bad in its content,
// and after an earlier one (migration 009). Messages are numbered from 1 in every SQL error.
func TestSQLEnqueueManyNamesTheFirstRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	id := uuid.New()
	good := func(id uuid.UUID) outbox.Message { return outbox.Message{Subject: "a.b", ID: id, Payload: []byte("p")} }
	badSubject := func(id uuid.UUID) outbox.Message { return outbox.Message{Subject: "a..b", ID: id} }
	badKey := outbox.Message{Subject: "a.b", Key: "k "}
	badHeader := outbox.Message{Subject: "a.b", Headers: map[string][]string{"Nats-Rollup": {"all"}}}
	bigBlock := sized(outbox.Message{Subject: "a.b"}, outbox.MaxHeaderBytes+1)
	traced := outbox.Message{Subject: "a.b", Key: "k", Headers: map[string][]string{"traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}}
	atLimit, overLimit := payloadFor(traced, outbox.DefaultMaxMessageBytes), payloadFor(traced, outbox.DefaultMaxMessageBytes+1)
	delayed := func(m outbox.Message) outbox.Message { return withDue(m, ahead) }
	badDue := func(id uuid.UUID) outbox.Message {
		return outbox.Message{Subject: "a.b", Key: "k", ID: id, DeliverAt: tooLate}
	}
	badDueEarly := withDue(traced, tooEarly)
	cases := []struct {
		name  string
		msgs  []outbox.Message
		want  string
		index int // 0-based, of the message named
	}{
		{"an id twice", []outbox.Message{good(id), good(id)}, "TX006", 1},
		{"an id twice, the second's subject invalid", []outbox.Message{good(id), badSubject(id)}, "TX001", 1},
		{"an id twice, then an invalid subject", []outbox.Message{good(id), good(id), badSubject(uuid.Nil)}, "TX006", 1},
		{"an invalid subject, then an id twice", []outbox.Message{good(id), badSubject(uuid.Nil), good(id)}, "TX001", 1},
		{"an invalid key, then invalid headers", []outbox.Message{good(uuid.Nil), badKey, badHeader}, "TX002", 1},
		{"a header block too large, then invalid headers", []outbox.Message{good(uuid.Nil), bigBlock, badHeader, badKey}, "TX004", 1},
		{"invalid headers, then a header block too large", []outbox.Message{good(uuid.Nil), badHeader, bigBlock}, "TX003", 1},
		{"a message too large, then invalid headers", []outbox.Message{good(uuid.Nil), overLimit, badHeader}, "TX005", 1},
		{"a message at the limit, then one over it", []outbox.Message{atLimit, overLimit, bigBlock}, "TX005", 1},
		{"a header block too large, then a message too large", []outbox.Message{atLimit, bigBlock, overLimit}, "TX004", 1},
		// Delivery times.
		{"a bad delivery time", []outbox.Message{delayed(good(uuid.Nil)), good(uuid.Nil), badDue(uuid.Nil)}, "TX009", 2},
		{"a bad delivery time, then an invalid subject", []outbox.Message{delayed(good(uuid.Nil)), badDue(uuid.Nil), badSubject(uuid.Nil)}, "TX009", 1},
		{"an invalid subject, then a bad delivery time", []outbox.Message{delayed(good(uuid.Nil)), badSubject(uuid.Nil), badDue(uuid.Nil)}, "TX001", 1},
		{"a bad delivery time, then an invalid key", []outbox.Message{good(uuid.Nil), badDueEarly, badKey}, "TX009", 1},
		{"an invalid key, then a bad delivery time", []outbox.Message{good(uuid.Nil), badKey, badDueEarly}, "TX002", 1},
		{"a bad delivery time, then invalid headers", []outbox.Message{badDueEarly, badHeader}, "TX009", 0},
		{"invalid headers, then a bad delivery time", []outbox.Message{delayed(good(uuid.Nil)), delayed(badHeader), badDueEarly}, "TX003", 1},
		{"a bad delivery time, then a header block too large", []outbox.Message{delayed(atLimit), badDueEarly, bigBlock}, "TX009", 1},
		{"a header block too large, then a bad delivery time", []outbox.Message{delayed(atLimit), delayed(bigBlock), badDueEarly}, "TX004", 1},
		{"a bad delivery time, then a message too large", []outbox.Message{good(uuid.Nil), badDueEarly, overLimit}, "TX009", 1},
		{"a message too large, then a bad delivery time", []outbox.Message{good(uuid.Nil), delayed(overLimit), badDueEarly}, "TX005", 1},
		{"a message too large with a bad delivery time", []outbox.Message{good(uuid.Nil), withDue(overLimit, tooLate)}, "TX005", 1},
		{"an id twice, the second's delivery time bad", []outbox.Message{good(id), badDue(id)}, "TX009", 1},
		{"an id twice, then a bad delivery time", []outbox.Message{delayed(good(id)), delayed(good(id)), badDue(uuid.Nil)}, "TX006", 1},
		{"a bad delivery time, then an id twice", []outbox.Message{good(id), badDue(uuid.Nil), good(id)}, "TX009", 1},
	}
	for _, tc := range cases {
		tx := beginTx(t, db)
		_, goErr := c.EnqueueTx(ctx, tx, tc.msgs...)
		_ = tx.Rollback(ctx)
		var me *outbox.MessageError
		if goOutcome(goErr) != tc.want || !errors.As(goErr, &me) || me.Index != tc.index {
			t.Errorf("%s: EnqueueTx: %v; want %s naming message %d (0-based)", tc.name, goErr, tc.want, tc.index)
		}
		tx = beginTx(t, db)
		_, sqlErr := enqueueManySQL(ctx, tx, tc.msgs)
		_ = tx.Rollback(ctx)
		var pgErr *pgconn.PgError
		if !errors.As(sqlErr, &pgErr) || pgErr.Code != tc.want || !strings.Contains(pgErr.Message, fmt.Sprintf("message %d:", tc.index+1)) {
			t.Errorf("%s: txoutbox_enqueue_many: %v; want %s naming message %d (1-based)", tc.name, sqlErr, tc.want, tc.index+1)
		}
	}
}

// txoutbox_write, which producers may call (the public functions check their arrays' lengths
// first), pairs ids with messages by position: fewer ids than messages draw the rest, more ids
// than messages are refused as messages without a subject.
func TestSQLWriteWithIdsOfAnotherLength(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	id := uuid.New()
	const call = `SELECT txoutbox_write('f', true, ARRAY['a.b', 'a.c'], ARRAY['p', 'q']::bytea[], NULL, NULL, NULL, $1::uuid[], NULL, NULL, NULL)`
	tx := beginTx(t, db)
	defer func() { _ = tx.Rollback(ctx) }()
	var ids []uuid.UUID
	if err := tx.QueryRow(ctx, call, []uuid.UUID{id}).Scan(&ids); err != nil || len(ids) != 2 || ids[0] != id {
		t.Fatalf("two messages, one id: %v, %v; want the id, then one drawn", ids, err)
	}
	checkDrawnIDs(t, ids[1:])
	if err := tx.QueryRow(ctx, call, []uuid.UUID{uuid.New(), uuid.New(), uuid.New()}).Scan(&ids); sqlOutcome(err) != "TX001" {
		t.Fatalf("two messages, three ids: %v; want TX001 (message 3 has no subject)", err)
	}
}

// checkDrawnIDs checks the ids one call drew: each a version 7 UUID of the RFC 9562 variant
// whose timestamp is now (within a minute), each greater than the one before (monotonic
// random, RFC 9562 section 6.2, method 2: txoutbox_uuidv7s).
func checkDrawnIDs(t *testing.T, ids []uuid.UUID) {
	t.Helper()
	for i, id := range ids {
		if i > 0 && bytes.Compare(ids[i-1][:], id[:]) >= 0 {
			t.Fatalf("id %d of the call, %s, is not greater than the one before, %s", i, id, ids[i-1])
		}
		if id.Version() != 7 || id.Variant() != uuid.RFC4122 {
			t.Fatalf("id %s is version %d variant %v, want 7 of RFC 9562", id, id.Version(), id.Variant())
		}
		sec, nsec := id.Time().UnixTime()
		if d := time.Since(time.Unix(sec, nsec)); d < -time.Minute || d > time.Minute {
			t.Fatalf("id %s says %s, want now", id, time.Unix(sec, nsec))
		}
	}
}

// The functions hash and lock keys exactly as the Go client does.
func TestSQLKeyHashAndLockClassesAreTheStores(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	q := store.New(db.Schema)
	var kc, bc int32
	if err := db.Pool.QueryRow(ctx, `SELECT key_class, bucket_class FROM txoutbox_lock_classes()`).Scan(&kc, &bc); err != nil {
		t.Fatal(err)
	}
	if kc != q.KeyLockClass || bc != q.KeyBucketLockClass {
		t.Fatalf("SQL lock classes %d, %d; the store's %d, %d", kc, bc, q.KeyLockClass, q.KeyBucketLockClass)
	}
	strs := []string{"", "a", "order-1", "ключ🔑", strings.Repeat("x", 1024), uuid.NewString(), "txoutbox.key:" + db.Schema}
	for n := 1; n <= 40; n++ { // every length around the 4-byte steps of txoutbox_partition_keys
		strs = append(strs, strings.Repeat("k", n-1)+string(rune('a'+n%26)), strings.Repeat("é", n/2)+strings.Repeat("z", n%2))
	}
	for _, s := range strs {
		var h int32
		if err := db.Pool.QueryRow(ctx, `SELECT txoutbox_key_hash($1)`, s).Scan(&h); err != nil {
			t.Fatal(err)
		}
		if h != store.KeyHash(s) {
			t.Fatalf("txoutbox_key_hash(%.20q) = %d, store.KeyHash = %d", s, h, store.KeyHash(s))
		}
	}
	// txoutbox_partition_keys (migration 7) hashes a batch: the key, or the id's text form for
	// a message without one (NULL or ''); keys may be NULL.
	keys := make([]*string, 0, 2*len(strs))
	ids := make([]uuid.UUID, 0, 2*len(strs))
	want := make([]int32, 0, 2*len(strs))
	for i := range strs {
		id := uuid.Must(uuid.NewV7())
		var k *string
		switch {
		case strs[i] != "":
			k = &strs[i]
			want = append(want, store.KeyHash(strs[i]))
		default:
			k = &strs[i] // '' is no key
			want = append(want, store.KeyHash(id.String()))
		}
		keys, ids = append(keys, k), append(ids, id)
		id2 := uuid.New()
		keys, ids, want = append(keys, nil), append(ids, id2), append(want, store.KeyHash(id2.String()))
	}
	var got, gotNoKeys []int32
	if err := db.Pool.QueryRow(ctx, `SELECT txoutbox_partition_keys($1::text[], $2::uuid[]), txoutbox_partition_keys(NULL, $2::uuid[])`, keys, ids).
		Scan(&got, &gotNoKeys); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("txoutbox_partition_keys = %v, want store.KeyHash's %v", got, want)
	}
	for i, id := range ids {
		if gotNoKeys[i] != store.KeyHash(id.String()) {
			t.Fatalf("txoutbox_partition_keys(NULL, ids)[%d] = %d, want store.KeyHash(%s) = %d", i, gotNoKeys[i], id, store.KeyHash(id.String()))
		}
	}
}

// Go and SQL producers of one key serialise on its lock, whichever comes first and whichever
// lock mode (exact, or buckets past the budget) each is in: the later one waits, and draws a
// later id, so that the relay publishes the key in commit order.
func TestSQLAndGoProducersKeepKeyOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	goEnqueue := func(tx pgx.Tx, key string, bulk bool) (uuid.UUID, error) {
		msgs := []outbox.Message{{Subject: "k.v", Key: key}}
		if bulk {
			msgs = append(msgs, keyed("bulk-go-"+key, outbox.KeyLockBudget+1)...)
		}
		ids, err := c.EnqueueTx(ctx, tx, msgs...)
		if err != nil {
			return uuid.Nil, err
		}
		return ids[0], nil
	}
	sqlEnqueue := func(tx pgx.Tx, key string, bulk bool) (uuid.UUID, error) {
		if !bulk {
			return enqueueSQL(ctx, tx, outbox.Message{Subject: "k.v", Key: key})
		}
		keys := []string{key}
		for i := 0; i <= outbox.KeyLockBudget; i++ {
			keys = append(keys, "bulk-sql-"+key+"-"+strconv.Itoa(i))
		}
		subjects, payloads := make([]string, len(keys)), make([][]byte, len(keys))
		for i := range keys {
			subjects[i], payloads[i] = "k.v", []byte{}
		}
		var ids []uuid.UUID
		err := tx.QueryRow(ctx, `SELECT txoutbox_enqueue_many($1, $2, $3)`, subjects, payloads, keys).Scan(&ids)
		if err != nil {
			return uuid.Nil, err
		}
		return ids[0], nil
	}
	type producer struct {
		name    string
		enqueue func(pgx.Tx, string, bool) (uuid.UUID, error)
		bulk    bool
	}
	producers := []producer{
		{"Go", goEnqueue, false}, {"SQL", sqlEnqueue, false},
		{"Go in bucket mode", goEnqueue, true}, {"SQL in bucket mode", sqlEnqueue, true},
	}
	n := 0
	for _, first := range producers {
		for _, second := range producers {
			if !strings.Contains(first.name+second.name, "SQL") {
				continue // Go against Go is keylock_test's
			}
			n++
			key := "key-" + strconv.Itoa(n)
			tx1 := beginTx(t, db)
			id1, err := first.enqueue(tx1, key, first.bulk)
			if err != nil {
				t.Fatalf("%s: %v", first.name, err)
			}
			tx2 := beginTx(t, db)
			pid := tx2.Conn().PgConn().PID()
			done := make(chan error, 1)
			var id2 uuid.UUID
			go func() {
				var err error
				id2, err = second.enqueue(tx2, key, second.bulk)
				if err == nil {
					err = tx2.Commit(ctx)
				}
				done <- err
			}()
			// The second waits on the key's lock or its bucket's, whichever modes.
			testsvc.Eventually(t, 10*time.Second, first.name+" then "+second.name+": the second to wait on an advisory lock", func() bool {
				var waiting bool
				_ = db.AdminPool.QueryRow(ctx, `SELECT count(*) > 0 FROM pg_locks l WHERE l.pid = $1 AND l.locktype = 'advisory' AND NOT l.granted
					AND l.classid = ANY($2::int8[]::oid[])`, pid, []int64{int64(store.New(db.Schema).KeyLockClass), int64(store.New(db.Schema).KeyBucketLockClass)}).Scan(&waiting)
				return waiting
			})
			if err := tx1.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if err := <-done; err != nil {
				t.Fatalf("%s then %s: second: %v", first.name, second.name, err)
			}
			if a, b := keyID(t, db, key, id1), keyID(t, db, key, id2); a >= b {
				t.Fatalf("%s then %s: ids %d, %d: the later commit must draw the later id", first.name, second.name, a, b)
			}
		}
	}
}

// The functions size headers from their JSON text when it is simple (one value per header,
// nothing JSON escapes) and header by header otherwise: both must count as NATS does
// (outbox.EncodedSize). For each shape, a message exactly at the size limit is accepted and one
// byte over is refused with TX005, through txoutbox_enqueue and txoutbox_enqueue_many.
func TestSQLHeaderSizesAgreeWithGo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	shapes := []struct {
		h       map[string][]string
		invalid bool
	}{
		{h: map[string][]string{"a": {"x"}}}, // simple
		{h: map[string][]string{"traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}},
		{h: map[string][]string{"a": {"x y"}}},                  // an inner space
		{h: map[string][]string{"a": {`"], "b": ["`}}},          // looks like two headers
		{h: map[string][]string{"a": {"v "}}, invalid: true},    // a trailing space
		{h: map[string][]string{"a": {"v\x7f"}}, invalid: true}, // DEL
		{h: map[string][]string{"Status": {"1"}}, invalid: true},
		{h: map[string][]string{"a": {""}}},                         // simple, an empty value
		{h: map[string][]string{"A": {"1"}, "bb": {"22"}}},          // simple, two headers
		{h: map[string][]string{"a": {"zürich ☃"}}},                 // simple, multi-byte
		{h: map[string][]string{"a": {"x", "y"}}},                   // two values
		{h: map[string][]string{"a": {"x\ty"}}},                     // a tab: escaped in JSON
		{h: map[string][]string{"a": {`q"uote`}, "b": {`back\sl`}}}, // escaped in JSON
		{h: map[string][]string{"a": {"1", "2"}, "B": {"3"}, "c": {"4"}}},
		{h: map[string][]string{"a": {"v\u0080v"}}, invalid: true}, // a C1 control
		{h: map[string][]string{"a": {"x"}, "nats-x": {"y"}}, invalid: true},
	}
	for _, sh := range shapes {
		for _, key := range []string{"", "order-1"} {
			m := outbox.Message{Subject: "s.v", Key: key, Headers: sh.h}
			for _, over := range []int{0, 1} {
				want := map[bool]string{true: "TX003", false: map[int]string{0: "ok", 1: "TX005"}[over]}[sh.invalid]
				mm := payloadFor(m, outbox.DefaultMaxMessageBytes+over)
				tx := beginTx(t, db)
				_, err := c.EnqueueTx(ctx, tx, mm)
				goGot := goOutcome(err)
				_ = tx.Rollback(ctx)
				tx = beginTx(t, db)
				_, err = enqueueSQL(ctx, tx, mm)
				one := sqlOutcome(err)
				_ = tx.Rollback(ctx)
				tx = beginTx(t, db)
				_, err = enqueueManySQL(ctx, tx, []outbox.Message{{Subject: "first.v"}, mm})
				many := sqlOutcome(err)
				_ = tx.Rollback(ctx)
				if goGot != want || one != want || many != want {
					t.Errorf("headers %q, key %q, %d byte(s) over the limit: EnqueueTx %s, txoutbox_enqueue %s, txoutbox_enqueue_many %s; want %s",
						sh.h, key, over, goGot, one, many, want)
				}
			}
		}
	}
}

// JSON text a client's encoder may send that PostgreSQL's jsonb input refuses before any
// function runs — a lone surrogate (22P02), \u0000 (22P05) — stores nothing, in the single and
// the batch form: the README's list of codes a client meets besides the TX ones.
func TestSQLJSONInputRefusedBeforeTheCall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	for _, c := range []struct{ json, want string }{
		{`{"X": ["\ud800"]}`, "22P02"},
		{`{"X": ["a\udc00b"]}`, "22P02"},
		{`{"X": ["\u0000"]}`, "22P05"},
	} {
		for _, call := range []string{
			`SELECT txoutbox_enqueue('a.b', 'x', headers => $1::text::jsonb)`,
			`SELECT txoutbox_enqueue_many(ARRAY['a.b'], ARRAY['x']::bytea[], NULL, ARRAY[$1::text::jsonb])`,
		} {
			_, err := db.Pool.Exec(ctx, call, c.json)
			if got := sqlOutcome(err); got != c.want {
				t.Errorf("%s with %s: %s (%v), want %s", call, c.json, got, err, c.want)
			}
		}
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_messages`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d rows stored, %v; want none", n, err)
	}
}
