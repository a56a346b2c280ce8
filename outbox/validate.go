package outbox

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"
)

// Validation sentinels. Every error EnqueueTx and Prepare return for a bad message wraps one of
// these (test with errors.Is) inside a *MessageError that says which message and what was wrong.
//
// The rule behind them: a message is accepted only if JetStream stores it under the server's
// default limits and the consumer receives its subject, key, business key, header names and
// values and payload exactly as they were given, byte for byte. What the wire would drop,
// change, refuse or act on is refused here, never normalised on the way.
var (
	// ErrInvalidSubject: empty, ASCII white space or a control character (C0, DEL, C1),
	// invalid UTF-8, an empty token, a wildcard token (* or >), too long, or a first token
	// reserved for NATS ($JS, $JSC, $SYS, $NRG).
	ErrInvalidSubject = errors.New("invalid subject")
	// ErrMessageTooLarge: payload plus headers (as NATS counts them, including the headers the
	// relay adds) exceed Config.MaxMessageBytes. ErrHeadersTooLarge wraps it.
	ErrMessageTooLarge = errors.New("message too large")
	// ErrHeadersTooLarge: the header block NATS stores (the message's headers plus the
	// relay's, see HeaderBlockSize) exceeds MaxHeaderBytes, whatever the payload. It wraps
	// ErrMessageTooLarge, so errors.Is(err, ErrMessageTooLarge) holds for it too.
	ErrHeadersTooLarge = fmt.Errorf("%w: header block too large", ErrMessageTooLarge)
	// ErrInvalidHeader: a header name that is not an RFC 7230 token or is reserved (see
	// IsReservedHeader), a name with no value, a value that is not valid UTF-8, holds a
	// control character other than a tab inside it, or begins or ends with white space or a
	// zero-width character (see ValidateHeaderValue), or a name or value that holds the text
	// Nats-Msg-Id (see HeaderMsgID).
	ErrInvalidHeader = errors.New("invalid header")
	// ErrInvalidTraceparent: a traceparent header (any case) that is not a W3C trace context
	// (version-traceid-spanid-flags in lower-case hex, trace and span id not all zero,
	// version not ff, version 00 with flags 00 to 03 and nothing after them; one value, one
	// such header; see ValidateTraceparent): it would be published as given and
	// dropped by the consumer's propagator, and the trace would silently end at the
	// producer. It wraps ErrInvalidHeader, so errors.Is(err, ErrInvalidHeader) holds too.
	ErrInvalidTraceparent = fmt.Errorf("%w: traceparent is not a W3C trace context", ErrInvalidHeader)
	// ErrDuplicateID: two messages of one call share an id, or the id is already in the outbox.
	ErrDuplicateID = errors.New("duplicate message id")
	// ErrInvalidKey: a Key or BizKey that is too long, not valid UTF-8, holds a control
	// character or the text Nats-Msg-Id (see HeaderMsgID), or begins or ends with white space
	// or a zero-width character (see ValidateKey).
	ErrInvalidKey = errors.New("invalid key")
)

// MessageError is a validation error for one message of a call.
type MessageError struct {
	// Index is the message's position in the call.
	Index int
	// ID is the message id (zero when the caller left it to be generated).
	ID uuid.UUID
	// Subject is the message's subject as given.
	Subject string
	// Err is one of the sentinels above.
	Err error
	// Detail says what exactly was wrong.
	Detail string
}

func (e *MessageError) Error() string {
	id := "new id"
	if e.ID != uuid.Nil {
		id = "id " + e.ID.String()
	}
	return fmt.Sprintf("outbox: message %d (%s, subject %q): %v: %s", e.Index, id, e.Subject, e.Err, e.Detail)
}

func (e *MessageError) Unwrap() error { return e.Err }

// Header names the relay sets on every published message; callers cannot set them.
const (
	// HeaderMsgID is JetStream's deduplication header; the relay sets it to the message id.
	//
	// No key, business key, header name or header value may hold this text, in this case
	// (in another, "x-nats-msg-id", it is fine): nats-server finds a message's id by
	// searching the raw header block for it, case-sensitively, and Txoutbox-Key,
	// Txoutbox-Biz-Key and the message's own headers go into that block in map order, some
	// before the relay's Nats-Msg-Id. nats-server 2.9 looks only at the first occurrence, and
	// later versions miss the real header when the text occurs twice close together
	// ("Nats-Msg-IdNats-Msg-Id"): the server would take such a text for the message id
	// header and store the message without its id, and a republish of it (after a relay's
	// crash or a lost PubAck) would be stored again instead of dropped by the stream's
	// duplicate window. EnqueueTx and Prepare refuse it (ErrInvalidKey, ErrInvalidHeader).
	HeaderMsgID = "Nats-Msg-Id"
	// HeaderKey carries the message's ordering key, for consumers that order by key.
	HeaderKey = "Txoutbox-Key"
	// HeaderBizKey carries Message.BizKey, the business idempotency key consumers dedup on.
	HeaderBizKey = "Txoutbox-Biz-Key"
)

// msgIDTextProblem is what checkText and the header name checks say of a text holding
// HeaderMsgID.
const msgIDTextProblem = `holds the text "` + HeaderMsgID + `": nats-server would mistake it for the ` + HeaderMsgID +
	` header (it finds the message id by searching the header block for that text) and store the message without deduplication`

// MaxSubjectLength and MaxKeyLength bound subjects and keys (Key and BizKey), in bytes.
const (
	MaxSubjectLength = 1024
	MaxKeyLength     = 1024
)

// JetStreamMaxHeaderBytes is the largest header block nats-server stores in a stream: it
// refuses a message whose header block is longer than math.MaxUint16 bytes
// (JSStreamHeaderExceedsMaximumErr, 10097, "header size exceeds maximum allowed of 64k"), even
// when the whole message is below max_payload.
const JetStreamMaxHeaderBytes = 65535

// DeadLetterHeaderReserve is the room MaxHeaderBytes leaves below JetStreamMaxHeaderBytes for
// what a consumer (package consumer) adds when it dead-letters a message: its Txoutbox-Dead-*
// headers (the error cut to 1 KiB, the subject up to MaxSubjectLength, the durable and stream
// names up to JetStream's 255 bytes each, counts and a time) and the dead letter's own
// Nats-Msg-Id (durable:stream:sequence), less the relay's Nats-Msg-Id it leaves out: 3,481
// bytes with every field at its longest (package consumer's tests compute it), rounded up. So every message
// EnqueueTx accepts can be dead-lettered with every header it had. Its payload too, unless the
// message is within those added headers of the server's max_payload: the dead letter then
// carries no payload (consumer.HeaderDeadPayloadDropped).
const DeadLetterHeaderReserve = 4096

// MaxHeaderBytes bounds the header block of a message as NATS stores it: "NATS/1.0\r\n", one
// "Name: value\r\n" line per value (the message's headers and the relay's Nats-Msg-Id,
// Txoutbox-Key and Txoutbox-Biz-Key) and a final "\r\n". It is JetStream's limit
// (JetStreamMaxHeaderBytes) less DeadLetterHeaderReserve, so that the message can also be
// stored as a dead letter.
const MaxHeaderBytes = JetStreamMaxHeaderBytes - DeadLetterHeaderReserve

// What else nats-server (its client parser and stream.go's processJetStreamMsg) refuses for a
// message by itself under default limits, and how each is closed:
//   - payload plus header block over max_payload or the stream's max_msg_size: Config.MaxMessageBytes;
//   - a file store record over 32 MiB: Config.MaxMessageBytes is at most MaxMessageBytesLimit;
//   - headers the server interprets or strips (Nats-Expected-*, Nats-Rollup, Nats-TTL,
//     Nats-Incr, Nats-Batch-*, Nats-Schedule*, Nats-Request-Info, …): all of Nats-* is reserved;
//   - the protocol line (max_control_line, 4096 bytes) holds the subject (at most
//     MaxSubjectLength), the relay's reply inbox (about 40 bytes: it sets no inbox prefix)
//     and two numbers, so it cannot reach the limit; the file store keeps subject lengths in
//     16 bits, far above MaxSubjectLength.

// reservedSubjectTokens are the first subject tokens of NATS's own subjects: the JetStream
// API and its internals, the system account, and the Raft groups of a cluster. A message
// published there is a request to the server, made with the relay's credentials.
var reservedSubjectTokens = [...]string{"$JS", "$JSC", "$SYS", "$NRG"}

// ValidateSubject reports whether s is a valid NATS publish subject: non-empty, at most
// MaxSubjectLength bytes, valid UTF-8, no ASCII white space and no control character (C0,
// DEL, or C1: U+0080–U+009F, which includes NEL, U+0085), no empty
// token (leading, trailing or doubled dots), no wildcard token (* or >), and a first token
// that is not reserved for NATS: $JS (the JetStream API), $JSC, $SYS (the system account) or
// $NRG (Raft). Subjects are case-sensitive: "$js" is an ordinary token. Errors wrap
// ErrInvalidSubject.
func ValidateSubject(s string) error {
	if detail := subjectProblem(s); detail != "" {
		return fmt.Errorf("%w: %s", ErrInvalidSubject, detail)
	}
	return nil
}

// subjectProblem says what ValidateSubject refuses in s, or "" when s is valid: the detail
// of the error, for callers that report it in an error of their own (a *MessageError).
func subjectProblem(s string) string {
	if s == "" {
		return "subject is empty"
	}
	if len(s) > MaxSubjectLength {
		return fmt.Sprintf("subject is %d bytes, the limit is %d", len(s), MaxSubjectLength)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c <= ' ' || c == 0x7f {
			return fmt.Sprintf("whitespace or control character at byte %d", i)
		}
	}
	if !utf8.ValidString(s) {
		return "subject is not valid UTF-8"
	}
	for i, r := range s {
		if unicode.IsControl(r) { // C1: C0 and DEL are refused above
			return fmt.Sprintf("control character %U at byte %d", r, i)
		}
	}
	first := ""
	for n, start, i := 1, 0, 0; i <= len(s); i++ { // the tokens, without allocating them
		if i < len(s) && s[i] != '.' {
			continue
		}
		switch tok := s[start:i]; tok {
		case "":
			return fmt.Sprintf("token %d is empty", n)
		case "*", ">":
			return fmt.Sprintf("token %d is the wildcard %q; publish subjects must be literal", n, tok)
		default:
			if n == 1 {
				first = tok
			}
		}
		n, start = n+1, i+1
	}
	for _, r := range reservedSubjectTokens {
		if first == r {
			return fmt.Sprintf("subjects starting with %s are reserved for NATS (the JetStream API, the system account, Raft): a message there would act on the server", r)
		}
	}
	return ""
}

// ValidateSubjectFilter reports whether s is a valid NATS subject filter: like ValidateSubject,
// but * may stand for any one token and a final > for one or more. A filter whose first token
// is literally reserved for NATS ($JS, $JSC, $SYS, $NRG) is refused too: the relay never
// publishes there, so neither the relay nor a consumer has anything to select there; a
// wildcard first token (">", "*.x") is fine. Errors wrap ErrInvalidSubject.
func ValidateSubjectFilter(s string) error {
	toks := strings.Split(s, ".")
	for i, tok := range toks {
		if tok == ">" && i != len(toks)-1 {
			return fmt.Errorf("%w: '>' must be the last token", ErrInvalidSubject)
		}
		if tok == "*" || tok == ">" {
			toks[i] = "x" // a wildcard token stands for a literal one
		}
	}
	return ValidateSubject(strings.Join(toks, "."))
}

// ValidateHeaderName reports whether name can be the name of a header a producer sets: an RFC
// 7230 token (letters, digits and !#$%&'*+-.^_`|~; what NATS and HTTP accept) that is not
// reserved (see IsReservedHeader) and does not hold the text Nats-Msg-Id in that case
// ("X-Orig-Nats-Msg-Id": see HeaderMsgID). Errors wrap ErrInvalidHeader.
func ValidateHeaderName(name string) error {
	if what := headerNameProblem(name); what != "" {
		return fmt.Errorf("%w: %s", ErrInvalidHeader, what)
	}
	return nil
}

// headerNameProblem says what ValidateHeaderName refuses in name, or "".
func headerNameProblem(name string) string {
	if !validHeaderName(name) {
		return fmt.Sprintf("name %q is not a valid header name (letters, digits and !#$%%&'*+-.^_`|~ only)", name)
	}
	if what := reservedHeader(name); what != "" {
		return fmt.Sprintf("%q is reserved: %s", name, what)
	}
	if strings.Contains(name, HeaderMsgID) {
		return fmt.Sprintf("name %q %s", name, msgIDTextProblem)
	}
	return ""
}

// validHeaderName reports whether name is an RFC 7230 token (what NATS and HTTP accept).
func validHeaderName(name string) bool {
	if name == "" {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}

// IsReservedHeader reports whether producers may not set the header name, compared without
// regard to case:
//
//   - every name starting with "Nats-": the NATS namespace. nats-server acts on many such
//     headers at publish (Nats-Expected-*, Nats-Rollup, Nats-TTL, Nats-Incr, Nats-Batch-*,
//     Nats-Schedule*, Nats-Trace-Dest, …) and the relay sets Nats-Msg-Id from Message.ID;
//   - every name starting with "Txoutbox-": txoutbox's own. The relay sets Txoutbox-Key from
//     Message.Key and Txoutbox-Biz-Key from Message.BizKey; consumers set Txoutbox-Dead-* on
//     dead letters;
//   - "Status" and "Description": nats.go reads them as a server status, and never delivers a
//     message with an empty payload and a Status header to a JetStream pull consumer.
func IsReservedHeader(name string) bool {
	return reservedHeader(name) != ""
}

// reservedHeader returns what to do instead of setting the reserved header name, or "".
func reservedHeader(name string) string {
	hasPrefix := func(p string) bool { return len(name) >= len(p) && strings.EqualFold(name[:len(p)], p) }
	switch {
	case strings.EqualFold(name, HeaderMsgID):
		return HeaderMsgID + " is set by the relay to the message id; set Message.ID instead"
	case strings.EqualFold(name, HeaderKey):
		return HeaderKey + " is set by the relay; set Message.Key instead"
	case strings.EqualFold(name, HeaderBizKey):
		return HeaderBizKey + " is set from Message.BizKey; set that instead"
	case hasPrefix("Nats-"):
		return "Nats-* headers are reserved for NATS (the server acts on them at publish: expectations, rollups, TTLs, schedules, counters); use a name of your own"
	case hasPrefix("Txoutbox-"):
		return "Txoutbox-* headers are reserved for txoutbox (the relay sets Txoutbox-Key and Txoutbox-Biz-Key, consumers set Txoutbox-Dead-* on dead letters); use a name of your own"
	case strings.EqualFold(name, "Status"), strings.EqualFold(name, "Description"):
		return "Status and Description are NATS status headers (nats.go takes a message with an empty payload and a Status header for a server status and never delivers it); use another name"
	}
	return ""
}

// edgeSpace reports whether r may not begin or end a key or a header value: Unicode
// White_Space (unicode.IsSpace: ASCII space, tab, CR, LF, VT, FF, and U+0085, U+00A0, U+1680,
// U+2000–U+200A, U+2028, U+2029, U+202F, U+205F, U+3000) or an invisible zero-width character
// (U+200B, U+200C, U+200D, U+2060, U+FEFF).
func edgeSpace(r rune) bool {
	switch r {
	case '\u200b', '\u200c', '\u200d', '\u2060', '\ufeff':
		return true
	}
	return unicode.IsSpace(r)
}

// checkText returns what is wrong with s as a key (tabInside false) or header value
// (tabInside true), or "" when nothing is: invalid UTF-8, white space at an end, a control
// character, the text Nats-Msg-Id (HeaderMsgID), in that order.
func checkText(s string, tabInside bool) string {
	if !utf8.ValidString(s) {
		return "is not valid UTF-8"
	}
	if r, _ := utf8.DecodeRuneInString(s); edgeSpace(r) {
		return fmt.Sprintf("begins with white space (%U): trim it (NATS drops white space at the ends of a header value, and values that differ only there look alike)", r)
	}
	if r, _ := utf8.DecodeLastRuneInString(s); edgeSpace(r) {
		return fmt.Sprintf("ends with white space (%U): trim it (NATS drops white space at the ends of a header value, and values that differ only there look alike)", r)
	}
	for i, r := range s {
		if unicode.IsControl(r) && !(tabInside && r == '\t') {
			return fmt.Sprintf("holds the control character %U at byte %d", r, i)
		}
	}
	if strings.Contains(s, HeaderMsgID) {
		return msgIDTextProblem
	}
	return ""
}

// ValidateKey reports whether k can be a Message.Key or Message.BizKey: at most MaxKeyLength
// bytes, valid UTF-8, no control character at all (unicode.IsControl: C0, DEL, C1), no
// white space or zero-width character at its start or end (see ValidateHeaderValue for the
// characters), and not the text Nats-Msg-Id anywhere in it, in that case (keys travel as
// headers: see HeaderMsgID). White space inside a key is fine. The empty key is valid (no
// key); a key of white space only is not. Errors wrap ErrInvalidKey.
func ValidateKey(k string) error {
	if what := checkKey(k); what != "" {
		return fmt.Errorf("%w: key %s", ErrInvalidKey, what)
	}
	return nil
}

// checkKey returns what is wrong with k as a key, or "".
func checkKey(k string) string {
	if len(k) > MaxKeyLength {
		return fmt.Sprintf("is %d bytes, the limit is %d", len(k), MaxKeyLength)
	}
	return checkText(k, false)
}

// ValidateHeaderValue reports whether v can be a header value: valid UTF-8, no control
// character (unicode.IsControl: C0, DEL, C1) except a tab strictly inside it, and no white
// space at its start or end: Unicode White_Space (unicode.IsSpace: ASCII space, tab, CR, LF,
// VT, FF, and U+0085, U+00A0, U+1680, U+2000–U+200A, U+2028, U+2029, U+202F, U+205F, U+3000)
// or a zero-width character (U+200B, U+200C, U+200D, U+2060, U+FEFF). NATS drops ASCII white
// space at the edges of a value and turns CR and LF into spaces; the rest is refused so that
// values differing only in invisible edges are never confused. A value must not hold the text
// Nats-Msg-Id, in that case: nats-server would take it for the message id header and store
// the message without deduplication (see HeaderMsgID). The empty value is valid and arrives
// empty. Errors wrap ErrInvalidHeader.
func ValidateHeaderValue(v string) error {
	if what := checkText(v, true); what != "" {
		return fmt.Errorf("%w: value %s", ErrInvalidHeader, what)
	}
	return nil
}

// validateHeaders checks names and values and returns the size of their lines as NATS encodes
// them, "Name: value\r\n" per value, or what is wrong. Names are checked in sorted order, so that the error is
// the same from run to run.
func validateHeaders(h map[string][]string) (size int, problem string) {
	names := make([]string, 0, len(h))
	for name := range h {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		values := h[name]
		if what := headerNameProblem(name); what != "" {
			return 0, what
		}
		if len(values) == 0 {
			return 0, fmt.Sprintf("%q has no value and would not arrive; give it one (\"\" if need be) or leave it out", name)
		}
		for j, v := range values {
			if what := checkText(v, true); what != "" {
				return 0, fmt.Sprintf("value %d of %q %s", j+1, name, what)
			}
			size += len(name) + 2 + len(v) + 2
		}
	}
	return size, ""
}

// HeaderTraceparent is the W3C trace context header (checked without regard to case). Unlike
// the relay's headers above, a message may set it (one valid value, see ErrInvalidTraceparent);
// the client captures it from ctx otherwise (see Config.Propagator).
const HeaderTraceparent = "traceparent"

// traceparentProblem says what is wrong with the traceparent headers of h (names compared
// without regard to case), or "" when there is none or one valid one (see
// ErrInvalidTraceparent and ValidateTraceparent).
func traceparentProblem(h map[string][]string) string {
	var found []string
	var name string
	for k, v := range h {
		if strings.EqualFold(k, HeaderTraceparent) {
			found = append(found, v...)
			name = k
		}
	}
	switch {
	case len(found) == 0:
		return ""
	case len(found) > 1:
		return fmt.Sprintf("%d traceparent values: a message carries one trace context", len(found))
	}
	if err := ValidateTraceparent(found[0]); err != nil {
		v := found[0]
		if len(v) > 80 {
			v = v[:80] + "…"
		}
		return fmt.Sprintf("%s %q %v; the consumer's propagator would drop it and the trace would end at the producer", name, v, err)
	}
	return ""
}

// ValidateTraceparent reports whether v is a W3C trace context traceparent value that
// consumers' propagators accept: version "-" trace-id "-" parent-id "-" trace-flags, 2, 32, 16
// and 2 lower-case hex digits, the ids not all zero, the version not ff; version 00 exactly 55
// characters with flags 00 to 03 (the sampled and random bits: OpenTelemetry's propagator
// drops a version 00 traceparent with another bit set), a later version (01 to fe) 55
// characters or more with a "-" after the flags, and any flags. Every rule OpenTelemetry's
// propagation.TraceContext applies when it extracts a traceparent is here; this is stricter
// only in refusing a version 00 value with a "-" after its flags and nothing more, which the
// W3C format does not allow and OpenTelemetry's Go propagator lets pass. EnqueueTx, Prepare
// and their database/sql twins refuse a message whose traceparent header fails it
// (ErrInvalidTraceparent).
func ValidateTraceparent(v string) error {
	const n = 55 // 2+1+32+1+16+1+2
	if len(v) < n {
		return fmt.Errorf("is %d characters, a traceparent has at least %d (version-traceid-spanid-flags)", len(v), n)
	}
	if v[2] != '-' || v[35] != '-' || v[52] != '-' {
		return errors.New("is not version-traceid-spanid-flags (fields of 2, 32, 16 and 2 hex digits separated by -)")
	}
	version, traceID, spanID, flags := v[0:2], v[3:35], v[36:52], v[53:55]
	for _, f := range []struct{ what, s string }{{"version", version}, {"trace id", traceID}, {"span id", spanID}, {"flags", flags}} {
		if !lowerHex(f.s) {
			return fmt.Errorf("has a %s that is not lower-case hex", f.what)
		}
	}
	switch {
	case version == "ff":
		return errors.New("has version ff, which is invalid")
	case strings.Trim(traceID, "0") == "":
		return errors.New("has an all-zero trace id")
	case strings.Trim(spanID, "0") == "":
		return errors.New("has an all-zero span id")
	case version == "00" && len(v) != n:
		return fmt.Errorf("is %d characters, a version 00 traceparent has exactly %d", len(v), n)
	case version == "00" && flags > "03": // lower-case hex of one length: ordered as numbers
		return fmt.Errorf("has version 00 and flags %s: version 00 defines only the sampled (01) and random (02) bits, and propagators drop a version 00 traceparent with another bit set", flags)
	case len(v) > n && v[n] != '-':
		return errors.New("has more after the flags without a - between")
	}
	return nil
}

func lowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// headerOverhead is what a header block costs beyond its lines: "NATS/1.0\r\n" and the final "\r\n".
const headerOverhead = len("NATS/1.0\r\n") + len("\r\n")

// relayHeaderSize is the size of the lines the relay adds: Nats-Msg-Id (a 36-character UUID),
// Txoutbox-Key for keyed messages, and Txoutbox-Biz-Key (stored with the message's headers)
// when BizKey is set.
func relayHeaderSize(m *Message) int {
	n := len(HeaderMsgID) + 2 + 36 + 2
	if m.Key != "" {
		n += len(HeaderKey) + 2 + len(m.Key) + 2
	}
	if m.BizKey != "" {
		n += len(HeaderBizKey) + 2 + len(m.BizKey) + 2
	}
	return n
}

// HeaderBlockSize is the size of the header block NATS stores for m once the relay has added
// its headers: "NATS/1.0\r\n", a "Name: value\r\n" line per value of m.Headers, Nats-Msg-Id,
// Txoutbox-Key (keyed messages) and Txoutbox-Biz-Key (when BizKey is set), and a final "\r\n".
// EnqueueTx refuses a message whose header block exceeds MaxHeaderBytes.
func HeaderBlockSize(m *Message) int {
	hs, _ := validateHeaders(m.Headers)
	return headerOverhead + hs + relayHeaderSize(m)
}

// EncodedSize is the size NATS counts against max_payload for a message once the relay has
// added its headers: payload plus HeaderBlockSize.
func EncodedSize(m *Message) int {
	return len(m.Payload) + HeaderBlockSize(m)
}
