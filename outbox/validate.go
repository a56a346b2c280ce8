package outbox

import (
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"
)

// Validation sentinels. Every error EnqueueTx returns for a bad message wraps one of these
// (test with errors.Is) inside a *MessageError that says which message and what was wrong.
var (
	// ErrInvalidSubject: empty, whitespace, an empty token, a wildcard token (* or >), a first
	// token reserved for NATS itself ($JS, $JSC, $SYS, $NRG), or too long.
	ErrInvalidSubject = errors.New("invalid subject")
	// ErrMessageTooLarge: payload plus headers (as NATS counts them, including the headers the
	// relay adds) exceed Config.MaxMessageBytes, or the header block alone exceeds
	// MaxHeaderBytes.
	ErrMessageTooLarge = errors.New("message too large")
	// ErrInvalidHeader: a header name that is not an RFC 7230 token or has no value, a value
	// that would not arrive as given (see ValidateHeaderValue), or a reserved name (see
	// ReservedHeader).
	ErrInvalidHeader = errors.New("invalid header")
	// ErrDuplicateID: two messages of one call share an id, or the id is already in the outbox.
	ErrDuplicateID = errors.New("duplicate message id")
	// ErrInvalidKey: a Key or BizKey that would not arrive as given (see ValidateKey) or is
	// longer than MaxKeyLength.
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
	HeaderMsgID = "Nats-Msg-Id"
	// HeaderKey carries the message's ordering key, for consumers that order by key.
	HeaderKey = "Txoutbox-Key"
	// HeaderBizKey carries Message.BizKey, the business idempotency key consumers dedup on.
	HeaderBizKey = "Txoutbox-Biz-Key"
)

// MaxSubjectLength and MaxKeyLength bound subjects and keys.
const (
	MaxSubjectLength = 1024
	MaxKeyLength     = 1024
)

// MaxHeaderBytes is the largest header block JetStream stores (the server refuses a longer one
// with "header size exceeds maximum allowed", whatever max_payload says): "NATS/1.0\r\n", one
// "Name: value\r\n" line per value, the relay's own headers and the final "\r\n".
const MaxHeaderBytes = 65535

// reservedSubjectTokens are first subject tokens that belong to NATS itself: a message there
// would be a JetStream API call, an ack or a system request made with the relay's credentials.
var reservedSubjectTokens = []string{"$JS", "$JSC", "$SYS", "$NRG"}

// ValidateSubject reports whether s is a valid NATS publish subject: non-empty, at most
// MaxSubjectLength bytes, no whitespace or control characters, no empty token (leading,
// trailing or doubled dots) and no wildcard token (* or >).
func ValidateSubject(s string) error {
	if s == "" {
		return fmt.Errorf("%w: subject is empty", ErrInvalidSubject)
	}
	if len(s) > MaxSubjectLength {
		return fmt.Errorf("%w: subject is %d bytes, the limit is %d", ErrInvalidSubject, len(s), MaxSubjectLength)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c <= ' ' || c == 0x7f {
			return fmt.Errorf("%w: whitespace or control character at byte %d", ErrInvalidSubject, i)
		}
	}
	if !utf8.ValidString(s) {
		return fmt.Errorf("%w: subject is not valid UTF-8", ErrInvalidSubject)
	}
	for i, tok := range strings.Split(s, ".") {
		switch tok {
		case "":
			return fmt.Errorf("%w: token %d is empty", ErrInvalidSubject, i+1)
		case "*", ">":
			return fmt.Errorf("%w: token %d is the wildcard %q; publish subjects must be literal", ErrInvalidSubject, i+1, tok)
		}
		if i == 0 {
			for _, r := range reservedSubjectTokens {
				if strings.EqualFold(tok, r) {
					return fmt.Errorf("%w: subjects starting with %q are reserved for NATS itself", ErrInvalidSubject, r+".")
				}
			}
		}
	}
	return nil
}

// ValidateSubjectFilter reports whether s is a valid NATS subject filter: like ValidateSubject,
// but * may stand for any one token and a final > for one or more.
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

// ReservedHeader reports whether a producer may not set the header name, and why. Header
// names are compared without regard to case. Reserved are:
//   - every name starting with "Nats-": NATS's own namespace, where JetStream reads
//     publish-time controls (Nats-Expected-*, Nats-Rollup, Nats-TTL, Nats-Incr, Nats-Batch-*,
//     Nats-Schedule*, Nats-Trace-Dest, …) and refuses or acts on what it finds; Nats-Msg-Id
//     is the message id (set Message.ID);
//   - every name starting with "Txoutbox-": txoutbox's own (Txoutbox-Key is Message.Key,
//     Txoutbox-Biz-Key is Message.BizKey, Txoutbox-Dead-* are set on dead letters);
//   - Status and Description: nats.go reads a message with an empty payload and a Status
//     header as a server status message, and never delivers it.
func ReservedHeader(name string) (reason string, reserved bool) {
	switch {
	case strings.EqualFold(name, HeaderMsgID):
		return HeaderMsgID + " is set by the relay to the message id; set Message.ID instead", true
	case strings.EqualFold(name, HeaderKey):
		return HeaderKey + " is set by the relay; set Message.Key instead", true
	case strings.EqualFold(name, HeaderBizKey):
		return HeaderBizKey + " is set from Message.BizKey; set that instead", true
	case hasPrefixFold(name, "Nats-"):
		return "names starting with Nats- belong to NATS (JetStream reads them as publish controls)", true
	case hasPrefixFold(name, "Txoutbox-"):
		return "names starting with Txoutbox- belong to txoutbox", true
	case strings.EqualFold(name, "Status"), strings.EqualFold(name, "Description"):
		return "Status and Description are NATS status headers (a consumer would drop the message as a status message)", true
	}
	return "", false
}

func hasPrefixFold(s, prefix string) bool {
	return len(s) >= len(prefix) && strings.EqualFold(s[:len(prefix)], prefix)
}

// ValidateKey reports whether k (a Message.Key or BizKey) reaches a consumer exactly as given:
// valid UTF-8, no control character (C0, DEL or C1), no white space (ASCII or Unicode, such
// as NBSP) at either end, and at most MaxKeyLength bytes. White space at the ends would be
// lost on the wire (NATS trims header values), so two keys differing only there would become
// one; such keys, and keys of white space only, are refused. The empty key means "none".
func ValidateKey(k string) error {
	if p := keyProblem(k); p != "" {
		return fmt.Errorf("%w: %s", ErrInvalidKey, p)
	}
	return nil
}

// ValidateHeaderValue reports whether v reaches a consumer exactly as given: valid UTF-8, no
// control character but a tab inside the value, and no white space (ASCII or Unicode) at
// either end. The empty value is valid.
func ValidateHeaderValue(v string) error {
	if p := textProblem(v, true); p != "" {
		return fmt.Errorf("%w: %s", ErrInvalidHeader, p)
	}
	return nil
}

func keyProblem(k string) string {
	if len(k) > MaxKeyLength {
		return fmt.Sprintf("%d bytes, the limit is %d", len(k), MaxKeyLength)
	}
	return textProblem(k, false)
}

// textProblem is the rule keys and header values share; it says what is wrong, or "".
func textProblem(s string, innerTab bool) string {
	if !utf8.ValidString(s) {
		return "not valid UTF-8"
	}
	for i, r := range s {
		if unicode.IsControl(r) && !(innerTab && r == '\t' && i > 0 && i < len(s)-1) {
			return fmt.Sprintf("control character %U at byte %d", r, i)
		}
	}
	if first, _ := utf8.DecodeRuneInString(s); s != "" && isSpace(first) {
		return fmt.Sprintf("begins with white space (%U), which NATS does not carry", first)
	}
	if last, _ := utf8.DecodeLastRuneInString(s); s != "" && isSpace(last) {
		return fmt.Sprintf("ends with white space (%U), which NATS does not carry", last)
	}
	return ""
}

// isSpace is Unicode's White_Space property, plus the zero width no-break space (U+FEFF,
// which trimming code in other languages strips).
func isSpace(r rune) bool { return unicode.IsSpace(r) || r == '\uFEFF' }

// headerLines checks names and values and returns the size of their lines as NATS encodes
// them ("Name: value\r\n" per value), or what is wrong.
func headerLines(h map[string][]string) (size int, problem string) {
	for name, values := range h {
		if !validHeaderName(name) {
			return 0, fmt.Sprintf("name %q is not a valid header name (letters, digits and !#$%%&'*+-.^_`|~ only)", name)
		}
		if reason, reserved := ReservedHeader(name); reserved {
			return 0, fmt.Sprintf("%q is reserved: %s", name, reason)
		}
		if len(values) == 0 {
			return 0, fmt.Sprintf("%q has no value (it would not arrive at all)", name)
		}
		for j, v := range values {
			if p := textProblem(v, true); p != "" {
				return 0, fmt.Sprintf("value %d of %q: %s", j+1, name, p)
			}
			size += len(name) + 2 + len(v) + 2
		}
	}
	return size, ""
}

// headerOverhead is what a header block costs beyond its lines: "NATS/1.0\r\n" and the final "\r\n".
const headerOverhead = len("NATS/1.0\r\n") + len("\r\n")

// relayHeaderSize is what the relay adds: Nats-Msg-Id (a 36-character UUID) and, for keyed
// messages, Txoutbox-Key.
func relayHeaderSize(key string) int {
	n := len(HeaderMsgID) + 2 + 36 + 2
	if key != "" {
		n += len(HeaderKey) + 2 + len(key) + 2
	}
	return n
}

// EncodedSize is the size NATS counts against max_payload for a message once the relay has
// added its headers: payload plus the encoded header block.
func EncodedSize(m *Message) int {
	hs, _ := headerLines(m.Headers)
	return len(m.Payload) + headerBlockSize(m, hs)
}

// HeaderSize is the size of the message's header block on the wire once the relay has added
// its headers; JetStream refuses one over MaxHeaderBytes.
func HeaderSize(m *Message) int {
	hs, _ := headerLines(m.Headers)
	return headerBlockSize(m, hs)
}

func headerBlockSize(m *Message, headerLines int) int {
	n := headerOverhead + headerLines + relayHeaderSize(m.Key)
	if m.BizKey != "" {
		n += len(HeaderBizKey) + 2 + len(m.BizKey) + 2
	}
	return n
}
