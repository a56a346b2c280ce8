package relay

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// startWith is env.start with test hooks set before Run.
func (e *env) startWith(cfg *Config, set func(r *Relay)) *running {
	e.t.Helper()
	r := e.relay(cfg)
	set(r)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var once sync.Once
	var err error
	stop := func() error {
		once.Do(func() { cancel(); err = <-done })
		return err
	}
	e.t.Cleanup(func() { _ = stop() })
	return &running{Relay: r, stop: stop}
}

// freezer blocks a relay before a publish wave once armed: a pause (SIGSTOP, a VM pause, a long
// GC) at the worst moment, a batch claimed and partly sent.
type freezer struct {
	wave    int // the wave to stop before
	armed   atomic.Bool
	once    sync.Once
	frozen  chan struct{} // closed when the relay is blocked
	release chan struct{} // close to let it go on
	done    <-chan struct{}
}

// newFreezer returns a freezer that also lets go when the test ends (t.Context is cancelled
// before the relays are stopped by their cleanups: a failing test must not hang on a frozen
// relay).
func newFreezer(t *testing.T, wave int) *freezer {
	return &freezer{wave: wave, frozen: make(chan struct{}), release: make(chan struct{}), done: t.Context().Done()}
}

func (f *freezer) hook(n int) {
	if n != f.wave || !f.armed.Load() {
		return
	}
	block := false
	f.once.Do(func() { block = true; close(f.frozen) })
	if block {
		select {
		case <-f.release:
		case <-f.done:
		}
	}
}

// freeze installs f on r: its publishing blocks before wave f.wave, and once it has, so do its
// lease rounds (each right after it ends, its heartbeat written; r's afterRound observers still
// see it first). A real pause stops every goroutine, and a relay waiting for a batch in flight
// runs lease rounds (Relay.awaitBatch): without this the frozen relay would keep heartbeating.
// A round blocks with the leaser's lock held: while f is frozen, read what r holds from the
// database (heldInDB), not from r.
func (f *freezer) freeze(r *Relay) {
	r.hooks.beforeWave = f.hook
	observe := r.hooks.afterRound
	r.hooks.afterRound = func(start time.Time, st LeaseStatus) {
		if observe != nil {
			observe(start, st)
		}
		f.holdRound()
	}
}

// holdRound blocks while f is frozen and not released.
func (f *freezer) holdRound() {
	select {
	case <-f.frozen:
	default:
		return
	}
	select {
	case <-f.release:
	case <-f.done:
	}
}

// heldInDB counts the partition locks r's lease session holds, as pg_locks shows them (0 if
// r has no membership row).
func heldInDB(t *testing.T, db *testsvc.DB, r *Relay) int {
	t.Helper()
	m, err := store.New(db.Schema).Membership(context.Background(), db.Pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(m.Members, func(m store.RelayMember) bool { return m.Instance == r.lease.reg.Instance })
	if i < 0 {
		return 0
	}
	n := 0
	for _, lk := range m.Locks {
		if lk.PID == m.Members[i].PID {
			n++
		}
	}
	return n
}

func (f *freezer) wait(t *testing.T, what string) {
	t.Helper()
	select {
	case <-f.frozen:
	case <-time.After(20 * time.Second):
		t.Fatalf("timed out waiting for %s to freeze", what)
	}
}

// round is what a relay's afterRound hook reports.
type round struct {
	start time.Time
	st    LeaseStatus
}

func roundsOf(r *Relay) <-chan round {
	ch := make(chan round, 1024)
	r.hooks.afterRound = func(start time.Time, st LeaseStatus) {
		select {
		case ch <- round{start, st}:
		default:
		}
	}
	return ch
}

// nextRound returns the first round from ch that satisfies ok.
func nextRound(t *testing.T, ch <-chan round, what string, ok func(round) bool) round {
	t.Helper()
	timeout := time.After(20 * time.Second)
	for {
		select {
		case rd := <-ch:
			if ok(rd) {
				return rd
			}
		case <-timeout:
			t.Fatalf("timed out waiting for a lease round: %s", what)
		}
	}
}

// setDuplicateWindow sets the ORDERS stream's duplicate window.
func (e *env) setDuplicateWindow(w time.Duration) {
	e.t.Helper()
	ctx := context.Background()
	s, err := e.nats.JS.Stream(ctx, "ORDERS")
	if err != nil {
		e.t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	cfg.Duplicates = w
	if _, err := e.nats.JS.UpdateStream(ctx, cfg); err != nil {
		e.t.Fatal(err)
	}
}

// A relay frozen with a claimed batch, part of it sent, while another relay fences it and
// publishes its partitions: when it wakes, its lease has expired on its own clock, and it sends
// nothing more. The stream, with the shortest duplicate window the start check accepts, holds
// every message once, in order per key.
func TestFrozenRelayPublishesNothingAfterTakeover(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	cfg := func(id string, logger *slog.Logger) *Config {
		return &Config{ID: id, Partitions: 4, LeaseInterval: 100 * time.Millisecond, PublishTimeout: time.Second,
			BackoffBase: 10 * time.Millisecond, BackoffMax: time.Second, Subjects: []string{"orders.>"}, Logger: logger}
	}
	// The shortest window the start check accepts, and it refuses one a millisecond shorter.
	window := cfg("", nil).WithDefaults().RequiredDuplicateWindow()
	e.setDuplicateWindow(window - time.Millisecond)
	if err := e.relay(cfg("check", nil)).CheckStreams(ctx); !errors.Is(err, ErrDuplicateWindow) {
		t.Fatalf("CheckStreams with a window of %s = %v, want ErrDuplicateWindow", window-time.Millisecond, err)
	}
	e.setDuplicateWindow(window)

	const keys, perKey = 5, 4
	var msgs []outbox.Message
	for i := 0; i < perKey; i++ {
		for k := 0; k < keys; k++ {
			key := fmt.Sprintf("k%d", k)
			msgs = append(msgs, outbox.Message{Subject: "orders.seq", Key: key, Payload: []byte(key + ":" + strconv.Itoa(i))})
		}
	}
	e.enqueue(msgs...)

	// The first relay takes every partition, claims the batch, sends its first wave (the first
	// message of each key) and freezes before the second.
	fr := newFreezer(t, 2)
	fr.armed.Store(true)
	frozen := e.startWith(cfg("frozen", nil), fr.freeze)
	fr.wait(t, "the first relay")
	if got := heldInDB(t, e.db, frozen.Relay); got != 4 {
		t.Fatalf("the frozen relay holds %d partitions, want 4", got)
	}

	// The other relay watches its heartbeat stop, fences it after 11 lease intervals, takes
	// its partitions and publishes everything (the first wave again: duplicates).
	logs := &recordLog{}
	other := e.startWith(cfg("other", slog.New(logs)), func(*Relay) {})
	testsvc.Eventually(t, 20*time.Second, "the other relay to publish every row", func() bool { return e.count("true") == 0 })
	if n := logs.countMsg(slog.LevelWarn, "ended the lease session of a relay that stopped heartbeating; its partitions are free"); n != 1 {
		t.Fatalf("%d fence lines, want 1", n)
	}
	if got := other.Stats().Duplicates; got != keys {
		t.Fatalf("the other relay got %d duplicate PubAcks, want %d (the frozen relay's first wave)", got, keys)
	}

	// The frozen relay wakes: its lease has expired, it withholds the rest of its batch.
	close(fr.release)
	testsvc.Eventually(t, 10*time.Second, "the woken relay to withhold its batch", func() bool { return frozen.Stats().Withheld > 0 })
	if got, want := frozen.Stats().Withheld, int64(keys*(perKey-1)); got != want {
		t.Fatalf("the woken relay withheld %d rows, want %d (everything after its first wave)", got, want)
	}
	if got := frozen.Stats().Duplicates; got != 0 {
		t.Fatalf("the woken relay got %d duplicate PubAcks: it sent messages after its lease ended", got)
	}
	if got := frozen.Stats().Published; got != 0 {
		t.Fatalf("the woken relay settled %d rows", got)
	}
	_ = frozen.stop()
	_ = other.stop()

	stored := e.streamMsgs("ORDERS")
	if len(stored) != len(msgs) {
		t.Fatalf("stream holds %d messages, want %d", len(stored), len(msgs))
	}
	next := map[string]int{}
	for _, m := range stored {
		key, n, _ := strings.Cut(string(m.Data), ":")
		i, _ := strconv.Atoi(n)
		if i != next[key] {
			t.Fatalf("key %s: stored %d after %d", key, i, next[key]-1)
		}
		next[key]++
	}
}

// unheldAllowance is what the bound on unheld partitions (one lease interval: the next round of
// a live relay) allows on top for scheduling on a loaded machine: the round's own queries and
// the wake-up of the relay's goroutine; under the race detector (.ci/run runs this package with
// it, on two shared cores) every step is several times slower, so it allows more.
const unheldAllowance = 100*time.Millisecond + raceAllowance

// atRound is a lease round hook (hooks.afterRound) that freezes the relay once armed, right
// after the round (its heartbeat written).
func (f *freezer) atRound(time.Time, LeaseStatus) { f.hook(f.wave) }

// One relay frozen (still counted alive, so it keeps a share) and another killed: the killed
// relay's partitions are taken by the live relay at its first lease round after the kill,
// beyond its fair share, since the frozen relay is silent and waits for nothing. Once the
// others are back, the shares even out again.
func TestKilledRelaysPartitionsTakenWhileAnotherIsFrozen(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const parts = 8
	const lease = 200 * time.Millisecond
	// a and c freeze on their next batch; rows for every partition.
	tr := e.startFreezingTrio(parts, lease)
	a, b, c, fa, fc, bRounds, msgs := tr.a, tr.b, tr.c, tr.fa, tr.fc, tr.bRounds, tr.msgs
	nextRound(t, bRounds, "b to see a and c silent", func(rd round) bool { return rd.st.Silent == 2 })

	// c is killed: PostgreSQL ends its session, its locks go.
	killed := e.killLeaseSession(c)
	gone := time.Now()

	// b's first round after the kill takes both of c's partitions, although b's fair share
	// of two live relays is 4 and it holds 5 then: a, frozen, waits for nothing.
	rd := nextRound(t, bRounds, "b's first round after the kill", func(rd round) bool { return rd.start.After(gone) })
	if got := len(rd.st.Held); got != 5 {
		t.Fatalf("b's first round after the kill left it %d partitions (target %d, silent %d), want 5", got, rd.st.Target, rd.st.Silent)
	}
	unheld := time.Since(killed)
	if locks := len(e.leases().Locks); locks != parts {
		t.Fatalf("%d partitions held after b's first round since the kill, want %d", locks, parts)
	}
	if got := heldInDB(t, e.db, a.Relay); got != 3 {
		t.Fatalf("the frozen relay holds %d partitions, want its 3 (it must not have been fenced yet)", got)
	}
	if unheld > lease+unheldAllowance {
		t.Errorf("c's partitions stayed unheld for %s, more than a lease interval (%s) and %s for scheduling", unheld, lease, unheldAllowance)
	}
	t.Logf("c's partitions unheld for %s (lease interval %s)", unheld.Round(time.Millisecond), lease)

	// a and c come back: the shares even out again, every row is published once.
	close(fa.release)
	close(fc.release)
	testsvc.Eventually(t, 20*time.Second, "shares 3/3/2 again", func() bool {
		return slices.Equal(shares(a, b, c), []int{3, 3, 2}) && len(e.leases().Locks) == parts
	})
	testsvc.Eventually(t, 20*time.Second, "every row published", func() bool { return e.count("true") == 0 })
	e.checkStoredOnce("ORDERS", len(msgs))
}

// The corner of the rule above: a relay that froze only just now, right after its heartbeat,
// at its share, still counts as responsive (not silent: its lease interval is 2 s here), and
// when another relay is killed it is below its share of the two live relays. It never ran the
// round that would tell it so, and waits for nothing: the survivor takes every partition of
// the killed relay at its first round after the kill, within one of its lease intervals, and
// does not release any for the frozen relay while its heartbeat stays still. Before, the
// survivor kept one for the frozen relay until one and a half of its lease intervals after
// its last heartbeat (231–286 ms with 200 ms intervals everywhere, against 75–168 ms now).
func TestKilledRelaysPartitionsTakenWhenAnotherFrozeJustNow(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const parts = 8
	const lease = 200 * time.Millisecond
	cfg := func(id string, l time.Duration) *Config { return &Config{ID: id, Partitions: parts, LeaseInterval: l} }
	fa, fc := newFreezer(t, 1), newFreezer(t, 1)
	a := e.startWith(cfg("a", 2*time.Second), func(r *Relay) { r.hooks.afterRound = fa.atRound })
	testsvc.Eventually(t, 10*time.Second, "a to take every partition", func() bool { return len(a.Partitions()) == parts })
	var bRounds <-chan round
	b := e.startWith(cfg("b", lease), func(r *Relay) { bRounds = roundsOf(r) })
	testsvc.Eventually(t, 20*time.Second, "shares 4/4", func() bool { return slices.Equal(shares(a, b), []int{4, 4}) })
	c := e.startWith(cfg("c", lease), func(r *Relay) { r.hooks.afterRound = fc.atRound })
	testsvc.Eventually(t, 20*time.Second, "shares 3/3/2", func() bool { return slices.Equal(shares(a, b, c), []int{3, 3, 2}) })
	// a first (it runs a round every 2 s), then c (every 200 ms), killed at once: before the
	// fence (11 of c's intervals) could end its session.
	fa.armed.Store(true)
	fa.wait(t, "a, right after a heartbeat")
	fc.armed.Store(true)
	fc.wait(t, "c")

	killed := e.killLeaseSession(c)
	gone := time.Now()
	rd := nextRound(t, bRounds, "b's first round after the kill", func(rd round) bool { return rd.start.After(gone) })
	unheld := time.Since(killed)
	if got := len(rd.st.Held); got != 5 || rd.st.Silent != 0 {
		t.Fatalf("b's first round after the kill: %d partitions, %d silent relays; want 5 (its share 4, and the one a never asked for), 0 silent (a froze just now)",
			got, rd.st.Silent)
	}
	if locks := len(e.leases().Locks); locks != parts {
		t.Fatalf("%d partitions held after b's first round since the kill, want %d", locks, parts)
	}
	if unheld > lease+unheldAllowance {
		t.Errorf("c's partitions stayed unheld for %s, more than a lease interval (%s) and %s for scheduling", unheld, lease, unheldAllowance)
	}
	// Nothing is released for a while a stays frozen: no partition goes back and forth.
	for range 3 {
		if rd := nextRound(t, bRounds, "a later round of b", func(round) bool { return true }); len(rd.st.Held) != 5 {
			t.Fatalf("b holds %d partitions in a later round, want 5: nothing is released for a relay that does not know it is short", len(rd.st.Held))
		}
	}
	t.Logf("c's partitions unheld for %s after the kill (b's lease interval %s, a's 2s)", unheld.Round(time.Millisecond), lease)

	// a and c come back: the shares even out again.
	close(fa.release)
	close(fc.release)
	testsvc.Eventually(t, 30*time.Second, "shares 3/3/2 again", func() bool {
		return slices.Equal(shares(a, b, c), []int{3, 3, 2}) && len(e.leases().Locks) == parts
	})
}

// freezingTrio is three relays over parts partitions with shares 3/3/2, a and c frozen in
// their first wave of a batch of 64 rows (rows for every partition), b's lease rounds
// observed.
type freezingTrio struct {
	a, b, c *running
	fa, fc  *freezer
	bRounds <-chan round
	msgs    []outbox.Message
}

// startFreezingTrio starts a (lease interval aLease), then b and c (200 ms), waits for the
// shares 3/3/2, arms a's and c's freezers, enqueues 64 rows and waits until a and c are frozen.
func (e *env) startFreezingTrio(parts int, aLease time.Duration) freezingTrio {
	t := e.t
	t.Helper()
	cfg := func(id string, lease time.Duration) *Config {
		return &Config{ID: id, Partitions: parts, LeaseInterval: lease, BackoffBase: 10 * time.Millisecond, BackoffMax: time.Second}
	}
	tr := freezingTrio{fa: newFreezer(t, 1), fc: newFreezer(t, 1)}
	tr.a = e.startWith(cfg("a", aLease), tr.fa.freeze)
	testsvc.Eventually(t, 10*time.Second, "a to take every partition", func() bool { return len(tr.a.Partitions()) == parts })
	tr.b = e.startWith(cfg("b", 200*time.Millisecond), func(r *Relay) { tr.bRounds = roundsOf(r) })
	testsvc.Eventually(t, 20*time.Second, "a and b to hold 4 each", func() bool { return slices.Equal(shares(tr.a, tr.b), []int{4, 4}) })
	tr.c = e.startWith(cfg("c", 200*time.Millisecond), tr.fc.freeze)
	testsvc.Eventually(t, 20*time.Second, "shares 3/3/2", func() bool { return slices.Equal(shares(tr.a, tr.b, tr.c), []int{3, 3, 2}) })
	tr.fa.armed.Store(true)
	tr.fc.armed.Store(true)
	for i := 0; i < 64; i++ {
		tr.msgs = append(tr.msgs, outbox.Message{Subject: "orders.created", Payload: []byte(strconv.Itoa(i))})
	}
	e.enqueue(tr.msgs...)
	tr.fa.wait(t, "a")
	tr.fc.wait(t, "c")
	return tr
}

// killLeaseSession ends r's lease session as PostgreSQL would for a killed relay (its locks
// go), waits until the backend is gone, and returns when it was terminated.
func (e *env) killLeaseSession(r *running) time.Time {
	e.t.Helper()
	ctx := context.Background()
	var pid int32
	if err := e.db.Pool.QueryRow(ctx, `SELECT backend_pid FROM txoutbox_relays WHERE instance = $1`, r.lease.reg.Instance).Scan(&pid); err != nil {
		e.t.Fatal(err)
	}
	killed := time.Now()
	if _, err := e.db.Pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
		e.t.Fatal(err)
	}
	testsvc.Eventually(e.t, 10*time.Second, "the killed relay's session to end", func() bool { return !e.backendExists(pid) })
	return killed
}

// checkStoredOnce checks that stream holds want messages, each message id once.
func (e *env) checkStoredOnce(stream string, want int) {
	e.t.Helper()
	seen := map[string]bool{}
	for _, m := range e.streamMsgs(stream) {
		id := m.Header.Get(outbox.HeaderMsgID)
		if seen[id] {
			e.t.Fatalf("message %s stored twice", id)
		}
		seen[id] = true
	}
	if len(seen) != want {
		e.t.Fatalf("stream holds %d messages, want %d", len(seen), want)
	}
}

func (e *env) backendExists(pid int32) bool {
	e.t.Helper()
	var ok bool
	if err := e.db.Pool.QueryRow(context.Background(), `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)`, pid).Scan(&ok); err != nil {
		e.t.Fatal(err)
	}
	return ok
}

// The required duplicate window is the longest republish delay: each term wins in turn.
func TestRequiredDuplicateWindowCoversEveryRepublish(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  Config
		want time.Duration
	}{
		// Every term: PublishTimeout, the look at JetStream (min(PublishTimeout, 2s)) and PollMax
		// (1s by default), then the longest delay.
		{"defaults: the backoff", Config{}, 5*time.Second + 2*time.Second + time.Second + time.Minute},
		{"the fence", Config{LeaseInterval: 10 * time.Second, BackoffMax: 30 * time.Second, HandoverAfter: txoutbox.Off}, 8*time.Second + 140*time.Second},
		{"a dead host's session", Config{LeaseInterval: 100 * time.Millisecond, BackoffMax: time.Second, HandoverAfter: txoutbox.Off}, 8*time.Second + 11200*time.Millisecond},
		{"the handover", Config{LeaseInterval: 100 * time.Millisecond, BackoffMax: time.Second, HandoverAfter: 30 * time.Second}, 8*time.Second + 30200*time.Millisecond},
		{"no handover", Config{LeaseInterval: 100 * time.Millisecond, BackoffMax: 12 * time.Second, HandoverAfter: txoutbox.Off, PublishTimeout: time.Second}, 15 * time.Second},
		{"a short poll", Config{PollMax: 100 * time.Millisecond, PublishTimeout: 500 * time.Millisecond}, 500*time.Millisecond + 500*time.Millisecond + 100*time.Millisecond + time.Minute},
	} {
		if got := c.cfg.WithDefaults().RequiredDuplicateWindow(); got != c.want {
			t.Errorf("%s: RequiredDuplicateWindow = %s, want %s", c.name, got, c.want)
		}
		// The defaults apply to unset fields, as in MaxStopTime.
		if got := c.cfg.RequiredDuplicateWindow(); got != c.want {
			t.Errorf("%s: RequiredDuplicateWindow without WithDefaults = %s, want %s", c.name, got, c.want)
		}
	}
	if got := (*Config)(nil).RequiredDuplicateWindow(); got != 68*time.Second {
		t.Errorf("RequiredDuplicateWindow of a nil Config = %s, want the defaults' 1m8s", got)
	}
}

// A batch claimed before a partition was released (a rebalancing round while it is in flight)
// or before the lease ran out sends nothing more: its rows stay ready, untouched.
func TestBatchStopsWhenItsLeaseEnds(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	r := e.relay(&Config{Partitions: 2, LeaseInterval: time.Second})
	e.enqueue(outbox.Message{Subject: "orders.created", Key: "a", Payload: []byte("1")},
		outbox.Message{Subject: "orders.created", Key: "a", Payload: []byte("2")},
		outbox.Message{Subject: "orders.created", Payload: []byte("unkeyed")})
	for _, end := range []struct {
		name string
		do   func(l *leaser)
	}{
		{"a partition released", func(l *leaser) { l.lostLocked() }},
		{"the lease expired", func(l *leaser) { l.validUntil = time.Now().Add(-time.Millisecond); l.publishSnapLocked() }},
	} {
		_, gen, rows, err := r.claim(ctx, nil)
		if err != nil || len(rows) != 3 {
			t.Fatalf("claim = %d rows, %v", len(rows), err)
		}
		if !r.lease.valid(gen) {
			t.Fatalf("%s: the lease is not valid right after the claim", end.name)
		}
		r.lease.mu.Lock()
		end.do(r.lease)
		r.lease.mu.Unlock()
		res := r.publish(ctx, rows, nil, gen)
		if res.withheld != 3 || len(res.published) != 0 || len(res.failed) != 0 || res.brokerErr != nil || !heldFrom(res.heldKeys, "a", rows[0].ID) {
			t.Fatalf("%s: withheld %d, published %d, failed %d, broker error %v, held keys %v; want all 3 withheld, key a held",
				end.name, res.withheld, len(res.published), len(res.failed), res.brokerErr, res.heldKeys)
		}
	}
	// The next claim runs a round at once, although one is not due for a second: the lease
	// has expired. The round renews it, and the rows go out.
	if got := r.Stats().Withheld; got != 6 {
		t.Fatalf("Stats.Withheld = %d, want 6", got)
	}
	if got := len(e.streamMsgs("ORDERS")); got != 0 {
		t.Fatalf("stream holds %d messages, want none", got)
	}
	drain(t, r)
	if got := len(e.streamMsgs("ORDERS")); got != 3 {
		t.Fatalf("after a drain the stream holds %d messages, want 3", got)
	}
}

// heldFrom reports whether key is held from row id on.
func heldFrom(held map[string]int64, key string, id int64) bool {
	from, ok := held[key]
	return ok && from == id
}

// The lease is checked again immediately before each hand-off to the NATS client, after the
// stream checks (knownOutage and knownUnusable may ask JetStream for up to 500 ms, or
// min(PublishTimeout, 2s)): a lease that ends while they ask — here it ends right after the
// first check, the stream in an outage whose info the relay then asks — sends nothing. Before,
// the row checked before the questions was sent.
func TestLeaseCheckedAgainBeforeTheHandOff(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	r := e.relay(&Config{Partitions: 2, LeaseInterval: time.Second})
	e.enqueue(outbox.Message{Subject: "orders.created", Key: "a", Payload: []byte("1")},
		outbox.Message{Subject: "orders.created", Key: "a", Payload: []byte("2")},
		outbox.Message{Subject: "orders.created", Payload: []byte("unkeyed")})
	for _, end := range []struct {
		name string
		do   func(l *leaser)
	}{
		{"a partition released", func(l *leaser) { l.lostLocked() }},
		{"the lease expired", func(l *leaser) { l.validUntil = time.Now().Add(-time.Millisecond); l.publishSnapLocked() }},
	} {
		_, gen, rows, err := r.claim(ctx, nil)
		if err != nil || len(rows) != 3 {
			t.Fatalf("claim = %d rows, %v", len(rows), err)
		}
		// ORDERS in an outage last checked long ago: the row's stream check asks its info.
		r.outages.begin(r, "ORDERS", []string{"orders.>"}, "orders.created", "test", false)
		r.outages.mu.Lock()
		r.outages.m["ORDERS"].checked = time.Now().Add(-time.Minute)
		r.outages.mu.Unlock()
		calls := 0
		r.hooks.afterLeaseCheck = func() {
			calls++
			if calls == 1 {
				r.lease.mu.Lock()
				end.do(r.lease)
				r.lease.mu.Unlock()
			}
		}
		res := r.publish(ctx, rows, nil, gen)
		r.hooks.afterLeaseCheck = nil
		if calls != 1 {
			t.Fatalf("%s: %d rows passed the first lease check, want 1", end.name, calls)
		}
		if res.withheld != 3 || len(res.published) != 0 || len(res.failed) != 0 || res.brokerErr != nil || !heldFrom(res.heldKeys, "a", rows[0].ID) {
			t.Fatalf("%s: withheld %d, published %d, failed %d, broker error %v, held keys %v; want all 3 withheld, key a held",
				end.name, res.withheld, len(res.published), len(res.failed), res.brokerErr, res.heldKeys)
		}
		if got := len(e.streamMsgs("ORDERS")); got != 0 {
			t.Fatalf("%s: stream holds %d messages, want none", end.name, got)
		}
		r.outages.mu.Lock()
		probing := r.outages.m["ORDERS"] != nil && r.outages.m["ORDERS"].probing
		r.outages.mu.Unlock()
		if !probing {
			t.Fatalf("%s: the stream check did not ask the stream's info", end.name)
		}
	}
	drain(t, r)
	if got := len(e.streamMsgs("ORDERS")); got != 3 {
		t.Fatalf("after a drain the stream holds %d messages, want 3", got)
	}
}

// pubCounter is a TCP proxy in front of the test's NATS server that counts the publishes
// (PUB/HPUB frames) the client sends on one subject. The first one is held until release is
// closed: the test acts (ends the relay's lease) between the relay's hand-off and the
// server's answer.
type pubCounter struct {
	addr    string
	subject string
	first   chan struct{} // closed when the first publish on subject reached the proxy
	release chan struct{} // close to let it through
	mu      sync.Mutex
	sent    int
}

func newPubCounter(t *testing.T, server, subject string) *pubCounter {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	p := &pubCounter{addr: ln.Addr().String(), subject: subject, first: make(chan struct{}), release: make(chan struct{})}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", server)
			if err != nil {
				_ = c.Close()
				return
			}
			t.Cleanup(func() { _ = c.Close(); _ = s.Close() })
			go func() { _, _ = io.Copy(c, s) }()
			go func() {
				br := bufio.NewReader(c)
				for {
					line, err := br.ReadString('\n')
					if err != nil {
						return
					}
					if strings.HasPrefix(line, "HPUB "+p.subject+" ") || strings.HasPrefix(line, "PUB "+p.subject+" ") {
						p.mu.Lock()
						p.sent++
						first := p.sent == 1
						p.mu.Unlock()
						if first {
							close(p.first)
							<-p.release
						}
					}
					if _, err := s.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return p
}

func (p *pubCounter) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.sent
}

// A relay whose lease ends after it handed a message to the NATS client sends it no more:
// nats.go resends an async publish answered with "no responders" by itself (two more times,
// 250 ms apart, from a timer) unless told not to, and those sends skip the relay's lease check;
// a relay frozen in that window sent stale messages when it woke. The relay turns that off
// (noClientRetry): the "no responders" is the publish's outcome at once, and a row is sent
// again only in a later wave, after the lease check. Here the lease ends (a release: the
// generation bumped) while the first send is on its way; by the time the relay has the
// publish's outcome (with nats.go's resends, only after them), the subject got exactly that one
// send.
func TestNoResendAfterTheLeaseEnded(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	const subject = "nostream.x" // no stream captures it: the server answers "no responders"
	proxy := newPubCounter(t, fmt.Sprintf("127.0.0.1:%d", e.nats.Port), subject)
	nc, err := nats.Connect("nats://"+proxy.addr, nats.MaxReconnects(0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(e.db.Pool, js, &Config{ID: uuid.NewString()[:8] + "/resend", Schema: e.db.Schema, Partitions: 1,
		LeaseInterval: time.Second, BackoffBase: time.Minute, BackoffMax: time.Minute, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	r.initTestSignals()
	t.Cleanup(r.Close)
	e.enqueue(outbox.Message{Subject: subject, Payload: []byte("x")})
	_, gen, rows, err := r.claim(ctx, nil)
	if err != nil || len(rows) != 1 {
		t.Fatalf("claim = %d rows, %v", len(rows), err)
	}
	go func() {
		select {
		case <-proxy.first:
		case <-t.Context().Done():
			return
		}
		r.lease.mu.Lock()
		r.lease.lostLocked() // a release for rebalancing: the batch's generation has ended
		r.lease.mu.Unlock()
		close(proxy.release)
	}()
	res := r.publish(ctx, rows, nil, gen)
	if n := proxy.count(); n != 1 {
		t.Fatalf("the subject got %d sends of the row, want 1: the NATS client sent it again after the relay's lease ended", n)
	}
	if len(res.failed) != 1 || !strings.Contains(res.failed[0].Err, "no JetStream stream captures subject") {
		t.Fatalf("outcome: %d failed (%v), %d published, %d withheld; want the row failed: no stream captures its subject",
			len(res.failed), res.failed, len(res.published), res.withheld)
	}
}

// What is released for a relay that waits (here one that just started: its first round found
// it short) is kept for it while it takes it, and no longer: a waiting relay runs a lease round
// every tenth of its interval, so one whose heartbeat has not moved for half an interval
// (stalledFactor) has stalled, and the holder takes the partitions back at the round it runs
// for that moment. Here the joiner freezes right after its first round: the holder releases
// its share, then takes it back; the partitions are unheld for less than a lease interval, and
// nothing is released again while the joiner's heartbeat stays still (no partition goes back
// and forth). Once the joiner is back, it gets its share.
func TestPartitionsReleasedForAFrozenJoinerAreTakenBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const parts = 8
	const lease = 200 * time.Millisecond
	cfg := func(id string) *Config { return &Config{ID: id, Partitions: parts, LeaseInterval: lease} }
	type rd struct {
		end  time.Time
		held int
	}
	aRounds := make(chan rd, 1024)
	a := e.startWith(cfg("a"), func(r *Relay) {
		r.hooks.afterRound = func(_ time.Time, st LeaseStatus) {
			select {
			case aRounds <- rd{time.Now(), len(st.Held)}:
			default:
			}
		}
	})
	testsvc.Eventually(t, 10*time.Second, "a to take every partition", func() bool { return len(a.Partitions()) == parts })
	fb := newFreezer(t, 1)
	fb.armed.Store(true)
	b := e.startWith(cfg("b"), func(r *Relay) { r.hooks.afterRound = fb.atRound })
	fb.wait(t, "b, after its first round")

	next := func(what string, ok func(rd) bool) rd {
		t.Helper()
		for {
			r := testsvc.Receive(t, aRounds, 20*time.Second, what)
			if ok(r) {
				return r
			}
		}
	}
	released := next("a to release b's share", func(r rd) bool { return r.held == parts/2 })
	back := next("a to take it back", func(r rd) bool { return r.held == parts })
	if unheld := back.end.Sub(released.end); unheld > lease+unheldAllowance {
		t.Errorf("the partitions released for b stayed unheld for %s, more than a lease interval (%s) and %s for scheduling", unheld, lease, unheldAllowance)
	}
	for range 3 {
		if r := next("a later round of a", func(rd) bool { return true }); r.held != parts {
			t.Fatalf("a holds %d partitions in a later round, want %d: nothing is released for a relay whose heartbeat stays still", r.held, parts)
		}
	}
	t.Logf("released for the frozen joiner, taken back %s later (lease interval %s)", back.end.Sub(released.end).Round(time.Millisecond), lease)
	close(fb.release)
	testsvc.Eventually(t, 20*time.Second, "shares 4/4", func() bool { return slices.Equal(shares(a, b), []int{4, 4}) })
}
