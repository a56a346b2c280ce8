package outbox

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/google/uuid"
)

// Validation sentinels. Every error EnqueueTx returns for a bad message wraps one of these
// (test with errors.Is) inside a *MessageError that says which message and what was wrong.
var (
	// ErrInvalidSubject: empty, whitespace, an empty token, a wildcard token (* or >), or too long.
	ErrInvalidSubject = errors.New("invalid subject")
	// ErrMessageTooLarge: payload plus headers (as NATS counts them, including the headers the
	// relay adds) exceed Config.MaxMessageBytes.
	ErrMessageTooLarge = errors.New("message too large")
	// ErrInvalidHeader: a header name that is not an RFC 7230 token, a value with CR or LF, or
	// a header the relay owns (Nats-Msg-Id, Txoutbox-Key).
	ErrInvalidHeader = errors.New("invalid header")
	// ErrDuplicateID: two messages of one call share an id, or the id is already in the outbox.
	ErrDuplicateID = errors.New("duplicate message id")
	// ErrInvalidKey: an ordering key that is too long or holds a NUL byte.
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

// validateHeaders checks names and values and returns the encoded size NATS will count:
// "NATS/1.0\r\n" + "Name: value\r\n" per value + "\r\n".
func validateHeaders(h map[string][]string) (int, error) {
	size := 0
	for name, values := range h {
		if !validHeaderName(name) {
			return 0, fmt.Errorf("%w: name %q is not a valid header name (letters, digits and !#$%%&'*+-.^_`|~ only)", ErrInvalidHeader, name)
		}
		switch {
		case strings.EqualFold(name, HeaderMsgID):
			return 0, fmt.Errorf("%w: %s is set by the relay to the message id; set Message.ID instead", ErrInvalidHeader, HeaderMsgID)
		case strings.EqualFold(name, HeaderKey):
			return 0, fmt.Errorf("%w: %s is set by the relay; set Message.Key instead", ErrInvalidHeader, HeaderKey)
		case strings.EqualFold(name, HeaderBizKey):
			return 0, fmt.Errorf("%w: %s is set from Message.BizKey; set that instead", ErrInvalidHeader, HeaderBizKey)
		}
		for _, v := range values {
			if strings.ContainsAny(v, "\r\n") {
				return 0, fmt.Errorf("%w: value of %q contains CR or LF", ErrInvalidHeader, name)
			}
			size += len(name) + 2 + len(v) + 2
		}
	}
	return size, nil
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
	hs, _ := validateHeaders(m.Headers)
	return encodedSize(m, hs)
}

func encodedSize(m *Message, headerLines int) int {
	n := len(m.Payload) + headerOverhead + headerLines + relayHeaderSize(m.Key)
	if m.BizKey != "" {
		n += len(HeaderBizKey) + 2 + len(m.BizKey) + 2
	}
	return n
}
