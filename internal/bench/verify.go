package bench

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"sort"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox/outbox"
)

// msgSet is a set of messages a scenario publishes: ids, deterministic random payloads (so
// that the stream's copy can be checked byte for byte without keeping them in memory) and
// optional ordering keys.
type msgSet struct {
	ids   []uuid.UUID
	index map[uuid.UUID]int32
	size  int
	keys  int
	seed  uint64
}

func newMsgSet(n, size, keys int) (*msgSet, error) {
	s := &msgSet{ids: make([]uuid.UUID, n), index: make(map[uuid.UUID]int32, n), size: size, keys: keys, seed: rand.Uint64()}
	for i := range s.ids {
		id, err := uuid.NewV7()
		if err != nil {
			return nil, err
		}
		s.ids[i] = id
		s.index[id] = int32(i)
	}
	return s, nil
}

// payload returns message i's payload: size bytes from a ChaCha8 stream seeded by (seed, i).
func (s *msgSet) payload(i int) []byte {
	var seed [32]byte
	binary.LittleEndian.PutUint64(seed[0:], s.seed)
	binary.LittleEndian.PutUint64(seed[8:], uint64(i))
	b := make([]byte, s.size)
	_, _ = rand.NewChaCha8(seed).Read(b)
	return b
}

// key returns message i's ordering key ("" when the set is unkeyed).
func (s *msgSet) key(i int) string {
	if s.keys == 0 {
		return ""
	}
	return fmt.Sprintf("key-%d", i%s.keys)
}

func (s *msgSet) message(i int, subject string) outbox.Message {
	return outbox.Message{ID: s.ids[i], Subject: subject, Key: s.key(i), Payload: s.payload(i)}
}

// natsMsg is message i as the relay publishes it: Nats-Msg-Id, and Txoutbox-Key when keyed.
func (s *msgSet) natsMsg(i int, subject string) *nats.Msg {
	h := nats.Header{}
	h.Set(outbox.HeaderMsgID, s.ids[i].String())
	if k := s.key(i); k != "" {
		h.Set(outbox.HeaderKey, k)
	}
	return &nats.Msg{Subject: subject, Header: h, Data: s.payload(i)}
}

// checkResult is what a stream held compared with what it should hold.
type checkResult struct {
	Expected   int // messages that should be in the stream
	Msgs       int // messages read from the stream
	Lost       int // expected ids never seen
	Duplicates int // further copies of an id already seen
	Unknown    int // ids that were never sent
	Corrupt    int // payload or key different from what was sent
	Misordered int // a key's message stored before an earlier one of the same key
}

// kv is the check's counts as the final line's key=value pairs: every way it can fail.
func (c checkResult) kv() []any {
	return []any{"lost", c.Lost, "duplicates", c.Duplicates, "unknown", c.Unknown, "corrupt", c.Corrupt, "misordered", c.Misordered}
}

func (c checkResult) ok() bool {
	return c.Lost == 0 && c.Duplicates == 0 && c.Unknown == 0 && c.Corrupt == 0 && c.Misordered == 0 && c.Msgs == c.Expected
}

func (c checkResult) String() string {
	return fmt.Sprintf("expected=%d stored=%d lost=%d duplicates=%d unknown=%d corrupt=%d misordered=%d",
		c.Expected, c.Msgs, c.Lost, c.Duplicates, c.Unknown, c.Corrupt, c.Misordered)
}

// checker accumulates a checkResult from the messages of a stream, in stream order.
type checker struct {
	set  *msgSet
	seen []bool
	// rank, when set, is each message's position in the order the outbox assigned (row id
	// order): for one key, stream order must follow it.
	rank     []int32
	lastRank map[string]int32
	res      checkResult
}

// newChecker checks for the messages of set, or only its first expected ones when expected is
// positive (messages with a later index then count as unknown).
func newChecker(set *msgSet, rank []int32, expected int) *checker {
	if expected <= 0 || expected > len(set.ids) {
		expected = len(set.ids)
	}
	return &checker{set: set, seen: make([]bool, expected), rank: rank, lastRank: map[string]int32{},
		res: checkResult{Expected: expected}}
}

// add checks one stored message; it returns the message's index and whether it is the
// first copy of an expected message.
func (c *checker) add(h nats.Header, data []byte) (int, bool) {
	c.res.Msgs++
	id, err := uuid.Parse(h.Get(outbox.HeaderMsgID))
	if err != nil {
		c.res.Unknown++
		return -1, false
	}
	i, ok := c.set.index[id]
	if !ok || int(i) >= len(c.seen) {
		c.res.Unknown++
		return -1, false
	}
	if c.seen[i] {
		c.res.Duplicates++
		return int(i), false
	}
	c.seen[i] = true
	key := c.set.key(int(i))
	if h.Get(outbox.HeaderKey) != key || !bytes.Equal(data, c.set.payload(int(i))) {
		c.res.Corrupt++
	}
	if key != "" && c.rank != nil {
		r := c.rank[i]
		if last, ok := c.lastRank[key]; ok && r < last {
			c.res.Misordered++
		}
		c.lastRank[key] = max(c.lastRank[key], r)
	}
	return int(i), true
}

func (c *checker) result() checkResult {
	res := c.res
	for _, s := range c.seen {
		if !s {
			res.Lost++
		}
	}
	return res
}

// readStream calls fn for every message of the stream, in stream order, through an ordered
// consumer, up to the last message stored when it starts.
func readStream(ctx context.Context, js jetstream.JetStream, stream string, fn func(jetstream.Msg)) error {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return fmt.Errorf("stream %s: %w", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return fmt.Errorf("stream %s: %w", stream, err)
	}
	if info.State.Msgs == 0 {
		return nil
	}
	last := info.State.LastSeq
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return fmt.Errorf("read stream %s: %w", stream, err)
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(2000))
	if err != nil {
		return fmt.Errorf("read stream %s: %w", stream, err)
	}
	defer it.Stop()
	for {
		m, err := it.Next(jetstream.NextMaxWait(30 * time.Second))
		if err != nil {
			return fmt.Errorf("read stream %s: %w", stream, err)
		}
		fn(m)
		meta, err := m.Metadata()
		if err != nil {
			return fmt.Errorf("read stream %s: %w", stream, err)
		}
		if meta.Sequence.Stream >= last {
			return nil
		}
	}
}

// checkStream reads the stream and checks it holds exactly the messages of set, once each,
// intact, and (given rank) in key order.
func checkStream(ctx context.Context, js jetstream.JetStream, stream string, set *msgSet, rank []int32) (checkResult, error) {
	c := newChecker(set, rank, 0)
	err := readStream(ctx, js, stream, func(m jetstream.Msg) { c.add(m.Headers(), m.Data()) })
	return c.result(), err
}

// streamMsgs returns the number of messages a stream holds.
func streamMsgs(ctx context.Context, s jetstream.Stream) (uint64, error) {
	info, err := s.Info(ctx)
	if err != nil {
		return 0, err
	}
	return info.State.Msgs, nil
}

// percentile returns the q-quantile (0 < q <= 1) of sorted by the nearest-rank method.
func percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*q+0.999999999) - 1
	i = max(0, min(i, len(sorted)-1))
	return sorted[i]
}

func sortDurations(d []time.Duration) {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
}

// ms formats a duration in milliseconds for the final line.
func ms(d time.Duration) string {
	return fmt.Sprintf("%.3f", float64(d)/float64(time.Millisecond))
}
