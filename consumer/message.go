package consumer

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/outbox"
)

// Message is a delivered message as the handler sees it. Every field is byte-exact: the
// consumer never trims or normalises what arrived. For a message enqueued with package outbox,
// Subject, Payload, Key, BizKey and every header name and value are exactly what the producer
// gave (the producer refuses, at enqueue, anything NATS would not carry exactly).
//
// Each handler call gets its own copy of Payload and Headers: a handler may change them (or keep
// them), and no one else sees the change — not a later run of a handler with the same message
// (a retry, a batch handled again), not its dead letter, which carries the message as it was
// delivered.
type Message struct {
	// Subject is the subject the message was published on.
	Subject string
	// Payload is the message body: outbox.Message.Payload as the producer enqueued it.
	Payload []byte
	// Headers are all the message's headers: the producer's own (traceparent and the like)
	// and those the relay sets (Nats-Msg-Id, Txoutbox-Key, Txoutbox-Biz-Key). Header names
	// are case-sensitive, as the producer wrote them (names differing only in case are two
	// headers); a name's values are in the producer's order; an empty value arrives empty.
	Headers nats.Header

	// ID is the Nats-Msg-Id header: the outbox message id for messages published by the relay.
	ID string
	// Key is the ordering key (Txoutbox-Key), or "".
	Key string
	// BizKey is the producer's business idempotency key (Txoutbox-Biz-Key), or "".
	BizKey string
	// IdempotencyKey is what the dedup table records: BizKey when set, else ID, byte for
	// byte: keys differing in any byte (white space included) are two keys.
	IdempotencyKey string

	// Stream and StreamSeq locate the message in JetStream.
	Stream    string
	StreamSeq uint64
	// Timestamp is when the stream stored the message.
	Timestamp time.Time
	// Delivery is the 1-based attempt number: JetStream's delivery count, plus the in-place
	// retries of ordered mode.
	Delivery int
}

// handlerCopy returns m for one handler call: Payload and Headers (the map and each name's
// values) are the call's own, so that what a handler changes in them, or keeps and changes
// later, never reaches what the consumer does with the delivered message afterwards — the
// dead letter (payload and headers), a rerun of the handler (a batch's savepoint path, a
// batch handler's split, an ordered key's in-place retry, the one-by-one handling after a
// refused commit), the dedup row. The consumer's own copy (item.msg, the raw message) is
// never given out. Header values are strings, immutable: only the slices holding them are
// copied, all into one allocation.
func (m Message) handlerCopy() Message {
	m.Payload = bytes.Clone(m.Payload)
	m.Headers = cloneHeader(m.Headers)
	return m
}

// cloneHeader copies h: a new map, and each name's values in a slice of their own (capped,
// so that an append to one name's values cannot overwrite the next name's).
func cloneHeader(h nats.Header) nats.Header {
	if h == nil {
		return nil
	}
	n := 0
	for _, vs := range h {
		n += len(vs)
	}
	all := make([]string, n)
	out := make(nats.Header, len(h))
	for k, vs := range h {
		if vs == nil {
			out[k] = nil
			continue
		}
		c := all[:len(vs):len(vs)]
		copy(c, vs)
		all = all[len(vs):]
		out[k] = c
	}
	return out
}

// errMalformed is wrapped by the errors of messages that cannot be decoded (the cases
// DeadReasonMalformed lists). Such messages go to the dead-letter subject at once.
var errMalformed = errors.New("consumer: malformed message")

// decode builds the handler's view of raw, or reports why it is malformed.
func decode(raw jetstream.Msg) (Message, error) {
	m := Message{Subject: raw.Subject(), Payload: raw.Data(), Headers: raw.Headers()}
	md, err := raw.Metadata()
	if err != nil {
		return m, fmt.Errorf("%w: no JetStream metadata: %v", errMalformed, err)
	}
	m.Stream, m.StreamSeq, m.Timestamp = md.Stream, md.Sequence.Stream, md.Timestamp
	m.Delivery = int(md.NumDelivered)
	return m, decodeHeaders(&m)
}

// decodeHeaders sets m's ID, Key, BizKey and IdempotencyKey from m.Headers, or reports why
// they are malformed. The ordered consumer classifies the messages it reads from the stream
// (not delivered to it) with it too, so that both agree on which messages have a key.
func decodeHeaders(m *Message) error {
	var err error
	if m.ID, err = single(m.Headers, outbox.HeaderMsgID); err != nil {
		return err
	}
	if m.Key, err = single(m.Headers, outbox.HeaderKey); err != nil {
		return err
	}
	if m.BizKey, err = single(m.Headers, outbox.HeaderBizKey); err != nil {
		return err
	}
	switch {
	case m.BizKey != "":
		m.IdempotencyKey = m.BizKey
	case m.ID != "":
		m.IdempotencyKey = m.ID
	default:
		return fmt.Errorf("%w: neither %s nor %s is set", errMalformed, outbox.HeaderBizKey, outbox.HeaderMsgID)
	}
	// Both end up in text columns of the dedup row: a value PostgreSQL refuses would make the
	// insert fail on every delivery, forever, instead of dead-lettering the message.
	for _, v := range []struct{ what, s string }{{"idempotency key", m.IdempotencyKey}, {outbox.HeaderMsgID, m.ID}} {
		if len(v.s) > outbox.MaxKeyLength {
			return fmt.Errorf("%w: %s is %d bytes, more than %d", errMalformed, v.what, len(v.s), outbox.MaxKeyLength)
		}
		if !utf8.ValidString(v.s) || strings.ContainsRune(v.s, 0) {
			return fmt.Errorf("%w: %s is not valid UTF-8 or holds a NUL byte", errMalformed, v.what)
		}
	}
	return nil
}

// single returns the only value of header name, exactly as it arrived; several different
// values are ambiguous, and an empty one is malformed.
func single(h nats.Header, name string) (string, error) {
	vals := h.Values(name)
	if len(vals) == 0 {
		return "", nil
	}
	for _, v := range vals[1:] {
		if v != vals[0] {
			return "", fmt.Errorf("%w: header %s has %d different values", errMalformed, name, len(vals))
		}
	}
	// Byte-exact: never trimmed nor normalised, so that "order-1" and "order-1 " stay two
	// keys (the producer refuses the second one; another publisher may send it).
	v := vals[0]
	if v == "" {
		return "", fmt.Errorf("%w: header %s is empty", errMalformed, name)
	}
	return v, nil
}

// PermanentError marks a handler error that no retry can fix: the message goes to the
// dead-letter subject at once. Create it with Permanent.
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err so that the consumer dead-letters the message without further retries.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}
