package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/outbox"
)

// Ordered mode across restarts and instances.
//
// A key's messages are applied in stream order when, in the transaction that applies message
// N of key K, the consumer holds K's row of txoutbox_consumer_key_order (the highest stream
// sequence A applied or dead-lettered for K) and knows that the stream holds no message of K
// between A and N. It then records N as K's applied sequence, in the same transaction. If
// such a message exists (an earlier message of K that was delivered to a consumer that died,
// and waits for its ack wait to be redelivered; or one another instance is handling), N is
// not applied: it waits, held and kept alive, and is checked again.
//
// What the stream holds between A and N comes from keyOrder: every keyed message this
// instance was delivered, and, for the parts of the stream it did not see (deliveries to
// other instances or to its previous incarnation), the messages read back from the stream.
// Everything at or below the durable's ack floor is settled (acked or terminated, each after
// its sequence was recorded for its key), so only the range above it matters.

// errOrderFloor: the durable's ack floor is not known yet (JetStream did not answer).
var errOrderFloor = errors.New("consumer: the durable's ack floor is not known yet")

// errStreamBehind: the stream's leader does not store yet a message the consumer was delivered
// (a new leader catching up): the read is tried again later.
var errStreamBehind = errors.New("consumer: the stream does not hold every message before the one delivered yet")

// validOrderKey reports whether key can be stored in the key-order table; a message whose
// key cannot is malformed in ordered mode.
func validOrderKey(key string) error {
	if len(key) > outbox.MaxKeyLength {
		return fmt.Errorf("%w: %s is %d bytes, more than %d", errMalformed, outbox.HeaderKey, len(key), outbox.MaxKeyLength)
	}
	if !utf8.ValidString(key) || strings.ContainsRune(key, 0) {
		return fmt.Errorf("%w: %s is not valid UTF-8 or holds a NUL byte", errMalformed, outbox.HeaderKey)
	}
	return nil
}

// orderKeyOf is the key a stream message is ordered by in ordered mode: "" for a message
// without one, and for one the consumer dead-letters as malformed.
func orderKeyOf(m *Message) string {
	if decodeHeaders(m) != nil || m.Key == "" || validOrderKey(m.Key) != nil {
		return ""
	}
	return m.Key
}

// keyOrder is what an ordered consumer knows about the keyed messages of the stream above the
// durable's ack floor.
type keyOrder struct {
	nc      *nats.Conn
	getSubj string // the stream leader's message-get API subject
	stream  jetstream.Stream
	cons    jetstream.Consumer
	filters []string // the consumer's filter subjects, or ">"

	mu      sync.Mutex
	floor   uint64 // every message at or below it is settled
	floorOK bool
	// covered: every keyed message the consumer reads in (floor, covered] is in pending (or
	// was settled and removed).
	covered uint64
	pending map[string][]uint64 // stream sequences of keyed messages not known to be settled
	// [segFrom, segTo]: a run of first deliveries with every delivery in between seen here;
	// its keyed messages are in pending. extending: the run goes on (no delivery missed since).
	segFrom, segTo uint64
	extending      bool
	lastC          uint64 // consumer sequence of the last delivery seen
	scanned        uint64 // messages read back from the stream, for tests

	scanMu sync.Mutex // one scan at a time
}

func newKeyOrder(js jetstream.JetStream, stream jetstream.Stream, cons jetstream.Consumer, filters []string) *keyOrder {
	if len(filters) == 0 {
		filters = []string{">"}
	}
	opts := js.Options()
	prefix := jetstream.DefaultAPIPrefix
	switch {
	case opts.APIPrefix != "":
		prefix = strings.TrimSuffix(opts.APIPrefix, ".") + "."
	case opts.Domain != "":
		prefix = "$JS." + opts.Domain + ".API."
	}
	return &keyOrder{
		nc:      js.Conn(),
		getSubj: prefix + "STREAM.MSG.GET." + stream.CachedInfo().Config.Name,
		stream:  stream, cons: cons, filters: filters, pending: map[string][]uint64{},
	}
}

// refresh reads the durable's ack floor and forgets what it settles.
func (o *keyOrder) refresh(ctx context.Context) error {
	info, err := o.cons.Info(ctx)
	if err != nil {
		return err
	}
	floor := info.AckFloor.Stream
	o.mu.Lock()
	defer o.mu.Unlock()
	o.floorOK = true
	if floor <= o.floor {
		return nil
	}
	o.floor = floor
	o.covered = max(o.covered, floor)
	o.merge()
	for k, seqs := range o.pending {
		seqs = slices.DeleteFunc(seqs, func(s uint64) bool { return s <= floor })
		if len(seqs) == 0 {
			delete(o.pending, k)
		} else {
			o.pending[k] = seqs
		}
	}
	return nil
}

// add records a keyed message above the floor; o.mu held.
func (o *keyOrder) add(key string, seq uint64) {
	if seq <= o.floor || slices.Contains(o.pending[key], seq) {
		return
	}
	o.pending[key] = append(o.pending[key], seq)
}

// observe records a delivery, in delivery order (JetStream's callback). First deliveries come
// in stream order and every delivery, redeliveries included, takes the next consumer
// sequence: when every delivery between two first deliveries was seen here, the stream holds
// no message for this consumer between their stream sequences.
func (o *keyOrder) observe(md *jetstream.MsgMetadata, key string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	s := md.Sequence.Stream
	if key != "" {
		o.add(key, s)
	}
	if o.lastC == 0 || md.Sequence.Consumer != o.lastC+1 {
		o.extending = false // deliveries went elsewhere (another instance, a lost pull)
	}
	o.lastC = md.Sequence.Consumer
	if md.NumDelivered == 1 {
		if o.extending {
			o.segTo = max(o.segTo, s)
		} else {
			o.segFrom, o.segTo, o.extending = s, s, true
		}
	}
	o.merge()
}

// merge extends covered over the run of deliveries seen here when they touch; o.mu held.
func (o *keyOrder) merge() {
	if o.segFrom > 0 && o.covered+1 >= o.segFrom {
		o.covered = max(o.covered, o.segTo)
	}
}

// complete makes sure every keyed message before seq is known, reading from the stream the
// parts this instance was not delivered. seq itself was observed.
func (o *keyOrder) complete(ctx context.Context, seq uint64) error {
	o.mu.Lock()
	ok, covered := o.floorOK, o.covered
	o.mu.Unlock()
	if !ok {
		if err := o.refresh(ctx); err != nil {
			return fmt.Errorf("%w: %w", errOrderFloor, err)
		}
	}
	if covered >= seq {
		return nil
	}
	o.scanMu.Lock()
	defer o.scanMu.Unlock()
	for {
		o.mu.Lock()
		from := o.covered + 1
		// Read up to seq (observed), or up to the run of deliveries seen here that holds it.
		end := seq
		if o.segFrom > from && o.segFrom <= seq && seq <= o.segTo {
			end = o.segFrom
		}
		o.mu.Unlock()
		if from > seq {
			return nil
		}
		read, err := o.scan(ctx, from, end)
		o.mu.Lock()
		o.scanned += read
		if err == nil {
			// Everything in [from, end) was read; seq itself was observed. A run of
			// deliveries that started meanwhile may not hold seq: then the loop goes on.
			o.covered = max(o.covered, end-1)
			if end == seq {
				o.covered = max(o.covered, seq)
			}
			o.merge()
		}
		o.mu.Unlock()
		if err != nil {
			return err
		}
	}
}

// scan reads the stream's messages in [from, end) matching the consumer's filters and records
// the keyed ones.
func (o *keyOrder) scan(ctx context.Context, from, end uint64) (read uint64, err error) {
	for _, f := range o.filters {
		for next := from; next < end; {
			raw, err := o.getNext(ctx, next, f)
			if errors.Is(err, jetstream.ErrMsgNotFound) {
				// Nothing matches f from next on: true only if the stream leader stores
				// everything before end (messages are stored in sequence order).
				info, err := o.stream.Info(ctx)
				if err != nil {
					return read, fmt.Errorf("stream info: %w", err)
				}
				if info.State.LastSeq+1 < end {
					return read, fmt.Errorf("%w: the stream's last sequence is %d, before %d", errStreamBehind, info.State.LastSeq, end-1)
				}
				break
			}
			if err != nil {
				return read, fmt.Errorf("read stream message %d: %w", next, err)
			}
			if raw.Sequence >= end {
				break
			}
			read++
			m := Message{Subject: raw.Subject, Headers: raw.Header}
			if key := orderKeyOf(&m); key != "" {
				o.mu.Lock()
				o.add(key, raw.Sequence)
				o.mu.Unlock()
			}
			next = raw.Sequence + 1
		}
	}
	return read, nil
}

// blocked reports whether a message of key before seq is still unsettled, given that every
// message of key up to applied is; it forgets those.
func (o *keyOrder) blocked(key string, applied, seq uint64) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	seqs := slices.DeleteFunc(o.pending[key], func(s uint64) bool { return s <= applied })
	if len(seqs) == 0 {
		delete(o.pending, key)
		return false
	}
	o.pending[key] = seqs
	for _, s := range seqs {
		if s < seq {
			return true
		}
	}
	return false
}

// settled forgets a message of key that was applied, dead-lettered or found a duplicate.
func (o *keyOrder) settled(key string, seq uint64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	seqs := slices.DeleteFunc(o.pending[key], func(s uint64) bool { return s == seq })
	if len(seqs) == 0 {
		delete(o.pending, key)
	} else {
		o.pending[key] = seqs
	}
}

// scannedMessages is how many messages were read back from the stream.
func (o *keyOrder) scannedMessages() uint64 {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.scanned
}

// msgGetTimeout bounds one read of a stream message.
const msgGetTimeout = 5 * time.Second

// getNext returns the first message of the stream at or after seq whose subject matches
// filter. It asks the stream's leader (JetStream's STREAM.MSG.GET API), never a direct get:
// with AllowDirect, direct gets may be answered by a replica that does not store the latest
// messages yet, and a message missing from the answer would let a later one of its key be
// applied first.
func (o *keyOrder) getNext(ctx context.Context, seq uint64, filter string) (*jetstream.RawStreamMsg, error) {
	req, err := json.Marshal(struct {
		Seq     uint64 `json:"seq"`
		NextFor string `json:"next_by_subj"`
	}{seq, filter})
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, msgGetTimeout)
	defer cancel()
	reply, err := o.nc.RequestWithContext(rctx, o.getSubj, req)
	if err != nil {
		return nil, err
	}
	var resp struct {
		Error *struct {
			Code        int    `json:"code"`
			ErrCode     uint16 `json:"err_code"`
			Description string `json:"description"`
		} `json:"error"`
		Message *struct {
			Subject  string `json:"subject"`
			Sequence uint64 `json:"seq"`
			Header   []byte `json:"hdrs"`
		} `json:"message"`
	}
	if err := json.Unmarshal(reply.Data, &resp); err != nil {
		return nil, fmt.Errorf("message get: %w", err)
	}
	switch {
	case resp.Error != nil && resp.Error.ErrCode == uint16(jetstream.JSErrCodeMessageNotFound):
		return nil, jetstream.ErrMsgNotFound
	case resp.Error != nil:
		return nil, fmt.Errorf("message get: %s (%d, %d)", resp.Error.Description, resp.Error.Code, resp.Error.ErrCode)
	case resp.Message == nil:
		return nil, errors.New("message get: empty answer")
	}
	out := &jetstream.RawStreamMsg{Subject: resp.Message.Subject, Sequence: resp.Message.Sequence}
	if len(resp.Message.Header) > 0 {
		if out.Header, err = nats.DecodeHeadersMsg(resp.Message.Header); err != nil {
			return nil, fmt.Errorf("message get: headers: %w", err)
		}
	}
	return out, nil
}
