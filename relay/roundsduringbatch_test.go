package relay

import (
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// keyIn returns a key whose partition, of parts, is p.
func keyIn(t *testing.T, p int32, parts int) string {
	t.Helper()
	for i := range 10000 {
		if k := "hot" + strconv.Itoa(i); store.KeyHash(k)%int32(parts) == p {
			return k
		}
	}
	t.Fatalf("no key found for partition %d of %d", p, parts)
	return ""
}

// A relay whose batch stays in flight for longer than its lease (a hot key's rows, sent one
// wave after another; here held before the second wave) keeps running its lease rounds while
// it waits for it: its heartbeat moves, so a relay started meanwhile does not fence it and
// its lease does not end (once the batch goes on, it is published and settled whole, nothing
// withheld), and the partitions a relay that stops meanwhile leaves are taken at its next
// round, not once the batch is over.
//
// Two partitions: a (started first) and k hold one each; s, started while a's batch is held,
// is the third relay, whose share is none (nothing is rebalanced for it: a releasing a
// partition would end its batch). Then s and k stop, and a, alone, must take k's partition.
func TestLeaseRoundsRunWhileABatchIsInFlight(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const parts, rows = 2, 100
	const lease = 50 * time.Millisecond
	const fenced = "ended the lease session of a relay that stopped heartbeating; its partitions are free"
	const lost = "partition leases lost with their connection"
	cfg := func(id string, logs *recordLog) *Config {
		return &Config{ID: id, Partitions: parts, LeaseInterval: lease, BackoffBase: 10 * time.Millisecond,
			BackoffMax: time.Second, Subjects: []string{"orders.>"}, Logger: slog.New(logs)}
	}
	aLogs, kLogs, sLogs := &recordLog{}, &recordLog{}, &recordLog{}

	// a's publishing blocks before the second wave of its batch once armed; its lease rounds
	// are left alone (not a freeze: the relay is merely busy with a long batch).
	hold := newFreezer(t, 2)
	var aRounds <-chan round
	a := e.startWith(cfg("a", aLogs), func(r *Relay) {
		aRounds = roundsOf(r)
		r.hooks.beforeWave = hold.hook
	})
	testsvc.Eventually(t, 10*time.Second, "a to take every partition", func() bool { return len(a.Partitions()) == parts })
	k := e.startWith(cfg("k", kLogs), func(*Relay) {})
	testsvc.Eventually(t, 20*time.Second, "shares 1/1", func() bool { return slices.Equal(shares(a, k), []int{1, 1}) })
	mine := a.Partitions()

	// One hot key of a's partition: its rows go out one wave each, one after another.
	key := keyIn(t, mine[0], parts)
	var msgs []outbox.Message
	for i := range rows {
		msgs = append(msgs, outbox.Message{Subject: "orders.seq", Key: key, Payload: []byte(strconv.Itoa(i))})
	}
	hold.armed.Store(true)
	e.enqueue(msgs...)
	a.Wake()
	hold.wait(t, "a's batch to be held before its second wave")

	// s joins while the batch is held, and watches a's heartbeat.
	var sRounds <-chan round
	s := e.startWith(cfg("s", sLogs), func(r *Relay) { sRounds = roundsOf(r) })
	nextRound(t, sRounds, "s's first round", func(round) bool { return true })
	since := time.Now()

	// a runs its rounds while its batch is held: 15 of them since s first read its heartbeat,
	// more than the 11 lease intervals after which s would fence a relay whose heartbeat stood
	// still, and the 10 after which a's own lease would end.
	timeout := time.After(20 * time.Second)
	for n := 0; n < 15; {
		select {
		case rd := <-aRounds:
			if !rd.start.After(since) {
				continue
			}
			n++
			if !slices.Equal(rd.st.Held, mine) {
				t.Fatalf("a's round %d while its batch is held left it %v, want %v", n, rd.st.Held, mine)
			}
		case <-timeout:
			t.Fatalf("a ran %d lease rounds in 20s while its batch was held, want 15 (rounds every %s)", n, lease)
		}
	}
	select {
	case <-hold.release:
		t.Fatal("the batch was released early")
	default:
	}
	if got := a.Partitions(); !slices.Equal(got, mine) {
		t.Fatalf("a holds %v after %s with its batch held, want %v", got, time.Since(since).Round(time.Millisecond), mine)
	}
	if got := heldInDB(t, e.db, a.Relay); got != 1 {
		t.Fatalf("a's lease session holds %d partitions, want 1", got)
	}
	for who, logs := range map[string]*recordLog{"s": sLogs, "k": kLogs} {
		if n := logs.countMsg(slog.LevelWarn, fenced); n != 0 {
			t.Fatalf("%s fenced a relay %d times, want none: a ran its lease rounds", who, n)
		}
	}

	// s and k stop while the batch is still held: a, alone, takes k's partition at its next
	// round.
	if err := s.stop(); err != nil {
		t.Fatal(err)
	}
	if err := k.stop(); err != nil {
		t.Fatal(err)
	}
	freed := time.Now()
	nextRound(t, aRounds, "a to take k's partition", func(rd round) bool { return len(rd.st.Held) == parts })
	took := time.Since(freed)
	if took > 2*lease+unheldAllowance {
		t.Errorf("a took k's partition %s after k stopped, more than two lease intervals (%s) and %s for scheduling", took, 2*lease, unheldAllowance)
	}
	if got := heldInDB(t, e.db, a.Relay); got != parts {
		t.Fatalf("a's lease session holds %d partitions, want %d", got, parts)
	}
	// Lease (and Partitions, /readyz, the status page) shows what a round during the batch
	// changed, not what the last claim saw: the batch is still held.
	testsvc.Eventually(t, 10*time.Second, "a's Lease to show the partition it took during its batch", func() bool {
		return len(a.Partitions()) == parts && len(a.Lease().Held) == parts
	})

	// The batch goes on: every row is published, in order, and settled by a; nothing withheld.
	heldFor := time.Since(since)
	close(hold.release)
	testsvc.Eventually(t, 30*time.Second, "a to publish and settle its batch", func() bool { return a.Stats().Published == rows })
	st := a.Stats()
	if st.Withheld != 0 {
		t.Fatalf("a withheld %d rows of its batch: its lease ended while the batch was held", st.Withheld)
	}
	if st.Duplicates != 0 {
		t.Fatalf("a got %d duplicate PubAcks, want none", st.Duplicates)
	}
	if n := e.count("true"); n != 0 {
		t.Fatalf("%d rows left in the outbox", n)
	}
	if n := aLogs.countMsg(slog.LevelWarn, lost); n != 0 {
		t.Fatalf("a lost its leases %d times, want never", n)
	}
	if err := a.stop(); err != nil {
		t.Fatal(err)
	}
	stored := e.streamMsgs("ORDERS")
	if len(stored) != rows {
		t.Fatalf("stream holds %d messages, want %d", len(stored), rows)
	}
	for i, m := range stored {
		if got := string(m.Data); got != strconv.Itoa(i) {
			t.Fatalf("message %d of key %s is %q, want %q", i, key, got, fmt.Sprint(i))
		}
	}
	t.Logf("batch held %s (%d lease intervals); k's partition taken %s after k stopped",
		heldFor.Round(time.Millisecond), heldFor/lease, took.Round(time.Millisecond))
}

// A relay stopping while a batch is in flight runs no more lease rounds while it drains it:
// it would take free partitions it never claims, or have partitions released to it, until
// Run returns.
func TestNoLeaseRoundsWhileStoppingWithABatchInFlight(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const parts = 2
	const lease = 50 * time.Millisecond
	cfg := func(id string) *Config {
		return &Config{ID: id, Partitions: parts, LeaseInterval: lease, BackoffBase: 10 * time.Millisecond,
			BackoffMax: time.Second, Subjects: []string{"orders.>"}, Logger: quietLogger()}
	}
	hold := newFreezer(t, 2)
	var aRounds <-chan round
	a := e.startWith(cfg("a"), func(r *Relay) {
		aRounds = roundsOf(r)
		r.hooks.beforeWave = hold.hook
	})
	testsvc.Eventually(t, 10*time.Second, "a to take every partition", func() bool { return len(a.Partitions()) == parts })
	var kRounds <-chan round
	k := e.startWith(cfg("k"), func(r *Relay) { kRounds = roundsOf(r) })
	testsvc.Eventually(t, 20*time.Second, "shares 1/1", func() bool { return slices.Equal(shares(a, k), []int{1, 1}) })

	key := keyIn(t, a.Partitions()[0], parts)
	var msgs []outbox.Message
	for i := range 20 {
		msgs = append(msgs, outbox.Message{Subject: "orders.seq", Key: key, Payload: []byte(strconv.Itoa(i))})
	}
	hold.armed.Store(true)
	e.enqueue(msgs...)
	a.Wake()
	hold.wait(t, "a's batch to be held before its second wave")

	stopped := make(chan error, 1)
	cancelled := time.Now()
	go func() { stopped <- a.stop() }()
	// k's rounds are the clock: six of them, six lease intervals in which a's rounds fell due.
	for i := range 6 {
		nextRound(t, kRounds, fmt.Sprintf("k's round %d after a was told to stop", i+1), func(rd round) bool { return rd.start.After(cancelled) })
	}
	after := 0
	for len(aRounds) > 0 {
		if rd := <-aRounds; rd.start.After(cancelled.Add(lease / 2)) {
			after++
		}
	}
	close(hold.release)
	if err := <-stopped; err != nil {
		t.Fatalf("a's Run: %v", err)
	}
	if after != 0 {
		t.Fatalf("a ran %d lease rounds while stopping with its batch in flight, want none", after)
	}
}
